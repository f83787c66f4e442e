"""Cost-aware sizing of a drafted tree, for drafters that expand a tree level by level with a
forward of their own per level (``draft_model.py``'s draft model, an EAGLE head).

Sequoia ("Sequoia: Scalable, Robust, and Hardware-aware Speculative Decoding", Chen et al., 2024)
picks the tree that maximises expected accepted tokens per second on the hardware at hand;
EAGLE-2 ("EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees", Li et al., 2024)
shows that the drafter's own confidence tracks acceptance.  ``TreeSizer`` joins the two for
greedy trees: a candidate's value is its path's calibrated acceptance probability (the drafter's
probability of each node given its parent, mapped through ``AcceptanceCalibration`` learned from
the verifier's verdicts), another level is drafted only while it is expected to raise the tokens
per second of the step (the drafter's measured forward time against the target's measured
verification cost, ``VerifyCost``), and the verified tree is the prefix of the best candidates
that maximises that rate (``best_tree_size``).

Once the drafter's steps have a measured long-run rate (tokens per second of its sized steps,
``note_step``), levels and rows are judged against that rate instead (``best_tree_gain``,
Dinkelbach's criterion): a level or a row is worth it when the tokens it is expected to add exceed
what its seconds would earn at the rate.  The step ratio counts the drafting time already spent,
which is sunk: the slower a step's draft so far (a deep tree, a catch-up on the prompt), the more
levels and rows it found worth their time (measured on qwen2.5-coder-1.5b: 22-42% fewer verified
rows per forward with the rate, at the same tokens per second; docs/lab-notes/benchmarks.md 47).

Model-free tries (``rest``'s retrieved continuations, ``suffix``'s suffix tries) are sized the same
way in one pass (``TrieSizer``, ``calibrated_cut``): each node's chance is its continuation frequency
given its parent through a calibration learned from the verdicts, the nodes are ranked by their paths'
chances and cut where the tokens per second of the verification peak, and every few cuts one node
beyond the cut is verified too (``TryAgain``: a calibration learns only from what is verified).

Both are ``core.sizing.Sizer``s: a proposer ``size``s its candidates and hands what it drafted back
to ``learn`` with the verdict.

Only greedy trees are sized this way: any greedy tree gives vanilla's tokens, so timings may steer
it; a seeded sampling run's trees must not depend on a clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Hashable, NamedTuple

from ..core.cost_model import VerifyCost
from ..core.running_mean import discounted_mean
from ..core.sizing import AcceptanceCalibration, TryAgain, best_tree_gain, best_tree_size

if TYPE_CHECKING:
    from ..core.tree import TokenTree


class TreeSizer:
    """The ``Sizer`` of a tree drafted level by level: it sizes the candidates' path scores (log
    calibrated acceptance, ``log_accept``) to how many of the best to verify, and learns from the
    drafted nodes' (token, drafter probability given the parent), in tree order.  Per drafter and
    target, kept in the runner's memory (``ctx.remember``) across generations: the calibration, running means of the drafter's forward time and of the best child's
    acceptance probability, and of the tokens and seconds of its sized steps."""

    # The rates below were set when the sizer was written (commits 7968b4b, e91aae8); no measurement
    # chose them (not measured; kept as they were).
    RATE_STEPS = 4  # sized steps seen before their rate is used (the step ratio until then)
    RATE_WEIGHT = 0.05  # least weight of one step in the running means of its tokens and seconds
    FORWARD_RATE = 0.2  # weight of one forward in the mean drafter forward time
    TOP_RATE = 0.1  # weight of one forward in the mean calibrated probability of its best child

    def __init__(self) -> None:
        self.calibration = AcceptanceCalibration()
        self.forward_s: float | None = None
        self.top_accept: float | None = None  # (0.5 is assumed until a forward is seen)
        self.steps = 0
        self._tokens = self._seconds = 0.0  # running means per sized step

    @property
    def rate(self) -> float | None:
        """Tokens per second of the drafter's sized steps (drafting, verifying and committing), once
        ``RATE_STEPS`` were seen; ``None`` before."""
        return self._tokens / self._seconds if self.steps >= self.RATE_STEPS and self._seconds > 0 else None

    def note_step(self, tokens: int, seconds: float) -> None:
        """A sized step decided ``tokens`` tokens in ``seconds`` (from its draft's start to the end of
        its verification; a catch-up on earlier positions left out)."""
        if not (seconds > 0.0 and math.isfinite(seconds)):
            return
        self.steps += 1
        self._tokens = discounted_mean(self._tokens, tokens, self.RATE_WEIGHT, self.steps)
        self._seconds = discounted_mean(self._seconds, seconds, self.RATE_WEIGHT, self.steps)

    @staticmethod
    def _best(probs: list[float], spent: float, verify: VerifyCost, rate: float | None) -> tuple[int, float]:
        """The best number of ``probs`` (sorted) to verify and its value: the expected tokens less
        their verification's worth at the long-run ``rate``, or (no rate yet) the step's ratio."""
        return best_tree_size(probs, spent, verify) if rate is None else best_tree_gain(probs, rate, verify)

    def log_accept(self, p: float) -> float:
        """A node's contribution to its path's score: log P(accepted | parent accepted)."""
        return math.log(self.calibration(p))

    def note_forward(self, seconds: float, child_probs: list[float]) -> None:
        """One drafter forward took ``seconds`` and gave children with these probabilities.  The
        drafters call it for every forward, the root's included: were only the deeper levels'
        forwards noted, a pessimistic state (a slow first forward, a hard warm-up prompt) would stop
        all deeper drafting and, with it, every chance to learn otherwise (issue 46: one-node trees
        for a whole HumanEval run)."""
        # (1 - r) * mean + r * x, not the running-mean helper's mean + r * (x - mean): the two differ in
        # the last bits, and this is the arithmetic these means always had (1 - 0.2 and 1 - 0.1 are
        # exactly 0.8 and 0.9)
        r = self.FORWARD_RATE
        self.forward_s = seconds if self.forward_s is None else (1.0 - r) * self.forward_s + r * seconds
        if child_probs:
            top, r = self.calibration(max(child_probs)), self.TOP_RATE
            self.top_accept = top if self.top_accept is None else (1.0 - r) * self.top_accept + r * top

    def worth_expanding(self, scores: list[float], expand_scores: list[float], budget: int, spent: float,
                        verify: VerifyCost) -> bool:
        """Does one more level (each expanded node adding its best child, accepted with the running
        mean probability of a best child) raise the expected tokens per second of the step?"""
        if self.forward_s is None:
            return True  # not measured yet: draft, and learn
        probs = sorted((math.exp(v) for v in scores), reverse=True)[:budget]
        rate = self.rate
        _, now = self._best(probs, spent, verify, rate)
        rho = 0.5 if self.top_accept is None else self.top_accept
        more = sorted(probs + [math.exp(v) * rho for v in expand_scores], reverse=True)[:budget]
        _, then = self._best(more, spent + self.forward_s, verify, rate)
        return then > now if rate is None else then - rate * self.forward_s > now

    def size(self, scores: list[float], budget: int | None, verify: VerifyCost, spent: float = 0.0) -> int:
        """How many of the best candidates (their path ``scores``) to verify."""
        probs = sorted((math.exp(v) for v in scores), reverse=True)[:budget]
        return self._best(probs, spent, verify, self.rate)[0]

    def learn(self, drafted: list[tuple[int, float]], tree: TokenTree, accepted: list[int]) -> None:
        """Calibrate from a verified greedy tree: ``drafted`` are its drafted (token, drafter
        probability given the parent) in tree order; every node whose parent was accepted (or is
        the root) had its chance.  Nodes a grammar pruned (another token there now) are skipped."""
        ok = set(accepted)
        self.update([(drafted[i][1], i in ok) for i in range(min(len(tree), len(drafted)))
                     if drafted[i][0] == tree.tokens[i] and (tree.parents[i] < 0 or tree.parents[i] in ok)])

    def update(self, verified: list[tuple[float, bool]]) -> None:
        """(drafter probability given the parent, accepted) of every verified node whose parent was
        accepted (or is the root)."""
        for p, ok in verified:
            self.calibration.update(self.calibration.bin(p), ok)


@dataclass
class CutRecord:
    """What the verdict on a tree ``calibrated_cut`` sized teaches: its calibration, each kept node's
    empirical probability given its parent (in the order of the tree, best first) and the try
    beyond the cut, ``(TryAgain slot, tree index)``, or ``None``."""

    calibration: AcceptanceCalibration
    cond: list[float]
    attempt: tuple | None

    def learn(self, parents: list[int], accepted: list[int], tries: TryAgain) -> None:
        """The tree (its ``parents``, perhaps truncated to the step's budget) was verified and
        ``accepted`` taken: every node whose parent was accepted had its chance."""
        self.calibration.observe_tree(self.cond, parents, accepted)
        if self.attempt is not None and self.attempt[1] < len(parents):
            slot, node = self.attempt
            parent = parents[node]
            if parent < 0 or parent in accepted:
                tries.verdict(slot, node in accepted)


class Cut(NamedTuple):
    """A sized trie: the kept nodes best first, their parents as positions in that list (-1: the
    root), their calibrated path probabilities, the cut's rate (expected tokens per second of the
    step) and what the verdict will teach."""

    nodes: list[int]
    parents: list[int]
    probs: list[float]
    rate: float
    record: CutRecord


def calibrated_cut(cond: list[float], parents: list[int], calib: AcceptanceCalibration, tries: TryAgain,
                   verify: VerifyCost, context: Hashable, budget: int | None = None, spent: float = 0.0) -> Cut:
    """Size a trie whose node ``i`` has parent ``parents[i]`` (parents first, -1 the root) and
    empirical probability ``cond[i]`` given its parent: the nodes ranked by calibrated path
    probability (a child is never worth more than its parent; on a tie the parent, added first,
    leads), at most ``budget`` of them, cut to the prefix that maximises expected tokens per second
    of the verification (``spent``: seconds already drafting the step), with a node beyond the cut now and
    then (``tries``, per ``context`` and cut size)."""
    path: list[float] = []
    for c, parent in zip(cond, parents):
        path.append(calib(c) * (path[parent] if parent >= 0 else 1.0))
    order = sorted(range(len(cond)), key=lambda i: (-path[i], i))[:budget]
    keep, rate, tried = tries.sized([path[i] for i in order], spent, verify, context)
    order = order[:keep]
    position = {node: i for i, node in enumerate(order)}
    kept_parents = [position[parents[i]] if parents[i] >= 0 else -1 for i in order]
    attempt = ((context, keep - 1), keep - 1) if tried else None
    return Cut(order, kept_parents, [path[i] for i in order], rate,
               CutRecord(calib, [cond[i] for i in order], attempt))


class Trie(NamedTuple):
    """A model-free trie to size: node ``i``'s parent ``parents[i]`` (parents first, -1 the root) and
    empirical probability ``cond[i]`` given its parent, the calibration of its source and context, and
    that context (``TryAgain``'s, with the cut's size)."""

    cond: list[float]
    parents: list[int]
    calibration: AcceptanceCalibration
    context: Hashable


class TrieSizer:
    """The ``Sizer`` of model-free tries (``rest``, ``suffix``): ``calibrated_cut`` with the tries beyond
    the cut that ``tries`` keeps (the calibrations travel with each ``Trie``); the verdict is learned
    from the ``Cut`` that was drafted."""

    def __init__(self, tries: TryAgain) -> None:
        self.tries = tries

    def size(self, trie: Trie, budget: int | None, verify: VerifyCost, spent: float = 0.0) -> Cut:
        return calibrated_cut(trie.cond, trie.parents, trie.calibration, self.tries, verify, trie.context, budget,
                              spent)

    def learn(self, drafted: Cut, tree: TokenTree, accepted: list[int]) -> None:
        """``tree`` node ``i`` is the cut's ``i``-th node (perhaps truncated to the step's budget)."""
        drafted.record.learn(tree.parents, accepted, self.tries)
