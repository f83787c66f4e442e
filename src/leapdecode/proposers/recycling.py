"""Token Recycling (``method="recycling"``): reuse the candidates the target already ranked.

"Turning Trash into Treasure: Accelerating Inference of Large Language Models
with Token Recycling" (Luo et al., 2024).  Every verification forward computes
the target's next-token distribution at every drafted node, and all but the
accepted path are normally thrown away.  Token Recycling keeps them: an
adjacency matrix ``M[token] = top-k next tokens`` (k = 8) is overwritten after
each forward with ``topk(logits at node i)`` for the token of every node i
(root included).  Drafting needs no model: starting from the root token, a
*static tree template* is filled breadth-first -- a template node of sibling
rank ``r`` under a node holding token ``x`` gets ``M[x][r]``.

The template.  The paper uses a fixed, left-heavy tree of about 80 nodes whose
branching decreases with depth (the best-ranked candidate at each level gets
the most children).  We build such a template by taking the most likely
rank-paths under a fixed per-rank prior (rank 0 ~ 0.6, rank 1 ~ 0.15, ...),
with root branching 8 and per-depth caps decreasing ``8, 4, 3, 2, 2, 2, 1...``;
nodes are ordered best-first (parents first), so the first ``budget`` nodes
of the 80-node template are the best template of that size.  The default
budget is 28: 5 root children, branching ``5, 4, 3, 2, 1, 1, 1`` by depth,
depth 7.  Tokens whose row is still empty (never seen in a forward) get no
children, so the tree is just smaller early on.

State.  The paper's matrix is ``[V, k]`` and it reports under 2 MB of extra
storage.  For a 152k vocabulary a dense int32 ``[V, 8]`` matrix is
4.9 MB, so rows are allocated only for tokens actually seen: an int32 slot per
vocabulary entry (0.6 MB for 152k) plus int32 rows of ``k`` for seen tokens
(32 bytes each), well under 2 MB unless tens of thousands of distinct tokens
were seen.  ``stats()['recycling_state_bytes']`` reports it.  As in the paper
the matrix is kept across generations (``persist=True``, stored on the target
model object); it only changes speed, never the output.  Prefill logits are not
available to the loop, so a fresh matrix starts empty.

Update order within one forward: rows of the nodes off the accepted path
first, then the root, then the accepted path, so when a token appears several
times in a tree the row from the context that really happened wins.  All
nodes are deterministic (``sampled=False``), so the verifier is exact under
greedy decoding and sampling.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from ..core.tree import TokenTree
from ..errors import InvalidParameterError
from ..core.proposer import DecodeContext, MemoryKey, Proposer
from .common import check_int
from .configs import RecyclingConfig

RANK_PRIOR = (0.6, 0.15, 0.08, 0.05, 0.03, 0.02, 0.02, 0.01)
DEPTH_CAPS = (8, 4, 3, 2, 2, 2, 1, 1, 1, 1, 1, 1)
TEMPLATE_SIZE = 80


def default_template(size: int = TEMPLATE_SIZE, k: int = 8) -> list[tuple[int, ...]]:
    """Rank-paths (``(0, 1)``: root's best candidate, then that token's second best), best first."""
    paths: list[tuple[int, ...]] = []
    level: list[tuple[int, ...]] = [()]
    for cap in DEPTH_CAPS:
        level = [p + (r,) for p in level for r in range(min(cap, k))]
        paths += level

    def prior(p: tuple[int, ...]) -> float:
        s = 1.0
        for r in p:
            s *= RANK_PRIOR[r] if r < len(RANK_PRIOR) else RANK_PRIOR[-1]
        return s

    paths.sort(key=lambda p: (-prior(p), len(p), p))
    return paths[:size]


def compile_template(paths: Sequence[Sequence[int]], k: int) -> list[tuple[int, int]]:
    """``(parent template index or -1, rank)`` per node; parents must precede their children."""
    index: dict[tuple[int, ...], int] = {}
    out: list[tuple[int, int]] = []
    for p in paths:
        p = tuple(p)
        if not p or any(isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < k for r in p):
            raise InvalidParameterError(f"template paths must be non-empty tuples of ranks in [0, {k}), got {p!r}")
        if p in index:
            raise InvalidParameterError(f"template path {p!r} appears twice")
        parent = index.get(p[:-1], -1) if len(p) > 1 else -1
        if len(p) > 1 and parent < 0:
            raise InvalidParameterError(f"template path {p!r} comes before its parent {p[:-1]!r}")
        index[p] = len(out)
        out.append((parent, p[-1]))
    return out


class AdjacencyMatrix:
    """``M[token] -> top-k next tokens``, rows allocated for seen tokens only (int32 throughout)."""

    def __init__(self, k: int, vocab: int = 0) -> None:
        self.k = k
        self.slot = np.full(max(vocab, 1), -1, dtype=np.int32)
        self.rows = np.zeros((64, k), dtype=np.int32)
        self.n = 0

    def nbytes(self) -> int:
        return int(self.slot.nbytes + self.rows.nbytes)

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        """The matrix as it is now, for ``restore`` (the bench repeats a request from one state)."""
        return self.slot.copy(), self.rows[: self.n].copy()

    def restore(self, snap: tuple[np.ndarray, np.ndarray]) -> None:
        slot, rows = snap
        self.slot, self.n = slot.copy(), len(rows)
        self.rows = np.zeros((max(64, len(rows)), self.k), dtype=np.int32)
        self.rows[: self.n] = rows

    def row(self, token: int) -> list[int] | None:
        if token >= len(self.slot):
            return None
        s = self.slot[token]
        return None if s < 0 else self.rows[s].tolist()

    def update(self, tokens: Sequence[int], topk: np.ndarray) -> None:
        """``M[tokens[i]] = topk[i]`` in order (a later row of the same token wins)."""
        if len(tokens) == 0:
            return
        last: dict[int, int] = {}
        for i, t in enumerate(tokens):
            last[int(t)] = i
        toks = np.fromiter(last.keys(), dtype=np.int64, count=len(last))
        src = np.fromiter(last.values(), dtype=np.int64, count=len(last))
        top = int(toks.max())
        if top >= len(self.slot):
            grown = np.full(max(top + 1, 2 * len(self.slot)), -1, dtype=np.int32)
            grown[: len(self.slot)] = self.slot
            self.slot = grown
        slots = self.slot[toks]
        new = slots < 0
        n_new = int(new.sum())
        if n_new:
            if self.n + n_new > len(self.rows):
                rows = np.zeros((max(self.n + n_new, 2 * len(self.rows)), self.k), dtype=np.int32)
                rows[: self.n] = self.rows[: self.n]
                self.rows = rows
            slots[new] = np.arange(self.n, self.n + n_new, dtype=np.int32)
            self.slot[toks[new]] = slots[new]
            self.n += n_new
        self.rows[slots] = topk[src, : self.k]


class TokenRecyclingProposer(Proposer):
    name = "recycling"

    def __init__(
        self,
        tree_budget: int | None = None,
        k: int = RecyclingConfig.k,
        template: list[list[int]] | None = RecyclingConfig.template,
        persist: bool = RecyclingConfig.persist,
    ) -> None:
        if tree_budget is not None:
            check_int("tree_budget", tree_budget)
        self.k = check_int("k", k)
        paths = template if template is not None else default_template(TEMPLATE_SIZE, self.k)
        if not isinstance(paths, (list, tuple)) or not paths:
            raise InvalidParameterError("template must be a non-empty list of rank paths")
        self.template = compile_template(paths, self.k)
        self.default_budget = tree_budget or min(RecyclingConfig.default_tree_budget, len(self.template))
        self.persist = bool(persist)
        self.matrix: AdjacencyMatrix | None = None
        self._steps = self._nodes = 0

    def begin(self, ctx: DecodeContext, tokens: list[int]) -> None:
        super().begin(ctx, tokens)
        vocab = int(getattr(ctx.target.model, "vocab_size", 0) or 0)
        if self.persist:
            # one matrix per target and k, learned across its generations (the runner's memory)
            self.matrix = ctx.remember(MemoryKey("recycling", "matrix", (self.k,)), lambda: AdjacencyMatrix(self.k, vocab))
        elif self.matrix is None:
            self.matrix = AdjacencyMatrix(self.k, vocab)

    def propose(self, tokens: list[int], budget: int) -> TokenTree:
        tree = TokenTree()
        self._steps += 1
        m = self.matrix
        if m is None or budget < 1:
            return tree
        rows: dict[int, list[int] | None] = {}
        node_of: list[int] = []  # template node -> tree node (-2: absent)
        root = int(tokens[-1])
        for parent, rank in self.template:
            if len(tree) >= budget:
                break
            if parent == -1:
                src, tparent = root, -1
            else:
                tparent = node_of[parent]
                if tparent < 0:
                    node_of.append(-2)
                    continue
                src = tree.tokens[tparent]
            row = rows.get(src, 0)
            if row == 0:
                row = rows[src] = m.row(src)
            if row is None:
                node_of.append(-2)
                continue
            node_of.append(tree.add(row[rank], tparent, sampled=False, source=self.name))
        self._nodes += len(tree)
        return tree

    def observe(self, tokens, tree, verdict, logits, hidden=None) -> None:
        if self.matrix is None:
            return
        n = len(tree) + 1
        k = min(self.k, logits.shape[-1])
        top = torch.topk(logits[:n], k, dim=-1).indices.to("cpu", torch.int32).numpy()
        if k < self.k:
            top = np.pad(top, ((0, 0), (0, self.k - k)), mode="edge")
        root = tokens[-len(verdict.tokens) - 1]
        row_tokens = [root] + tree.tokens  # row 0 = root, row i + 1 = node i
        on_path = set(verdict.accepted)
        order = [i + 1 for i in range(len(tree)) if i not in on_path] + [0] + [a + 1 for a in verdict.accepted]
        self.matrix.update([row_tokens[r] for r in order], top[order])

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"draft_nodes": self._nodes}
        if self.matrix is not None:
            out["recycling_rows"] = self.matrix.n
            out["recycling_state_bytes"] = self.matrix.nbytes()
        return out
