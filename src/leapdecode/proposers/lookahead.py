"""Lookahead decoding (``method="lookahead"``): Jacobi iterations that harvest n-grams, verified in one forward.

"Break the Sequential Dependency of LLM Inference Using Lookahead Decoding"
(Fu, Bailis, Stoica and Zhang, ICML 2024).  No draft model: every step runs
two branches through the *same* target forward,

* the **lookahead branch** -- a 2D window of ``N - 1`` levels x ``W``
  positions of guessed future tokens, advanced by one Jacobi iteration per
  step; its trajectories yield n-grams that go into
* the **n-gram pool** -- keyed by an n-gram's first token, at most ``G``
  n-grams per key (oldest dropped first, a re-seen n-gram becomes the newest);
* the **verification branch** -- the pool's n-grams whose first token is the
  root (the last decided token) are proposed as candidate chains, merged into
  a trie (shared prefixes verified once); the verifier accepts the longest
  path the target agrees with.

Parameters: ``window`` (the paper's W, default 5), ``ngram`` (N, default 4,
at least 2), ``guesses`` (G, default W).  The default tree budget is
``(G + W) * (N - 1)``: the whole window plus G unmerged n-grams.

The window.  Positions are counted from the root (position 0).  Column ``j``
(``0 <= j < W``) is one diagonal *trajectory*: tokens at positions ``j + 1,
j + 2, ..., j + N - 1`` -- the paper's ``(level 0, offset j), (level 1,
offset j + 1), ...``, i.e. the would-be n-gram minus its last token.  Each
step the target's argmax after the top token of every column is that
column's next token (the new level); the column's n-gram is
``column + [new token]``; the column then drops its oldest token and appends
the new one (the window drops its oldest level and gains the new one), which
moves it one position right, exactly as far as the root moves when one token
is emitted.

The attention mask.  Our cache attention is tree-shaped (a node sees the
committed tokens and its ancestors, at position committed length + depth), so
the window goes in as *auxiliary* tree nodes (``aux=True``: never accepted,
their logits come back in ``observe``): the level-0 tokens form a chain
hanging off the root (level-0 token ``j`` is the child of level-0 token
``j - 1``), and the rest of column ``j`` is a chain hanging off its level-0
token.  A lookahead token at level ``l`` of column ``j`` therefore attends to
the context, the root, level-0 tokens ``0 .. j`` and the column's levels
``1 .. l``, at position ``j + l + 1`` -- which is the paper's lookahead mask
(Fig. 2/3 there: each token sees the first level up to its diagonal's start,
then only its own diagonal), so this *is* the paper's mask rather than an
approximation of it.  What we do not reproduce exactly is the paper's
progressive warm-up; see below.  It is a Jacobi update because the guess
for every position is the target's argmax given the previous iterate's
tokens before it along that trajectory; as in the paper the tokens of other
trajectories at earlier positions are not seen (that cut is what makes the
update cheap and the n-grams diverse).  Every auxiliary node's logits are
used: the top node of each column gives its new token, the others are the
price of conditioning it on the trajectory (as in the paper, where only the
last level's outputs are kept).

Initialisation, warm-up and re-alignment.  As in the paper the window starts
from random tokens of the prompt, drawn with a generator seeded from the
decode context's generator (``initial_seed``: no draw is taken from the
decode generator itself, so the verifier's random stream -- and with a fixed
seed the sampled tokens -- are exactly vanilla's).  The paper fills level 0
randomly and grows the other levels during ``N - 2`` warm-up steps; we fill
every level randomly and instead *do not collect* a column's n-gram until all
its tokens after the first one are target outputs (each column counts its
leading random tokens), which takes the same ``N - 2`` steps and harvests the
same kind of n-grams (a random first token followed by model outputs).  When
the verifier accepts ``k > 0`` drafted tokens the root moves ``k + 1``
positions in one step: the window is re-aligned to the new root by dropping
the ``k`` columns that now start at or before the root and appending ``k``
new random columns at the far end (their random tokens are never harvested,
as above).  If a tight budget cut some columns out of the forward, those
columns keep their tokens at their absolute positions (they simply did not
iterate) and are re-indexed against the new root.

Budget.  Candidate (verification) nodes come first and aux nodes after, so
the loop's prefix truncation drops lookahead work before candidates; the aux
nodes are laid out column by column, so a partial window still iterates
whole columns.  All candidates are deterministic (``sampled=False``), so the
verifier is exact under greedy decoding and sampling; the lookahead guesses
are argmax tokens in both modes.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..core.tree import TokenTree
from ..core.proposer import DecodeContext, Proposer
from .common import check_int, merge_candidates
from .configs import LookaheadConfig


class NGramPool:
    """First token -> up to ``capacity`` continuations (the n-gram minus its first token), oldest first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.table: dict[int, list[tuple[int, ...]]] = {}

    def __len__(self) -> int:
        return sum(len(v) for v in self.table.values())

    def add(self, ngram: Sequence[int]) -> None:
        if len(ngram) < 2:
            return
        key, cont = int(ngram[0]), tuple(int(t) for t in ngram[1:])
        lst = self.table.setdefault(key, [])
        if cont in lst:
            lst.remove(cont)  # seen again: it becomes the newest
        lst.append(cont)
        if len(lst) > self.capacity:
            del lst[0]

    def get(self, key: int) -> list[tuple[int, ...]]:
        return self.table.get(int(key), [])


class LookaheadWindow:
    """The 2D Jacobi window as ``width`` diagonal trajectories (columns) of ``levels`` tokens each.

    ``root`` is the absolute position of the root; column ``j`` holds guesses for absolute
    positions ``root + 1 + j .. root + levels + j``.  ``random[j]`` counts the column's leading
    tokens that are random fill rather than target outputs.
    """

    def __init__(self, width: int, levels: int) -> None:
        self.width = width
        self.levels = levels
        self.root = 0
        self.columns: list[list[int]] = []
        self.random: list[int] = []

    def reset(self, root: int, source: Sequence[int], rng: torch.Generator) -> None:
        self.root = root
        self.columns = [self._random_column(source, rng) for _ in range(self.width)]
        self.random = [self.levels] * self.width

    def _random_column(self, source: Sequence[int], rng: torch.Generator) -> list[int]:
        idx = torch.randint(len(source), (self.levels,), generator=rng).tolist()
        return [int(source[i]) for i in idx]

    def step(self, outputs: dict[int, int], new_root: int, source: Sequence[int],
             rng: torch.Generator) -> list[list[int]]:
        """One Jacobi update + re-alignment; returns the harvested n-grams.

        ``outputs[j]`` is the target's token after column ``j``'s top token (columns that did
        not run are absent).  A column that ran drops its oldest token and appends its output
        (so it now starts one position later); one that did not run stays where it is.  Then
        the window is re-indexed against ``new_root`` (columns starting at or before it are
        gone) and gaps are filled with random columns drawn from ``source``.
        """
        ngrams: list[list[int]] = []
        by_start: dict[int, tuple[list[int], int]] = {}
        for j, col in enumerate(self.columns):
            if j not in outputs:
                by_start[self.root + 1 + j] = (col, self.random[j])
        for j, out in outputs.items():
            col, rnd = self.columns[j], self.random[j]
            if rnd <= 1:  # every token after the first is a target output: a real trajectory
                ngrams.append(col + [int(out)])
            by_start[self.root + 2 + j] = (col[1:] + [int(out)], max(rnd - 1, 0))
        self.root = new_root
        self.columns, self.random = [], []
        for j in range(self.width):
            col, rnd = by_start.get(new_root + 1 + j, (None, 0))
            if col is None:
                col, rnd = self._random_column(source, rng), self.levels
            self.columns.append(col)
            self.random.append(rnd)
        return ngrams

    def add_to_tree(self, tree: TokenTree, room: int, source: str) -> list[tuple[int, int]]:
        """Append the window as aux nodes (column by column, at most ``room``); returns
        ``(column, top node index)`` for every column that fit completely."""
        complete: list[tuple[int, int]] = []
        prev_level0 = -1
        for j, col in enumerate(self.columns):
            parent = prev_level0
            for lv, t in enumerate(col):
                if room <= 0:
                    return complete
                parent = tree.add(t, parent, sampled=False, source=source, aux=True)
                room -= 1
                if lv == 0:
                    prev_level0 = parent
            complete.append((j, parent))
        return complete


class LookaheadProposer(Proposer):
    name = "lookahead"

    def __init__(self, tree_budget: int | None = None, window: int = LookaheadConfig.window, ngram: int = LookaheadConfig.ngram,
                 guesses: int | None = LookaheadConfig.guesses) -> None:
        if tree_budget is not None:
            check_int("tree_budget", tree_budget)
        self.window = check_int("window", window)
        self.ngram = check_int("ngram", ngram, low=2)
        self.guesses = check_int("guesses", guesses) if guesses is not None else self.window
        self.levels = self.ngram - 1
        self.default_budget = tree_budget or (self.guesses + self.window) * self.levels
        self.pool = NGramPool(self.guesses)
        self.win = LookaheadWindow(self.window, self.levels)
        self.rng = torch.Generator()
        self._last: TokenTree | None = None
        self._columns: list[tuple[int, int]] = []
        self._steps = self._hits = self._nodes = self._aux = self._ngrams = 0

    def begin(self, ctx: DecodeContext, tokens: list[int]) -> None:
        super().begin(ctx, tokens)
        self.rng = torch.Generator().manual_seed(int(ctx.generator.initial_seed()))
        self.pool = NGramPool(self.guesses)
        self.win = LookaheadWindow(self.window, self.levels)
        self.win.reset(len(tokens) - 1, tokens, self.rng)
        self._last = None

    def _align(self, tokens: list[int]) -> None:
        root = len(tokens) - 1
        if not self.win.columns or root < self.win.root:  # not begun, or a different text
            self.win.reset(root, tokens, self.rng)
        elif root > self.win.root:
            self.win.step({}, root, tokens, self.rng)

    def propose(self, tokens: list[int], budget: int) -> TokenTree:
        self._align(tokens)
        self._steps += 1
        cands = [(list(c), 0, r) for r, c in enumerate(self.pool.get(tokens[-1]))]
        tree = merge_candidates(cands, budget, self.name) if cands else TokenTree()
        self._hits += bool(cands)
        self._nodes += len(tree)
        before = len(tree)
        self._columns = self.win.add_to_tree(tree, budget - len(tree), self.name + "-aux")
        self._aux += len(tree) - before
        self._last = tree
        return tree

    def observe(self, tokens: list[int], tree: TokenTree, verdict, logits: torch.Tensor, hidden=None) -> None:
        outputs: dict[int, int] = {}
        last, self._last = self._last, None
        if last is not None and len(tree) <= len(last) and tree.tokens == last.tokens[: len(tree)]:
            present = [(j, top) for j, top in self._columns if top < len(tree)]
            if present:
                rows = torch.tensor([top + 1 for _, top in present], device=logits.device)
                best = logits.index_select(0, rows).argmax(-1).tolist()
                outputs = {j: b for (j, _), b in zip(present, best)}
        for ng in self.win.step(outputs, len(tokens) - 1, tokens, self.rng):
            self.pool.add(ng)
            self._ngrams += 1

    def stats(self) -> dict[str, Any]:
        return {
            "lookahead_hit_rate": round(self._hits / self._steps, 4) if self._steps else 0.0,
            "lookahead_pool": len(self.pool),
            "lookahead_ngrams": self._ngrams,
            "draft_nodes": self._nodes,
            "aux_nodes": self._aux,
        }
