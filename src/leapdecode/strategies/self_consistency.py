"""Self-consistency: sample N reasoning paths, extract each one's final answer, return the
majority answer.

"Self-Consistency Improves Chain of Thought Reasoning in Language Models" (Wang, Wei, Schuurmans,
Le, Chi, Narang, Chowdhery, Zhou; 2022, ICLR 2023): instead of greedy decoding, sample diverse
chains of thought and marginalize them out by a majority vote over the answers they reach (the
paper's unweighted vote, which it finds as good as the probability-weighted ones).

The answer extractor is ``"auto"`` (the last number in the sample, else its last non-empty
line), ``"number"``, ``"last-line"``, or a user's callable ``text -> answer | None`` (API only); a
sample without an answer does not vote.  Hypotheses: one per distinct answer, most votes first
(ties: the answer reached first, by sample index), each the lowest-indexed sample that reached it;
``score`` is its vote count, ``info`` holds ``answer``, ``votes`` and ``share`` (votes / voters).
The N samples are one batch on the shared prompt (``strategies/parallel.py``), each may use a
speculative method (exact in distribution).
"""

from __future__ import annotations

from typing import Any

from .parallel import ParallelSamples
from .scorers import Extractor
from .search import Hypothesis


class SelfConsistency(ParallelSamples):
    def __init__(self, *args: Any, extractor: Extractor, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.extractor = extractor
        self.answers: list[Any] = []

    def hypotheses(self) -> list[Hypothesis]:
        members = [m for m in self.members if m.done and not m.rejected]
        votes: dict[Any, list] = {}
        self.answers = []
        for m in members:
            answer = self.extractor(self.sample(m).text)
            self.answers.append(answer)
            if answer is not None:
                votes.setdefault(answer, []).append(m)
        voters = sum(len(v) for v in votes.values())
        ranked = sorted(votes.items(), key=lambda kv: (-len(kv[1]), kv[1][0].index))
        out = [self.hyp(ms[0], float(len(ms)), answer=a, votes=len(ms), share=len(ms) / voters) for a, ms in ranked]
        if not out and members:  # nobody answered: the first sample, with no votes
            out = [self.hyp(members[0], 0.0, answer=None, votes=0, share=0.0)]
        return out

    def stats(self) -> dict[str, Any]:
        return {"answers": self.answers}
