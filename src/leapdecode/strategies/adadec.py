"""AdaDec: "Towards Better Code Generation: Adaptive Decoding with Uncertainty Guidance" (He, Liu,
Wang, Li, Wang, Peng, Zheng, 2025; arXiv 2506.08980).

Most code-generation errors of a model happen at high-uncertainty steps where the right token is
among the top few but not first.  AdaDec decodes greedily and *pauses* where the next-token
entropy ``H = -sum p log p`` (nats) reaches a threshold, then *reranks* the ``B`` most probable
tokens by a short lookahead: each candidate ``v`` is continued greedily for up to ``L`` tokens,
and the candidate with the best mean log-probability over itself and its continuation,

    (log p(v | x) + sum_i log p(r_i | x, v, r_<i)) / (1 + number of lookahead tokens)

is chosen (the lookahead tokens are thrown away: the next step starts after ``v``).  The paper
learns the threshold per model (a logistic regression of "the top token is right" on the entropy,
over ground-truth code; its released thresholds are 0.6 to 1.3 nats for 0.6B to 8B models); here
it is the option ``entropy_threshold`` (learning it needs ground-truth data and is not part of
decoding).  ``lookahead_length`` (L, 5) and ``lookahead_beam_size`` (B, 3) are the released code's
defaults (github.com/SYSUSELab/AdaDec, ``AdaFixL`` with an outer beam of 1, the paper's setting).

Two details differ from the released code, which stops a lookahead on HumanEval-specific text
rules (a line without indentation, four empty lines) and otherwise keeps adding the log-probabilities
of a stopped rollout's further tokens while no longer counting them: here a rollout stops at an
end-of-sequence token (counted, then nothing more is added), and a candidate that is itself an
end-of-sequence token has no lookahead.

**On the tree.**  A pause runs the ``B`` candidates as ``B`` children of the current node and
their ``B`` greedy rollouts side by side, one tree forward per lookahead step (``L`` forwards for
all ``B``); the chosen candidate's node is committed (its logits are the next step's) and the rest
dropped.  A step below the threshold is one forward of one token.  The result is one hypothesis
(``score`` = ``logprob``, the model's log-probability of the tokens); ``stats["pauses"]`` counts
the reranked steps.
"""

from __future__ import annotations

from typing import Any

import torch

from .search import Hypothesis, TreeSearch, log_probs


def entropy(logits: torch.Tensor) -> float:
    """Shannon entropy (nats) of ``softmax(logits)``."""
    lp = log_probs(logits)
    return float(-(lp.exp() * lp).sum())


class AdaDec(TreeSearch):
    """Greedy decoding with entropy-triggered lookahead reranking (see the module docstring)."""

    def tree_nodes(self) -> int:
        return self.cfg.lookahead_beam_size * self.cfg.lookahead_length + 1

    def begin(self, logits: torch.Tensor) -> None:
        self.logits = logits
        self.node = self.tree.end
        self.tokens: list[int] = []
        self.logprob = 0.0
        self.pauses = 0
        self.entropies: list[float] = []

    def advance(self) -> bool:
        cfg, tree = self.cfg, self.tree
        lp = log_probs(self.logits)
        h = entropy(self.logits)
        self.entropies.append(h)
        tree.retain([self.node])
        if h < cfg.entropy_threshold:
            token = int(torch.argmax(lp))
            self.tokens.append(token)
            self.logprob += float(lp[token])
            if token in self.eos or len(self.tokens) >= self.max_new_tokens:
                return True
            ids, logits = yield from tree.expand_co([self.node], [token])
            self.node, self.logits = ids[0], logits[0]
            return False
        # pause: rerank the top B by a greedy lookahead of up to L tokens each, all in one tree
        self.pauses += 1
        b = min(cfg.lookahead_beam_size, lp.shape[-1])
        top, cands = torch.topk(lp, b)
        cands_l = cands.tolist()
        totals = top.tolist()
        counts = [1] * b
        live = [i for i, v in enumerate(cands_l) if v not in self.eos]
        first: dict[int, tuple[int, torch.Tensor]] = {}  # candidate -> (its node, its logits)
        parents = [self.node] * len(live)
        tokens = [cands_l[i] for i in live]
        for step in range(cfg.lookahead_length):
            if not live:
                break
            ids, logits = yield from tree.expand_co(parents, tokens)
            if step == 0:
                first = {i: (ids[j], logits[j]) for j, i in enumerate(live)}
            rows = log_probs(logits)
            best_lp, best = rows.max(dim=-1)
            nxt_live, parents, tokens = [], [], []
            for j, i in enumerate(live):  # the lookahead's token step + 1 of each live rollout
                r = int(best[j])
                totals[i] += float(best_lp[j])
                counts[i] += 1
                if r not in self.eos:
                    nxt_live.append(i)
                    parents.append(ids[j])
                    tokens.append(r)
            live = nxt_live if step + 1 < cfg.lookahead_length else []
        scores = [t / c for t, c in zip(totals, counts)]
        k = max(range(b), key=lambda i: (scores[i], -i))  # the first best (candidates in probability order)
        token = cands_l[k]
        self.tokens.append(token)
        self.logprob += float(lp[token])
        if token in self.eos or len(self.tokens) >= self.max_new_tokens:
            return True
        self.node, self.logits = first[k]
        return False

    def hypotheses(self) -> list[Hypothesis]:
        return [self.hypothesis(self.tokens, self.logprob, self.logprob)]

    def stats(self) -> dict[str, Any]:
        n = len(self.entropies)
        return {"pauses": self.pauses, "mean_entropy": round(sum(self.entropies) / n, 6) if n else 0.0}
