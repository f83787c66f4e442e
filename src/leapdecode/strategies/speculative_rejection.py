"""Speculative rejection: Best-of-N that stops the unpromising samples early.

"Fast Best-of-N Decoding via Speculative Rejection" (Sun et al., 2024): start many
samples, and at decision points score the partial ones with a (partial) reward and terminate
the lowest-scoring fraction, so that the compute goes to the samples likely to win;
the finished survivors are ranked by the reward.

Here a checkpoint comes every ``interval`` decided tokens: a sample that reaches checkpoint c
(``c * interval`` decided tokens) waits there until every running sample has; then every sample
that did not end within its first ``c * interval`` tokens is scored by ``partial_scorer`` on
exactly those tokens (a sample whose speculation carried it past the checkpoint, even to its
end, is judged on the same prefix: the decisions do not depend on how much speculation
accepted), the ``ceil((1 - rejection_rate) * scored)`` best go on (ties: the lower sample index),
never fewer than ``num_return_sequences``, and the others stop at once.  Checkpoints end when no
more than ``num_return_sequences`` samples are left to score.  At the end the finished
samples that were never rejected are ranked by ``scorer``; ``stats["checkpoints"]`` lists each
checkpoint's position and the samples it kept.  The samples are one batch on the shared prompt
(``strategies/parallel.py``), each may use a speculative method.
"""

from __future__ import annotations

import math
from typing import Any

from .parallel import ParallelSamples
from .scorers import Scorer
from .search import Hypothesis


class SpeculativeRejection(ParallelSamples):
    def __init__(self, *args: Any, scorer: Scorer, partial_scorer: Scorer, interval: int, rejection_rate: float,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.scorer, self.partial_scorer = scorer, partial_scorer
        self.interval, self.rate = interval, rejection_rate
        self.next_checkpoint = interval
        self.active = True  # checkpoints to come
        self.checkpoints: list[dict[str, Any]] = []
        self.scored: dict[int, float] = {}

    def candidates(self, at: int) -> list:
        """The samples checkpoint ``at`` decides on: not rejected, and running or ended after ``at``."""
        return [m for m in self.members if not m.rejected and (m.live or self.end_position(m) > at)]

    def waiting(self, m: Any) -> bool:
        # a sample at the next checkpoint waits for the others (no work on what may be rejected)
        return self.active and len(m.emitted) >= self.next_checkpoint

    def after_round(self) -> bool:
        while self.active:
            at = self.next_checkpoint
            if any(len(m.emitted) < at for m in self.members if m.live):
                return False
            pool = self.candidates(at)
            if len(pool) <= max(1, self.cfg.returns):
                self.active = False  # too few left to reject any: no more checkpoints
                return False
            scores = {m.index: self.partial_scorer(self.sample(m, upto=at)) for m in pool}
            keep_n = max(self.cfg.returns, 1, math.ceil((1 - self.rate) * len(pool) - 1e-9))
            ranked = sorted(pool, key=lambda m: (-scores[m.index], m.index))
            for m in ranked[keep_n:]:
                self.reject(m)
            self.checkpoints.append({"position": at, "scores": scores,
                                     "kept": sorted(m.index for m in ranked[:keep_n])})
            self.next_checkpoint += self.interval
        return False

    def hypotheses(self) -> list[Hypothesis]:
        members = [m for m in self.members if m.done and not m.rejected]
        for m in members:
            self.scored[m.index] = self.scorer(self.sample(m))
        ranked = sorted(members, key=lambda m: (-self.scored[m.index], m.index))
        return [self.hyp(m, self.scored[m.index], scorer=self.scorer.name) for m in ranked]

    def stats(self) -> dict[str, Any]:
        return {"checkpoints": [{"position": c["position"], "kept": c["kept"]} for c in self.checkpoints],
                "rejected": sorted(m.index for m in self.members if m.rejected)}
