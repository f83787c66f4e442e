"""A generation's step planner (``core/step_planner.py``) and committer (``core/committer.py``) on
their own: the tree's budget, a proposer that breaks the rule, what a step's logits decide (the
accepted path committed, an end-of-sequence token, the token limit) and what the proposer sees."""

from __future__ import annotations

import types

import pytest
import torch

from leapdecode import ModelRunner
from leapdecode.core.committer import Committer
from leapdecode.core.output import OutputProcessor
from leapdecode.core.proposer import DecodeContext
from leapdecode.core.sampling import SamplingParams
from leapdecode.core.step_planner import StepPlanner
from leapdecode.core.tree import TokenTree


class Chain:
    """A proposer that drafts a fixed chain and records what it observed."""

    name = "chain"

    def __init__(self, tokens: list[int], leave_pending: bool = False, cache=None, decoder=None) -> None:
        self.tokens, self.leave_pending, self.cache, self.decoder = tokens, leave_pending, cache, decoder
        self.seen: list = []

    def propose(self, tokens, budget):
        if self.leave_pending:  # breaks the rule: a forward on the target's cache not rolled back
            self.decoder.forward(torch.tensor([[tokens[-1]]]), self.cache)
        return TokenTree.chain(self.tokens)

    def wants_hidden(self):
        return False

    def observe(self, tokens, tree, verdict, logits, hidden):
        self.seen.append((list(tokens), verdict.accepted))


def _setup(tiny, prompt=(5, 6, 7), max_new_tokens=8):
    model = tiny(seed=0)
    runner = ModelRunner(model)
    cache = runner.acquire_cache(model, 64)
    ctx = DecodeContext(runner, cache, SamplingParams(), torch.Generator(), len(prompt), max_new_tokens)
    return model, runner, cache, ctx


def test_the_budget_is_the_smallest_bound():
    planner = StepPlanner(None, None, 10, "cpu", OutputProcessor(None, []))
    assert planner.budget(room=100, remaining=100, cap=None) == 10
    assert planner.budget(room=4, remaining=100, cap=None) == 3  # the root takes a slot
    assert planner.budget(room=100, remaining=3, cap=None) == 2  # the root's own token is one
    assert planner.budget(room=100, remaining=100, cap=1) == 1
    assert planner.budget(room=100, remaining=1, cap=5) == 0


def test_a_plan_without_a_proposer_is_the_root_alone(tiny):
    model, runner, cache, ctx = _setup(tiny)
    planner = StepPlanner(None, None, 0, model.device, OutputProcessor(model.tokenizer, []))
    work = planner.plan([5, 6, 7], cache, 0)
    assert work.tokens.tolist() == [7] and len(work.tree) == 0 and not work.proposed and work.parents is None
    runner.release_cache(cache)


def test_a_proposer_that_leaves_nodes_pending_is_refused(tiny):
    model, runner, cache, ctx = _setup(tiny)
    out = OutputProcessor(model.tokenizer, [])
    planner = StepPlanner(Chain([1, 2], leave_pending=True, cache=cache, decoder=model.model), None, 4,
                          model.device, out)
    with pytest.raises(RuntimeError, match="proposer 'chain' left 1 nodes pending"):
        planner.plan([5, 6, 7], cache, 4)
    runner.release_cache(cache)


def _step(tiny, rows_argmax, max_new_tokens=8, generated=(), eos_token=None):
    """Plan a chain [11, 12] after the prompt, and commit logits whose rows pick ``rows_argmax``."""
    model, runner, cache, ctx = _setup(tiny, max_new_tokens=max_new_tokens)
    if eos_token is not None:
        ctx.runner = types.SimpleNamespace(model=types.SimpleNamespace(eos_token_ids={eos_token},
                                                                        device=model.device))
    proposer = Chain([11, 12])
    out = OutputProcessor(model.tokenizer, [])
    tokens = [5, 6, 7]
    work = StepPlanner(proposer, None, 4, model.device, out).plan(tokens, cache, 2)
    model.model.forward(work.tokens[None], cache)  # three pending nodes: the root and the chain
    logits = torch.zeros(3, model.model.cfg.vocab_size)
    for row, t in enumerate(rows_argmax):
        logits[row, t] = 10.0
    committer = Committer(ctx, proposer, None, None, out, tokens)
    gen = list(generated)
    kept, finish = committer.commit(work, logits, tokens, gen)
    length = cache.length
    runner.release_cache(cache)
    return kept, finish, tokens, gen, proposer.seen, length, out


def test_the_accepted_path_is_committed_and_observed(tiny):
    kept, finish, tokens, gen, seen, length, out = _step(tiny, [11, 3, 0])  # 11 accepted, 12 not: 3 instead
    assert kept == [11, 3] and finish is None and tokens == [5, 6, 7, 11, 3] and gen == [11, 3]
    assert length == 2  # the root and the accepted node (no prompt prefilled here); the rejected one dropped
    assert seen == [([5, 6, 7, 11, 3], [0])] and out.forwards == 1 and out.hist[1] == 1


def test_an_end_of_sequence_token_ends_the_step(tiny):
    kept, finish, tokens, gen, seen, _, out = _step(tiny, [11, 12, 9], eos_token=12)
    assert kept == [11] and finish == "stop" and gen == [11] and seen == []  # no observe after the end
    assert out.decided == 2  # the end-of-sequence token was decided too


def test_the_token_limit_cuts_the_step(tiny):
    kept, finish, _, gen, seen, _, _ = _step(tiny, [11, 12, 9], max_new_tokens=3, generated=(1,))
    assert kept == [11, 12] and finish == "length" and gen == [1, 11, 12] and seen == []
