"""EAGLE (``method="eagle"``): a one-layer draft that is autoregressive over the target's features.

Papers: "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty" (Li et al., 2024) and
"EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees" (Li et al., 2024).

The head (``EagleHead``, weights only) reads, at position ``t``, the target's feature ``f_t`` (what
its output projection reads: ``common.target_features``) concatenated with the embedding of the
*next* token ``x_{t+1}`` (the token sequence shifted by one, which removes the feature's
uncertainty about which token was sampled), projects the pair back to the hidden width (``fc``), and
runs one decoder layer (RMSNorm, rotary causal self-attention over the earlier positions, SwiGLU
MLP) whose output predicts ``f_{t+1}``.  The target's own output projection (or FR-Spec's
frequency-ranked subset of it) turns a predicted feature into the distribution of ``x_{t+2}``.  The
embedding and output projection are the target's, shared, not trained.

Decoding.  The draft layer's keys and values live on the proposer (never on a model): one entry per
decided position whose input pair is exact (the target's feature of the token before it, from the
verification forward's hidden states, and the token).  Each step first feeds the decided positions
not fed yet, the root last (its pair ``(f of the last committed token, root)`` is exact too, so it is
kept), which predicts the root's feature; from there the tree grows on the draft's own predicted
features (EAGLE's feature-level autoregression): the children of a node come from the head's output
at that node, whose input is the parent's predicted feature and the node's token.  The tree is
EAGLE-2's dynamic tree: every candidate carries its path's cumulative log-probability (the draft's
confidence, which EAGLE-2 shows tracks acceptance), each round expands the ``beam`` best frontier
candidates in one head forward (``top_k`` children each, tree attention over their ancestors), and
the ``budget`` best candidates form the tree (greedy).  Under sampling the children of a node are
drawn without replacement from the head's processed distribution (Gumbel-top-k) and all are kept,
its distribution recorded as the node's ``q`` for the verifier's recursive rejection sampling, and
expansion stops before the budget would be exceeded.  The draft's pending entries are dropped after
each proposal.  Those keys and values, and the layer run over them, are a ``DraftKV``: op by op in
torch, or (``KernelDraftKV``, wherever the head's projections run on the block kernel) the layer in
one ``LayerStack`` call over static buffers, as the target's layers run.

The draft's context starts with the prompt's last ``prompt_window`` tokens, whose features the
prefill's own forwards hand over (``prompt_features``/``observe_prompt``: no extra target forward);
a prompt chunk the prefix cache restored has none, and the context then starts after it (at worst at
the first verified token, the first step drafting nothing).

EAGLE-3 (``Eagle3Head``, head kind ``eagle3``; "EAGLE-3: Scaling up Inference Acceleration of Large
Language Models via Training-Time Test", Li et al., 2025).  The input feature of a decided position
is not the last layer's alone but a fusion of a low, a middle and a high layer of the target
(``layers``: indices into the verification forward's hidden states, ``0`` the embedding output,
``i`` the output of layer ``i``; default EAGLE-3's ``2, N // 2, N - 3`` clamped to the model's
``N`` layers): each layer's residual stream RMS-normalised (without weights; the raw streams of a
large model hold outlier dimensions) and concatenated, then projected back to the hidden width
(``fuse``).  The head's output is no longer asked to be the target's next feature: it is read
out through its own RMSNorm (``out_norm``) and the target's output projection, and at a drafted
node it is fed back as the next input feature as before.  Training (``training/train.py``) uses
EAGLE-3's training-time test: the head is unrolled for a few steps on its own outputs with the
attention pattern of a drafted chain, and trained by the token loss alone.  The decoding above is
the same for both kinds; old ``eagle`` heads stay loadable and unchanged.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...core.proposer import DecodeContext, Identity, MemoryKey, Proposer
from ...core.tree import TokenTree
from ...errors import InvalidParameterError
from ...models.qkernel import LayerStack, attention_supported
from ..common import check_int, draw_children
from ..configs import EagleConfig
from ..tree_cost import TreeSizer
from .common import (HeadVocab, best_first, candidate_tree, check_head_weights, head_stats, int8_linears, node_dist,
                     require_native, running_head, target_features)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _rope_tables(positions: torch.Tensor, d: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary tables ``cos``, ``sin`` (``[T, d]``, rotate-half layout) at ``positions`` ``[T]``."""
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=positions.device, dtype=torch.float32) / d))
    ang = positions.to(torch.float32)[:, None] * inv[None]
    return torch.cat([ang.cos(), ang.cos()], -1).to(dtype), torch.cat([ang.sin(), ang.sin()], -1).to(dtype)


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[heads, T, d]`` at ``positions`` ``[T]`` (rotate-half layout)."""
    d = x.shape[-1]
    cos, sin = _rope_tables(positions.to(x.device), d, theta, x.dtype)
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-b, a], -1) * sin


class EagleHead(nn.Module):
    """EAGLE's draft: ``fc([feature ; embedding]) -> one decoder layer -> predicted next feature``.

    ``forward(features [T, H], embeds [T, H], positions [T], past_k, past_v [heads, P, d],
    mask [T, P + T] bool) -> (out [T, H], k [heads, T, d], v [heads, T, d])``: the caller keeps the
    keys and values (weights only here)."""

    kind = "eagle"

    def __init__(self, hidden: int, heads: int, intermediate: int, rope_theta: float = 10000.0,
                 eps: float = 1e-6) -> None:
        super().__init__()
        if hidden % heads:
            raise InvalidParameterError(f"eagle head: hidden {hidden} is not a multiple of heads {heads}")
        self.config = {"hidden": int(hidden), "heads": int(heads), "intermediate": int(intermediate),
                       "rope_theta": float(rope_theta), "eps": float(eps)}
        self.n_heads, self.head_dim, self.eps, self.theta = heads, hidden // heads, eps, rope_theta
        self.fc = nn.Linear(2 * hidden, hidden)
        self.attn_norm = nn.Parameter(torch.ones(hidden))
        self.mlp_norm = nn.Parameter(torch.ones(hidden))
        self.wqkv = nn.Linear(hidden, 3 * hidden)
        self.wo = nn.Linear(hidden, hidden, bias=False)
        self.w_gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.w_down = nn.Linear(intermediate, hidden, bias=False)

    @classmethod
    def from_config(cls, config: dict) -> "EagleHead":
        return cls(config["hidden"], config["heads"], config["intermediate"], config.get("rope_theta", 10000.0),
                   config.get("eps", 1e-6))

    @classmethod
    def for_target(cls, target, intermediate: int | None = None) -> "EagleHead":
        cfg = target.model.cfg
        return cls(cfg.hidden_size, cfg.n_heads, intermediate or cfg.intermediate_size,
                   getattr(cfg, "rope_theta", 10000.0), cfg.rms_norm_eps)

    def forward(self, features: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
                past_k: torch.Tensor | None = None, past_v: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = features.shape[0]
        x = self.fc(torch.cat([features, embeds], -1))
        h = _rms(x, self.attn_norm, self.eps)
        q, k, v = self.wqkv(h).view(t, 3, self.n_heads, self.head_dim).permute(1, 2, 0, 3)
        q, k = _rope(q, positions, self.theta), _rope(k, positions, self.theta)
        keys = k if past_k is None or past_k.shape[1] == 0 else torch.cat([past_k, k], 1)
        vals = v if past_v is None or past_v.shape[1] == 0 else torch.cat([past_v, v], 1)
        if mask is None:  # causal over the new rows, everything before them visible
            p = keys.shape[1] - t
            mask = torch.ones(t, keys.shape[1], dtype=torch.bool, device=x.device).tril(p)
        a = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)
        x = x + self.wo(a.transpose(0, 1).reshape(t, -1))
        gate, up = self.w_gate_up(_rms(x, self.mlp_norm, self.eps)).chunk(2, -1)
        return x + self.w_down(F.silu(gate) * up), k, v

    # what the proposer asks of a head (EAGLE: the last layer's feature in, the predicted feature out)
    def input_features(self, model, hidden: list[torch.Tensor], rows) -> torch.Tensor:
        """The input feature of the positions ``rows`` of a forward's per-layer ``hidden`` states."""
        return self.features_of(self.input_states(model, hidden, rows))

    def input_states(self, model, hidden: list[torch.Tensor], rows) -> torch.Tensor:
        """What ``input_features`` reads of ``hidden`` at ``rows`` (kept for the prompt until ``begin``
        knows which copy of the head runs): here the target's features themselves."""
        return target_features(model, hidden[-1][0, rows])

    def features_of(self, states: torch.Tensor) -> torch.Tensor:
        """``input_states`` -> the input features."""
        return states

    def readout(self, out: torch.Tensor) -> torch.Tensor:
        """What the output projection reads from the head's output ``out``."""
        return out


def default_layers(n_layers: int) -> list[int]:
    """EAGLE-3's low, middle and high layers (indices into the hidden states: 0 is the embedding
    output, ``i`` the output of layer ``i``), clamped to a model of ``n_layers`` layers."""
    return sorted({min(2, n_layers), n_layers // 2, max(n_layers - 3, 0)})


def _unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Eagle3Head(EagleHead):
    """EAGLE-3's draft: the fused low, middle and high layer features in (``fuse``), the same decoder
    layer, and its output read out through its own norm (``out_norm``) by the target's output head."""

    kind = "eagle3"

    def __init__(self, hidden: int, heads: int, intermediate: int, rope_theta: float = 10000.0,
                 eps: float = 1e-6, layers: list[int] | tuple[int, ...] = (0, 1, 2)) -> None:
        super().__init__(hidden, heads, intermediate, rope_theta, eps)
        layers = [int(x) for x in layers]
        if not layers or any(x < 0 for x in layers):
            raise InvalidParameterError(f"eagle3 head: layers must be hidden-state indices >= 0, got {layers}")
        self.config["layers"] = layers
        self.fuse = nn.Linear(len(layers) * hidden, hidden, bias=False)
        self.out_norm = nn.Parameter(torch.ones(hidden))

    @classmethod
    def from_config(cls, config: dict) -> "Eagle3Head":
        return cls(config["hidden"], config["heads"], config["intermediate"], config.get("rope_theta", 10000.0),
                   config.get("eps", 1e-6), config["layers"])

    @classmethod
    def for_target(cls, target, intermediate: int | None = None, layers: list[int] | None = None) -> "Eagle3Head":
        cfg = target.model.cfg
        layers = default_layers(cfg.n_layers) if layers is None else list(layers)
        if any(x > cfg.n_layers for x in layers):
            raise InvalidParameterError(f"eagle3 head: layers {layers} beyond the target's {cfg.n_layers} layers")
        return cls(cfg.hidden_size, cfg.n_heads, intermediate or cfg.intermediate_size,
                   getattr(cfg, "rope_theta", 10000.0), cfg.rms_norm_eps, layers)

    def fuse_states(self, states: torch.Tensor) -> torch.Tensor:
        """``[..., len(layers) * H]`` (the chosen layers' residual streams side by side) -> ``[..., H]``."""
        parts = states.unflatten(-1, (len(self.config["layers"]), -1))
        return self.fuse(_unit_rms(parts, self.eps).flatten(-2))

    def input_states(self, model, hidden: list[torch.Tensor], rows) -> torch.Tensor:
        if len(hidden) <= max(self.config["layers"]):
            raise InvalidParameterError(f"eagle3 head reads hidden states {self.config['layers']}; the forward "
                                        f"gave {len(hidden)}")
        return torch.cat([hidden[i][0, rows] for i in self.config["layers"]], -1)

    def features_of(self, states: torch.Tensor) -> torch.Tensor:
        return self.fuse_states(states.to(self.out_norm.dtype))  # (out_norm: fuse may be an int8 layer)

    def readout(self, out: torch.Tensor) -> torch.Tensor:
        return _rms(out, self.out_norm, self.eps)


def ttt_outputs(head: EagleHead, inp: torch.Tensor, emb: torch.Tensor, steps: int,
                segments: torch.Tensor | None = None) -> list[torch.Tensor]:
    """EAGLE-3's training-time test: the head's outputs ``[t, H]`` of ``steps`` unrolled steps over
    ``t = len(inp)`` rows.  Step 0 row ``i`` reads ``(inp[i], emb[i + 1])`` at position ``i`` and sees
    rows ``<= i``; step ``j`` row ``i`` reads ``(step j - 1's output at row i, emb[i + 1 + j])`` at
    position ``i + j`` and sees step 0's rows ``<= i`` and its own row of steps ``1 .. j``: what
    decoding computes for a chain of ``j`` drafted tokens after the decided row ``i``.  ``emb``:
    at least ``t + steps`` rows (those past the text are padding whose outputs carry no loss).
    ``segments`` (``[t]``, non-decreasing): rows of different windows see nothing of each other and
    positions restart at each window's first row, so each window's outputs are its own call's."""
    t = inp.shape[0]
    dev = inp.device
    rows = torch.arange(t, device=dev)
    causal = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
    first = None
    if segments is not None:
        causal = causal & (segments[:, None] == segments[None, :])
        rows = rows - torch.searchsorted(segments, segments)  # position within the window
        first = causal
    out, k, v = head(inp, emb[1 : t + 1], rows, mask=first)
    outs, ks, vs = [out], [k], [v]
    eye = torch.eye(t, dtype=torch.bool, device=dev)
    for j in range(1, steps):
        mask = torch.cat([causal] + [eye] * j, 1)  # the exact context up to the row, then its own drafted rows
        out, k, v = head(out, emb[1 + j : 1 + j + t], rows + j, torch.cat(ks, 1), torch.cat(vs, 1), mask)
        outs.append(out)
        ks.append(k)
        vs.append(v)
    return outs


class DraftKV:
    """The draft layer's keys and values during one generation, and the head run over them:
    *committed* entries (decided positions, ``feed``) and *pending* ones (this proposal's tree levels,
    ``level``; dropped by ``drop_pending``).  Here op by op in torch, the past concatenated for each
    call; ``KernelDraftKV`` runs the layer on the kernels' route instead."""

    kernel = False

    def __init__(self, net: EagleHead, dtype: torch.dtype, device: torch.device) -> None:
        self.net = net
        self.k = torch.zeros(net.n_heads, 0, net.head_dim, dtype=dtype, device=device)
        self.v = self.k.clone()
        self.pend_k: list[torch.Tensor] = []
        self.pend_v: list[torch.Tensor] = []

    @property
    def committed(self) -> int:
        return self.k.shape[1]

    def feed(self, feats: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The head's output at new decided positions (causal among them, every committed entry
        visible); their keys and values are committed."""
        out, k, v = self.net(feats, embeds, positions, self.k, self.v)
        self.k, self.v = torch.cat([self.k, k], 1), torch.cat([self.v, v], 1)
        return out

    def level(self, feats: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
              rows: list[list[int]]) -> torch.Tensor:
        """The head's output at one tree level's nodes: node ``j`` sees every committed entry and the
        pending entries ``rows[j]`` (numbered from 0 in this proposal, its own included: the level's
        entries are numbered after the earlier pending ones)."""
        committed = self.committed
        pending = sum(k.shape[1] for k in self.pend_k)
        dev = self.k.device
        mask = torch.zeros(len(rows), committed + pending + len(rows), dtype=torch.bool, device=dev)
        mask[:, :committed] = True
        for j, r in enumerate(rows):
            mask[j, [committed + s for s in r]] = True
        past_k = torch.cat([self.k] + self.pend_k, 1) if self.pend_k else self.k
        past_v = torch.cat([self.v] + self.pend_v, 1) if self.pend_v else self.v
        out, k, v = self.net(feats, embeds, positions, past_k, past_v, mask)
        self.pend_k.append(k)
        self.pend_v.append(v)
        return out

    def drop_pending(self) -> None:
        self.pend_k, self.pend_v = [], []


class KernelDraftKV(DraftKV):
    """``DraftKV`` with the draft layer on the kernels' route (as the target's layers run):
    ``fc`` (or EAGLE-3's input projection) as a module call, then RMSNorm, the packed projections,
    rope and cache store, the invariant attention kernel over the attended slots, and the SwiGLU MLP
    in one ``LayerStack`` call, over static key and value buffers (grown by doubling) instead of
    concatenating the past for every call: a drafting step's head forwards pay for their weights and
    little else.  Its outputs equal the torch layer's up to rounding (the norm and the attention
    sum in another order), which only changes what is drafted, never what is accepted.  ``of``
    gives None where the layer does not fit the route (float projections, a head size the
    attention kernel does not take, no kernel)."""

    kernel = True
    CHUNK = 64  # rows of one stack call at most (qkernel.MAX_ROWS)

    def __init__(self, net: EagleHead, stack: LayerStack, norms: list[torch.Tensor], dtype: torch.dtype,
                 capacity: int = 512) -> None:
        self.net, self.stack, self.dtype = net, stack, dtype
        self.norms = norms  # the bf16 norm weights the stack reads: alive as long as it is
        self.n = 0  # committed entries
        self.pending = 0
        self.kv = torch.zeros(2, 1, 1, net.n_heads, capacity, net.head_dim, dtype=torch.bfloat16)

    @classmethod
    def of(cls, net: EagleHead, dtype: torch.dtype, device: torch.device,
           capacity: int = 512) -> "KernelDraftKV | None":
        if device.type != "cpu":
            return None
        cfg = net.config
        h, d = net.n_heads, net.head_dim
        norms = [w.detach().to(torch.bfloat16).contiguous() for w in (net.attn_norm, net.mlp_norm)]
        stack = LayerStack.of([(net.wqkv, net.wo, net.w_gate_up, net.w_down, *norms)], hidden=cfg["hidden"],
                              inter=cfg["intermediate"], n_heads=h, n_kv_heads=h, head_dim=d, eps=net.eps)
        if stack is None or not attention_supported(torch.empty(0, dtype=torch.bfloat16),
                                                    torch.empty(1, h, 1, d, dtype=torch.bfloat16), h):
            return None
        return cls(net, stack, norms, dtype, capacity)

    @property
    def committed(self) -> int:
        return self.n

    def _run(self, feats: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
             rows: list[torch.Tensor]) -> torch.Tensor:
        t = feats.shape[0]
        slot0 = self.n + self.pending
        if slot0 + t > self.kv.shape[4]:  # grow the buffers (by doubling)
            kv = self.kv.new_zeros(*self.kv.shape[:4], max(2 * self.kv.shape[4], slot0 + t), self.kv.shape[5])
            kv[..., :slot0, :] = self.kv[..., :slot0, :]
            self.kv = kv
        x = self.net.fc(torch.cat([feats, embeds], -1).to(self.dtype)).to(torch.bfloat16).contiguous()
        cos, sin = _rope_tables(positions, self.net.head_dim, self.net.theta, torch.bfloat16)
        offsets = torch.tensor([0] + [int(r.numel()) for r in rows], dtype=torch.int64).cumsum(0)
        out = self.stack.run(x[None], cos, sin, self.kv[0], self.kv[1], slot0, torch.cat(rows), offsets, [0])
        return out[0].to(self.dtype)

    def feed(self, feats: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        outs = []
        for i in range(0, feats.shape[0], self.CHUNK):  # (the prompt's window: in chunks the stack takes)
            t, n = min(self.CHUNK, feats.shape[0] - i), self.n
            outs.append(self._run(feats[i : i + t], embeds[i : i + t], positions[i : i + t],
                                  [torch.arange(n + j + 1) for j in range(t)]))
            self.n += t
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def level(self, feats: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
              rows: list[list[int]]) -> torch.Tensor:
        n = self.n
        past = torch.arange(n)
        out = self._run(feats, embeds, positions, [torch.cat([past, n + torch.tensor(r, dtype=torch.int64)])
                                                   for r in rows])
        self.pending += len(rows)
        return out

    def drop_pending(self) -> None:
        self.pending = 0


class EagleProposer(Proposer):
    name = "eagle"

    def __init__(self, target, head: EagleHead, tree_budget: int | None = None, top_k: int = EagleConfig.top_k, beam: int = EagleConfig.beam,
                 max_depth: int = EagleConfig.max_depth, draft_vocab: int = EagleConfig.draft_vocab, prompt_window: int = EagleConfig.prompt_window,
                 head_weights: str = EagleConfig.head_weights, cost_aware: bool = EagleConfig.cost_aware) -> None:
        require_native(target, "eagle")
        if not isinstance(head, EagleHead):
            raise InvalidParameterError(f"eagle needs an EagleHead, got {type(head).__name__}")
        if tree_budget is not None:
            check_int("tree_budget", tree_budget)
        self.top_k, self.beam, self.max_depth = check_int("top_k", top_k), check_int("beam", beam), \
            check_int("max_depth", max_depth)
        self.draft_vocab = check_int("draft_vocab", draft_vocab, low=0)
        self.prompt_window = check_int("prompt_window", prompt_window, low=0)
        self.head_weights = check_head_weights(head_weights)
        self.cost_aware = bool(cost_aware)
        self.target = target
        self.head = head
        self.net: EagleHead = head  # what runs: the head, or its int8/int4 copy (``begin``)
        self.kv: DraftKV | None = None  # the draft layer's keys and values (``begin``)
        self._prompt_feats: dict[int, torch.Tensor] = {}
        self.feats: dict[int, torch.Tensor] = {}
        self._states: dict[int, torch.Tensor] = {}
        self.default_budget = tree_budget or EagleConfig.default_tree_budget
        self._steps = self._drafted = self._accepted = self._head_forwards = 0
        self._time = 0.0

    # ---------------------------------------------------------------- setup
    def prompt_features(self) -> int:
        return self.prompt_window

    def observe_prompt(self, start: int, hidden: list[torch.Tensor]) -> None:
        # only the last ``prompt_window`` positions seen so far can be in ``begin``'s window
        first = start + hidden[-1].shape[1] - self.prompt_window
        self._prompt_feats = {p: f for p, f in self._prompt_feats.items() if p >= first}
        if first >= start + hidden[-1].shape[1]:
            return
        with torch.inference_mode():  # the states only: ``begin`` turns them into features with the running head
            f = self.head.input_states(self.target.model, hidden, slice(max(first - start, 0), None))
        for i in range(f.shape[0]):
            self._prompt_feats[max(first, start) + i] = f[i]

    def begin(self, ctx: DecodeContext, tokens: list[int]) -> None:
        super().begin(ctx, tokens)
        self.model = ctx.target.model
        self.dtype = next(self.head.parameters()).dtype
        self.out = HeadVocab(ctx, self.draft_vocab, tokens)
        self.net = running_head(ctx, self.head, self.head_weights)
        # greedy trees sized by expected tokens per second (proposers/tree_cost.py): the calibration
        # and the head's forward time are learned across generations, per head and target
        self.sizer = ctx.remember(MemoryKey("eagle", "tree_sizer", of=Identity(self.head)), TreeSizer)
        self._node_p: list[tuple[int, float]] = []  # the greedy tree's nodes: (token, head probability)
        # position -> the target's feature there: the prompt's last ``prompt_window`` from the prefill
        # (those the prefix cache restored are missing: the draft then starts later)
        last = len(tokens) - 2
        self.feats = {}
        # position -> the target's states there, observed but not yet fused (``_fuse_observed``): here
        # the prompt's window, fused right away (``n_fed`` below starts from it)
        self._states = {p: s for p, s in self._prompt_feats.items() if last - self.prompt_window < p <= last}
        self._fuse_observed()
        self._prompt_feats = {}
        # positions below n_fed are fed to the draft's cache (or skipped): from the first prompt
        # position whose previous feature is known
        self.n_fed = min(self.feats) + 1 if self.feats else len(tokens)
        self._fresh_from = len(tokens) - 1  # the root: what a step of the head's own feeds; before it, the prompt
        self._catchup = 0.0
        dev = torch.device(self.model.device)
        self.kv = KernelDraftKV.of(self.net, self.dtype, dev) or DraftKV(self.net, self.dtype, dev)

    def wants_hidden(self) -> bool:
        return True

    def _embed(self, toks: list[int]) -> torch.Tensor:
        return self.model.embed(torch.tensor(toks, device=self.model.device)).to(self.dtype)

    # -------------------------------------------------------------- propose
    def propose(self, tokens: list[int], budget: int) -> TokenTree:
        t0 = self._t_step = time.perf_counter()
        n = len(tokens)
        tree = TokenTree()
        self._catchup = 0.0
        self._fuse_observed()
        if (n - 2) not in self.feats or budget < 1:
            self.n_fed = max(self.n_fed, n)
            return tree  # no exact input for the root yet (the first step, or a step not observed)
        with torch.inference_mode():
            t_root = time.perf_counter()
            root_feat, old_share = self._feed_decided(tokens)
            # fusing and feeding positions decided before the last step (the prompt, other arms'
            # steps) is catching up, in proportion to how many of the fed positions they are
            self._catchup = (time.perf_counter() - t0) * old_share
            tree = self._grow(tokens, root_feat, budget, t0, t_root)
        self._drafted += len(tree)
        self._time += time.perf_counter() - t0
        return tree

    def catchup_seconds(self) -> float:
        return self._catchup

    def _feed_decided(self, tokens: list[int]) -> tuple[torch.Tensor, float]:
        """Feed the decided positions ``n_fed .. len(tokens) - 1`` whose previous feature is known
        (committing their keys and values); returns the head's output at the root, and the share of
        the fed positions decided before the last observed step (the prompt's, or steps another
        drafter made: 0 when the head drafted the step before)."""
        n = len(tokens)
        pos = [t for t in range(self.n_fed, n) if (t - 1) in self.feats]
        old_share = sum(t < self._fresh_from for t in pos) / len(pos)
        self.n_fed = n
        feats = torch.stack([self.feats[t - 1] for t in pos]).to(self.dtype)
        out = self.kv.feed(feats, self._embed([tokens[t] for t in pos]), torch.tensor(pos, device=self.model.device))
        self._head_forwards += 1
        for t in pos:
            if t - 1 < n - 2:
                self.feats.pop(t - 1, None)
        return out[-1], old_share

    def _grow(self, tokens: list[int], root_feat: torch.Tensor, budget: int, t0: float, t_root: float) -> TokenTree:
        params, gen = self.ctx.params, self.ctx.generator
        greedy = params.greedy
        verify = self.sizing_cost()
        sizer = self.sizer if verify is not None else None
        root_pos = len(tokens) - 1
        k = min(self.top_k, budget)
        cand_tok: list[int] = []
        cand_par: list[int] = []
        cand_score: list[float] = []
        cand_depth: list[int] = []
        cand_p: list[float] = []  # the head's probability of a candidate given its parent
        parent_feat: list[torch.Tensor] = []  # the head's output at each candidate's parent
        qdist: dict[int, torch.Tensor] = {}

        def add_children(parent: int, feat: torch.Tensor, logits: torch.Tensor) -> list[int]:
            lp = node_dist(logits, params)
            if not greedy:
                qdist[parent] = self.out.full(lp.exp())
            base = cand_score[parent] if parent >= 0 else 0.0
            depth = cand_depth[parent] + 1 if parent >= 0 else 0
            first = self.out.coupled(lp, self.ctx.uniform(root_pos + 1 + depth))  # drafter-invariant sampling
            idx, vals = draw_children(lp, k, params, gen, first)
            added = []
            for t, v in zip(self.out.ids(idx), vals):
                cand_tok.append(t)
                cand_par.append(parent)
                cand_p.append(math.exp(v))
                # a path's score: its log-probability, calibrated to acceptance when sized by cost
                cand_score.append(base + (sizer.log_accept(math.exp(v)) if sizer is not None else v))
                cand_depth.append(depth)
                parent_feat.append(feat)
                added.append(len(cand_tok) - 1)
            return added

        frontier = add_children(-1, root_feat, self.out.logits(self.net.readout(root_feat)))
        if sizer is not None:  # the root's forward is measured too: every step teaches the sizer
            sizer.note_forward(time.perf_counter() - t_root, [cand_p[c] for c in frontier])
        self.kv.drop_pending()
        slot_of: dict[int, int] = {}  # expanded candidate -> its pending slot
        anc: list[list[int]] = []  # per pending slot: the pending slots it attends to (itself included)
        depth = 1
        while depth < self.max_depth and frontier:
            frontier.sort(key=lambda c: -cand_score[c])
            expand = frontier[: self.beam]
            if not greedy and len(cand_tok) + len(expand) * k > budget:
                break  # sampled children are never pruned: stop before the budget is exceeded
            if greedy and len(cand_tok) >= budget and cand_score[expand[0]] <= sorted(cand_score)[-budget]:
                break  # nothing deeper can enter the best ``budget``
            if sizer is not None and not sizer.worth_expanding(cand_score, [cand_score[c] for c in expand], budget,
                                                               time.perf_counter() - t0, verify):
                break
            t1 = time.perf_counter()
            base = len(anc)
            rows = []
            for j, c in enumerate(expand):
                p = cand_par[c]
                rows.append((anc[slot_of[p]] if p >= 0 else []) + [base + j])
                slot_of[c] = base + j
            anc.extend(rows)
            out = self.kv.level(torch.stack([parent_feat[c] for c in expand]),
                                self._embed([cand_tok[c] for c in expand]),
                                torch.tensor([root_pos + 1 + cand_depth[c] for c in expand], device=self.model.device),
                                rows)
            self._head_forwards += 1
            frontier = [c for c in frontier if c not in slot_of]
            logits = self.out.logits(self.net.readout(out))  # every expanded node's children: one matmul
            added = []
            for j, c in enumerate(expand):
                added += add_children(c, out[j], logits[j])
            frontier += added
            if sizer is not None:
                sizer.note_forward(time.perf_counter() - t1, [cand_p[c] for c in added])
            depth += 1
        if sizer is not None:
            budget = sizer.size(cand_score, budget, verify, time.perf_counter() - t0)
        self.kv.drop_pending()
        kept = best_first(cand_score, cand_par, budget) if greedy else None
        self._node_p = [(cand_tok[c], cand_p[c]) for c in kept or []]
        return candidate_tree(cand_tok, cand_par, cand_score, qdist, budget, greedy, "eagle", order=kept)

    # -------------------------------------------------------------- observe
    def observe(self, tokens, tree, verdict, logits, hidden=None) -> None:
        self._steps += 1
        self._accepted += len(verdict.accepted)
        self._fresh_from = len(tokens) - len(verdict.tokens)  # the first position this step decided
        if self.sizing_cost() is not None and self._node_p:
            self.sizer.learn(self._node_p, tree, verdict.accepted)  # calibrate
            self.sizer.note_step(len(verdict.tokens), time.perf_counter() - self._t_step - self._catchup)
        # this step's nodes, used once: on a step another of auto's arms drafted, the head observes
        # the verdict of a tree that is not its own (stale nodes calibrated against it were wrong)
        self._node_p = []
        if not hidden:
            return
        rows = [0] + [a + 1 for a in verdict.accepted]
        first = len(tokens) - len(verdict.tokens) - 1  # the old root's position
        # the states only (a copy of these rows): they become features when the head next drafts, so
        # a step another drafter made (``auto``'s other arms) costs no fusing; the head's layer reads
        # the features of every position anyway, in one call (``_feed_decided``)
        with torch.inference_mode():
            states = self.net.input_states(self.model, hidden, rows)
        for i in range(len(rows)):
            self._states[first + i] = states[i]

    def _fuse_observed(self) -> None:
        """The observed states' features (``features_of``: EAGLE-3's fusion of its layers), for all
        positions observed since the last call, in one call."""
        if not self._states:
            return
        pos = sorted(self._states)
        with torch.inference_mode():
            f = self.net.features_of(torch.stack([self._states[p] for p in pos]))
        self.feats.update((p, f[i]) for i, p in enumerate(pos))
        self._states = {}

    def end(self) -> None:
        self.feats = {}
        self._states = {}

    def stats(self) -> dict[str, Any]:
        out = head_stats("eagle", self._steps, self._drafted, self._accepted, self._time)
        out["eagle_head_forwards"] = self._head_forwards
        out["head_int8_linears"] = int8_linears(self.net)
        out["eagle_layer_kernel"] = int(self.kv is not None and self.kv.kernel)
        return out

