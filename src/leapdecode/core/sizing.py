"""Tree sizing maths: how many of a drafter's candidate nodes a verification is worth.

A hardware-aware tree size is the idea of "Sequoia: Scalable, Robust, and Hardware-aware
Speculative Decoding" (Chen et al., 2024): the best tree is the one that maximises expected accepted
tokens per second, and the seconds are the target's measured verification cost
(``cost_model.VerifyCost``).  Here: the best prefix of candidates ranked by acceptance probability
(``best_tree_size``, ``best_tree_gain``), the occasional try beyond a cut that learning alone could
never revise (``TryAgain``), and the acceptance estimates learned from verdicts: per depth of a
model-free chain (``ChainAcceptance``) and as a calibration of a drafter's probabilities
(``AcceptanceCalibration``).

Every way of sizing is a ``Sizer``: ``size`` a scored candidate chain or tree under a budget and the
measured verification cost, ``learn`` from the verifier's verdict on what was drafted.  Three
implement it: model-free chains (``ChainAcceptance``, here), model-free tries cut in one pass and
trees drafted level by level (``TrieSizer`` and ``TreeSizer`` in ``proposers/tree_cost.py``).

Only decisions that cannot change the output may use these: greedy tree sizes (any tree gives
vanilla's tokens).  Seeded sampling must be reproducible, so its tree shapes never depend on a clock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol, TypeVar, runtime_checkable

if TYPE_CHECKING:
    from .cost_model import VerifyCost
    from .tree import TokenTree

C = TypeVar("C", contravariant=True)  # what a sizer sizes: a chain, a trie's scored nodes, a tree's scores
S = TypeVar("S", covariant=True)  # what sizing it gives
D = TypeVar("D", contravariant=True)  # what the proposer drafted from it, which the verdict is on


@runtime_checkable
class Sizer(Protocol[C, S, D]):
    """The one interface of cost-aware sizing (greedy only: see above).  A proposer drafts its
    candidates, ``size``s them and drafts what the sizing keeps; after the verification it hands what it
    drafted back to ``learn``, with the verified tree and the verdict's accepted nodes.  What is
    learned is the sizer's own state, kept in the runner's memory across generations."""

    def size(self, candidates: C, budget: int | None, verify: VerifyCost, spent: float = 0.0) -> S:
        """Size ``candidates`` to at most ``budget`` nodes (``None``: no bound) by expected tokens per
        second under the verification cost ``verify``; ``spent``: seconds this step already drafted."""
        ...

    def learn(self, drafted: D, tree: TokenTree, accepted: list[int]) -> None:
        """The verdict on ``tree`` (drafted as ``drafted`` says) accepted the nodes ``accepted``."""
        ...


class Chain(NamedTuple):
    """A model-free chain: its context bucket (e.g. how long the match was) and its length in tokens."""

    bucket: int
    length: int


def best_tree_size(probs: list[float], fixed_s: float, verify: VerifyCost) -> tuple[int, float]:
    """How many of the candidate nodes to verify, best first: the ``n`` that maximises
    (1 + sum of the ``n`` largest acceptance probabilities) / (``fixed_s`` + verify(n + 1)),
    i.e. expected tokens emitted per second of this step.  ``probs`` must be sorted,
    largest first.  Returns (n, rate)."""
    return _best_prefix(probs, lambda expected, rows: expected / (fixed_s + verify(rows)))


def best_tree_gain(probs: list[float], rate: float, verify: VerifyCost) -> tuple[int, float]:
    """How many of the candidate nodes to verify, best first, at a known long-run ``rate`` (tokens
    per second of the drafter's steps): the ``n`` that maximises (1 + sum of the ``n`` largest
    acceptance probabilities) - ``rate`` x verify(n + 1), the expected tokens of the step less what
    its verification's seconds earn at that rate.  This is Dinkelbach's step for a ratio ("On
    Nonlinear Fractional Programming", Dinkelbach, 1967): at the rate the current choices achieve,
    choices that maximise it do not achieve less.  Time already spent drafting the step is sunk and does
    not enter, unlike ``best_tree_size``'s step ratio, where it does: a slow draft made a larger
    tree look worth verifying.  ``probs`` must be sorted, largest first.  Returns (n, value)."""
    return _best_prefix(probs, lambda expected, rows: expected - rate * verify(rows))


def _best_prefix(probs: list[float], value) -> tuple[int, float]:
    """The ``n`` whose ``value(1 + sum of the n largest probs, n + 1 verified rows)`` is largest (the
    first on a tie), and that value."""
    best_n, best = 0, value(1.0, 1)
    expected = 1.0
    for i, p in enumerate(probs):
        expected += p
        v = value(expected, i + 2)
        if v > best:
            best_n, best = i + 1, v
    return best_n, best


class TryAgain:
    """A cut that learning alone can never revise, tried again now and then.

    A drafter that learns its acceptance from verdicts learns only about what it drafted: once its
    estimates say the next candidate is not worth a row, that candidate is never verified, so the
    estimate never moves, whatever the text does later (measured: after one early miss ``sam`` and
    ``pld`` drafted nothing for the rest of eight HumanEval problems whose matches' first tokens
    were 75% right; ``suffix``'s trie for the request's own text stopped drafting its long matches;
    ``scripts/draft_ceiling.py --replay``).  So for each slot (a context and the size the cut
    stopped at) every ``patience`` cuts the candidate after the cut is drafted too.  The patience
    starts at ``explore_after``, doubles each time that candidate has its chance and is rejected,
    and starts over when it is accepted: where it never pays, the tries are a logarithmic share of
    the steps (after a first miss at the 8th, 24th, 56th, 120th, ... cut).  A candidate that would
    not pay even if it were always accepted is never tried (``sized``)."""

    MAX_PATIENCE = 1 << 16

    def __init__(self, explore_after: int = 4) -> None:
        self.explore_after = explore_after  # 0: never
        self._state: dict = {}  # slot -> [cuts waited, patience]

    def _slot(self, slot) -> list[int]:
        return self._state.setdefault(slot, [0, self.explore_after])

    def patience(self, slot) -> int:
        return self._slot(slot)[1]

    def due(self, slot) -> bool:
        """A cut at ``slot``: is it time to draft the next candidate too?"""
        if not self.explore_after:
            return False
        state = self._slot(slot)
        state[0] += 1
        if state[0] >= state[1]:
            state[0] = 0
            return True
        return False

    def verdict(self, slot, accepted: bool) -> None:
        """The candidate after the cut at ``slot`` had its chance (its parent was accepted)."""
        if self.explore_after:
            state = self._slot(slot)
            state[1] = self.explore_after if accepted else min(2 * state[1], self.MAX_PATIENCE)

    def sized(self, probs: list[float], fixed_s: float, verify: "VerifyCost", context) -> tuple[int, float, bool]:
        """``best_tree_size`` of ``probs`` (best first), one more when the cut at slot ``(context,
        size)`` is due and that candidate would pay if it were sure.  Returns (size, the cut's rate,
        whether the last one is a try)."""
        n, rate = best_tree_size(probs, fixed_s, verify)
        if n < len(probs):
            sure = probs[:n] + [probs[n - 1] if n else 1.0]  # the next one always accepted
            if best_tree_size(sure, fixed_s, verify)[0] > n and self.due((context, n)):
                return n + 1, rate, True
        return n, rate, False


class ChainAcceptance:
    """The ``Sizer`` of a model-free drafter's chain (a ``Chain`` sized to the ``Chain`` worth drafting): P(the token at depth ``d`` is accepted | the tokens
    before it were), per context bucket (e.g. how long the suffix match was), learned from the
    verdicts.  Starts from ``prior`` with the weight of ``strength`` observations.  A depth the
    estimates cut off is tried again now and then (``TryAgain``: without it one rejected first
    token after a match of some length shut that length out for good)."""

    def __init__(self, n_buckets: int, max_depth: int, prior: float = 0.5, strength: float = 2.0,
                 explore_after: int = 4) -> None:
        self.max_depth = max_depth
        self.hits = [[prior * strength] * max_depth for _ in range(n_buckets)]
        self.seen = [[strength] * max_depth for _ in range(n_buckets)]
        self.tries = TryAgain(explore_after)

    def cumulative(self, bucket: int, length: int) -> list[float]:
        """P(the first ``d`` tokens are all accepted), d = 1..length."""
        out, p = [], 1.0
        for d in range(min(length, self.max_depth)):
            p *= self.hits[bucket][d] / self.seen[bucket][d]
            out.append(p)
        return out

    def update(self, bucket: int, verified: int, accepted: int) -> None:
        """``verified`` chain tokens were checked, the first ``accepted`` of them accepted."""
        for d in range(min(verified, accepted + 1, self.max_depth)):
            self.seen[bucket][d] += 1.0
            self.hits[bucket][d] += float(d < accepted)
        last = verified - 1  # the chain's last token, when it had its chance: the cut before it
        if 0 <= last < self.max_depth and accepted >= last:
            self.tries.verdict((bucket, last), accepted > last)

    def size(self, chain: Chain, budget: int | None, verify: VerifyCost, spent: float = 0.0) -> Chain:
        """The prefix of ``chain`` (at most ``budget`` tokens) worth verifying (greedy): the one that
        maximises expected tokens per second (``best_tree_size``), or one token more when the depth it
        stops at is due to be tried again."""
        length = chain.length if budget is None else min(chain.length, budget)
        return Chain(chain.bucket, self.tries.sized(self.cumulative(chain.bucket, length), spent, verify,
                                                    chain.bucket)[0])

    def learn(self, drafted: Chain, tree: TokenTree, accepted: list[int]) -> None:
        """``drafted`` was drafted as tree nodes 0, 1, 2, ... (perhaps cut to the step's budget in
        ``tree``); the verdict accepted ``accepted`` (its path): learn from the leading run of chain
        nodes on it."""
        on_chain = 0
        for d, node in enumerate(accepted):
            if node != d:
                break
            on_chain += 1
        self.update(drafted.bucket, min(drafted.length, len(tree)), on_chain)


class AcceptanceCalibration:
    """P(a draft node is accepted | its parent was), as a function of the drafter's probability
    of the node given its parent (a draft model's, or a retrieved continuation's frequency):
    binned frequencies, starting from the identity."""

    BINS = 10

    def __init__(self, prior: float = 2.0) -> None:
        self.hits = [prior * (b + 0.5) / self.BINS for b in range(self.BINS)]
        self.seen = [prior] * self.BINS

    def bin(self, p: float) -> int:
        return min(int(p * self.BINS), self.BINS - 1)

    def __call__(self, p: float) -> float:
        b = self.bin(p)
        return min(max(self.hits[b] / self.seen[b], 1e-4), 1.0)

    def update(self, b: int, accepted: bool) -> None:
        self.hits[b] += float(accepted)
        self.seen[b] += 1.0

    def observe_tree(self, probs: list[float], parents: list[int], accepted: list[int]) -> None:
        """Learn from a verified tree whose node ``i`` had probability ``probs[i]`` given its parent:
        every node whose parent was accepted (or is the root) had its chance."""
        ok = set(accepted)
        for node in range(min(len(parents), len(probs))):
            parent = parents[node]
            if parent < 0 or parent in ok:
                self.update(self.bin(probs[node]), node in ok)
