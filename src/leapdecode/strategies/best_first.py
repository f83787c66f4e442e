"""Best-first beam search: "Best-First Beam Search" (Meister, Vieira, Cotterell, TACL 2020).

Beam search written as an agenda-based search: a priority queue holds partial hypotheses by
score, the best is popped, and its extensions are pushed; beam search's width ``k`` becomes a
*beam constraint*: at most ``k`` hypotheses of each length are ever popped (a later pop of a
length that already had ``k`` is pruned).  The score is the hypothesis's log-probability, which
never grows with length (a *monotone* score), so:

* hypotheses come out of the queue best first, and the first complete one popped (ended by an
  end-of-sequence token, or at ``max_new_tokens``) is the best complete hypothesis the beam
  constraint lets through: the paper shows it is the hypothesis beam search of width ``k`` returns,
  found with fewer expansions; with ``k`` at least the number of hypotheses of any length (a
  tiny vocabulary) it is the exact mode of the model (uniform-cost search);
* the pruning rule for monotone scores: once ``n`` complete hypotheses are popped
  (``num_return_sequences``), nothing left in the queue can beat them (its extensions only lose
  probability), so the search stops and drops the rest; likewise a hypothesis whose length has
  had its ``k`` pops can never be popped and is dropped.  Of a node's extensions only its ``k``
  best are pushed: at most ``k`` of them could be popped before the beam constraint prunes the
  rest.

The ``n`` returned hypotheses are the first ``n`` complete ones popped, best first (``score`` and
``logprob``: the log-probability).  Each expansion is one forward of one node, whose parent is
the popped hypothesis's node in the shared token tree (``search.TreeKV``); nodes no queued
hypothesis needs are dropped when the tree fills.  Ties in score pop the longer hypothesis first.
"""

from __future__ import annotations

import heapq
from collections import Counter
from typing import Any

import torch

from .search import ROOT, Hypothesis, TreeSearch, log_probs


class BestFirstBeamSearch(TreeSearch):
    def tree_nodes(self) -> int:
        return self.cfg.num_beams * self.max_new_tokens + 1

    def begin(self, logits: torch.Tensor) -> None:
        self.queue: list[tuple] = []
        self.pops: Counter[int] = Counter()
        self.complete: list[tuple[float, list[int]]] = []
        self.count = 0
        self.expansions = 0
        self.pruned = 0
        self.max_queue = 0
        self._push(ROOT, [], 0.0, log_probs(logits))

    def _push(self, node: int, tokens: list[int], score: float, logp: torch.Tensor) -> None:
        k = min(self.cfg.num_beams, logp.shape[-1])
        top, idx = torch.topk(logp, k)
        n = len(tokens) + 1
        for value, tok in zip(top.tolist(), idx.tolist()):
            s = score + value
            self.count += 1
            heapq.heappush(self.queue, (-s, -n, self.count, node, tokens + [tok], s))
        self.max_queue = max(self.max_queue, len(self.queue))

    def advance(self) -> bool:
        k, want = self.cfg.num_beams, self.cfg.returns
        while self.queue:
            _, neg_len, _, node, tokens, score = heapq.heappop(self.queue)
            n = -neg_len
            if self.pops[n] >= k:  # the beam constraint: this length had its k pops
                self.pruned += 1
                continue
            self.pops[n] += 1
            if tokens[-1] in self.eos or n >= self.max_new_tokens:
                self.complete.append((score, tokens))
                if len(self.complete) >= want:  # monotone scores: nothing queued can beat these
                    return True
                continue
            tree = self.tree
            if tree.pending + 1 > tree.max_nodes:
                self._compact()
            ids, logits = yield from tree.expand_co([node], [tokens[-1]])
            self.expansions += 1
            self._push(ids[0], tokens, score, log_probs(logits[0]))
            return False
        return True

    def _compact(self) -> None:
        """Drop the queued hypotheses the beam constraint has pruned, then the tree nodes no queued
        hypothesis needs."""
        k = self.cfg.num_beams
        before = len(self.queue)
        self.queue = [e for e in self.queue if self.pops[-e[1]] < k]
        heapq.heapify(self.queue)
        self.pruned += before - len(self.queue)
        self.tree.retain(e[3] for e in self.queue)

    def hypotheses(self) -> list[Hypothesis]:
        return [self.hypothesis(t, s, s) for s, t in self.complete]

    def stats(self) -> dict[str, Any]:
        return {"expansions": self.expansions, "pruned": self.pruned, "max_queue": self.max_queue}
