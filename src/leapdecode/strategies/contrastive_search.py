"""Contrastive search: "A Contrastive Framework for Neural Text Generation" (Su, Lan, Wang,
Yogatama, Kong, Collier, 2022; NeurIPS 2022).

At each step the ``top_k`` most probable next tokens ``V(k)`` are the candidates, and the one
chosen maximizes

    (1 - alpha) * p(v | x_<t)  -  alpha * max_{j < t} cos(h_v, h_j)

where ``h_v`` is the candidate's last-layer hidden state (the model run on ``x_<t, v``) and ``h_j``
the last-layer hidden states of every token of the context (the prompt and what was generated):
the *degeneration penalty* pushes away from tokens whose representation repeats the context.
``alpha = 0`` (or ``top_k = 1``) is greedy decoding.  The hidden state is the one the output head
reads (after the final norm), the convention of transformers' implementation
(``generate(penalty_alpha=..., top_k=...)``, ``outputs.hidden_states[-1]``), which moved to the Hub
(``transformers-community/contrastive-search``) in transformers 4.56; the installed transformers
does not ship it, so tests/test_contrastive.py checks this search against a brute-force reference
that runs the transformers model itself on every candidate sequence.

**One forward per token.**  The ``k`` candidates are ``k`` children of the current node of the
cache's token tree (``search.TreeKV``): one tree forward scores them all and gives each its hidden
state and its next-token logits, so the chosen candidate's logits are the next step's
distribution; the chosen node is committed and its ``k - 1`` siblings dropped.  The prompt's
hidden states come from the prefill (which therefore does not read the prefix cache).

The result is one hypothesis: ``score`` the sum of the per-step contrastive scores, ``logprob``
the model's log-probability of the tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from .search import Hypothesis, TreeSearch, final_hidden


def degeneration_penalty(candidates: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
    """``max_j cos(candidates[i], context[j])`` per candidate (``[k, H]`` against ``[S, H]``)."""
    cand = candidates / candidates.norm(dim=-1, keepdim=True)
    ctx = context / context.norm(dim=-1, keepdim=True)
    return (cand @ ctx.T).max(dim=-1).values


class ContrastiveSearch(TreeSearch):
    """One hypothesis grown by contrastive search (see the module docstring)."""

    prompt_hidden = "all"

    def tree_nodes(self) -> int:
        return self.cfg.top_k + 1

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._prompt: list[torch.Tensor] = []  # the prompt's last-layer hidden states, per prefill forward

    def prompt_states(self, states: list) -> None:
        self._prompt.append(final_hidden(self.model.model, states))

    def begin(self, logits: torch.Tensor) -> None:
        self.context = torch.cat(self._prompt)  # [S, H]: every prompt token's last-layer hidden state
        self._prompt = []
        self.logits = logits
        self.node = self.tree.end
        self.tokens: list[int] = []
        self.score = 0.0
        self.logprob = 0.0
        self.penalties: list[float] = []

    def advance(self) -> bool:
        cfg, tree = self.cfg, self.tree
        probs = torch.softmax(self.logits.float(), dim=-1)
        k = min(cfg.top_k, probs.shape[-1])
        top_p, top_ids = torch.topk(probs, k)
        tree.retain([self.node])
        states: list = []
        ids, logits = yield from tree.expand_co([self.node] * k, top_ids.tolist(), hidden=states)
        hidden = final_hidden(self.model.model, states)  # [k, H]
        penalty = degeneration_penalty(hidden, self.context)
        alpha = cfg.penalty_alpha
        scores = (1.0 - alpha) * top_p - alpha * penalty
        j = int(torch.argmax(scores))
        token = int(top_ids[j])
        self.tokens.append(token)
        self.score += float(scores[j])
        self.logprob += float(torch.log_softmax(self.logits.float(), dim=-1)[token])
        self.penalties.append(float(penalty[j]))
        self.context = torch.cat([self.context, hidden[j : j + 1]])
        self.node, self.logits = ids[j], logits[j]
        return token in self.eos or len(self.tokens) >= self.max_new_tokens

    def hypotheses(self) -> list[Hypothesis]:
        return [self.hypothesis(self.tokens, self.score, self.logprob)]

    def stats(self) -> dict[str, Any]:
        n = len(self.penalties)
        return {"mean_degeneration_penalty": round(sum(self.penalties) / n, 6) if n else 0.0}
