"""DoLa: "DoLa: Decoding by Contrasting Layers Improves Factuality in Large Language Models"
(Chuang, Xie, Luo, Kim, Glass, He, 2023; ICLR 2024).

Factual knowledge emerges in the later layers of a transformer: DoLa contrasts the next-token
distribution of the final ("mature") layer ``N`` with that of an early ("premature") layer ``M``
read through the same vocabulary head (early exit), and picks ``M`` per token, among a bucket
of candidate layers, as the one whose distribution differs most from the final one (the
Jensen-Shannon divergence).  Each step:

1. ``q_j = softmax(head(h_j))`` for every candidate layer ``j`` (``h_j``: the last token's hidden
   state after layer ``j``; 0 is the embedding) and ``q_N`` the model's own distribution;
2. ``M = argmax_j JSD(q_N, q_j)``;
3. the score of token ``x`` is ``log q_N(x) - log q_M(x)`` if ``q_N(x) >= relative_top * max q_N``
   (the adaptive plausibility constraint; ``relative_top`` = the paper's alpha, 0.1), ``-inf``
   otherwise;
4. an optional repetition penalty (the paper uses 1.2 with DoLa for open-ended text, as in
   Keskar et al., 2019: a positive score of a token already in the text is divided by it, a
   negative one multiplied), then the best token (greedy).

The details follow the authors' released code (github.com/voidism/DoLa), which transformers'
``generate(dola_layers=...)`` reproduced before it moved to the Hub
(``transformers-community/dola``, transformers 4.56; the installed version does not ship it):

* candidate buckets: with ``N`` layers, ``"low"`` is ``range(s, N // 2, 2)`` and ``"high"``
  ``range(N // 2, N, 2)`` (for ``N > 40``: ``range(s, 20, 2)`` and ``range(N - 20, N, 2)``), where
  ``s`` skips the embedding layer of a model with tied embeddings (``s = 2`` for ``N > 2``, 1 for
  ``N = 2``; 0 for untied or one-layer models); or an explicit list of layer indices;
* the head reads the early hidden states as they are, without the final norm (the authors'
  ``lm_head(outputs.hidden_states[j])``); ``final_norm=True`` applies the final norm first (the
  "logit lens" reading of early exit);
* the divergence is the code's ``0.5 * (KL(m || q_N) + KL(m || q_j))`` with ``m = (q_N + q_j) / 2``,
  averaged over the vocabulary (the paper writes the Jensen-Shannon divergence with the
  arguments of the KL terms the other way round); with one candidate layer none is computed.

It runs on the native decoder (the early heads need its layers' hidden states and its head),
one forward per token on the runner's cache (a one-node chain of ``search.TreeKV``), the
candidate layers' hidden states taken from that forward (``hidden_states=``).  The result is one
hypothesis: ``score`` the sum of the chosen tokens' DoLa scores, ``logprob`` their final-layer
log-probability; ``stats["premature_layers"]`` counts how often each layer was chosen.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import InvalidParameterError
from ..models.native import rms_norm
from .search import Hypothesis, TreeSearch, log_probs


def candidate_layers(spec: "str | list[int]", n_layers: int, tied_embeddings: bool) -> list[int]:
    """The candidate premature layers of ``spec`` (``"low"``, ``"high"`` or indices) for a model of
    ``n_layers`` layers (the released code's buckets; see the module docstring)."""
    n = n_layers
    if isinstance(spec, list):
        bad = [i for i in spec if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n]
        if bad or not spec:
            raise InvalidParameterError(f"option 'dola_layers' of strategy 'dola' must list layer indices in [0, {n}) "
                                        f"(0: the embeddings; {n} is the final layer itself), got {spec!r}")
        return list(dict.fromkeys(spec))
    start = 0 if not tied_embeddings else 2 if n > 2 else 1 if n == 2 else 0
    if spec == "low":
        if start == n // 2:
            return [start]
        layers = list(range(start, n // 2, 2)) if n <= 40 else list(range(start, 20, 2))
    else:
        layers = list(range(n // 2, n, 2)) if n <= 40 else list(range(n - 20, n, 2))
    if not layers:
        raise InvalidParameterError(f"option 'dola_layers' of strategy 'dola': the bucket {spec!r} holds no layer of "
                                    f"this {n}-layer model; give a list of layer indices")
    return layers


def relative_top_contrast(final_logits: torch.Tensor, base_logits: torch.Tensor, relative_top: float) -> torch.Tensor:
    """``log q_N - log q_M`` on the tokens with ``q_N >= relative_top * max q_N``, ``-inf`` elsewhere."""
    lp_final = log_probs(final_logits)
    lp_base = log_probs(base_logits)
    keep = lp_final >= lp_final.max(dim=-1, keepdim=True).values + math.log(relative_top)
    return torch.where(keep, lp_final - lp_base, torch.full_like(lp_final, -math.inf))


def select_premature(final_logits: torch.Tensor, premature: torch.Tensor) -> tuple[int, torch.Tensor]:
    """The index (into ``premature``'s rows, ``[L, vocab]``) of the layer whose distribution
    diverges most from the final one, and the divergences (the released code's; see above)."""
    final = final_logits.float()[None]
    early = premature.float()
    m = 0.5 * (torch.softmax(final, dim=-1) + torch.softmax(early, dim=-1))
    kl_final = F.kl_div(torch.log_softmax(final, dim=-1), m, reduction="none").mean(-1)
    kl_early = F.kl_div(torch.log_softmax(early, dim=-1), m, reduction="none").mean(-1)
    js = 0.5 * (kl_final + kl_early)
    return int(torch.argmax(js)), js


def repetition_penalty(scores: torch.Tensor, seen: list[int], penalty: float) -> torch.Tensor:
    """Keskar et al.'s penalty on the tokens in ``seen``: a negative score times ``penalty``, a
    positive one divided by it (transformers' ``RepetitionPenaltyLogitsProcessor``)."""
    if penalty == 1.0 or not seen:
        return scores
    idx = torch.tensor(sorted(set(seen)), device=scores.device)
    s = scores.index_select(0, idx)
    scores = scores.clone()
    scores[idx] = torch.where(s < 0, s * penalty, s / penalty)
    return scores


class DoLa(TreeSearch):
    """Greedy DoLa decoding (see the module docstring)."""

    prompt_hidden = "last"

    def __init__(self, *args: Any, layers: list[int], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.layers = layers
        self.counts: dict[int, int] = {j: 0 for j in layers}
        self._early: torch.Tensor | None = None

    def tree_nodes(self) -> int:
        return 2

    def early_logits(self, states: list) -> torch.Tensor:
        """``[L, vocab]``: the head on the last token's hidden state after each candidate layer."""
        decoder = self.model.model
        rows = torch.stack([states[j][0, -1] for j in self.layers])
        with torch.no_grad():
            if self.cfg.final_norm:
                rows = rms_norm(rows, decoder.norm, decoder.cfg.rms_norm_eps)
            return decoder.lm_head(rows).float()

    def prompt_states(self, states: list) -> None:
        self._early = self.early_logits(states)

    def begin(self, logits: torch.Tensor) -> None:
        self.logits = logits
        self.node = self.tree.end
        self.tokens: list[int] = []
        self.score = 0.0
        self.logprob = 0.0

    def advance(self) -> bool:
        cfg = self.cfg
        early = self._early
        if len(self.layers) == 1:
            j = 0
        else:
            j, _ = select_premature(self.logits, early)
        self.counts[self.layers[j]] += 1
        scores = relative_top_contrast(self.logits, early[j], cfg.relative_top)
        scores = repetition_penalty(scores, self.prompt_ids + self.tokens, cfg.repetition_penalty)
        token = int(torch.argmax(scores))
        self.tokens.append(token)
        self.score += float(scores[token])
        self.logprob += float(log_probs(self.logits)[token])
        if token in self.eos or len(self.tokens) >= self.max_new_tokens:
            return True
        tree = self.tree
        tree.retain([self.node])
        states: list = []
        ids, logits = yield from tree.expand_co([self.node], [token], hidden=states)
        self.node, self.logits = ids[0], logits[0]
        self._early = self.early_logits(states)
        return False

    def hypotheses(self) -> list[Hypothesis]:
        return [self.hypothesis(self.tokens, self.score, self.logprob)]

    def stats(self) -> dict[str, Any]:
        return {"premature_layers": dict(self.counts)}
