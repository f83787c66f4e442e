"""The reference loop (``core/reference.py``) is the oracle of the exactness tests: the engine's
vanilla generation (every part of ``Generation``: prefill planner, step planner, committer, output
processor, prefix cache, the batched scheduler) gives its tokens and finish reason, greedy, seeded
and unseeded sampling, across prefill chunks, at an end-of-sequence token and at the context's end.
tests/test_lossless.py compares every method with it through vanilla's results."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import leapdecode
from leapdecode import ModelRunner
from leapdecode.core.batch import step_batch
from leapdecode.core.committer import Committer
from leapdecode.core.reference import reference_generate
from leapdecode.core.sampling import SamplingParams

PROMPT = "the cat sat on the mat. " * 3
SAMPLING = [dict(), dict(temperature=0.9, seed=7), dict(temperature=1.0, top_k=8, seed=3),
            dict(temperature=0.8, repetition_penalty=1.3, seed=11), dict(repetition_penalty=1.2)]


def _engine(model, ids, max_new_tokens, **kw):
    res = leapdecode.generate(ModelRunner(model), prompt_ids=ids, method="vanilla", max_new_tokens=max_new_tokens, **kw)
    return res.tokens, res.finish_reason


@pytest.mark.parametrize("kw", SAMPLING, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "greedy")
def test_vanilla_generation_equals_the_reference_loop(tiny, kw):
    model = tiny(seed=1, invariant=True)
    ids = model.tokenizer.encode(PROMPT)
    want = reference_generate(model, ids, 40, SamplingParams(**kw))
    assert len(want[0]) > 5
    assert _engine(model, ids, 40, **kw) == want


def test_unseeded_sampling_follows_the_global_generator(tiny):
    model = tiny(seed=0, invariant=True)
    ids = model.tokenizer.encode(PROMPT)
    torch.manual_seed(5)
    want = reference_generate(model, ids, 24, SamplingParams(temperature=3.0))
    torch.manual_seed(5)
    assert _engine(model, ids, 24, temperature=3.0) == want
    torch.manual_seed(6)
    assert reference_generate(model, ids, 24, SamplingParams(temperature=3.0)) != want  # the draws matter


def test_a_prompt_of_several_prefill_chunks(tiny):
    model = tiny(seed=0, invariant=True)
    ids = model.tokenizer.encode("one two three four five six seven. " * 20)
    assert len(ids) > 300  # more than one PREFILL_CHUNK
    assert _engine(model, ids, 16) == reference_generate(model, ids, 16)


def test_an_end_of_sequence_token_and_the_end_of_the_context(tiny):
    model = tiny(seed=0, invariant=True)
    ids = model.tokenizer.encode(PROMPT)
    free, _ = reference_generate(model, ids, 12)
    eos = dataclasses.replace(model, eos_token_ids={free[4]})  # the 5th token ends the output now
    want = reference_generate(eos, ids, 12)
    assert want == (free[: free.index(free[4])], "stop")
    assert _engine(eos, ids, 12) == want
    long_ids = (ids * (model.max_seq_len // len(ids) + 1))[: model.max_seq_len - 5]
    want = reference_generate(model, long_ids, 50)
    assert want[1] == "length" and len(want[0]) == 5  # the context holds the prompt and 5 more
    assert _engine(model, long_ids, 50) == want


def test_the_batched_scheduler_equals_the_reference_loop(tiny):
    model = tiny(seed=1, invariant=True)
    prompts = [model.tokenizer.encode(p) for p in (PROMPT, "hello hello world", "def f(x): return x")]
    runner = ModelRunner(model)
    gens = [leapdecode.start_generation(runner, prompt_ids=p, method="vanilla", max_new_tokens=20) for p in prompts]
    while not all(g.done for g in gens):
        step_batch([g for g in gens if not g.done], max_prefill_chunks=3)
    for g, p in zip(gens, prompts):
        assert (g.result.tokens, g.result.finish_reason) == reference_generate(model, p, 20)


def test_the_oracle_catches_a_committer_that_keeps_a_wrong_token(tiny, monkeypatch):
    """The comparison can fail: a committer that swaps the 3rd step's token differs from the oracle."""
    model = tiny(seed=1, invariant=True)
    ids = model.tokenizer.encode(PROMPT)
    original = Committer.commit
    steps = []

    def wrong(self, work, logits, tokens, generated):
        steps.append(1)
        if len(steps) == 3:
            logits = logits.clone()
            logits[0, int(logits[0].argmax())] = -1e9
        return original(self, work, logits, tokens, generated)

    monkeypatch.setattr(Committer, "commit", wrong)
    assert _engine(model, ids, 12) != reference_generate(model, ids, 12)
