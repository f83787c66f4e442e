"""Speculative decoding with a smaller draft model of the same tokenizer.

The draft keeps its own static KV cache.  Each step it first feeds the tokens
the target decided since last time (usually just the target's bonus token: the
accepted draft nodes are already in its cache and are committed there, not
recomputed), then grows a token tree:

* **Dynamic draft tree** (EAGLE-2: "EAGLE-2: Faster Inference of Language
  Models with Dynamic Draft Trees", Li et al., 2024): every candidate carries
  its cumulative draft log-probability; each round expands the ``beam`` best
  frontier nodes in one batched draft forward (``top_k`` children each), and
  at the end the ``budget`` best nodes overall form the tree (a child never
  scores above its parent, so the best set is a tree).  The shape adapts to
  the draft's confidence, as Sequoia ("Sequoia: Scalable, Robust, and
  Hardware-aware Speculative Decoding", Chen et al., 2024) and OPT-Tree
  ("OPT-Tree: Speculative Decoding with Adaptive Draft Tree Structure", Wang
  et al., 2024) argue a tree should.
* **Adaptive draft length** (in the spirit of "SpecDec++: Boosting Speculative
  Decoding via Adaptive Candidate Lengths", Huang et al., 2024): drafting stops
  when the best frontier node's cumulative probability falls below a threshold
  tau.  SpecDec++ trains an acceptance-prediction head; we have no training
  data here, so tau is learned online from the verdicts: raised when the
  deepest drafted level went unused, lowered when the whole draft was accepted.

Under sampling the children of a node are drawn from the (identically
processed) draft distribution without replacement (Gumbel-top-k) and all of
them are kept, so the verifier's recursive rejection sampling is exact; the
global best-``budget`` pruning is used only for greedy decoding, where it is
always safe.
"""

from __future__ import annotations

import math
import time

import torch

from ..core.sampling import SamplingParams, target_probs
from ..core.tree import TokenTree
from .base import DecodeContext, Proposer, feed_committed


class DraftModelProposer(Proposer):
    name = "draft"

    def __init__(
        self,
        draft,  # LoadedModel
        tree_budget: int | None = None,
        top_k: int = 4,
        beam: int = 4,
        max_depth: int = 8,
        adaptive: bool = True,
        tau: float = 0.05,
    ) -> None:
        if top_k < 1 or beam < 1 or max_depth < 1:
            raise ValueError("top_k, beam and max_depth must be >= 1")
        self.draft = draft
        self.default_budget = tree_budget or 24
        self.top_k, self.beam, self.max_depth = top_k, beam, max_depth
        self.adaptive = adaptive
        self.tau = tau
        self.cache = None
        self._time = 0.0
        self._draft_forwards = 0

    # ---------------------------------------------------------------- setup
    def begin(self, ctx: DecodeContext, tokens: list[int]) -> None:
        super().begin(ctx, tokens)
        needed = min(self.draft.max_seq_len, ctx.prompt_len + ctx.max_new_tokens + 256)
        # not ``_cache``: that is the generation's cache when the draft is also used as a target
        # (``draft=`` the target's own LoadedModel); sharing it would corrupt both
        cache = getattr(self.draft, "_draft_cache", None)
        if cache is None or cache.max_len < needed:
            self.draft._draft_cache = None
            cache = self.draft.model.new_cache(max_len=needed)
            self.draft._draft_cache = cache
        cache.reset()
        self.cache = cache
        self.n_cached = 0  # tokens[:n_cached] are committed in the draft cache
        self.params: SamplingParams = ctx.params
        self.vocab = min(ctx.target.model.vocab_size, self.draft.model.vocab_size)
        self._pending_of: dict[int, int] = {}
        # prefill all but the root now, so the first propose only feeds the root
        if 1 < len(tokens) <= cache.max_len:  # (a prompt the draft cannot hold: propose() drafts nothing)
            self._feed(tokens[:-1], want_logits=False)

    def _feed(self, new: list[int], want_logits: bool = True) -> torch.Tensor | None:
        logits, _ = feed_committed(self.draft, self.cache, new, want_logits)
        self._draft_forwards += 1
        self.n_cached += len(new)
        return None if logits is None else logits[: self.vocab]

    def _dist(self, logits: torch.Tensor) -> torch.Tensor:
        """Log-probabilities that rank candidates (greedy) or that children are drawn from (sampling)."""
        if self.params.greedy:
            return logits.float().log_softmax(-1)
        return target_probs(logits, self.params).clamp_min(0).log()

    def _children(self, logp: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
        if self.params.greedy:
            vals, idx = torch.topk(logp, k)
        else:
            # Gumbel-top-k: an ordered sample without replacement from exp(logp)
            g = -torch.empty_like(logp).exponential_(generator=self.ctx.generator).log()
            keys = logp + g
            _, idx = torch.topk(keys, k)
            idx = idx[torch.isfinite(logp[idx])]
            vals = logp[idx]
        return idx.tolist(), vals.tolist()

    # -------------------------------------------------------------- propose
    def propose(self, tokens: list[int], budget: int) -> TokenTree:
        t0 = time.perf_counter()
        if self.cache.n_pending:
            self.cache.rollback()
        new = tokens[self.n_cached :]
        if self.cache.room() < len(new):  # the draft's context is full: no draft, the target goes on alone
            self._tree_to_cand, self._last_depth = {}, 0
            return TokenTree()
        logits = self._feed(new)
        greedy = self.params.greedy
        k = min(self.top_k, budget)
        # candidate nodes: token, parent (candidate index), score, depth, logp row used
        cand_tok: list[int] = []
        cand_par: list[int] = []
        cand_score: list[float] = []
        qdist: dict[int, torch.Tensor] = {}
        logp = self._dist(logits)
        if not greedy:
            qdist[-1] = logp.exp()
        toks, vals = self._children(logp, k)
        frontier = []
        for t, v in zip(toks, vals):
            cand_tok.append(t)
            cand_par.append(-1)
            cand_score.append(v)
            frontier.append(len(cand_tok) - 1)
        self._pending_of = {}
        log_tau = math.log(self.tau) if self.adaptive else -math.inf
        depth = 1
        while depth < self.max_depth and frontier:
            frontier.sort(key=lambda c: -cand_score[c])
            expand = [c for c in frontier[: self.beam] if cand_score[c] >= log_tau]
            if not expand:
                break
            if self.cache.room() < len(expand):
                break  # near the end of the draft's context
            if not greedy and len(cand_tok) + len(expand) * k > budget:
                break  # sampled children are never pruned, so stop before exceeding the budget
            parents = []
            for c in expand:
                p = cand_par[c]
                parents.append(self._pending_of[p] if p >= 0 else -1)
            base = self.cache.n_pending
            inp = torch.tensor([cand_tok[c] for c in expand], device=self.draft.device)[None]
            out = self.draft.model.forward(inp, self.cache, parents=parents)[0, :, : self.vocab]
            self._draft_forwards += 1
            for j, c in enumerate(expand):
                self._pending_of[c] = base + j
            new_frontier = []
            for j, c in enumerate(expand):
                lp = self._dist(out[j])
                if not greedy:
                    qdist[c] = lp.exp()
                toks, vals = self._children(lp, k)
                for t, v in zip(toks, vals):
                    cand_tok.append(t)
                    cand_par.append(c)
                    cand_score.append(cand_score[c] + v)
                    new_frontier.append(len(cand_tok) - 1)
            frontier = new_frontier
            depth += 1
        # choose nodes
        n = len(cand_tok)
        if greedy and n > budget:
            keep = sorted(range(n), key=lambda c: (-cand_score[c], c))[:budget]
            keep_set = set(keep)
            # ties could drop a parent; make the set ancestor-closed
            for c in list(keep_set):
                p = cand_par[c]
                while p >= 0 and p not in keep_set:
                    keep_set.add(p)
                    p = cand_par[p]
            order = sorted(keep_set)[: max(budget, 0)]
            order = [c for c in order if cand_par[c] < 0 or cand_par[c] in set(order)]
        else:
            order = list(range(n))
        tree = TokenTree()
        index = {}
        for c in order:
            p = cand_par[c]
            index[c] = tree.add(cand_tok[c], index[p] if p >= 0 else -1, sampled=not greedy, source="draft")
        if not greedy:
            tree.q = {(index[c] if c >= 0 else -1): q for c, q in qdist.items() if c < 0 or c in index}
        self._tree_to_cand = {index[c]: c for c in order}
        self._last_depth = max(tree.depths(), default=-1) + 1
        self._time += time.perf_counter() - t0
        return tree

    # -------------------------------------------------------------- observe
    def observe(self, tokens, tree, verdict, logits) -> None:
        # keep the accepted draft nodes that the draft already forwarded
        path = []
        for node in verdict.accepted:
            cand = self._tree_to_cand.get(node)
            if cand is None or cand not in self._pending_of:
                break
            path.append(self._pending_of[cand])
        if path:
            self.cache.commit(path)
            self.n_cached += len(path)
        else:
            self.cache.rollback()
        if self.adaptive and self._last_depth > 0:
            accepted = len(verdict.accepted)
            if accepted >= self._last_depth:
                self.tau = max(self.tau * 0.7, 1e-4)
            elif accepted + 1 < self._last_depth:
                self.tau = min(self.tau * 1.15, 0.5)

    def end(self) -> None:
        if self.cache is not None:
            self.cache.rollback()

    def stats(self) -> dict:
        return {"draft_forwards": self._draft_forwards, "draft_tau": round(self.tau, 5)}
