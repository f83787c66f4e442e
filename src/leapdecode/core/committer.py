"""A generation's committer (issue 48 item 1): what a decoding forward's logits decide.

The one verifier (``core/verifier.py``) walks the tree against the target's logits, under the
grammar's masks when there is a grammar (``RowMasks``) and with each position's own uniform number
in a seeded sampling generation; the committer then keeps the accepted path in the KV cache (the
root and the accepted nodes; the rest is dropped), tells a KV-cache policy, cuts the step's tokens
at an end-of-sequence token or the token limit, pushes them through the grammar, and lets the
proposer observe the verdict (in its own tree's numbering when the grammar pruned it).  Showing the
text and deciding on stop strings is the output processor's part (``core/output.py``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from .constraint import Constraint, RowMasks, unprune
from .verifier import Verdict, verify

if TYPE_CHECKING:
    from .kv_policy import PolicyState
    from .output import OutputProcessor
    from .proposer import DecodeContext, Proposer
    from .task import Forward


class Committer:
    """Commits a generation's decoding steps into ``ctx.cache`` (see the module docstring):
    ``proposer`` observes them, ``constraint`` and ``kv`` (a KV-cache policy's state) follow them,
    ``out`` counts them.  ``tokens``: every token decided so far, prompt first."""

    def __init__(self, ctx: "DecodeContext", proposer: "Proposer | None", constraint: Constraint | None,
                 kv: "PolicyState | None", out: "OutputProcessor", tokens: list[int]) -> None:
        self.ctx, self.params, self.eos = ctx, ctx.params, ctx.target.eos_token_ids
        self.proposer, self.constraint, self.kv, self.out = proposer, constraint, kv, out
        # the repetition penalty reads every token decided so far
        self.history = torch.tensor(tokens, device=ctx.target.device) if ctx.params.repetition_penalty != 1.0 else None

    def commit(self, work: "Forward", logits: torch.Tensor, tokens: list[int],
               generated: list[int]) -> tuple[list[int], str | None]:
        """Decide ``work``'s step from its ``logits`` (``[1 + len(tree), vocab]``): extends ``tokens``
        with what it emits and ``generated`` with what it keeps; returns the kept tokens and the
        finish reason ("stop": an end-of-sequence token, "length": the limit; None: go on)."""
        ctx, tree, hidden, constraint, out = self.ctx, work.tree, work.hidden, self.constraint, self.out
        masks = RowMasks(constraint, tree) if constraint is not None else None
        try:
            start = len(tokens)
            uniform = (lambda depth: ctx.uniform(start + depth)) if ctx.drafter_invariant else None
            verdict = verify(tree, logits, self.params, self.history, ctx.generator, allowed=masks, uniform=uniform)
        finally:
            if masks is not None:
                masks.close()
                out.constraint_s += masks.seconds
        path = [0] + [a + 1 for a in verdict.accepted]
        ctx.cache.commit(path)
        if self.kv is not None:
            self.kv.committed(path, "decode")
        out.verify_s += time.perf_counter() - work.t0
        out.count_step(len(tree), len(verdict.accepted))
        finish, kept = None, []
        for t in verdict.tokens:
            if t in self.eos:
                finish = "stop"
                break
            if constraint is not None:
                t1 = time.perf_counter()
                constraint.push(t)
                out.constraint_s += time.perf_counter() - t1
            kept.append(t)
            if len(generated) + len(kept) >= ctx.max_new_tokens:
                finish = "length"
                break
        generated.extend(kept)
        out.decided += len(kept) + (finish == "stop")  # the end-of-sequence token was decided too
        tokens.extend(verdict.tokens)
        if self.history is not None:
            self.history = torch.tensor(tokens, device=self.history.device)
        if work.proposed and finish is None:
            t2 = time.perf_counter()
            if work.kept is not None:  # the grammar pruned the proposer's tree: its own numbering back
                accepted, logits, hidden = unprune(work.drafted, work.kept, verdict.accepted, logits, hidden)
                tree, verdict = work.drafted, Verdict(accepted, verdict.next_token, verdict.tokens)
            self.proposer.observe(tokens, tree, verdict, logits, hidden)
            out.draft_s += time.perf_counter() - t2
        return kept, finish
