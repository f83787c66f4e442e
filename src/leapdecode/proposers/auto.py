"""``method="auto"``: the default.  Uses what the model has, and learns online which
drafter earns the tree budget.

Arms (each one proposes a whole tree for one step):

* ``sam`` - the suffix automaton over prompt + generated text (model-free, microseconds); with
  ``copier="suffix"`` this arm is ``suffix`` instead: the request's own suffix trie
  (``suffix.py`` without its cross-request memory), whose frequency-scored branches and calibrated
  cut drafted better than the automaton's newest-occurrence chain when replayed on vanilla's
  outputs (``scripts/draft_ceiling.py --replay``), but in ``auto`` it ran at the automaton's speed
  (Spec-Bench dev 1.13x against 1.14x, HumanEval 1.34x both: docs/lab-notes/benchmarks.md section
  50), so it is not the default; the automaton still gives the bandit its context, the match length;
* ``hybrid`` - when a same-tokenizer draft model is available (the target's registered draft
  only while the target has no trained head: see ``registry._build_auto``; a named draft always):
  the draft model's dynamic
  tree (EAGLE-2 style) with the suffix automaton's continuation grafted onto it under the
  same node budget, as in the hybrid of "SAM Decoding: Speculative Decoding via Suffix
  Automaton" (Hu et al., 2024) and the retrieval + draft merge of "RASD:
  Retrieval-Augmented Speculative Decoding" (2025);
* ``head`` - when the model cache holds a trained head for the target (``leapdecode
  train-head``; the first of eagle3, eagle, hydra, medusa found, ``registry.AUTO_HEAD_KINDS``):
  that head's tree alone (``head_graft=True``: with the automaton's continuation grafted as in
  ``hybrid``; measured on qwen2.5-coder-1.5b, the graft added 18-27% rows per forward for no fewer
  forwards, and ``auto`` ran 3-4% faster without it on Spec-Bench dev and HumanEval).  The head reads
  the target's states from every verification forward (also on steps another arm drafted, so
  its context stays current; its acceptance counters then include those steps); an EAGLE head
  fuses and feeds them only when it next drafts, in one call;
* ``memory`` - with ``use_memory``: the runner's memory of earlier requests' outputs (the global
  tree of "SuffixDecoding: Extreme Speculative Decoding for Emerging AI Applications" (Oliaro
  et al., 2024), ``suffix.py``), offered on a step where the text's last tokens occur in it at
  least as long as in the request itself and at least ``MEMORY_MIN_MATCH`` tokens: many requests
  of one kind (an extraction pipeline, an agent loop) draft from what the earlier ones wrote.
  Every generation's output is added to that memory at its end (bounded, LRU);
* ``none`` - no draft (a vanilla step), so auto can never lose much to vanilla decoding.

Without a trained head (or with ``use_head=False``) the arms and behaviour are as before.

As in SAM Decoding, a match of at least ``sam_only_match`` tokens (default 12) uses the
automaton's draft alone.  The draft model reads only the first tokens and the last
``AUTO_DRAFT_WINDOW`` tokens (``common.py``) of a long prompt (``draft_model.py``'s ``context_window``): the
automaton copies from the whole text, and on a CPU the draft's prefill of a 1,400-token
retrieval prompt cost more than a short answer saved.  It reads them at the first step its arm
drafts (``defer_prefill``), so a generation in which the bandit never picks that arm pays nothing
for the draft model, and the arm that uses it is charged for the prefill.

Which arm runs is a contextual bandit, after "BanditSpec: Adaptive Speculative Decoding
via Bandit Algorithms" (Hou et al., 2025): the reward of a step is the number of tokens it
emitted divided by its wall time (draft + verify: from its ``propose`` to the end of its
``observe``, so steps that ran without a proposal in between -- a batched engine's plain
steps, tokens a grammar forced -- are not charged to the arm; nor is the head's catching up on
the prompt and on the steps other arms drafted, ``catchup_seconds``: charged to the head's first
step, the prompt's feed alone halved the reward of that step on short answers, and the bandit
then kept away from the head on text where it paid), the context is how long the
suffix automaton's current match is (a long match predicts that copying pays off, whatever
the draft model says), and the policy is UCB1 on exponentially discounted means, so that it
follows a text that changes character (prose to code to a repeated list).  The statistics live in the runner's memory, so later
generations on the same target start from what earlier ones learned.

Every arm proposes an ordinary token tree, so auto is exactly as lossless as the
verifier: greedy output is vanilla's, and sampling keeps the target distribution (draft
nodes are sampled children with their draft distribution, grafted automaton nodes are
deterministic children).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from ..core.tree import TokenTree
from ..core.proposer import DecodeContext, MemoryKey, Proposer
from ..core.running_mean import discounted_mean
from .sam import MATCH_BUCKETS, SuffixAutomatonProposer, match_bucket
from .suffix import SuffixDecodingProposer
from .configs import AutoConfig

MEMORY_MIN_MATCH = 4  # the memory arm is offered where its match is at least this long


@dataclass(frozen=True)
class Arm:
    """One of ``auto``'s drafting arms: its name in the bandit (``"sam"`` or ``"suffix"`` for the
    copying arm, ``"hybrid"``, ``"head"``, ``"memory"``) and the proposer that drafts for it."""

    name: str
    proposer: Proposer


def graft(tree: TokenTree, chain: list[int], budget: int, source: str) -> int:
    """Add ``chain`` (a continuation of the root) to ``tree`` as a trie path, sharing the
    nodes it matches; new nodes are appended (existing indices never change) while the
    tree has fewer than ``budget`` nodes.  Returns the number of nodes added."""
    parent, added = -1, 0
    for t in chain:
        node = tree.find_child(parent, t)
        if node < 0:
            if len(tree) >= budget:
                break
            node = tree.add(t, parent, sampled=False, source=source)
            added += 1
        parent = node
    return added


class BanditStats:
    """Discounted reward means and counts per (context, arm); UCB1 picks the arm.  ``discount`` and
    ``explore`` come from ``AutoConfig`` (0.99 and 0.15, chosen in docs/lab-notes/benchmarks.md
    section 3, "`auto`, revised policy"), written there once.  The discount applies to the counts;
    the mean takes each reward with weight ``1 / count`` of the discounted count."""

    def __init__(self, arms: list[str], discount: float, explore: float) -> None:
        self.arms = arms
        self.discount = discount
        self.explore = explore
        self.n: dict[tuple[int, str], float] = {}
        self.mean: dict[tuple[int, str], float] = {}

    def choose(self, ctx: int, arms: list[str] | None = None) -> str:
        arms = arms or self.arms
        untried = [a for a in arms if self.n.get((ctx, a), 0.0) < 1.0]
        if untried:
            return untried[0]
        total = sum(self.n[(ctx, a)] for a in arms)
        best = max(self.mean[(ctx, a)] for a in arms) or 1.0

        def ucb(a: str) -> float:
            # rewards are tokens/s; scale the exploration bonus by the best mean so it is unit-free
            return self.mean[(ctx, a)] + self.explore * best * math.sqrt(math.log(total + 1) / self.n[(ctx, a)])

        return max(arms, key=ucb)

    def update(self, ctx: int, arm: str, reward: float) -> None:
        for a in self.arms:  # discount this context's evidence so the bandit tracks a drifting text
            if (ctx, a) in self.n:
                self.n[(ctx, a)] *= self.discount
        key = (ctx, arm)
        self.n[key] = n = self.n.get(key, 0.0) + 1.0
        self.mean[key] = discounted_mean(self.mean.get(key, 0.0), reward, 0.0, n)  # weight 1 / n

    def snapshot(self) -> dict[str, Any]:
        return {f"{a}@{MATCH_BUCKETS[c]}+": [round(self.mean[(c, a)], 2), round(self.n[(c, a)], 1)]
                for (c, a) in sorted(self.n)}


class AutoProposer(Proposer):
    name = "auto"

    def __init__(self, draft_proposer: Proposer | None = None, tree_budget: int | None = None,
                 sam_len: int = AutoConfig.sam_len, sam_only_match: int = AutoConfig.sam_only_match,
                 explore: float = AutoConfig.explore, discount: float = AutoConfig.discount,
                 head_proposer: Proposer | None = None,
                 memory_proposer: SuffixDecodingProposer | None = None,
                 head_graft: bool = AutoConfig.head_graft,
                 copier_proposer: SuffixDecodingProposer | None = None) -> None:
        """``copier_proposer``: the copying arm's drafter instead of the automaton (the request's own
        suffix trie, ``copier="suffix"``); the automaton still measures the match length."""
        self.sam_only_match = sam_only_match
        self.head_graft = head_graft  # the automaton's continuation grafted onto the head arm's tree too
        self.sam = SuffixAutomatonProposer(draft_len=sam_len)
        self.copier: Proposer = copier_proposer if copier_proposer is not None else self.sam
        self.copy_arm = self.copier.name  # "sam" or "suffix"
        self.draft = draft_proposer
        self.head = head_proposer  # over a trained head
        self.memory = memory_proposer  # earlier requests' outputs (``local=False``: the memory alone)
        # the drafting arms, in the order they begin, end and are offered to the bandit
        self.drafting = [Arm(name, p) for name, p in ((self.copy_arm, self.copier), ("hybrid", draft_proposer),
                                                      ("head", head_proposer), ("memory", memory_proposer))
                         if p is not None]
        self.arms = [arm.name for arm in self.drafting] + ["none"]
        self.discount, self.explore = discount, explore
        self.bandit: BanditStats | None = None  # the runner's, shared by this target's generations
        self.default_budget = tree_budget or getattr(draft_proposer, "default_budget", None) \
            or getattr(head_proposer, "default_budget", None) or AutoConfig.default_tree_budget
        self._pending: tuple[int, str, int] | None = None
        self._t_step = 0.0
        self._t_end: float | None = None  # when the pending step's observe() finished
        self._draft_live = False
        self._uses: dict[str, int] = {}

    @property
    def cost_aware(self) -> bool:
        """Any of its drafters sizes by cost (each arm decides its own use: ``sizing_cost``)."""
        return self.sam.cost_aware or any(arm.proposer.cost_aware for arm in self.drafting)

    def prompt_features(self) -> int:
        return self.head.prompt_features() if self.head is not None else 0

    def observe_prompt(self, start: int, hidden) -> None:
        if self.head is not None:
            self.head.observe_prompt(start, hidden)

    def wants_hidden(self) -> bool:
        return self.head is not None  # every step: the head's features stay current

    def begin(self, ctx: DecodeContext, tokens: list[int]) -> None:
        super().begin(ctx, tokens)
        # wall-time rewards and statistics learned by earlier runs steer every run, seeded sampling
        # too: its text does not depend on which arm drafted (drafter-invariant sampling)
        self.bandit = ctx.remember(MemoryKey("auto", "bandit", (tuple(self.arms), self.discount, self.explore)),
                                   lambda: BanditStats(self.arms, discount=self.discount, explore=self.explore))
        self.sam.begin(ctx, tokens)
        for arm in self.drafting:
            if arm.proposer is not self.sam:
                arm.proposer.begin(ctx, tokens)
        self._pending = None

    def _arms_for(self, match_len: int, memory_len: int) -> list[str]:
        """SAM Decoding's rule: past ``sam_only_match`` matched tokens the automaton's draft is
        used alone (a long match is cheap and rarely wrong); below it the bandit decides,
        trying the arm the match length suggests first.  Where the automaton sizes its chains by
        cost (greedy with a measured profile) it drafts nothing when nothing is worth its rows, so
        the ``none`` arm is left out: it could only take steps away from chains worth drafting.
        The memory arm is offered only where the memory matches at least ``MEMORY_MIN_MATCH``
        tokens and no fewer than the request's own text."""
        arms = self.bandit.arms
        if self.sam.sizes_by_cost:
            arms = [a for a in arms if a != "none"]
        if "memory" in arms and (memory_len < MEMORY_MIN_MATCH or memory_len < match_len):
            arms = [a for a in arms if a != "memory"]
        if match_len >= self.sam_only_match:
            return [self.copy_arm]
        if match_len >= MATCH_BUCKETS[2]:
            return arms
        return sorted(arms, key=lambda a: a == self.copy_arm)  # no or a short match: the draft model first

    def _close_step(self) -> None:
        """Credit the previous step's arm with tokens per second, now that its time is known."""
        if self._pending is not None:
            ctx, arm, emitted = self._pending
            end = self._t_end if self._t_end is not None else time.perf_counter()
            elapsed = end - self._t_step
            if elapsed > 0:
                self.bandit.update(ctx, arm, emitted / elapsed)
            self._pending = None

    def propose(self, tokens: list[int], budget: int) -> TokenTree:
        self._close_step()
        self._t_step = time.perf_counter()
        self._t_end = None
        self.sam.sync(tokens)
        found = self.sam.matches()
        match_len = found[0][0] if found else 0
        memory_len = self.memory.memory_match(tokens) if self.memory is not None else 0
        ctx = match_bucket(match_len)
        arm = self.bandit.choose(ctx, self._arms_for(match_len, memory_len))
        self._arm, self._ctx = arm, ctx
        self._uses[arm] = self._uses.get(arm, 0) + 1
        self._draft_live = False
        if arm == "none" or budget < 1:
            return TokenTree()
        if arm == self.copy_arm:
            return self.copier.propose(tokens, budget)
        if arm == "memory":
            return self.memory.propose(tokens, budget)
        chain = found[0][2] if found and (arm == "hybrid" or self.head_graft) else []
        if chain:  # as much of the automaton's continuation as is worth verifying on its own
            chain = chain[: self.sam.worth_drafting(match_len, len(chain))]
        reserve = min(len(chain), budget // 3)  # room for the automaton's continuation
        drafter = self.head if arm == "head" else self.draft
        tree = drafter.propose(tokens, max(budget - reserve, 1))
        # a drafter's catching up on the prompt and other arms' steps is no arm's cost (the head's;
        # the draft model reports none: its deferred prefill is charged to the hybrid arm)
        self._t_step += drafter.catchup_seconds()
        self._draft_live = arm == "hybrid"
        if chain:
            graft(tree, chain, budget, "sam")
        return tree

    def observe(self, tokens, tree, verdict, logits, hidden=None) -> None:
        self._pending = (self._ctx, self._arm, len(verdict.accepted) + 1)
        if self._arm == self.copy_arm:
            self.copier.observe(tokens, tree, verdict, logits)
        if self._draft_live:
            self.draft.observe(tokens, tree, verdict, logits)
        if self.head is not None:
            self.head.observe(tokens, tree, verdict, logits, hidden)
        if self.memory is not None:
            self.memory.observe(tokens, tree, verdict, logits)  # the text so far: what ``end`` remembers
        self._t_end = time.perf_counter()

    def end(self) -> None:
        self._close_step()
        for arm in self.drafting:  # (the memory arm's: this generation's output joins the memory)
            if arm.proposer is not self.sam:
                arm.proposer.end()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"auto_arms": dict(self._uses), "auto_bandit": self.bandit.snapshot()}
        if self.draft is not None:
            out.update(self.draft.stats())
        if self.head is not None:
            out.update(self.head.stats())
        if self.memory is not None:
            out["auto_memory_tokens"] = self.memory.stats()["suffix_memory_tokens"]
        return out
