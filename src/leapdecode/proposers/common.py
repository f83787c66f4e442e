"""Helpers shared by several proposers: option checks, copying continuations, merging
candidate continuations into a tree, drawing a node's children, and FR-Spec's vocabulary-subset
draft head."""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

import torch

from ..core.proposer import DecodeContext, Identity, MemoryKey
from ..core.sampling import SamplingParams, sample_at
from ..core.tree import TokenTree
from ..errors import InvalidParameterError
from ..models.qkernel import QLinear

DRAFT_VOCAB = 32768  # FR-Spec's subset size for Llama-3's 128k vocabulary
HEAD_WEIGHTS = ("auto", "bf16", "int8", "int4")  # the trained heads' ``head_weights`` (heads/common.py resolves it)
ATTENTION_SINK = 4  # StreamingLLM keeps the first four tokens
CONTEXT_WINDOW = 512  # prompt tokens a draft model reads besides the attention sink
AUTO_DRAFT_WINDOW = 256  # the same for auto's draft (its automaton copies from the whole text)


def check_int(name: str, value: Any, low: int = 1) -> int:
    """An integer option ``>= low`` (bools are not integers here)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidParameterError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


def copy_continuation(text: Sequence[int], start: int, length: int) -> list[int]:
    """``length`` tokens copied from ``text[start:]``; past the end the copy continues from its own
    output (LZ77-style overlapping copy), so it predicts that the text repeats with period
    ``len(text) - start``.  ``start`` must be ``< len(text)``."""
    out = list(text[start : start + length])
    if len(out) < length:
        end = len(text)
        for j in range(len(out), length):
            out.append(out[start + j - end])
    return out


def merge_candidates(cands: Iterable[tuple[Sequence[int], int, int]], budget: int, source: str) -> TokenTree:
    """Merge candidate continuations into a trie and keep its ``budget`` best nodes.

    Each candidate is ``(tokens, rank, recency)``.  A node scores
    ``(max rank, number of candidates through it, max recency)`` over the
    candidates passing through it; a child never scores above its parent (it
    is supported by a subset of the parent's candidates), and ties go to the
    shallower node, so the best ``budget`` nodes form a tree and the returned
    node order (best first) keeps parents before children: any prefix of the
    tree is again the best tree of that size.
    """
    tree = TokenTree()
    if budget < 1:
        return tree
    child: dict[tuple[int, int], int] = {}
    tok: list[int] = []
    par: list[int] = []
    depth: list[int] = []
    best_rank: list[int] = []
    count: list[int] = []
    recency: list[int] = []
    for toks, rank, rec in cands:
        parent = -1
        for d, t in enumerate(toks):
            node = child.get((parent, t))
            if node is None:
                node = len(tok)
                child[(parent, t)] = node
                tok.append(t)
                par.append(parent)
                depth.append(d)
                best_rank.append(rank)
                count.append(0)
                recency.append(rec)
            else:
                if rank > best_rank[node]:
                    best_rank[node] = rank
                if rec > recency[node]:
                    recency[node] = rec
            count[node] += 1
            parent = node
    order = sorted(range(len(tok)), key=lambda v: (-best_rank[v], -count[v], -recency[v], depth[v], v))[:budget]
    index: dict[int, int] = {}
    for v in order:
        p = par[v]
        index[v] = tree.add(tok[v], index[p] if p >= 0 else -1, sampled=False, source=source)
    return tree


def draw_children(logp: torch.Tensor, k: int, params: SamplingParams,
                  generator: torch.Generator, first: int | None = None) -> tuple[list[int], list[float]]:
    """``k`` children of a drafted node as (positions in ``logp``, log-probabilities): the top ``k``
    (greedy), or an ordered sample without replacement (Gumbel-top-k) of the tokens with non-zero
    probability, ``first`` (a position, ``coupled_first``) taken first when given."""
    k = min(k, logp.shape[-1])
    if params.greedy:
        vals, idx = torch.topk(logp, k)
        return idx.tolist(), vals.tolist()
    keys = logp - torch.empty_like(logp).exponential_(generator=generator).log()
    if first is not None:
        keys[first] = math.inf
    _, idx = torch.topk(keys, k)
    idx = idx[torch.isfinite(logp[idx])]
    return idx.tolist(), logp[idx].tolist()


def coupled_first(logp: torch.Tensor, u: float | None, ids: torch.Tensor | None = None) -> int | None:
    """Drafter-invariant sampling (``u``: the number the target draws the position's token with,
    ``DecodeContext.uniform``): the position in ``logp`` of the drafter's own draw with that number,
    inverse transform sampling in the target's token order (``sample_at``), which is the target's
    token whenever the two distributions agree there; None without ``u``.  ``ids``: the vocabulary
    ids of ``logp``'s positions under a subset head (their ascending order is the target's order;
    the tokens outside have probability 0, so they change no cumulative sum)."""
    if u is None:
        return None
    if ids is None:
        return sample_at(logp.exp(), u)
    order = torch.argsort(ids)
    return int(order[sample_at(logp[order].exp(), u)])


class SubsetHead(torch.nn.Module):
    """The draft's output projection restricted to ``ids`` (FR-Spec): the frequency-ranked
    base rows (built once per draft model) plus this generation's extra rows; fp32 logits."""

    def __init__(self, base: torch.nn.Module, base_ids: torch.Tensor, extra_ids: torch.Tensor,
                 extra: torch.nn.Module | None, extra_cols: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        """``extra``: a layer whose outputs (its columns ``extra_cols``, default all) are the
        logits of ``extra_ids``; ``dtype``: what the layers take as input."""
        super().__init__()
        self.base, self.extra, self.extra_cols, self.dtype = base, extra, extra_cols, dtype
        self.ids = torch.cat([base_ids, extra_ids])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dtype)
        y = self.base(x).float()
        if self.extra is None:
            return y
        z = self.extra(x).float()
        return torch.cat([y, z if self.extra_cols is None else z[..., self.extra_cols]], dim=-1)


def subset_head(ctx: DecodeContext, draft, size: int, extra: list[int], vocab: int | None = None) -> SubsetHead | None:
    """A ``SubsetHead`` over the ``size`` lowest ids plus ``extra`` (ids below ``vocab``, the
    vocabulary shared with the target); None where the draft has no plain head weight to
    slice (non-native backend) or the vocabulary is small anyway.

    A block-quantized head (the default format's ``QLinear``) is sliced as it is: the base rows are
    views of its packed rows and the extra rows a copy of the 16-row units that hold them, so the
    subset's logits are the target's own logits for those ids, at the quantized kernel's cost
    (qwen2.5-coder-1.5b, 32,768 rows: 0.24-0.5x the bf16 copy's time at 1-4 rows,
    docs/lab-notes/benchmarks.md section 31), and the head is never
    dequantized.  Other heads: a bf16 (oneDNN-packed) copy of the base rows."""
    from ..models.linear import make_linear

    model = draft.model
    vocab = min(vocab or model.vocab_size, model.vocab_size)
    head = getattr(model, "lm_head", None)
    quantized = isinstance(head, QLinear) and head.out_features >= vocab
    if size <= 0 or vocab <= 2 * size or (not quantized and model.head_weight is None):
        return None
    extra_ids = torch.tensor(sorted({t for t in extra if size <= t < vocab}), dtype=torch.long)
    if quantized:
        # the frequency-ranked base rows, sliced once per draft model and kept in the runner's memory
        base = ctx.remember(MemoryKey("subset_head", "rows", (size,), Identity(model)), lambda: head.first_rows(size), shared=True)
        if not len(extra_ids):
            return SubsetHead(base, torch.arange(size), extra_ids, None)
        rows, cols = head.gather_rows(extra_ids)
        return SubsetHead(base, torch.arange(size), extra_ids, rows, cols)
    weight = model.head_weight
    base = ctx.remember(MemoryKey("subset_head", "rows", (size,), Identity(model)), lambda: make_linear(weight[:size]), shared=True)
    extra_ids = extra_ids.to(weight.device)
    rows = make_linear(weight[extra_ids]) if len(extra_ids) else None
    return SubsetHead(base, torch.arange(size, device=weight.device), extra_ids, rows, dtype=weight.dtype)
