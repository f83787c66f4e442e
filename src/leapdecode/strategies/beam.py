"""Beam search as Hugging Face transformers defines it, with the patience factor; and diverse
(group) beam search.

Papers:

* beam search with length normalization and early stopping as in transformers' ``generate``
  (``num_beams``, ``length_penalty``, ``early_stopping``, ``num_return_sequences``);
* "Beam Decoding with Controlled Patience" (Kasai, Sakaguchi, Le Bras, Peng, Lu, Radev, Choi,
  Smith, 2022): the patience factor;
* "Diverse Beam Search: Decoding Diverse Solutions from Neural Sequence Models" (Vijayakumar,
  Cogswell, Selvaraju, Sun, Lee, Crandall, Batra, 2016; AAAI 2018): groups with a Hamming
  diversity penalty.

**Beam search** (``strategy="beam"``) follows transformers' ``_beam_search`` (5.x) step for step,
so on the same model it returns the same hypotheses and the same ``sequences_scores``
(tests/test_strategies.py checks it against ``generate(num_beams=...)``).  With ``k`` beams and
``E`` end-of-sequence ids, each round:

1. every running beam's next-token log-probabilities (fp32 log-softmax) are added to its score
   (the sum of its tokens' log-probabilities); the top ``max(2, 1 + E) * k`` (beam, token)
   candidates over all beams are kept, best first;
2. a candidate *finishes* when its token is an end-of-sequence id or it reaches
   ``max_new_tokens``; the best ``k`` candidates that do not finish are the next running beams;
3. of the candidates ranked in the top ``k``, those that finish enter the finished pool with the
   score ``sum of log-probabilities / generated_length ** length_penalty`` (the length counts the
   end-of-sequence token); the pool keeps its best ``k``;
4. the search stops when no candidate can continue (the length limit), or by ``early_stopping``:
   ``True``: as soon as the pool holds ``k`` hypotheses; ``False`` (the default): when it is full
   and the best running beam, scored as if it finished at its current length, cannot beat the
   pool's worst (transformers' heuristic: with ``length_penalty > 0`` a longer continuation could
   still score better); ``"never"``: the same test with the best attainable length penalty
   (``max_new_tokens`` when ``length_penalty > 0``), the canonical stopping rule.

The result is the pool, best first, cut to ``num_return_sequences``.

**Patience** (``patience=p``, default 1): the finished pool holds ``ceil(p * k)`` hypotheses
instead of ``k``, so with ``early_stopping=True`` (the first-come-first-served rule the paper
modifies: fairseq's) the search ends once ``ceil(p * k)`` hypotheses have finished: ``p > 1``
searches longer, ``p < 1`` stops earlier.  With ``early_stopping`` ``False``/``"never"`` the larger
or smaller pool is what the stopping test compares against.  ``p = 1`` is plain beam search.

**Diverse beam search** (``strategy="diverse-beam"``): the ``k`` beams form ``G`` groups of
``k / G``; each group is a beam search as above (its own finished pool of ``k / G``, its own
stopping), and the groups take their round in order: group ``g`` adds ``-diversity_penalty * n(t)``
to token ``t``'s log-probability, ``n(t)`` being how many beams of groups ``0..g-1`` chose ``t`` in
this round (the paper's Hamming diversity).  As in the paper, and as transformers' group beam
search did, the penalty is part of the objective: it accumulates in the beams' scores and the
finished hypotheses' ``score``; ``logprob`` is the plain model log-probability.  The result is the
union of the groups' pools, best ``score`` first, each hypothesis with its ``group``.  transformers removed group beam search from the
library in 4.56 (it now lives on the Hub, ``transformers-community/group-beam-search``) and the
installed version does not ship it, so this is written from the paper, with transformers'
conventions where the paper leaves a choice (the candidates per group, the finished pools, the
stopping rules above); one deliberate difference: a group that has stopped contributes nothing
to later groups' penalties (transformers' group search padded it and penalized the pad token).

All live beams of all groups are leaves of one token tree in one KV cache: each round runs one
forward over the new beams' tokens (``search.TreeKV``), the prefix all beams share is committed,
and dead branches are dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .search import ROOT, Hypothesis, TreeSearch, log_probs


@dataclass
class Beam:
    node: int  # the tree node holding its last token (ROOT: nothing generated)
    tokens: list[int]
    score: float  # the objective: log-probabilities (+ diversity penalties), fp32
    logprob: float  # the model's log-probability of ``tokens``
    row: int = -1  # its row in the last forward's logits


class BeamPool:
    """One beam search's state (a diverse search has one per group): running beams, the finished
    pool, and the stopping test, as transformers' ``_beam_search`` has them."""

    def __init__(self, width: int, capacity: int, length_penalty: float, early_stopping: bool | str,
                 n_eos: int, max_new_tokens: int) -> None:
        self.width = width
        self.capacity = capacity
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.candidates = max(2, 1 + n_eos) * width
        self.max_new_tokens = max_new_tokens
        self.running: list[Beam] = [Beam(ROOT, [], 0.0, 0.0, 0)]
        self.finished: list[tuple[float, Beam]] = []  # (normalized score, beam), best first
        self.open = True  # transformers' is_early_stop_heuristic_unsatisfied
        self.done = False

    @property
    def full(self) -> bool:
        return len(self.finished) >= self.capacity

    def select(self, logp: torch.Tensor, plain: torch.Tensor, length: int, eos: frozenset[int]) -> list[Beam]:
        """One round for this pool: ``logp`` (``[running, vocab]``) are the running beams'
        objective increments (log-probabilities, minus any diversity penalty), ``plain`` their
        plain log-probabilities; ``length`` tokens were generated before this round.  Returns the
        next running beams (their ``node`` is their parent's; the caller runs them) and updates the
        finished pool and the stopping state."""
        vocab = logp.shape[-1]
        scores = torch.tensor([b.score for b in self.running], dtype=torch.float32, device=logp.device)
        acc = (logp + scores[:, None]).reshape(-1)
        k = min(self.candidates, acc.numel())
        top, idx = torch.topk(acc, k)
        top_l, idx_l = top.tolist(), idx.tolist()
        last = length + 1 >= self.max_new_tokens
        new_len = length + 1
        denom = float(new_len) ** self.length_penalty
        normalized = (top / denom).tolist()
        nxt: list[Beam] = []
        all_hit = True
        add_finished = self.open and not (self.full and self.early_stopping is True)
        fresh: list[tuple[float, Beam]] = []
        for rank, (value, flat) in enumerate(zip(top_l, idx_l)):
            parent = self.running[flat // vocab]
            tok = flat % vocab
            hit = last or tok in eos
            beam = Beam(parent.node, parent.tokens + [tok], value,
                        parent.logprob + float(plain[flat // vocab, tok]))
            if not hit:
                all_hit = False
                if len(nxt) < self.width:
                    nxt.append(beam)
            elif rank < self.width and add_finished:
                fresh.append((normalized[rank], beam))
        if fresh:
            merged = self.finished + fresh
            merged.sort(key=lambda x: -x[0])  # stable: earlier entries first among equals
            self.finished = merged[: self.capacity]
        self.running = nxt
        # the stopping test, after the round (transformers' _check_early_stop_heuristic)
        if self.open and self.full and nxt:
            if self.early_stopping == "never" and self.length_penalty > 0.0:
                hyp_len = self.max_new_tokens
            else:
                hyp_len = new_len
            best = torch.tensor(nxt[0].score, dtype=torch.float32) / (float(hyp_len) ** self.length_penalty)
            self.open = bool(best > torch.tensor(self.finished[-1][0], dtype=torch.float32))
        stop = (not self.open) or (self.full and self.early_stopping is True) or all_hit or not nxt
        if stop:
            self.done = True
            self.running = []
        return self.running


class BeamSearch(TreeSearch):
    """Beam search (one pool) or diverse beam search (``groups`` pools with a Hamming penalty)."""

    def __init__(self, *args: Any, groups: int = 1, diversity_penalty: float = 0.0, patience: float = 1.0,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cfg = self.cfg
        self.groups = groups
        self.diversity_penalty = diversity_penalty
        self.group_width = cfg.num_beams // groups
        self.capacity = max(1, math.ceil(patience * self.group_width - 1e-9))
        self.pools: list[BeamPool] = []
        self.length = 0

    def begin(self, logits: torch.Tensor) -> None:
        cfg = self.cfg
        self.pools = [BeamPool(self.group_width, self.capacity, cfg.length_penalty, cfg.early_stopping,
                               len(self.eos), self.max_new_tokens) for _ in range(self.groups)]
        self.logp = log_probs(logits[None])  # rows of the running beams (the root's, for now)

    def advance(self) -> bool:
        logp = self.logp
        chosen: list[Beam] = []
        counts = None
        for pool in self.pools:
            if pool.done:
                continue
            rows = torch.tensor([b.row for b in pool.running], device=logp.device)
            plain = logp.index_select(0, rows)
            inc = plain
            if self.diversity_penalty and counts is not None:
                inc = plain - self.diversity_penalty * counts[None, :]
            new = pool.select(inc, plain, self.length, self.eos)
            if self.groups > 1 and new:
                if counts is None:
                    counts = torch.zeros(logp.shape[-1], dtype=logp.dtype, device=logp.device)
                for b in new:
                    counts[b.tokens[-1]] += 1
            chosen.extend(new)
        self.length += 1
        if not chosen:
            return True
        tree = self.tree
        tree.retain(b.node for b in chosen)
        ids, logits = yield from tree.expand_co([b.node for b in chosen], [b.tokens[-1] for b in chosen])
        for i, (b, nid) in enumerate(zip(chosen, ids)):
            b.node, b.row = nid, i
        self.logp = log_probs(logits)
        return False

    def hypotheses(self) -> list[Hypothesis]:
        entries = [(s, b, g) for g, pool in enumerate(self.pools) for s, b in pool.finished]
        entries.sort(key=lambda x: -x[0])  # stable: among equal scores, earlier groups first
        if self.groups == 1:
            return [self.hypothesis(b.tokens, s, b.logprob) for s, b, _ in entries]
        return [self.hypothesis(b.tokens, s, b.logprob, group=g) for s, b, g in entries]

    def stats(self) -> dict[str, Any]:
        return {"finished_hypotheses": sum(len(p.finished) for p in self.pools)}
