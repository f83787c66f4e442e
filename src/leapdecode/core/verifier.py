"""The one verifier: decides which drafted tokens the target accepts.

Given the target's logits at every node of a flattened token tree (row 0 = the
root), it walks down from the root:

* **greedy** (temperature 0): descend into the child whose token is the
  target's argmax; stop when none matches.  The emitted tokens are exactly
  those vanilla greedy decoding produces.
* **sampling**: at each node, first the children that were *drawn from a draft
  distribution q* (without replacement, in order) go through recursive
  rejection sampling: accept child x with probability min(1, p(x)/q(x)); on
  rejection the target distribution becomes the residual norm(max(p - q, 0))
  and x is removed from q (renormalised).  This is speculative sampling
  (Leviathan et al., 2023, "Fast Inference from Transformers via Speculative
  Decoding"; Chen et al., 2023, "Accelerating Large Language Model Decoding
  with Speculative Sampling") for one child, SpecInfer's multi-step
  speculative sampling for several ("SpecInfer", Miao et al., 2024;
  "Multi-Candidate Speculative Decoding", Yang et al., 2024) in its
  without-replacement form ("Recursive Speculative Decoding: Accelerating LLM
  Inference via Sampling Without Replacement", Jeon et al., 2024).  If all are
  rejected, a token is drawn from the (residual) target distribution; if it
  equals a *deterministic* child (model-free drafters), the walk descends
  there, otherwise that token is emitted and the step ends.  Each stage leaves
  the emitted token distributed exactly as the target's p.
* **drafter-invariant sampling** (``uniform`` given: seeded generations): the
  token at each position is the target's own draw there, inverse transform
  sampling of p with the uniform number that belongs to that position
  (``sampling.position_uniform``); the walk descends into the child (drawn or
  deterministic) holding that token and stops when none does.  This is
  "Coupling without Communication and Drafter-Invariant Speculative Decoding"
  (Daliri, Musco & Suresh, 2024/2025) with an inverse-transform coupling in
  place of their Gumbel-max one (one uniform number per position instead of
  one per vocabulary entry).  Every emitted token is exactly the token vanilla
  seeded decoding draws at that position, so a seeded text is the same with any
  method, any tree and any batch; a draft token is accepted with probability
  p(x), the same as speculative sampling gives a deterministic draft (for
  several deterministic children, p summed over them, as recursive rejection
  gives), and drafters that sample couple their draws to the same numbers
  (``DecodeContext.uniform``).

``allowed`` (optional) is the hook for constrained decoding: a bool vocabulary
mask per row (``[rows, V]``), or a function ``row -> [V]`` mask that is asked
only for the rows the walk visits (``core/constraint.py``'s ``RowMasks``; its
``bias(row)``, when not None, is added to that row's logits first).
Tokens outside it get probability 0 for the target (the target's distribution
restricted to the allowed tokens and renormalized, as vanilla constrained
decoding samples), so drafts outside the constraint are never accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .sampling import SamplingParams, greedy_tokens, sample, sample_at, target_probs
from .tree import TokenTree


@dataclass
class Verdict:
    accepted: list[int]  # tree node indices on the accepted path, root's child first
    next_token: int  # the target's own token after the accepted path
    tokens: list[int]  # accepted draft tokens + next_token: what this step emits


def _ancestor_tokens(tree: TokenTree) -> list[list[int]]:
    """Per flattened row (root first), the draft tokens on the path to that row."""
    rows: list[list[int]] = [[]]
    for i, p in enumerate(tree.parents):
        rows.append(rows[p + 1] + [tree.tokens[i]])
    return rows


def follow_path(tree: TokenTree, children: dict[int, list[int]], token_at: Callable[[int, int], int]) -> Verdict:
    """Descend from the root while a child holds the target's own token ``token_at(row, depth)``
    (a function of the target's logits at that row only: greedy, or drafter-invariant sampling;
    ``scripts/draft_ceiling.py``'s replays: the known greedy output at that depth).  ``children``:
    ``tree.child_map()``."""
    node, path = -1, []
    while True:
        token = token_at(node + 1, len(path))
        nxt = next((c for c in children.get(node, ()) if tree.tokens[c] == token), -1)
        if nxt < 0:
            return Verdict(path, token, [tree.tokens[c] for c in path] + [token])
        path.append(nxt)
        node = nxt


def verify(
    tree: TokenTree,
    logits: torch.Tensor,
    params: SamplingParams,
    history: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    allowed: torch.Tensor | Callable[[int], torch.Tensor] | None = None,
    uniform: Callable[[int], float] | None = None,
) -> Verdict:
    """Accept a path of ``tree`` given target ``logits`` ``[1 + len(tree), V]`` (row 0 = root).

    ``history`` holds the token ids decided so far (prompt + generated, root
    included); it only matters for the repetition penalty.  ``uniform`` (sampling
    only): ``depth -> u``, the uniform number of the token ``depth`` positions past
    the root's next one, for drafter-invariant sampling; ``generator`` is then unused.
    """
    extra = _ancestor_tokens(tree) if params.repetition_penalty != 1.0 else None
    lazy = callable(allowed)
    if allowed is not None and not lazy:
        logits = logits.masked_fill(~allowed, torch.finfo(logits.dtype).min)

    row_bias = getattr(allowed, "bias", None) if lazy else None

    def row_logits(row: int) -> torch.Tensor:  # [1, V]: one row, masked when the mask is lazy
        out = logits[row : row + 1]
        if lazy:
            mask = allowed(row).to(out.device)
            if not bool(mask.any()):
                raise ValueError(f"the constraint allows no token at tree row {row}")
            bias = row_bias(row) if row_bias is not None else None
            if bias is not None:  # grammar-aligned sampling's reweighting (constraints/asap.py)
                out = out + bias.to(out.device, out.dtype)
            out = out.masked_fill(~mask, torch.finfo(out.dtype).min)
        return out

    children = tree.child_map()
    if params.greedy:
        if lazy:
            def best_at(row: int) -> int:
                return int(greedy_tokens(row_logits(row), params, history,
                                         extra[row : row + 1] if extra else None)[0])
        else:
            best_at = greedy_tokens(logits, params, history, extra).tolist().__getitem__
        return follow_path(tree, children, lambda row, depth: best_at(row))

    if lazy:
        def probs_at(row: int) -> torch.Tensor:
            return target_probs(row_logits(row), params, history, extra[row : row + 1] if extra else None)[0]
    else:
        probs_at = target_probs(logits, params, history, extra).__getitem__
    if uniform is not None:
        return follow_path(tree, children, lambda row, depth: sample_at(probs_at(row), uniform(depth)))

    node, path = -1, []
    while True:
        p = probs_at(node + 1)
        kids = children.get(node, [])
        sampled = [c for c in kids if tree.sampled[c]]
        descended = -1
        if sampled:
            q = tree.q[node].to(p.device, torch.float32).clone()
            for c in sampled:
                x = tree.tokens[c]
                qx, px = q[x].item(), p[x].item()
                if qx <= 0.0:
                    raise ValueError(f"draft token {x} has zero probability under its own draft distribution")
                u = torch.rand((), generator=generator, device=p.device).item()
                if u * qx < px:  # u < min(1, p/q)
                    descended = c
                    break
                residual = (p - q).clamp_min(0.0)
                total = residual.sum()
                # total == 0 means p == q up to rounding, where rejection has probability 0
                p = residual / total if total > 0 else p
                q[x] = 0.0
                q_total = q.sum()
                if q_total <= 0:
                    break
                q = q / q_total
        if descended < 0:
            token = int(sample(p, generator)[0])
            descended = next((c for c in kids if not tree.sampled[c] and tree.tokens[c] == token), -1)
            if descended < 0:
                return Verdict(path, token, [tree.tokens[c] for c in path] + [token])
        path.append(descended)
        node = descended
