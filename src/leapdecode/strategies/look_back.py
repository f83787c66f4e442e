"""Look-back decoding: "Look-back Decoding for Open-Ended Text Generation" (Xu, Zhou, Celikyilmaz,
Ma, 2023; EMNLP 2023, arXiv 2305.13477).

Repetition shows in the next-token distributions before it shows in the text: a step about to
repeat has a distribution very close (in KL divergence) to the one of an earlier step, and a step
drifting off topic has distributions far from those of the prefix.  Look-back decodes greedily
and watches

    KL_min^t = min_{j < t} KL(p(. | x_<t) || p(. | x_<j))

over the distributions of the earlier positions (the prompt's and the generated steps', within a
sliding window of ``window`` positions: the paper's 128).  Where ``KL_min^t <= threshold`` (the
paper's alpha) the step is an *alarm*: instead of the most probable token, one of the ``top_k``
most probable tokens ``v`` is sampled, each weighted by how close the distribution *after* it
stays to the prefix's (a one-step lookahead):

    KL_v = min_{1 <= j <= m} KL(p(. | x_<t, v) || p(. | x_<j)),     x_t ~ softmax(-KL_v / T)

(Algorithm 1 of the paper; ``T`` is the request's temperature, 1 in the paper).  Elsewhere the
token is the argmax.  The top token stays among the candidates (the paper keeps it on purpose).

The prefix set ``{p(. | x_<j), 1 <= j <= m}`` holds the distributions the model predicts *inside*
the prompt (for its tokens 2..m): the prefill's every position is read through the output head
(the prompt's hidden states; the prefix cache is not read).  Two limits the paper does not need
(its prefixes are a few dozen tokens): the prefix set holds the last ``prefix_window`` of them
(256), and for a one-token prompt, which predicts nothing inside itself, it is the first step's
distribution.  The authors' repository (github.com/xunannancy/LookBackDecoding) holds no code, so
this follows the paper's equations and Algorithm 1.

**On the tree.**  A greedy step is one forward of one token.  An alarm runs the ``top_k``
candidates as ``top_k`` children of the current node in one tree forward (their logits are the
lookahead distributions); the sampled child is committed and its logits are the next step's, so
an alarm costs no extra forward either.  The result is one hypothesis (``score`` = ``logprob``,
the model's log-probability of the tokens); ``stats["alarms"]`` counts the sampled steps.
"""

from __future__ import annotations

from typing import Any

import torch

from ..models.native import rms_norm
from .search import Hypothesis, TreeSearch, log_probs


def head_log_probs(decoder: Any, states: list, last: int | None = None) -> torch.Tensor:
    """fp32 log-probabilities ``[T, vocab]`` at every position of one forward (its ``last``
    positions only, if given), from its ``hidden_states`` list (batch row 0): the output head on
    the last layer's output."""
    x = states[-1] if last is None else states[-1][:, -last:]
    with torch.no_grad():
        if getattr(decoder, "backend", None) == "native":
            logits = decoder.lm_head(rms_norm(x, decoder.norm, decoder.cfg.rms_norm_eps))
        else:  # transformers' last hidden state is already normed
            logits = decoder.hf.get_output_embeddings()(x)
    return finite(log_probs(logits[0]))


def finite(lp: torch.Tensor) -> torch.Tensor:
    """``lp`` with ``-inf`` (a token a model rules out) raised to a huge finite negative, so that
    ``0 * log 0`` terms of the KL sums are 0, not NaN (a row's KL to it is then huge instead)."""
    return lp.clamp(min=-1e30)


def min_kl(lp: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
    """``min_j KL(p_i || q_j)`` for each row ``lp[i]`` (log-probabilities ``[n, V]``) against the
    rows of ``history`` (log-probabilities ``[H, V]``); ``+inf`` where ``history`` is empty."""
    if history.shape[0] == 0:
        return torch.full((lp.shape[0],), float("inf"), device=lp.device)
    lp = finite(lp)
    p = lp.exp()
    kl = (p * lp).sum(-1, keepdim=True) - p @ history.T  # [n, H]
    return kl.min(dim=-1).values


class LookBack(TreeSearch):
    """Greedy decoding that samples among the top-k, by their lookahead distance to the prefix,
    where the current distribution comes too close to an earlier one (see the module docstring)."""

    prompt_hidden = "all"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._prompt: list[torch.Tensor] = []  # log-probabilities at the prompt's positions, per prefill forward

    def tree_nodes(self) -> int:
        return self.cfg.top_k + 1

    def prompt_states(self, states: list) -> None:
        keep = max(self.cfg.prefix_window, self.cfg.window) + 1
        self._prompt.append(head_log_probs(self.model.model, states, keep))
        total = torch.cat(self._prompt)[-keep:]  # bounded: a long prompt keeps its last positions only
        self._prompt = [total]

    def begin(self, logits: torch.Tensor) -> None:
        rows = torch.cat(self._prompt) if self._prompt else torch.empty(0, logits.shape[-1], device=logits.device)
        self._prompt = []
        inside = rows[:-1]  # the prompt's own positions: p(. | x_<j) for j = 2..m (the last row is step 1's)
        self.prefix = inside[-self.cfg.prefix_window:] if inside.shape[0] else finite(log_probs(logits))[None]
        self.history = inside[-self.cfg.window:]  # the earlier positions' distributions, newest last
        self.logits = logits
        self.node = self.tree.end
        self.tokens: list[int] = []
        self.logprob = 0.0
        self.alarms = 0
        self.kl_trace: list[float] = []

    def advance(self) -> bool:
        cfg, tree = self.cfg, self.tree
        lp = log_probs(self.logits)
        kl = float(min_kl(lp[None], self.history)[0])
        self.kl_trace.append(kl)
        tree.retain([self.node])
        alarm = kl <= cfg.threshold
        self.alarms += alarm
        if alarm and cfg.top_k > 1:  # (with one candidate the alarm's choice is the argmax anyway)
            k = min(cfg.top_k, lp.shape[-1])
            cands = torch.topk(lp, k).indices.tolist()
            ids, logits = yield from tree.expand_co([self.node] * k, cands)
            dist = min_kl(log_probs(logits), self.prefix)  # each candidate's next step against the prefix
            q = torch.softmax(-dist / self.temperature, dim=-1)
            j = int(torch.multinomial(q.cpu(), 1, generator=self.generator))  # (the generator is a CPU one)
            token, node, nxt = cands[j], ids[j], logits[j]
        else:
            token = int(torch.argmax(lp))
            node = nxt = None
        self.tokens.append(token)
        self.logprob += float(lp[token])
        self.history = torch.cat([self.history, finite(lp)[None]])[-cfg.window:]
        if token in self.eos or len(self.tokens) >= self.max_new_tokens:
            return True
        if node is None:
            ids, logits = yield from tree.expand_co([self.node], [token])
            node, nxt = ids[0], logits[0]
        self.node, self.logits = node, nxt
        return False

    def hypotheses(self) -> list[Hypothesis]:
        return [self.hypothesis(self.tokens, self.logprob, self.logprob)]

    def stats(self) -> dict[str, Any]:
        seen = [k for k in self.kl_trace if k != float("inf")]
        return {"alarms": self.alarms, "mean_kl_min": round(sum(seen) / len(seen), 6) if seen else None}
