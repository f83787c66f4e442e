"""Jacobi decoding (``method="jacobi"``): guess the next ``k`` tokens and refine the guess in parallel.

"Accelerating Transformer Inference for Translation via Parallel Decoding"
(Santilli et al., ACL 2023).  Greedy decoding is the solution of a system of
``k`` equations ``y_i = argmax p(. | x, y_1 .. y_{i-1})``; Jacobi iteration
solves all of them at once from a guess: one forward over ``root + guess``
gives the target's argmax at every position, which becomes the next guess.
The prefix on which guess and argmax agree is final (at least one token per
iteration, so never slower in forwards than autoregressive decoding).

Here the guess is a chain of ``k`` *candidate* nodes (deterministic,
``sampled=False``) after the root; the verifier accepts the prefix the
target agrees with (for greedy that is exactly Jacobi's converged prefix;
under sampling the verifier's rule keeps the target distribution exact).
This is the sliding form of Jacobi decoding (as lookahead decoding's paper
describes it) rather than Santilli et al.'s fixed blocks: after accepting
``m`` guessed tokens plus the target's own next token, the root moves
``m + 1`` positions and the new guess for the positions after it is the
target's argmax at each row after the accepted prefix (row ``i + 1`` of the
logits is node ``i``, predicting position ``i + 2``; the rows from ``m + 1``
on are conditioned on the previous iterate, as in a Jacobi update), followed
by any old guesses that were not submitted (a tight budget), padded to ``k``
by repeating the last token.  The first guess is the root token repeated
(Santilli et al. start from padding tokens).
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.tree import TokenTree
from ..core.proposer import DecodeContext, Proposer
from .common import check_int
from .configs import JacobiConfig


class JacobiProposer(Proposer):
    name = "jacobi"

    def __init__(self, tree_budget: int | None = None, k: int = JacobiConfig.k) -> None:
        if tree_budget is not None:
            check_int("tree_budget", tree_budget)
        self.k = check_int("k", k)
        self.default_budget = tree_budget or self.k
        self.guess: list[int] = []
        self.root = -1  # absolute position of the root the guess is relative to (guess[i] at root + 1 + i)
        self._last: TokenTree | None = None
        self._steps = self._nodes = 0

    def begin(self, ctx: DecodeContext, tokens: list[int]) -> None:
        super().begin(ctx, tokens)
        self.root = len(tokens) - 1
        self.guess = [int(tokens[-1])] * self.k
        self._last = None

    def _align(self, tokens: list[int]) -> None:
        root = len(tokens) - 1
        if self.root < 0 or root < self.root or not self.guess:
            self.root, self.guess = root, [int(tokens[-1])] * self.k
        elif root > self.root:
            self._update({}, root, tokens)

    def _update(self, predicted: dict[int, int], new_root: int, tokens: list[int]) -> None:
        """``predicted``: absolute position -> target argmax; old guesses fill the rest."""
        known = {self.root + 1 + i: t for i, t in enumerate(self.guess)}
        known.update(predicted)
        out: list[int] = []
        for p in range(new_root + 1, new_root + 1 + self.k):
            t = known.get(p)
            out.append(t if t is not None else (out[-1] if out else int(tokens[-1])))
        self.root, self.guess = new_root, out

    def propose(self, tokens: list[int], budget: int) -> TokenTree:
        self._align(tokens)
        self._steps += 1
        tree = TokenTree.chain(self.guess[: max(budget, 0)], source=self.name)
        self._nodes += len(tree)
        self._last = tree
        return tree

    def observe(self, tokens: list[int], tree: TokenTree, verdict, logits: torch.Tensor, hidden=None) -> None:
        last, self._last = self._last, None
        predicted: dict[int, int] = {}
        n = len(tree)
        if last is not None and n <= len(last) and tree.tokens == last.tokens[:n]:
            m = len(verdict.accepted)
            if n > m:
                # rows m+1 .. n (node i's row is i + 1) predict positions m+2 .. n+1 after the old root
                best = logits[m + 1 : n + 1].argmax(-1).tolist()
                predicted = {self.root + m + 2 + r: int(b) for r, b in enumerate(best)}
        self._update(predicted, len(tokens) - 1, tokens)

    def stats(self) -> dict[str, Any]:
        return {"draft_nodes": self._nodes}
