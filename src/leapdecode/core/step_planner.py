"""A generation's step planner (issue 48 item 1): what its next decoding forward verifies.

Each step the planner sizes the draft tree (the method's budget, bounded by the cache's room, the
tokens still wanted and a scheduler's cap), asks the proposer for a tree, or, where a grammar
forces the next tokens, drafts them itself (``Constraint.forced``: no proposer time); prunes what
the grammar forbids (``prune_tree``) and extends the surviving path with what it forces after it
(``extend_forced``); and hands back the ``Forward`` of the root and the tree.  The proposer only
proposes: verifying, committing and letting the proposer observe is the committer's part
(``core/committer.py``).  Time spent here is counted on the generation's ``OutputProcessor``.

The planner owns the one gate of cost-aware tree sizing (``begin``): under greedy decoding, where
any tree gives vanilla's tokens and a clock may steer it, a proposer that sizes its trees by cost
(``Proposer.cost_aware``) gets the target's measured verification cost (``ctx.verify_cost``, the
only place it is set in a generation); under sampling it never does, so a seeded run's trees never
depend on a clock.  A step's forward run alone (``run``) teaches that profile its time.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from .constraint import Constraint, extend_forced, prune_tree
from .cost_model import synchronize
from .task import Forward
from .tree import TokenTree

if TYPE_CHECKING:
    from .cost_model import VerifyCost
    from .output import OutputProcessor
    from .proposer import DecodeContext, Proposer


class StepPlanner:
    """Plans a generation's decoding steps: ``proposer`` (None: nothing is drafted) proposes trees
    of at most ``tree_budget`` nodes, ``constraint`` (None: none) forces and prunes them."""

    def __init__(self, proposer: "Proposer | None", constraint: Constraint | None, tree_budget: int,
                 device: Any, out: "OutputProcessor") -> None:
        self.proposer, self.constraint, self.tree_budget = proposer, constraint, tree_budget
        self.device, self.out = device, out
        self.verify_cost: "VerifyCost | None" = None  # what the trees are sized by (``begin``'s gate)

    def begin(self, ctx: "DecodeContext", tokens: list[int]) -> None:
        """The generation decodes from here (``tokens``: the prompt, its last token the root): the
        proposer begins, given the measured verification cost where the gate holds (see the module
        docstring)."""
        if self.proposer is None:
            return
        if self.proposer.cost_aware and ctx.params.greedy:
            self.verify_cost = ctx.verify_cost = ctx.runner.verify_cost(ctx.cache)
        self.proposer.begin(ctx, tokens)

    def run(self, work: Forward) -> torch.Tensor:
        """``work``'s forward alone, on its own decoder and cache; a decoding step's teaches the
        measured profile its time where the profile learns (greedy tree sizes follow it)."""
        cost = self.verify_cost if work.tree is not None else None
        if cost is None or not cost.learn:
            return work.run()
        t0 = time.perf_counter()
        logits = work.run()
        synchronize(logits.device)
        cost.observe(work.tokens.numel(), time.perf_counter() - t0)
        return logits

    def budget(self, room: int, remaining: int, cap: int | None) -> int:
        """Nodes this step may draft: the method's budget, within the cache's ``room`` beyond the
        root, the ``remaining`` tokens wanted (the root's token is one) and a scheduler's ``cap``."""
        budget = min(self.tree_budget, room - 1, max(remaining - 1, 0))
        return budget if cap is None else min(budget, max(cap, 0))

    def plan(self, tokens: list[int], cache: Any, budget: int) -> Forward:
        """The forward of the root (``tokens[-1]``, not yet in ``cache``) and a tree of at most
        ``budget`` nodes drafted after ``tokens``."""
        proposer, constraint = self.proposer, self.constraint
        t0 = time.perf_counter()
        forced = constraint.forced(budget) if constraint is not None and proposer is not None and budget > 0 else []
        t_grammar = time.perf_counter() - t0
        proposed = proposer is not None and budget > 0 and not forced  # observe() follows only a propose()
        if forced:
            tree = TokenTree.chain(forced, source="grammar")
        else:
            tree = proposer.propose(tokens, budget) if proposed else TokenTree()
        if cache.n_pending:
            raise RuntimeError(f"proposer {proposer.name!r} left {cache.n_pending} nodes pending in the target's "
                               "cache; a proposer must roll back what it appends")
        tree = tree.truncated(max(budget, 0))
        drafted, kept = tree, None
        if constraint is not None and len(tree):
            t1 = time.perf_counter()
            tree, kept = prune_tree(tree, constraint)
            if proposed and len(tree) < budget:  # what the grammar forces after the drafted path
                extended = tree if kept is not None else tree.copy()
                if extend_forced(extended, constraint, budget - len(tree)):
                    kept = kept if kept is not None else list(range(len(tree)))
                    tree = extended
            t_grammar += time.perf_counter() - t1
        self.out.constraint_s += t_grammar
        hidden = [] if proposed and proposer.wants_hidden() else None
        chain = all(p == i - 1 for i, p in enumerate(tree.parents))
        flat = torch.tensor([tokens[-1]] + tree.tokens, device=self.device)
        self.out.draft_s += time.perf_counter() - t0
        return Forward(flat, None if chain else tree.flattened_parents(), tree=tree, hidden=hidden,
                       t0=time.perf_counter(), proposed=proposed, drafted=drafted if kept is not None else None,
                       kept=kept)
