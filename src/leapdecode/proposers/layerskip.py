"""Layer-skip self-speculation (``method="layerskip"``): the target drafts for itself with some of
its own layers skipped, and keeps re-choosing which layers to skip from the text being written.

Paper: "CLaSp: In-Context Layer Skip for Self-Speculative Decoding" (Chen et al., 2025).  Related:
"Draft & Verify: Lossless Large Language Model Acceleration via Self-Speculative Decoding" (Zhang
et al., 2023), which drafts with a skip set found once, offline (Bayesian optimisation), and stops
drafting when the draft's confidence falls below a threshold; and SWIFT ("SWIFT: On-the-Fly
Self-Speculative Decoding for LLM Inference Acceleration", Xia et al., 2024), which searches the
skip set during inference.  No extra weights, no training: the draft model *is* the target with
``skip`` of its ``L`` layers left out, and it shares the target's KV cache.

Choosing the layers (CLaSp's dynamic programme).  Let ``x_0 .. x_L`` be the target's residual
stream at the last verified token (``x_0`` the embedding, ``x_i`` the output of layer ``i``).
State ``(i, j)`` holds one hidden state: the best one found after the first ``i`` layers with
``j`` of them skipped, best meaning the highest cosine similarity to ``x_i``.  The candidates for
``(i, j)`` are layer ``i`` applied to the state of ``(i - 1, j)`` and the state of ``(i - 1, j - 1)``
passed through unchanged (layer ``i`` skipped); the better one is kept, and the skip set is read
back from ``(L, M)``.  Keeping one state per cell is the paper's approximation: the objective (the
cosine of the *final* states) does not decompose over layers, so this is not guaranteed to find the
best of the ``C(L, M)`` subsets; it does whenever the objective is monotone in a per-layer additive
score (``tests/test_layerskip.py`` checks both against brute force).  As in the paper the ``M + 1``
states of one layer go through that layer together: they are ``M + 1`` sibling tree nodes at the
token's position, each attending to the committed prefix (the full model's keys/values: exact) and to
itself, so one DP costs about one target forward over ``M + 1`` tokens.  Those nodes are rolled back
afterwards.

Cadence.  CLaSp re-optimises after every verification.  On a CPU that would add roughly one
``M + 1``-token forward to every step, so here the DP runs every ``update_every`` verifications
(default 4) and once before the first step (on the last prompt token, with the full model's own path
riding along as one extra row to provide the targets).  In the other cases the hidden states come
free from the verification forward: the proposer asks the loop for them (``wants_hidden``) for that one
forward (it keeps references to tensors the forward makes anyway); the row of the last accepted token
is used.

Drafting.  A chain of up to ``k`` tokens, one forward per token through the kept layers only
(``NativeCausalLM.forward(..., layers=...)``) on the target's cache: the committed prefix has exact
keys/values for every layer the draft runs, and the earlier draft tokens have theirs for exactly the
layers that read them.  Drafting stops once the draft's probability of its latest token is below
``min_conf`` (Draft & Verify's draft-exiting rule with a fixed threshold; D&V adapts it online).  The
token that fell below is still proposed: its forward was already paid, and it costs verification
one row.  The draft's pending nodes have no keys/values for the skipped layers, so
they are always rolled back before the tree is returned: nothing the draft wrote survives into the
verification forward, which recomputes every layer for every tree node.

The draft's output projection scores only a frequency-ranked subset of the vocabulary (``draft_vocab``,
default 32768 of Qwen2.5's 152k, plus the prompt's tokens), as "FR-Spec: Accelerating
Large-Vocabulary Language Models via Frequency-Ranked Speculative Sampling" (Zhao et al., 2025) does
for EAGLE's draft (see ``draft_model.py``).  The other logits are -inf, so under sampling the draft
distribution is zero there and rejection sampling stays exact; ``draft_vocab=0`` scores everything.
A cost-aware stopping rule like ``draft``'s (calibrated confidence, measured draft and verification
costs) was tried here and measured no faster than ``min_conf`` on six Spec-Bench prompts (AMD EPYC,
0.951x vs 0.954x of vanilla), so it was left out: acceptances come in runs that a per-token model
misses.

Defaults: ``skip`` = 30% of the layers (8 of Qwen2.5-1.5B's 28), ``k`` = 6, ``min_conf`` = 0.6,
``update_every`` = 4.  On qwen2.5-coder-1.5b (bf16, CPU, two prompts) that setting had the best
tokens per unit of work (target forwards + draft forwards weighted by the share of layers run + DP
runs) of the (skip, min_conf) pairs tried: (40%, 0.4), (40%, 0.7), (30%, 0.6), (50%, 0.6); with
``update_every=1`` (the paper's cadence) the DP cost more than it gained there.

Greedy decoding drafts the draft's argmax (deterministic nodes); sampling draws each token from the
draft's own processed distribution and records it as the node's ``q``, so the verifier's rejection
sampling keeps the output distribution exactly the target's.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from ..core.sampling import apply_repetition_penalty, sample, sample_at, target_probs
from ..core.tree import TokenTree
from ..errors import InvalidParameterError
from ..core.proposer import DecodeContext, Proposer
from .common import subset_head
from .common import check_int
from .configs import LayerSkipConfig

DEFAULT_SKIP_FRACTION = 0.3


def clasp_dp(
    run_layer: Callable[[int, torch.Tensor], torch.Tensor],
    x0: torch.Tensor,
    n_layers: int,
    n_skip: int,
    targets: torch.Tensor | None = None,
) -> tuple[list[int], float]:
    """CLaSp's layer-selection DP: which ``n_skip`` of ``n_layers`` layers to skip.

    ``run_layer(i, states)`` applies layer ``i`` to every row of ``states`` (``[R, hidden]``)
    independently.  ``x0`` is the input of layer 0 (the embedding); ``targets[i]`` is the full
    model's state after layer ``i`` (``[n_layers, hidden]``).  With ``targets=None`` the full
    model's path is computed alongside as one more row (``R = n_skip + 2``, the last row), else
    ``R = n_skip + 1``.  Returns (sorted skipped layers, cosine similarity of the chosen path's
    final state to the full model's).
    """
    L, M = n_layers, n_skip
    if not 0 <= M <= L:
        raise ValueError(f"cannot skip {M} of {L} layers")
    full = targets is None
    R = M + 1
    dev = x0.device
    h = x0.reshape(1, -1).expand(R + int(full), -1).clone()
    valid = torch.zeros(R, dtype=torch.bool, device=dev)
    valid[0] = True
    j = torch.arange(R, device=dev)
    neg = torch.tensor(-math.inf, device=dev)
    no = torch.zeros(1, dtype=torch.bool, device=dev)
    choices = []
    for i in range(L):
        out = run_layer(i, h)
        target = (out[R] if full else targets[i]).float()
        s_run = F.cosine_similarity(out[:R].float(), target[None], dim=-1)
        s_prev = F.cosine_similarity(h[:R].float(), target[None], dim=-1)
        feasible = (j <= i + 1) & (M - j <= L - i - 1)
        valid_skip = torch.cat([no, valid[:-1]])
        a = torch.where(valid & feasible, s_run, neg)
        b = torch.where(valid_skip & feasible, torch.cat([neg[None], s_prev[:-1]]), neg)
        take_skip = b > a  # ties: run the layer
        shifted = torch.cat([h[:1], h[: R - 1]])  # row j <- state of (i - 1, j - 1)
        new = torch.where(take_skip[:, None], shifted, out[:R])
        h = torch.cat([new, out[R:]]) if full else new
        valid = (valid | valid_skip) & feasible
        choices.append(take_skip)
    table = torch.stack(choices).tolist() if choices else []
    skip, jj = [], M
    for i in range(L - 1, -1, -1):
        if table[i][jj]:
            skip.append(i)
            jj -= 1
    assert jj == 0, "the DP lost its feasible path"
    final = (h[R] if full else targets[L - 1]).float() if L else x0.float()
    score = float(F.cosine_similarity(h[M].float(), final, dim=0))
    return sorted(skip), score


def resolve_skip(skip: Any, n_layers: int) -> int:
    """``skip``: a count ``0 <= skip < n_layers``, a fraction ``0 < skip < 1`` of the layers, or
    ``None`` for the default fraction."""
    if skip is None:
        skip = DEFAULT_SKIP_FRACTION
    if isinstance(skip, bool) or not isinstance(skip, (int, float)) or (isinstance(skip, float) and math.isnan(skip)):
        raise InvalidParameterError(f"skip must be a layer count or a fraction in (0, 1), got {skip!r}")
    if isinstance(skip, float) and not skip.is_integer():
        if not 0 < skip < 1:
            raise InvalidParameterError(f"skip as a fraction of the layers must be in (0, 1), got {skip}")
        return min(max(round(skip * n_layers), 1), n_layers - 1)
    skip = int(skip)
    if not 0 <= skip < n_layers:
        raise InvalidParameterError(
            f"skip must be in [0, {n_layers - 1}] for a model of {n_layers} layers (at least one runs), got {skip}"
        )
    return skip


class LayerSkipProposer(Proposer):
    name = "layerskip"

    def __init__(
        self,
        target,  # LoadedModel
        tree_budget: int | None = None,
        skip: int | float | None = LayerSkipConfig.skip,
        k: int = LayerSkipConfig.k,
        min_conf: float = LayerSkipConfig.min_conf,
        update_every: int = LayerSkipConfig.update_every,
        draft_vocab: int = LayerSkipConfig.draft_vocab,
    ) -> None:
        if getattr(target, "backend", None) != "native":
            raise InvalidParameterError(
                f"layerskip needs the native backend (it runs a subset of the decoder's layers on a shared "
                f"KV cache); {getattr(target, 'name', 'this model')} is on the {getattr(target, 'backend', '?')} "
                "backend"
            )
        if tree_budget is not None:
            check_int("tree_budget", tree_budget)
        self.n_layers = int(target.model.n_layers)
        self.n_skip = resolve_skip(skip, self.n_layers)
        self.k = check_int("k", k)
        if isinstance(min_conf, bool) or not isinstance(min_conf, (int, float)) or not 0 <= min_conf < 1:
            raise InvalidParameterError(f"min_conf must be a number in [0, 1), got {min_conf!r}")
        self.min_conf = float(min_conf)
        self.update_every = check_int("update_every", update_every)
        if isinstance(draft_vocab, bool) or not isinstance(draft_vocab, int) or draft_vocab < 0:
            raise InvalidParameterError(f"draft_vocab must be an integer >= 0 (0: the whole vocabulary), got {draft_vocab!r}")
        self.draft_vocab = draft_vocab
        self.target = target
        self.default_budget = tree_budget or self.k
        self.layers: list[int] | None = None  # the layers the draft runs
        self._since = 0
        self._dp_runs = self._draft_forwards = self._drafted = self._accepted = self._verified = self._steps = 0
        self._dp_s = 0.0
        self.last_score: float | None = None  # the DP's cosine for its last choice

    # ---------------------------------------------------------------- setup
    def begin(self, ctx: DecodeContext, tokens: list[int]) -> None:
        super().begin(ctx, tokens)
        self.model = ctx.target.model
        self._want_hidden = False
        self.cache = ctx.cache
        self.layers = None
        self._since = 0
        self.vocab = int(self.model.vocab_size)
        self.head = subset_head(ctx, ctx.target, self.draft_vocab, tokens, self.vocab) if self.draft_vocab else None
        if self.n_skip == 0:
            self.layers = list(range(self.n_layers))
        elif self.cache.length >= 1:
            # the last prompt token is committed: probe it with the full path as an extra row
            self._optimise(tokens[-2], None)

    # ------------------------------------------------------------- the DP
    @contextmanager
    def sibling_rows(self, rows: int) -> Iterator[Callable[[int, torch.Tensor], torch.Tensor]]:
        """``run_layer(i, states)`` for ``rows`` states of the last committed token (slot
        ``cache.length - 1``): each row is a pending sibling node at that token's position that
        attends to the committed prefix before it and to itself.  Rolled back on exit."""
        model, cache = self.model, self.cache
        pos = cache.length - 1
        true_pos = pos + cache.pos_offset  # its position (a KV-cache policy may have evicted earlier tokens)
        _, mask = cache.plan_append([-1] * rows, rows)
        try:
            mask[:, pos] = False  # the token's committed copy: its pending rows stand in for it
            cos = model.rope_cos[true_pos : true_pos + 1].to(model.dtype)
            sin = model.rope_sin[true_pos : true_pos + 1].to(model.dtype)

            def run_layer(i: int, states: torch.Tensor) -> torch.Tensor:
                return model.layers[i](states[None], cos, sin, cache, i, mask)[0]

            yield run_layer
        finally:
            cache.rollback()

    def _optimise(self, token: int, targets: torch.Tensor | None, x0: torch.Tensor | None = None) -> None:
        """Re-choose the skipped layers at the last committed token ``token`` (slot ``cache.length - 1``)."""
        model, cache = self.model, self.cache
        rows = self.n_skip + 1 + (targets is None)
        if cache.length < 1 or cache.room() < rows or cache.n_pending:
            return
        t0 = time.perf_counter()
        with torch.inference_mode():
            if x0 is None:
                x0 = model.embed(torch.tensor([token], device=model.device))[0]
            with self.sibling_rows(rows) as run_layer:
                skip, self.last_score = clasp_dp(run_layer, x0, self.n_layers, self.n_skip, targets)
        skipped = set(skip)
        self.layers = [i for i in range(self.n_layers) if i not in skipped]
        self._dp_runs += 1
        self._since = 0
        self._dp_s += time.perf_counter() - t0

    # -------------------------------------------------------------- propose
    def propose(self, tokens: list[int], budget: int) -> TokenTree:
        if self.cache.n_pending:
            self.cache.rollback()
        tree = TokenTree()
        n = min(self.k, budget)
        if self.layers is not None and n >= 1:
            tree = self._draft(tokens, n)
        self._drafted += len(tree)
        if self.n_skip and (self.layers is None or self._since + 1 >= self.update_every):
            # the verification forward that follows hands its hidden states to observe, for the DP
            self._want_hidden = True
        return tree

    def wants_hidden(self) -> bool:
        return self._want_hidden

    def _draft(self, tokens: list[int], n: int) -> TokenTree:
        model, cache, params = self.model, self.cache, self.ctx.params
        dev = model.device
        penalty = params.repetition_penalty != 1.0
        history = torch.tensor(tokens, device=dev) if penalty else None
        out: list[int] = []
        qs: list[torch.Tensor] = []
        tok = tokens[-1]
        try:
            for _ in range(n):
                logits = model.forward(torch.tensor([[tok]], device=dev), cache, layers=self.layers,
                                       head=self.head)[0, -1]
                if self.head is not None:  # back to the whole vocabulary: -inf outside the subset
                    logits = torch.full((self.vocab,), -math.inf, dtype=logits.dtype,
                                        device=dev).index_copy_(0, self.head.ids, logits)
                self._draft_forwards += 1
                if penalty:
                    hist = torch.cat([history, torch.tensor(out, dtype=history.dtype, device=dev)])
                    logits = apply_repetition_penalty(logits[None], params.repetition_penalty, hist)[0]
                if params.greedy:
                    conf, t = logits.softmax(-1).max(-1)
                    tok = int(t)
                else:
                    q = target_probs(logits[None], params)[0]
                    # drafter-invariant sampling: the number the target draws this position with
                    u = self.ctx.uniform(len(tokens) + len(out))
                    tok = int(sample(q, self.ctx.generator)[0]) if u is None else sample_at(q, u)
                    conf = q[tok]
                    qs.append(q)
                out.append(tok)
                if float(conf) < self.min_conf:
                    break
        finally:
            # the draft's nodes lack keys/values for the skipped layers: never let them reach verification
            cache.rollback()
        return TokenTree.chain(out, source="layerskip", q=None if params.greedy else qs)

    # -------------------------------------------------------------- observe
    def observe(self, tokens, tree, verdict, logits, hidden=None) -> None:
        captured = hidden if self._want_hidden else None
        self._want_hidden = False
        self._since += 1
        self._steps += 1
        self._accepted += len(verdict.accepted)
        self._verified += len(tree)
        if captured is not None and len(captured) == self.n_layers + 1:
            # the last verified token: the deepest accepted node (or the root); committed at length - 1
            row = verdict.accepted[-1] + 1 if verdict.accepted else 0
            states = torch.stack([h[0, row] for h in captured])
            self._optimise(tokens[-2], states[1:], x0=states[0])

    def stats(self) -> dict[str, Any]:
        skipped = sorted(set(range(self.n_layers)) - set(self.layers or range(self.n_layers)))
        return {
            "layerskip_skip": self.n_skip,
            "layerskip_skipped_layers": skipped,
            "layerskip_dp_runs": self._dp_runs,
            "layerskip_dp_s": round(self._dp_s, 4),
            "draft_forwards": self._draft_forwards,
            "draft_nodes": self._drafted,
            "layerskip_accept_rate": round(self._accepted / self._verified, 4) if self._verified else 0.0,
        }

