"""First Finish Search: run n samples in parallel, return the first one to finish.

"First Finish Search: Efficient Test-Time Scaling in Large Language Models" (Agarwal et al.,
2025): among parallel samples of a reasoning model the shortest is the most often right, so
decoding n samples at once and stopping as soon as one of them ends beats longer "thinking" at a
fraction of the tokens.

"First" is in tokens, not in wall time: the winner is the sample that ends (end-of-sequence token
or stop string, not the token limit) after the fewest decided tokens, ties to the lower sample
index.  With vanilla decoding every sample decides one token a round, so that is the first one
to end; with a speculative method (several tokens a round) the search goes on until every
sample still running has decided at least as many tokens as the winner (none can end earlier),
so the answer does not depend on how much each sample's speculation accepted.  If no sample
ends before the token limit, the first sample is returned.  The others are stopped then (their
caches go back at once).  The samples are one batch on the shared prompt
(``strategies/parallel.py``).
"""

from __future__ import annotations

from typing import Any

from .parallel import Member, ParallelSamples
from .search import Hypothesis


class FirstFinish(ParallelSamples):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.winner: Member | None = None

    def after_round(self) -> bool:
        ended = [m for m in self.members if m.done and not m.rejected and m.gen.result.finish_reason == "stop"]
        if not ended:
            return False
        best = min(ended, key=lambda m: (self.end_position(m), m.index))
        p = self.end_position(best)
        if all(len(m.emitted) >= p for m in self.members if m.live):
            self.winner = best
            return True
        return False

    def hypotheses(self) -> list[Hypothesis]:
        if self.winner is None:
            ended = [m for m in self.members if m.done and not m.rejected and m.gen.result.finish_reason == "stop"]
            pool = ended or [m for m in self.members if m.done and not m.rejected]
            if not pool:
                return []
            self.winner = min(pool, key=lambda m: (self.end_position(m) if m in ended else 0, m.index))
        w = self.winner
        pos = self.end_position(w) if w.gen.result.finish_reason == "stop" else len(w.scored_tokens())
        return [self.hyp(w, -float(pos), finished_after=pos)]

    def stats(self) -> dict[str, Any]:
        return {"winner": None if self.winner is None else self.winner.index}
