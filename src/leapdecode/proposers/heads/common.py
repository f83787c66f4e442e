"""What the trained-head proposers (``medusa``, ``eagle``) share: the target's features, the output
head they score with (the target's own, or FR-Spec's frequency-ranked subset of it), drawing a
node's children, and a fingerprint that ties a head to the target it was trained on.

The *feature* of a position is what the target's output projection reads there: the last layer's
residual stream after the final RMSNorm, so ``lm_head(feature)`` are the target's logits.  It is
computed from the per-layer hidden states the verification forward hands to ``observe``
(``hidden[-1]``, before the norm), never by patching the target.
"""

from __future__ import annotations

import copy
import hashlib
import math
import weakref
from typing import Any

import numpy as np
import torch
from torch import nn

from ...core.proposer import DecodeContext, Identity, MemoryKey
from ...core.sampling import SamplingParams, target_probs
from ...core.tree import TokenTree
from ...errors import InvalidParameterError
from ...models import kernel_library, kernel_pack, qkernel
from ...models.native import rms_norm
from ...models.quant import Int8Linear, kernel_problem
from ..common import HEAD_WEIGHTS, coupled_first, subset_head



def reads_target_head(target) -> bool:
    """Whether a head can run on ``target``: heads read its final norm and output head, which the
    native backend has.  (Checked on the class: reading ``model.head_weight`` would dequantize a
    block-quantized head.)"""
    model = getattr(target, "model", None)
    return getattr(target, "backend", None) == "native" and getattr(type(model), "head_weight", None) is not None


def require_native(target, method: str) -> None:
    """``reads_target_head``, or an ``InvalidParameterError`` naming the method and the backend."""
    if not reads_target_head(target):
        raise InvalidParameterError(
            f"method {method!r} needs the native backend (its head reads the target's final norm and output "
            f"head); {getattr(target, 'name', 'this model')} is on the {getattr(target, 'backend', '?')} backend")


def target_features(model, last_hidden: torch.Tensor) -> torch.Tensor:
    """The features of the rows of ``last_hidden`` (the last layer's residual stream, ``[..., H]``):
    what the target's output projection reads (after the final RMSNorm)."""
    return rms_norm(last_hidden, model.norm, model.cfg.rms_norm_eps)


# id(embedding module) -> (a weak reference to it, the stamp its fingerprint was computed for, the
# fingerprint): finding a head asks for it several times, and the strided sample of a large
# embedding table costs ~60 ms (one cache line per sampled value)
_FINGERPRINTS: dict[int, tuple[weakref.ref, tuple, str]] = {}


def fingerprint(target) -> str:
    """A hash that identifies a target's weights: its shape and a strided sample of its embedding
    table and final norm, rounded to bf16 (so the same checkpoint loaded in fp32, bf16 or with
    quantized linear layers has one fingerprint; the embedding's values are the checkpoint's, or
    the GGUF's dequantized).  Remembered per embedding module until its tables or the norm change
    (their version counters)."""
    model = target.model
    cfg = model.cfg
    emb, norm = model.embed, model.norm  # the embedding: a table, or the GGUF's blocks (BlockEmbedding)
    shape = (cfg.vocab_size, cfg.hidden_size, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads)
    try:
        stamp = (id(norm), norm._version, tuple(t._version for t in emb.state_dict(keep_vars=True).values()), shape)
    except RuntimeError:  # inference tensors have no version counter: not remembered
        stamp = None
    kept = _FINGERPRINTS.get(id(emb))
    if stamp is not None and kept is not None and kept[0]() is emb and kept[1] == stamp:
        return kept[2]
    h = hashlib.sha256()
    h.update(repr(shape).encode())
    with torch.no_grad():
        for numel, sampled in ((cfg.vocab_size * cfg.hidden_size, model.embedding_sample),
                               (norm.numel(), lambda step: norm.detach().reshape(-1)[::step])):
            sample = sampled(max(1, numel // 65536)).to("cpu", torch.bfloat16).view(torch.int16)
            h.update(sample.numpy().tobytes())
    digest = h.hexdigest()
    if stamp is not None:
        key = id(emb)
        _FINGERPRINTS[key] = (weakref.ref(emb, lambda _, key=key: _FINGERPRINTS.pop(key, None)), stamp, digest)
    return digest


class HeadVocab:
    """The output head a drafting head scores with: the target's own projection, or (FR-Spec,
    ``draft_vocab`` > 0 on a large vocabulary) its ``draft_vocab`` lowest ids plus this
    generation's prompt tokens.  Tokens outside a subset get draft probability 0.  Either runs on
    the target's head as it is loaded (the default format: the quantized kernel, whose logits are
    then the target's own), never a dequantized copy of it."""

    def __init__(self, ctx: DecodeContext, draft_vocab: int, tokens: list[int]) -> None:
        self.model = model = ctx.target.model
        self.vocab = int(model.vocab_size)
        self.sub = subset_head(ctx, ctx.target, draft_vocab, tokens, self.vocab) if draft_vocab else None

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 logits over the head's ids (``[..., n]``)."""
        if self.sub is not None:
            return self.sub(x)
        return self.model.lm_head(x.to(self.model.dtype)).float()[..., :self.vocab]

    def ids(self, idx: list[int]) -> list[int]:
        if self.sub is None:
            return idx
        return self.sub.ids[torch.tensor(idx, dtype=torch.long)].tolist() if idx else []

    def coupled(self, logp: torch.Tensor, u: float | None) -> int | None:
        """``coupled_first`` of the head's log-probabilities ``logp`` (drafter-invariant sampling)."""
        return coupled_first(logp, u, self.sub.ids if self.sub is not None else None)

    def full(self, p: torch.Tensor) -> torch.Tensor:
        """A distribution over the head's ids as one over the whole vocabulary (0 outside)."""
        if self.sub is None:
            return p
        out = torch.zeros(self.vocab, dtype=p.dtype, device=p.device)
        return out.index_copy_(0, self.sub.ids.to(p.device), p)


def node_dist(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities that rank candidates (greedy) or that children are drawn from (sampling:
    the draft's logits through the same temperature and filters as the target's)."""
    if params.greedy:
        return logits.float().log_softmax(-1)
    return target_probs(logits[None], params)[0].clamp_min(0).log()


def head_stats(name: str, steps: int, drafted: int, accepted: int, seconds: float) -> dict[str, Any]:
    return {f"{name}_steps": steps, "draft_nodes": drafted,
            f"{name}_accept_rate": round(accepted / drafted, 4) if drafted else 0.0,
            f"{name}_draft_s": round(seconds, 4)}


def best_first(scores: list[float], parents: list[int], budget: int) -> list[int]:
    """The ``budget`` best candidates by score (ties to the earlier), in candidate order.  Scores are
    cumulative log-probabilities, so a child never outranks its parent (which comes earlier): the
    chosen set is a tree."""
    if len(scores) <= budget:
        return list(range(len(scores)))
    return sorted(sorted(range(len(scores)), key=lambda c: (-scores[c], c))[:budget])


def candidate_tree(tokens: list[int], parents: list[int], scores: list[float], qdist: dict, budget: int,
                   greedy: bool, source: str, order: list[int] | None = None) -> TokenTree:
    """The drafted candidates (``parents[c] < 0``: a child of the root) as a ``TokenTree``: greedy,
    the ``budget`` best by score (``best_first``) as deterministic nodes; sampling, every candidate
    as a sampled node, with each kept node's draft distribution (``qdist``, keyed by candidate,
    -1 the root) renumbered onto the tree (``tree.q``).  ``order``: the greedy choice when the caller
    already made it (``best_first(scores, parents, budget)``)."""
    if order is None:
        order = best_first(scores, parents, budget) if greedy else list(range(len(tokens)))
    tree = TokenTree()
    index: dict[int, int] = {}
    for c in order:
        p = parents[c]
        index[c] = tree.add(tokens[c], index[p] if p >= 0 else -1, sampled=not greedy, source=source)
    if not greedy:
        tree.q = {(index[c] if c >= 0 else -1): q for c, q in qdist.items() if c < 0 or c in index}
    return tree


def check_head_weights(value: Any) -> str:
    if value not in HEAD_WEIGHTS:
        raise InvalidParameterError(f"head_weights must be one of {', '.join(HEAD_WEIGHTS)}, got {value!r}")
    return value


def head_weights_for(setting: str, target) -> str:
    """What ``head_weights=setting`` runs the head's linear layers on for ``target``: ``"int8"`` (8-bit
    weights: ``int8_linear``), ``"int4"`` (4-bit weights in groups of 32 on the block kernel:
    ``int4_linear``) or ``"bf16"`` (the head's float weights as loaded: the target's dtype).
    ``auto``: int8 on the CPU when the target runs a quantized format (int8, int4 or GGUF blocks:
    ``model.quantization``) and the kernel works here, else the float head.  ``int8`` or ``int4``
    where its kernel cannot run raises ``InvalidParameterError``.  (A head only drafts: its weights
    change which tokens are proposed, never which are accepted.)"""
    check_head_weights(setting)
    model = target.model
    device = torch.device(getattr(model, "device", "cpu"))
    if setting == "auto":
        quantized = bool(getattr(model, "quantization", None))
        return "int8" if device.type == "cpu" and quantized and kernel_problem("int8", device) is None else "bf16"
    if setting == "int8":
        problem = kernel_problem("int8", device)
        if problem is not None:
            raise InvalidParameterError(f"head_weights=int8: the int8 kernel cannot run on {device} here ({problem})")
    if setting == "int4":
        problem = (kernel_library.kernel_problem() if device.type == "cpu"
                   else f"the block kernel runs on the CPU, not {device}")
        if problem is not None:
            raise InvalidParameterError(f"head_weights=int4: the block kernel cannot run here ({problem})")
    return setting


def int8_linear(linear: nn.Linear) -> nn.Module | None:
    """``linear`` on per-row symmetric int8 weights (``Int8Linear.from_float``'s quantizer: an
    int8-stored head keeps its stored codes and scales exactly): on the block-quantized kernel
    (kernels/qgemm.cpp: 8-bit codes in groups of 32, each group with its row's scale) where that
    kernel runs here and the shape fits, else on torch's int8 kernel (``Int8Linear``); None where
    neither can take it.  (On the 2-core AMD EPYC the block kernel ran the EAGLE-3 head's layers of
    qwen2.5-coder-1.5b in 0.4-0.6x torch's int8 time at 1-4 rows: docs/lab-notes/benchmarks.md section 31.)"""
    n, k = linear.out_features, linear.in_features
    if Int8Linear.unsupported(n, k, linear.weight.device) is not None:
        return None
    ref = Int8Linear.from_float(linear.weight, linear.bias)
    if ref.qweight.device.type != "cpu" or kernel_library.kernel_problem() is not None or n % 16 or k % 32:
        return ref
    rows = ref.scales.float()[:, None].expand(n, k // 32).numpy()
    block = kernel_pack.BlockWeight(ref.qweight.numpy(), np.ascontiguousarray(rows), np.zeros((n, k // 32), np.float32),
                                    8, 32)
    return qkernel.QLinear([qkernel.QPart.from_block(block)], None if linear.bias is None else linear.bias.detach().float())


def int4_linear(linear: nn.Linear) -> nn.Module | None:
    """``linear`` on 4-bit weights in groups of 32 on the block kernel: per group, ``w ~ s * c + z``
    with codes ``c`` in 0..15, ``z`` the group's minimum and ``s`` its range / 15 (Q4_1's rule), both
    rounded to fp16 first (the kernel's fp16 scale mode: 20 bytes per 32 weights, against 36 for
    ``int8_linear``'s 8-bit codes), the codes then rounded to nearest.  None where the block kernel
    does not run here or the shape does not fit (the caller falls back to ``int8_linear``)."""
    n, k = linear.out_features, linear.in_features
    if linear.weight.device.type != "cpu" or kernel_library.kernel_problem() is not None or n % 16 or k % 32:
        return None
    w = linear.weight.detach().float().reshape(n, k // 32, 32)
    lo = w.amin(-1).half().float()
    s = ((w.amax(-1) - lo) / 15).half().float()
    s = torch.where(s > 0, s, torch.ones_like(s))  # a constant group: codes 0, the value in z
    if not (torch.isfinite(s).all() and torch.isfinite(lo).all()):
        return None  # beyond fp16's range
    codes = ((w - lo[..., None]) / s[..., None]).round().clamp(0, 15).to(torch.uint8).reshape(n, k)
    block = kernel_pack.BlockWeight(codes.numpy(), s.numpy(), lo.numpy(), 4, 32)
    return qkernel.QLinear([qkernel.QPart.from_block(block)], None if linear.bias is None else linear.bias.detach().float())


def quantized_copy(head: nn.Module, kind: str = "int8") -> nn.Module:
    """A copy of ``head`` whose ``nn.Linear`` layers run on ``kind`` weights (``"int8"``:
    ``int8_linear``; ``"int4"``: ``int4_linear``, or ``int8_linear`` where that does not fit),
    quantized from the float weights; a linear that no such kernel takes stays float (and shares
    the head's weights, read only).  The head itself is untouched; its other parameters, such as
    norms, are copied."""
    linears = [m for m in head.modules() if isinstance(m, nn.Linear)]
    # the float weights are not copied: the copy's linears are replaced right away
    memo = {id(t): t for m in linears for t in (m.weight, m.bias) if t is not None}
    clone = copy.deepcopy(head, memo)
    with torch.no_grad():
        for module in list(clone.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, nn.Linear):
                    q = (int4_linear(child) if kind == "int4" else None) or int8_linear(child)
                    if q is not None:
                        setattr(module, name, q)
    return clone.eval()


def int8_copy(head: nn.Module) -> nn.Module:
    """``quantized_copy(head, "int8")``."""
    return quantized_copy(head, "int8")


def running_head(ctx: DecodeContext, head: nn.Module, setting: str) -> nn.Module:
    """The module a proposer runs for ``head`` under ``head_weights=setting``: ``head`` itself, or its
    int8 or int4 copy (``quantized_copy``), made once per runner and kept in its memory (never on the
    head, which the runner's other users share)."""
    kind = head_weights_for(setting, ctx.target)
    if kind == "bf16":
        return head
    # the entry holds the head (kept as it was when the key was its id())
    kept, converted = ctx.remember(MemoryKey("head", "quantized_copy", (kind,), Identity(head)), lambda: (head, quantized_copy(head, kind)),
                                   shared=True)
    assert kept is head
    return converted


def int8_linears(module: nn.Module) -> int:
    """How many of ``module``'s linear layers run on a quantized kernel, int8 or int4 (a stat: did
    quantized drafting run)."""
    return sum(isinstance(m, (Int8Linear, qkernel.QLinear)) for m in module.modules())


NEG_INF = -math.inf
