"""Contrastive decoding with an amateur model: "Contrastive Decoding: Open-ended Text Generation as
Optimization" (Li, Holtzman, Fried, Liang, Eisner, Hashimoto, Zettlemoyer, Lewis, 2023; ACL 2023).

A large *expert* model and a small *amateur* model of the same vocabulary read the same text; the
continuation maximizes the contrastive objective, token by token

    CD(x_t) = log p_EXP(x_t | x_<t) - log p_AMA(x_t | x_<t)     if x_t is in V_head(x_<t)
              -inf                                                otherwise

    V_head(x_<t) = { x : p_EXP(x | x_<t) >= alpha * max_w p_EXP(w | x_<t) }

(the *adaptive plausibility constraint*: a token the expert finds implausible is never chosen,
however much more the amateur dislikes it).  The amateur's distribution may be taken at a
temperature tau (``amateur_temperature``; the paper's amateur-temperature ablation).  The paper
searches the sum of the token scores with beam search; ``num_beams = 1`` is the greedy version.

**The search** (``num_beams = k``): each round, every running hypothesis's candidates are the
tokens of its ``V_head``, scored by the hypothesis's score plus their CD score; the ``k`` best over
all hypotheses are taken in order: one ending on an end-of-sequence token (or at
``max_new_tokens``) is finished, the others run on (at most ``k``).  The search stops when ``k``
hypotheses finished, or none runs; the finished ones are returned by score (the sum of their CD
scores, no length normalization), best first.

**Two trees.**  The expert's hypotheses are nodes of the token tree of the runner's cache, the
amateur's the same nodes of a second tree on a cache for the amateur (``search.TreeKV`` with the
amateur model: the same runner hands it out and takes it back, and it never touches the target's
prefix cache): each round is one tree forward of each model over the new tokens.

The amateur is loaded through the runner like a draft model (``runner.draft(name)``; default: the
target's registered draft, e.g. ``qwen2.5-coder-0.5b`` for ``qwen2.5-coder-1.5b``), so a server
that loads its drafts at start-up only (``--draft``) can use exactly those.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InvalidParameterError
from .search import Hypothesis, TreeKV, TreeSearch, log_probs


def cd_scores(expert_logits: torch.Tensor, amateur_logits: torch.Tensor, alpha: float,
              amateur_temperature: float = 1.0) -> torch.Tensor:
    """The contrastive objective per token (rows of logits): ``log p_EXP - log p_AMA`` on the
    expert's plausible head (``p_EXP >= alpha * max p_EXP``), ``-inf`` elsewhere."""
    lp_e = log_probs(expert_logits)
    lp_a = log_probs(amateur_logits, amateur_temperature)
    head = lp_e >= lp_e.max(dim=-1, keepdim=True).values + math.log(alpha)
    return torch.where(head, lp_e - lp_a, torch.full_like(lp_e, -math.inf))


@dataclass
class CDBeam:
    nodes: tuple[int, int]  # its last token's node in the expert's and in the amateur's tree
    tokens: list[int]
    score: float  # the sum of its tokens' CD scores
    logprob: float  # the expert's log-probability of ``tokens``
    row: int = 0


class ContrastiveDecoding(TreeSearch):
    """Greedy (``num_beams = 1``) or beam search over the contrastive objective (see the module docstring)."""

    def __init__(self, *args: Any, amateur: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        target = self.model.model
        if amateur.model.vocab_size != target.vocab_size:
            raise InvalidParameterError(
                f"strategy 'contrastive' needs an amateur with the expert's vocabulary: {amateur.name} has "
                f"{amateur.model.vocab_size} tokens, {self.model.name} {target.vocab_size}")
        self.amateur = amateur
        self.amateur_tree: TreeKV | None = None

    def begin(self, logits: torch.Tensor) -> None:
        self.amateur_tree = TreeKV(self.runner, self.prompt_ids, self.max_new_tokens, self.tree_nodes(),
                                   model=self.amateur)
        amateur_logits = self.amateur_tree.prefill()
        self.running = [CDBeam((self.tree.end, self.amateur_tree.end), [], 0.0, 0.0, 0)]
        self.finished_beams: list[CDBeam] = []
        self.logits = (logits[None], amateur_logits[None])

    def advance(self) -> bool:
        cfg = self.cfg
        k = cfg.num_beams
        exp_logits, ama_logits = self.logits
        cd = cd_scores(exp_logits, ama_logits, cfg.alpha, cfg.amateur_temperature)
        lp_e = log_probs(exp_logits)
        cands: list[tuple[float, int, int]] = []  # (score, beam index, token)
        for i, beam in enumerate(self.running):
            row = cd[beam.row]
            n = min(k, int(torch.isfinite(row).sum()))
            top, idx = torch.topk(row, n)
            cands += [(beam.score + s, i, t) for s, t in zip(top.tolist(), idx.tolist())]
        cands.sort(key=lambda c: -c[0])  # stable: among equal scores, earlier beams and better tokens first
        nxt: list[CDBeam] = []
        length = len(self.running[0].tokens) + 1
        for rank, (score, i, tok) in enumerate(cands[:k]):
            parent = self.running[i]
            beam = CDBeam(parent.nodes, parent.tokens + [tok], score,
                          parent.logprob + float(lp_e[parent.row, tok]))
            if tok in self.eos or length >= self.max_new_tokens:
                self.finished_beams.append(beam)
            else:
                nxt.append(beam)
        self.running = nxt
        if not nxt or len(self.finished_beams) >= k:
            return True
        expert, amateur = self.tree, self.amateur_tree
        expert.retain(b.nodes[0] for b in nxt)
        amateur.retain(b.nodes[1] for b in nxt)
        tokens = [b.tokens[-1] for b in nxt]
        e_ids, e_logits = yield from expert.expand_co([b.nodes[0] for b in nxt], tokens)
        a_ids, a_logits = yield from amateur.expand_co([b.nodes[1] for b in nxt], tokens)
        for row, (b, e, a) in enumerate(zip(nxt, e_ids, a_ids)):
            b.nodes, b.row = (e, a), row
        self.logits = (e_logits, a_logits)
        return False

    def hypotheses(self) -> list[Hypothesis]:
        done = sorted(self.finished_beams, key=lambda b: -b.score)  # stable: the earlier finished first
        return [self.hypothesis(b.tokens, b.score, b.logprob) for b in done]

    def stats(self) -> dict[str, Any]:
        tree = self.amateur_tree
        return {"amateur": self.amateur.name, "amateur_forwards": tree.forwards if tree is not None else 0}

    def release_more(self) -> None:
        if self.amateur_tree is not None:
            self.amateur_tree.release()
