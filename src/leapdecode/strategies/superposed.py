"""Superposed decoding: "Superposed Decoding: Multiple Generations from a Single Autoregressive
Inference Pass" (Shen, Kusupati, Kembhavi, et al., 2024; NeurIPS 2024, arXiv 2405.18400).

``k`` drafts grow from *one* autoregressive pass: each step feeds the model a single input
embedding, the *superposition* of the ``k`` drafts' last tokens,

    e = sum_d w_d * E[x_d],      w_d = P(draft d) / sum_d' P(draft d')

(``E`` the token embeddings, ``P(draft d) = exp(score_d)``; drafts that end on the same token add
their weights), and reads one next-token distribution ``p`` from it, which every draft shares.
Each draft's continuations are then scored by interpolating ``p`` with an n-gram model of the
draft's own last tokens (the paper's "geometric" smoothing),

    s_d(v) = (1 - alpha) * log p(v) + alpha * log sum_i lambda_i * P_i(v | the draft's last i tokens)

where ``p`` is the model's distribution at ``lm_temperature`` kept to its ``n_token_sample`` most
probable tokens and renormalized; a context the n-gram model never saw adds nothing, and a draft
for which no candidate has n-gram support is scored ``(1 - alpha) * log p(v) - penalty``.  Of the
``k * n_token_sample`` extensions ``score_d + s_d(v)``, the best ``2k`` are taken; the best ``k``
not ending on an end-of-sequence token stay alive, those that end join the finished pool (its best
``k`` kept).  The first step expands the prompt alone.  With ``alpha = 0`` there is no n-gram
model (``s_d = log p``).

The details follow the authors' code (github.com/RAIVNLab/SuperposedDecoding,
``superposed/llama/superpose.py``), and the defaults are its released parameters
(``params/p15_d3_mixed.json``: k = 3, alpha = 0.54, temperature 0.06, 9 tokens, n-gram weights
0.01/0.04/0.15/0.18/0.12 for the 2- to 6-gram models, penalty 200).

**The n-gram model** here is not the paper's (counts over a large web corpus, gigabytes of
tables): it counts the n-grams of the prompt and, with the option ``ngram_corpus``, of a local
UTF-8 text file (tokenized with the model's tokenizer; the counts are kept in the runner's memory
per file and size), so that with no corpus the drafts are steered toward the prompt's own phrases.

**On the cache.**  The prompt is prefilled as for any search; each step is one forward of one
position whose input is the superposed embedding (``NativeCausalLM.forward(embeds=...)``), and
that position is committed: the drafts share one chain of keys and values, the approximation the
paper makes.  Hence the native backend only.  Where one draft is alive (``num_drafts = 1``, or
every draft on the same token) the superposition is exactly that token's embedding, and with
``num_drafts = 1, alpha = 0`` the output is greedy decoding's.

The result holds the best ``num_return_sequences`` (default ``k``) of the drafts, finished and
alive together, best ``score`` first (the summed interpolated scores; ``logprob`` is the sum of
the shared pass's log-probabilities of the draft's tokens, at temperature 1, not an independent
forward of the draft).
"""

from __future__ import annotations

import math
import os
from collections import Counter
from typing import Any

import torch

from ..core.proposer import Identity, MemoryKey
from .search import Hypothesis, TreeSearch, log_probs


class NGramCounts:
    """n-gram counts over token ids: for each context length ``n`` in ``orders``, a mapping from
    the ``n`` tokens before a position to a ``Counter`` of the tokens that followed them."""

    def __init__(self, orders: tuple[int, ...]) -> None:
        self.tables: dict[int, dict[tuple[int, ...], Counter]] = {n: {} for n in orders}

    def add(self, ids: list[int]) -> "NGramCounts":
        for n, table in self.tables.items():
            for i in range(n, len(ids)):
                table.setdefault(tuple(ids[i - n : i]), Counter())[ids[i]] += 1
        return self


def ngram_probability(models: list[NGramCounts], seq: list[int], tokens: list[int],
                      weights: list[float]) -> list[float]:
    """``sum_i weights[i] * P_{i+1}(v | seq's last i+1 tokens)`` for each ``v`` in ``tokens``, the
    counts of ``models`` pooled; a context none of them saw (or one longer than ``seq``) adds 0."""
    out = [0.0] * len(tokens)
    for i, w in enumerate(weights):
        n = i + 1
        if w == 0 or len(seq) < n:
            continue
        ctx = tuple(seq[-n:])
        seen = [m.tables[n][ctx] for m in models if n in m.tables and ctx in m.tables[n]]
        if not seen:
            continue
        total = sum(sum(c.values()) for c in seen)
        for j, v in enumerate(tokens):
            out[j] += w * sum(c.get(v, 0) for c in seen) / total
    return out


def corpus_counts(runner: Any, path: str, orders: tuple[int, ...]) -> NGramCounts:
    """The n-gram counts of the text file ``path`` in the model's tokens, kept in the runner's
    memory (keyed by the file's path, size and modification time, the orders counted, and the
    model whose tokenizer counted them, by identity).  No scope: the counts are derived from the
    file alone, the same for every memory scope, so they are kept once."""
    st = os.stat(path)
    key = MemoryKey("superposed", "ngram", (os.path.abspath(path), st.st_size, st.st_mtime_ns, orders),
                    Identity(runner.model))

    def build() -> NGramCounts:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        return NGramCounts(orders).add(list(runner.model.tokenizer.encode(text)))

    return runner.memory.get(key, build)


class Superposed(TreeSearch):
    """``num_drafts`` drafts from one pass of superposed embeddings (see the module docstring)."""

    def __init__(self, *args: Any, ngrams: list[NGramCounts], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ngrams = ngrams
        self.weights = [float(w) for w in self.cfg.ngram_weights]

    def tree_nodes(self) -> int:
        return 2

    def begin(self, logits: torch.Tensor) -> None:
        # a draft: (tokens, score, logprob); the first step expands the prompt alone
        self.alive: list[tuple[list[int], float, float]] = [([], 0.0, 0.0)]
        self.ended: list[tuple[list[int], float, float]] = []
        self.logits = logits
        self.penalized = 0
        self.steps = 0

    def extension_scores(self, logits: torch.Tensor) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """The candidate tokens (the ``n_token_sample`` most probable at ``lm_temperature``), each
        alive draft's scores ``s_d`` for them (``[drafts, n]``) and the tokens' temperature-1
        log-probabilities."""
        cfg = self.cfg
        lp = log_probs(logits, cfg.lm_temperature)
        n = min(cfg.n_token_sample, lp.shape[-1])
        top_lp, top = torch.topk(lp, n)
        cand_lp = top_lp - torch.logsumexp(top_lp, dim=-1)  # renormalized over the kept tokens
        cands = top.tolist()
        rows = []
        for tokens, _, _ in self.alive:
            if cfg.alpha == 0:
                rows.append(cand_lp)
                continue
            ng = torch.tensor(ngram_probability(self.ngrams, self.prompt_ids + tokens, cands, self.weights),
                              dtype=torch.float32, device=cand_lp.device)
            s = (1 - cfg.alpha) * cand_lp + cfg.alpha * torch.log(ng)
            if not bool(torch.isfinite(s).any()):  # no candidate has n-gram support
                self.penalized += 1
                s = (1 - cfg.alpha) * cand_lp - cfg.penalty
            rows.append(s)
        return cands, torch.stack(rows), log_probs(logits)[top]

    def advance(self) -> bool:
        k = self.cfg.num_drafts
        cands, scores, model_lp = self.extension_scores(self.logits)
        n = len(cands)
        totals = torch.tensor([d[1] for d in self.alive], dtype=torch.float32, device=scores.device)[:, None] + scores
        flat = totals.reshape(-1)
        finite = int(torch.isfinite(flat).sum())
        best_vals, best = torch.topk(flat, min(2 * k, finite)) if finite else (flat[:0], flat[:0].long())
        alive: list[tuple[list[int], float, float]] = []
        self.steps += 1
        for value, idx in zip(best_vals.tolist(), best.tolist()):
            d, j = divmod(idx, n)
            tokens, _, lp = self.alive[d]
            draft = (tokens + [cands[j]], value, lp + float(model_lp[j]))
            if cands[j] in self.eos:
                self.ended.append(draft)
            elif len(alive) < k:
                alive.append(draft)
        self.ended = sorted(self.ended, key=lambda h: -h[1])[:k]
        self.alive = alive
        if not alive or self.steps >= self.max_new_tokens:
            return True
        self.logits = self.superposed_forward([(d[0][-1], d[1]) for d in alive])
        return False

    def superposition(self, last: list[tuple[int, float]]) -> torch.Tensor:
        """``sum_d w_d E[x_d]`` (fp32 ``[hidden]``) over ``(last token, score)`` pairs,
        ``w = softmax(scores)`` with the weights of equal tokens added."""
        decoder = self.model.model
        w = torch.softmax(torch.tensor([s for _, s in last], dtype=torch.float64), dim=0)
        merged: dict[int, float] = {}
        for (tok, _), wd in zip(last, w.tolist()):
            merged[tok] = merged.get(tok, 0.0) + wd
        total = sum(merged.values())
        toks = list(merged)
        with torch.no_grad():
            emb = decoder.embed(torch.tensor(toks, device=decoder.device)).float()
        weights = torch.tensor([merged[t] / total for t in toks], dtype=torch.float32, device=emb.device)
        return (weights[:, None] * emb).sum(0)

    def superposed_forward(self, last: list[tuple[int, float]]) -> torch.Tensor:
        """One forward of the superposed embedding after the committed chain; its logits."""
        decoder, cache = self.model.model, self.tree.cache
        e = self.superposition(last)
        placeholder = torch.zeros((1, 1), dtype=torch.long, device=decoder.device)
        logits = decoder.forward(placeholder, cache, embeds=e[None, None])
        cache.commit()
        self.tree.forwards += 1
        self.tree.nodes += 1
        return logits[0, -1]

    def hypotheses(self) -> list[Hypothesis]:
        pool = sorted(self.ended + self.alive, key=lambda h: -h[1])
        return [self.hypothesis(tokens, score, lp) for tokens, score, lp in pool]

    def stats(self) -> dict[str, Any]:
        return {"drafts_alive": len(self.alive), "penalized": self.penalized,
                "ngram_orders": [i + 2 for i, w in enumerate(self.weights) if w]}


def check_weights(weights: Any) -> None:
    """Raise ``ValueError`` unless ``weights`` is a list (or tuple) of 1 to 6 finite numbers >= 0."""
    if (not isinstance(weights, (list, tuple)) or not 1 <= len(weights) <= 6
            or not all(isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) and w >= 0
                       for w in weights)):
        raise ValueError(weights)
