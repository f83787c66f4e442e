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
* **Adaptive draft length and tree size, from costs** (greedy): SpecDec++
  ("SpecDec++: Boosting Speculative Decoding via Adaptive Candidate Lengths",
  Huang et al., 2024) stops drafting when the predicted chance of a rejection
  outweighs the cost of one more draft forward, and Sequoia sizes the tree for
  the hardware.  We do both with measured costs: the target's verification
  cost per tree size (``core/cost_model.py``) and the draft forward's time, and
  an acceptance probability per node (its draft probability, calibrated online
  against the verdicts: SpecDec++ trains an acceptance head, we have no
  training data, so a binned calibration stands in).  Another draft level is
  run only while it raises the expected tokens per second of the step, and the
  verified tree is the prefix of the candidates (best first) that maximises it.
  Under sampling (seeded runs must be reproducible, so no clock may steer them)
  drafting stops when the best frontier node's cumulative probability falls
  below a threshold tau, learned online from the verdicts.
* **A frequency-ranked draft vocabulary** ("FR-Spec: Accelerating
  Large-Vocabulary Language Models via Frequency-Ranked Speculative Sampling",
  Zhao et al., 2025): with a 152k-token vocabulary the draft's output
  projection is a third of its forward.  The draft scores only the
  ``draft_vocab`` most frequent tokens plus every token of the prompt.  FR-Spec
  counts frequencies on a corpus; we have none offline, and a BPE tokenizer's
  ids follow its merge order, which is a frequency ranking of its training
  corpus, so the subset is the lowest ids.  A token outside the subset can
  still be emitted (the target's bonus token), just not drafted.
* **Staged speculation** ("Accelerating LLM Inference with Staged Speculative
  Decoding", Spector & Re, 2023; the phrase reuse of "Ouroboros", Zhao et al.,
  2024), greedy: a suffix automaton over the text speculates for the draft
  model.  Its continuation runs through the draft in one forward, and every
  guessed token that is among the draft's top-k children of the one before
  counts as a drafted level, with the draft's own children at each of them:
  one draft forward instead of several when the text repeats itself.
* **A bounded draft context** (``context_window``): the draft reads only the
  first ``ATTENTION_SINK`` tokens of a long prompt and its last
  ``context_window`` tokens, as in "Efficient Streaming Language Models with
  Attention Sinks" (StreamingLLM, Xiao et al., 2023).  Its prefill is then
  bounded: on a CPU a 0.5B draft's prefill of a 1,400-token prompt costs
  about as much as decoding 15 tokens with the target, which a short answer
  never earns back.  Long-range copying is the suffix automaton's job (staged
  speculation, ``auto``'s hybrid).  The target always sees everything, so the
  window changes only how good the drafts are, never the output.

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

from .tree_cost import TreeSizer
from ..core.sampling import SamplingParams, target_probs
from ..core.tree import TokenTree
from ..errors import InvalidParameterError
from ..core.proposer import DecodeContext, Identity, MemoryKey, Proposer, feed_committed
from .common import ATTENTION_SINK, coupled_first, draw_children, subset_head
from .configs import DraftConfig


class DraftModelProposer(Proposer):
    name = "draft"

    # Sampling's adaptive threshold ``tau`` (a candidate is expanded while its path probability is at
    # least it): after a step accepted as deep as its tree went it is lowered, after one that stopped
    # more than a level short it is raised.  Not measured; kept as they were since the first draft proposer (aa2d333).
    TAU_SHRINK, TAU_GROW = 0.7, 1.15
    TAU_MIN, TAU_MAX = 1e-4, 0.5

    def __init__(
        self,
        draft,  # LoadedModel
        tree_budget: int | None = None,
        top_k: int = DraftConfig.top_k,
        beam: int = DraftConfig.beam,
        max_depth: int = DraftConfig.max_depth,
        adaptive: bool = DraftConfig.adaptive,
        tau: float = DraftConfig.tau,
        draft_vocab: int = DraftConfig.draft_vocab,
        staged: bool = DraftConfig.staged,
        context_window: int | None = DraftConfig.context_window,
        defer_prefill: bool = False,
    ) -> None:
        for name, v in (("top_k", top_k), ("beam", beam), ("max_depth", max_depth)):
            if not isinstance(v, int) or v < 1:
                raise InvalidParameterError(f"{name} must be an integer >= 1, got {v}")
        if not isinstance(draft_vocab, int) or draft_vocab < 0:
            raise InvalidParameterError(f"draft_vocab must be an integer >= 0 (0: the whole vocabulary), got {draft_vocab}")
        if not 0 < tau < 1:
            raise InvalidParameterError(f"tau must be in (0, 1), got {tau}")
        if context_window is not None and (not isinstance(context_window, int) or context_window < 1):
            raise InvalidParameterError(
                f"context_window must be an integer >= 1 or None (the whole prompt), got {context_window}")
        self.context_window = context_window
        # prefill the draft's prompt at the first propose() instead of in begin(): for a caller that
        # may not draft with it at all in a generation (auto's hybrid arm), so a generation that never
        # uses the draft never pays its prefill, and the arm that does is charged for it
        self.defer_prefill = defer_prefill
        self._prompt: list[int] | None = None  # the prompt still to prefill (deferred)
        self.draft = draft
        self.default_budget = tree_budget or DraftConfig.default_tree_budget
        self.top_k, self.beam, self.max_depth = top_k, beam, max_depth
        self.adaptive = adaptive
        self.tau = tau
        self.draft_vocab = draft_vocab
        self.staged = None
        if staged:
            from .sam import SuffixAutomatonProposer

            self.staged = SuffixAutomatonProposer(draft_len=max_depth, cost_aware=False)
        self._staged_forwards = self._staged_tokens = 0
        self.cache = None
        self._time = 0.0
        self._draft_forwards = 0

    @property
    def cost_aware(self) -> bool:
        """Greedy trees sized by measured cost (``adaptive``; sampling's trees adapt ``tau`` instead)."""
        return self.adaptive

    # ---------------------------------------------------------------- setup
    def begin(self, ctx: DecodeContext, tokens: list[int]) -> None:
        super().begin(ctx, tokens)
        # a cache of the runner's for this generation (a draft that is the target itself gets its own)
        self.cache = ctx.acquire_cache(self.draft, ctx.prompt_len + ctx.max_new_tokens + 256)
        self.n_cached = 0  # how many of the decided tokens the draft cache has seen (or skipped)
        self.params: SamplingParams = ctx.params
        self.vocab = min(ctx.target.model.vocab_size, self.draft.model.vocab_size)
        if self.staged is not None and ctx.params.greedy:  # staging drafts greedy trees only
            self.staged.begin(ctx, tokens)
        self.head = subset_head(ctx, self.draft, self.draft_vocab, tokens, self.vocab) if self.draft_vocab else None
        # how this draft's probabilities translate into this target's acceptances, and what a draft
        # forward costs: learned across generations, kept in the runner's memory (per draft model)
        self.sizer = ctx.remember(MemoryKey("draft", "tree_sizer", of=Identity(self.draft.model)),
                                  lambda: (TreeSizer(), self.draft.model))[0]
        self._pending_of: dict[int, int] = {}
        # prefill all but the root now (deferred: at the first propose), or the sink and the window of a
        # long prompt, so that propose only feeds the root; n_cached counts tokens seen, skipped or not
        self._prompt = list(tokens)
        if not self.defer_prefill:
            self._prefill()

    def _prefill(self) -> None:
        """Feed the prompt but its last token (the root) to the draft: all of it, or the attention sink
        and the last ``context_window`` tokens of a long prompt."""
        tokens, self._prompt = self._prompt, None
        prompt = tokens[:-1]
        window = self.context_window
        if window is not None and len(prompt) > ATTENTION_SINK + window:
            prompt = prompt[:ATTENTION_SINK] + prompt[-window:]
        if prompt and len(prompt) < self.cache.max_len:  # (a prompt the draft cannot hold: propose() drafts nothing)
            self._feed(prompt, want_logits=False)
            self.n_cached = len(tokens) - 1

    def _feed(self, new: list[int], want_logits: bool = True) -> torch.Tensor | None:
        logits, _ = feed_committed(self.draft, self.cache, new, want_logits, head=self.head)
        self._draft_forwards += 1
        self.n_cached += len(new)
        return None if logits is None else self._cut(logits)

    def _cut(self, logits: torch.Tensor) -> torch.Tensor:
        return logits if self.head is not None else logits[..., : self.vocab]

    def _ids(self, idx: list[int]) -> list[int]:
        """Vocabulary ids of positions in the draft's logits (they differ under a subset head)."""
        if self.head is None:
            return idx
        return self.head.ids[torch.tensor(idx, dtype=torch.long)].tolist() if idx else []

    def _full(self, p: torch.Tensor) -> torch.Tensor:
        """A draft distribution over the whole (shared) vocabulary, zero outside the subset."""
        if self.head is None:
            return p
        out = torch.zeros(self.vocab, dtype=p.dtype, device=p.device)
        return out.index_copy_(0, self.head.ids, p)

    def _dist(self, logits: torch.Tensor) -> torch.Tensor:
        """Log-probabilities that rank candidates (greedy) or that children are drawn from (sampling)."""
        if self.params.greedy:
            return logits.float().log_softmax(-1)
        return target_probs(logits, self.params).clamp_min(0).log()

    def _children(self, logp: torch.Tensor, k: int, u: float | None = None) -> tuple[list[int], list[float]]:
        """``k`` children as (vocabulary ids, draft log-probabilities): ``draw_children``, with
        (drafter-invariant sampling, ``u`` the number the target draws this position's token with)
        the draft's own draw with that number first (``coupled_first``)."""
        first = None if self.params.greedy else coupled_first(logp, u, self.head.ids if self.head is not None else None)
        idx, vals = draw_children(logp, k, self.params, self.ctx.generator, first)
        return self._ids(idx), vals

    # -------------------------------------------------------------- propose
    def propose(self, tokens: list[int], budget: int) -> TokenTree:
        t0 = time.perf_counter()
        if self.cache.n_pending:
            self.cache.rollback()
        if self._prompt is not None:  # deferred from begin()
            self._prefill()
        self._t_step = time.perf_counter()  # the step's own time starts after a deferred prefill
        new = tokens[self.n_cached :]
        if self.cache.room() < len(new):  # the draft's context is full: no draft, the target goes on alone
            self._tree_to_cand, self._last_depth = {}, 0
            return TokenTree()
        t_root = time.perf_counter()
        logits = self._feed(new)
        greedy = self.params.greedy
        k = min(self.top_k, budget)
        # candidates: token, parent (candidate index), score, draft probability given the parent.
        # The score ranks candidates: the cumulative log-probability, calibrated to acceptance
        # probabilities when the cost model steers the tree.
        cand_tok: list[int] = []
        cand_par: list[int] = []
        cand_score: list[float] = []
        cand_p: list[float] = []
        cand_depth: list[int] = []  # 0: a child of the root
        qdist: dict[int, torch.Tensor] = {}
        verify = self.sizing_cost()
        sizer = self.sizer if verify is not None else None

        def add_children(parent: int, lp: torch.Tensor) -> list[int]:
            if not greedy:
                qdist[parent] = self._full(lp.exp())
            base = cand_score[parent] if parent >= 0 else 0.0
            depth = cand_depth[parent] + 1 if parent >= 0 else 0
            added = []
            for t, v in zip(*self._children(lp, k, self.ctx.uniform(len(tokens) + depth))):
                p = math.exp(v)
                cand_tok.append(t)
                cand_par.append(parent)
                cand_depth.append(depth)
                cand_p.append(p)
                cand_score.append(base + (sizer.log_accept(p) if sizer is not None else v))
                added.append(len(cand_tok) - 1)
            return added

        frontier = add_children(-1, self._dist(logits))
        # the root's forward is measured too (its time, and its best child when sized by cost): the
        # sizer learns at every step, not only when it drafts deeper (it could stop for good)
        self.sizer.note_forward(time.perf_counter() - t_root, [cand_p[c] for c in frontier] if sizer is not None else [])
        self._pending_of = {}
        log_tau = math.log(self.tau) if self.adaptive and verify is None else -math.inf
        depth = 1
        if self.staged is not None and greedy:
            frontier, depth = self._staged_guess(tokens, frontier, cand_tok, add_children)
        while depth < self.max_depth and frontier:
            frontier.sort(key=lambda c: -cand_score[c])
            expand = [c for c in frontier[: self.beam] if cand_score[c] >= log_tau]
            if not expand:
                break
            if self.cache.room() < len(expand):
                break  # near the end of the draft's context
            if not greedy and len(cand_tok) + len(expand) * k > budget:
                break  # sampled children are never pruned, so stop before exceeding the budget
            if sizer is not None and not sizer.worth_expanding(cand_score, [cand_score[c] for c in expand], budget,
                                                               time.perf_counter() - t0, verify):
                break
            parents = [self._pending_of[cand_par[c]] if cand_par[c] >= 0 else -1 for c in expand]
            base = self.cache.n_pending
            inp = torch.tensor([cand_tok[c] for c in expand], device=self.draft.device)[None]
            t1 = time.perf_counter()
            out = self._cut(self.draft.model.forward(inp, self.cache, parents=parents, head=self.head)[0])
            self._draft_forwards += 1
            for j, c in enumerate(expand):
                self._pending_of[c] = base + j
            frontier = []
            for j, c in enumerate(expand):
                frontier += add_children(c, self._dist(out[j]))
            # the draft forward's time (always), and its best child's acceptance (when sized by cost)
            self.sizer.note_forward(time.perf_counter() - t1, [cand_p[c] for c in frontier] if sizer is not None else [])
            depth += 1
        # choose nodes
        n = len(cand_tok)
        if greedy and sizer is not None:
            keep_n = sizer.size(cand_score, budget, verify, time.perf_counter() - t0)
        else:
            keep_n = budget
        if greedy and n > keep_n:
            keep_set = set(sorted(range(n), key=lambda c: (-cand_score[c], c))[:keep_n])
            # ties could drop a parent; make the set ancestor-closed
            for c in list(keep_set):
                p = cand_par[c]
                while p >= 0 and p not in keep_set:
                    keep_set.add(p)
                    p = cand_par[p]
            order = sorted(keep_set)[: max(keep_n, 0)]
            kept = set(order)
            order = [c for c in order if cand_par[c] < 0 or cand_par[c] in kept]
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
        self._cand_p = cand_p
        self._last_depth = max(tree.depths(), default=-1) + 1
        self._time += time.perf_counter() - t0
        return tree

    def _staged_guess(self, tokens, frontier, cand_tok, add_children) -> tuple[list[int], int]:
        """Staged speculation: the suffix automaton's continuation, run through the draft in one
        forward, stands in for as many sequential draft forwards as the draft agrees with it
        (each guessed token must be among the draft's top-k children of the one before).
        Returns the unexpanded candidates and the number of levels drafted."""
        self.staged.sync(tokens)
        found = self.staged.matches()
        guess = found[0][2][: self.max_depth - 1] if found else []
        node = next((c for c in frontier if cand_tok[c] == guess[0]), None) if guess else None
        if node is None or self.cache.room() < len(guess):
            return frontier, 1
        base = self.cache.n_pending
        parents = [-1] + [base + i for i in range(len(guess) - 1)]
        inp = torch.tensor([guess], device=self.draft.device)
        out = self._cut(self.draft.model.forward(inp, self.cache, parents=parents, head=self.head)[0])
        self._draft_forwards += 1
        self._staged_forwards += 1
        expanded, levels = set(), 1
        for i in range(len(guess)):
            self._pending_of[node] = base + i
            expanded.add(node)
            children = add_children(node, self._dist(out[i]))
            levels += 1
            nxt = guess[i + 1] if i + 1 < len(guess) else None
            node = next((c for c in children if cand_tok[c] == nxt), None)
            if node is None:
                break
            self._staged_tokens += 1
        return [c for c in range(len(cand_tok)) if c not in expanded], levels

    # -------------------------------------------------------------- observe
    def observe(self, tokens, tree, verdict, logits, hidden=None) -> None:
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
        if self.sizing_cost() is not None:
            # calibrate: every verified draft node whose parent was accepted had its chance (tree node i
            # is the i-th kept candidate, matched by position as it always was: its token is the tree's)
            n = min(len(tree), len(self._tree_to_cand))  # beyond: cut by the loop's budget, never verified
            self.sizer.learn([(tree.tokens[node], self._cand_p[self._tree_to_cand[node]]) for node in range(n)],
                             tree, verdict.accepted)
            if self._tree_to_cand:
                self.sizer.note_step(len(verdict.tokens), time.perf_counter() - self._t_step)
        elif self.adaptive and self._last_depth > 0:
            accepted = len(verdict.accepted)
            if accepted >= self._last_depth:
                self.tau = max(self.tau * self.TAU_SHRINK, self.TAU_MIN)
            elif accepted + 1 < self._last_depth:
                self.tau = min(self.tau * self.TAU_GROW, self.TAU_MAX)

    def end(self) -> None:
        if self.cache is not None:
            self.cache.rollback()

    def stats(self) -> dict:
        out = {"draft_forwards": self._draft_forwards, "draft_tau": round(self.tau, 5)}
        if self.staged is not None:
            out.update(staged_forwards=self._staged_forwards, staged_tokens=self._staged_tokens)
        return out
