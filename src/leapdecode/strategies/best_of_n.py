"""Best-of-N: draw N samples, return the best by a scorer.

Sampling N candidates and keeping the one a verifier (or the model's own likelihood, or unit
tests) ranks highest is the baseline of test-time scaling; "Training Verifiers to Solve Math
Word Problems" (Cobbe et al., 2021) ranks N samples with a trained verifier, and "Let's Verify
Step by Step" (Lightman et al., 2023) with a process reward model.  Here the scorer is the
model's mean or summed log-likelihood, a user's Python callable, or the execution of unit tests
in a sandbox (``strategies/scorers.py``).

The N samples are one batch on the shared prompt (``strategies/parallel.py``); each may use a
speculative method (exact in distribution).  Hypotheses: every finished sample, best score first
(ties: the lower sample index first); ``score`` is the scorer's value, ``info`` names the sample.
"""

from __future__ import annotations

from typing import Any

from .parallel import ParallelSamples
from .scorers import Scorer
from .search import Hypothesis


class BestOfN(ParallelSamples):
    def __init__(self, *args: Any, scorer: Scorer, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.scorer = scorer
        self.scored: dict[int, float] = {}

    def hypotheses(self) -> list[Hypothesis]:
        members = [m for m in self.members if m.done and not m.rejected]
        for m in members:
            self.scored[m.index] = self.scorer(self.sample(m))
        ranked = sorted(members, key=lambda m: (-self.scored[m.index], m.index))
        return [self.hyp(m, self.scored[m.index], scorer=self.scorer.name) for m in ranked]

    def stats(self) -> dict[str, Any]:
        return {"scores": [self.scored.get(m.index) for m in self.members]}
