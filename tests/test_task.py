"""One task protocol (``core/task.py``, issue 48 item 2): generations, searches and parallel samples
hand their forwards to one batched forward; the server's engine drives them alike (no type switch),
and a beam search shares the batch with other requests without changing its result."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest

import leapdecode
from leapdecode import ModelRunner
from leapdecode.core.batch import step_batch
from leapdecode.core.generate import Generation
from leapdecode.core.sampling import SamplingParams
from leapdecode.core.task import Forward, StepOutput, Task
from leapdecode.models.native import NativeCausalLM
from leapdecode.proposers import method_config
from leapdecode.request import GenerationRequest
from leapdecode.server.engine import Delta, Engine, Finished, GenSpec, build_runner
from leapdecode.strategies.parallel import ParallelSamples
from leapdecode.strategies.registry import strategy_config
from leapdecode.strategies.search import TreeSearch

from helpers.server import collect_job_events

SRC = Path(__file__).resolve().parents[1] / "src" / "leapdecode"


@pytest.fixture(scope="module")
def q4(q4_tiny):
    return q4_tiny


@pytest.fixture
def batches(monkeypatch):
    """Every forward ``step_batch`` runs together: (a search's forwards, the others) per call."""
    import leapdecode.core.batch as batch_mod

    seen: list[tuple[int, int]] = []
    original = batch_mod.run_forwards

    def spy(model, forwards):
        searches = sum(1 for f in forwards if f.all_logits)
        seen.append((searches, len(forwards) - searches))
        return original(model, forwards)

    monkeypatch.setattr(batch_mod, "run_forwards", spy)
    return seen


PROMPT = "The cat sat on the mat. The cat"


def _ids(model):
    return model.tokenizer.encode(PROMPT)


def test_every_kind_of_task_is_a_task(q4):
    runner = ModelRunner(q4)
    ids = _ids(q4)
    assert isinstance(leapdecode.start_generation(runner, prompt_ids=ids, max_new_tokens=2), Generation)
    for name, kw in (("beam", {}), ("best-of-n", {"temperature": 1.0, "seed": 1})):
        task = leapdecode.start_generation(runner, prompt_ids=ids, max_new_tokens=2, strategy=name, **kw)
        assert isinstance(task, Task) and isinstance(task, (TreeSearch, ParallelSamples))
        task.close()
    assert runner.caches_in_use == 0


def test_a_search_and_a_generation_share_one_forward_and_keep_their_results(q4, batches):
    runner = ModelRunner(q4)
    ids = _ids(q4)
    gen = leapdecode.start_generation(runner, prompt_ids=ids, method="pld", max_new_tokens=12)
    beam = leapdecode.start_generation(runner, prompt_ids=ids, strategy="beam", num_beams=3, max_new_tokens=8)
    tasks = [gen, beam]
    while tasks:
        outcomes = step_batch(tasks)
        assert all(o.error is None for o in outcomes), outcomes
        tasks = [t for t, o in zip(tasks, outcomes) if o.output is None or not o.output.finished]
    assert any(s and o for s, o in batches), batches  # a beam's nodes beside the generation's step
    alone_gen = leapdecode.generate(ModelRunner(q4), prompt_ids=ids, method="pld", max_new_tokens=12)
    alone_beam = leapdecode.generate(ModelRunner(q4), prompt_ids=ids, strategy="beam", num_beams=3, max_new_tokens=8)
    assert gen.result.tokens == alone_gen.tokens
    assert [h.tokens for h in beam.result.hypotheses] == [h.tokens for h in alone_beam.hypotheses]
    assert [h.score for h in beam.result.hypotheses] == [h.score for h in alone_beam.hypotheses]
    assert runner.caches_in_use == 0


def test_parallel_samples_hand_over_every_samples_forward(q4):
    runner = ModelRunner(q4)
    ids = _ids(q4)
    task = leapdecode.start_generation(runner, prompt_ids=ids, strategy="best-of-n", temperature=1.0, seed=3,
                                       max_new_tokens=6, strategy_options={"num_samples": 3})
    assert isinstance(task.next_forwards(), StepOutput)  # the first step starts the samples (prefill)
    forwards = task.next_forwards()
    assert isinstance(forwards, list) and len(forwards) == 3 and all(isinstance(f, Forward) for f in forwards)
    assert len({id(f.cache) for f in forwards}) == 3  # each sample on its own cache
    out = task.finish_forwards(forwards, [f.run() for f in forwards])
    assert isinstance(out, StepOutput)
    task.run()
    ref = leapdecode.generate(ModelRunner(q4), prompt_ids=ids, strategy="best-of-n", temperature=1.0, seed=3,
                              max_new_tokens=6, strategy_options={"num_samples": 3})
    assert [h.tokens for h in task.result.hypotheses] == [h.tokens for h in ref.hypotheses]


def test_a_failed_batch_undoes_a_searchs_nodes_and_retries_it_alone(q4, monkeypatch):
    runner = ModelRunner(q4)
    ids = _ids(q4)
    gen = leapdecode.start_generation(runner, prompt_ids=ids, method="vanilla", max_new_tokens=10)
    beam = leapdecode.start_generation(runner, prompt_ids=ids, strategy="beam", num_beams=2, max_new_tokens=6)
    original = NativeCausalLM.forward_batch
    calls = []

    def flaky(self, items):  # the second batch of both tasks' forwards fails once, after writing its caches
        calls.append(len(items))
        out = original(self, items)
        if len(items) == 2 and calls.count(2) == 2:
            raise RuntimeError("planted batch fault")
        return out

    monkeypatch.setattr(NativeCausalLM, "forward_batch", flaky)
    tasks = [gen, beam]
    while tasks:
        outcomes = step_batch(tasks)
        assert all(o.error is None for o in outcomes), outcomes
        if not beam.done:  # nothing the failed forward wrote is left pending
            assert beam.tree.pending == beam.tree.held
        tasks = [t for t, o in zip(tasks, outcomes) if o.output is None or not o.output.finished]
    assert calls.count(2) >= 3  # the failed batch, and the batches after it
    alone = leapdecode.generate(ModelRunner(q4), prompt_ids=ids, strategy="beam", num_beams=2, max_new_tokens=6)
    assert [h.tokens for h in beam.result.hypotheses] == [h.tokens for h in alone.hypotheses]
    assert gen.result.tokens == leapdecode.generate(ModelRunner(q4), prompt_ids=ids, max_new_tokens=10,
                                                    method="vanilla").tokens


def test_a_beam_search_batches_with_other_requests_on_the_server(q4, batches):
    runner = build_runner(q4, {})
    engine = Engine(runner, max_batch=4)
    ids = _ids(q4)
    beam = strategy_config("beam", {"num_beams": 3, "num_return_sequences": 2})
    try:
        search = [GenSpec(ids, GenerationRequest(method_config("vanilla"), SamplingParams(), 8, strategy=beam))]
        plain = [GenSpec(ids, GenerationRequest(method_config("vanilla"), SamplingParams(), 24))]

        async def both():
            return await asyncio.gather(collect_job_events(engine, search), collect_job_events(engine, plain))

        events, _ = asyncio.run(both())
    finally:
        engine.stop()
    assert any(s and o for s, o in batches), batches
    ref = leapdecode.generate(ModelRunner(q4), prompt_ids=ids, strategy="beam", num_beams=3, num_return_sequences=2,
                              max_new_tokens=8)
    finished = {e.index: e.result for e in events if isinstance(e, Finished)}
    assert [finished[i].tokens for i in (0, 1)] == [h.tokens for h in ref.hypotheses]
    assert [t for e in events if isinstance(e, Delta) and e.index == 0 for t in e.tokens] == ref.hypotheses[0].tokens
    assert runner.caches_in_use == 0


def test_the_engine_does_not_ask_what_kind_of_task_it_runs():
    """No ``isinstance`` against a task type in the engine or the batch step (the protocol decides)."""
    kinds = {"Generation", "TreeSearch", "ParallelSamples", "Task", "BeamSearch"}
    for path in (SRC / "server" / "engine.py", SRC / "core" / "batch.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                assert not names & kinds, f"{path.name}:{node.lineno} asks isinstance(..., {names & kinds})"
