"""The model runner (``core/runner.py``): decoding state lives in the runner, not on the model.

1. Two ``leapdecode.stream()`` iterators on ONE model, advanced in turn, each give exactly what it
   gives alone (tokens and text): vanilla, model-free, a method with a draft model
   (``draft`` with ``{"draft": "tiny-random:1"}``) and ``auto`` (with and without a draft),
   greedy and seeded sampling, with stop strings and different lengths.
2. A generation abandoned mid-way gives its caches back (``close()``, ``cancel()``, an iterator
   dropped, the ``Generation`` garbage-collected): ``runner.caches_in_use`` returns to 0.
3. ``ProposerMemory`` is a bounded LRU; a runner's memory stays within its bound.
4. A runner that may not load drafts (``allow_draft_loading=False``, as a server's) refuses a draft
   it does not hold with ``InvalidParameterError``, and uses the drafts added to it.
"""

from __future__ import annotations

import gc
import itertools

import pytest

import leapdecode
from leapdecode import ModelRunner, runner_for
from leapdecode.core.runner import ProposerMemory
from leapdecode.errors import InvalidParameterError

PROMPTS = ["the cat sat on the mat; the cat sat on the mat; the cat", "def f(x):\n    return x\n" * 2]


@pytest.fixture(scope="module")
def model():
    return leapdecode.load("tiny-random", dtype="fp32", device="cpu")


CASES = [
    ("vanilla", {}),
    ("pld", {}),
    ("sam", {}),
    ("recycling", {}),
    ("lookahead", {}),
    ("draft", {"draft": "tiny-random:1"}),
    ("auto", {}),
    ("auto", {"draft": "tiny-random:1"}),
]
CASE_IDS = [m + ("+draft" if o else "") for m, o in CASES]
SAMPLING = [dict(), dict(temperature=0.9, top_k=20, seed=4)]


def interleave(gens) -> list[list[str]]:
    """Advance the generations' iterators in turn, one piece each, until all are done."""
    its = [iter(g) for g in gens]
    pieces: list[list[str]] = [[] for _ in gens]
    live = set(range(len(its)))
    while live:
        for i in sorted(live):
            try:
                pieces[i].append(next(its[i]))
            except StopIteration:
                live.discard(i)
    return pieces


@pytest.mark.parametrize("sampling", SAMPLING, ids=["greedy", "sampled"])
@pytest.mark.parametrize("method,options", CASES, ids=CASE_IDS)
def test_two_interleaved_streams_on_one_model_give_their_solo_outputs(model, method, options, sampling):
    runner = runner_for(model)
    jobs = [dict(prompt=PROMPTS[0], max_new_tokens=40), dict(prompt=PROMPTS[1], max_new_tokens=25, stop=["\n\n"])]
    solo = [leapdecode.generate(model, method=method, options=options, **sampling, **job) for job in jobs]
    gens = [leapdecode.stream(model, method=method, options=options, **sampling, **job) for job in jobs]
    assert runner.caches_in_use == 0  # nothing taken before the first step
    pieces = interleave(gens)
    for job, gen, ref, got in zip(jobs, gens, solo, pieces):
        assert gen.result is not None
        assert gen.result.tokens == ref.tokens, (method, job)
        assert gen.result.text == ref.text == "".join(got)
        assert gen.result.finish_reason == ref.finish_reason
    assert runner.caches_in_use == 0  # every cache (targets' and drafts') given back
    if not sampling:  # greedy: the same as vanilla, too
        for job, ref in zip(jobs, solo):
            assert ref.tokens == leapdecode.generate(model, method="vanilla", **job).tokens


@pytest.mark.parametrize("method,options", [("vanilla", {}), ("draft", {"draft": "tiny-random:1"}), ("auto", {}),
                                            ("layerskip", {"skip": 1})], ids=["vanilla", "draft", "auto", "layerskip"])
def test_many_generations_in_flight_each_hold_their_own_caches(model, method, options):
    runner = ModelRunner(model)
    prompts = [PROMPTS[0], PROMPTS[1], "hello hello hello", "abc"]
    solo = [leapdecode.generate(runner, p, max_new_tokens=20, method=method, options=options) for p in prompts]
    gens = [leapdecode.stream(runner, p, max_new_tokens=20, method=method, options=options) for p in prompts]
    for g in gens:
        g.step()  # all four started: each took its own cache(s)
    per_gen = 2 if method == "draft" else None
    if per_gen:
        assert runner.caches_in_use == per_gen * len(gens)
    else:
        assert runner.caches_in_use >= len(gens)
    caches = [g.cache for g in gens]
    assert len({id(c) for c in caches}) == len(caches)
    # round-robin steps to the end
    for _ in range(100):
        for g in gens:
            g.step()
        if all(g.finished for g in gens):
            break
    assert [g.result.tokens for g in gens] == [r.tokens for r in solo]
    assert runner.caches_in_use == 0


# ============================================================================ abandoned generations
def started(runner, method="vanilla", options=None, n_pieces=3, **kw):
    gen = leapdecode.stream(runner, PROMPTS[0], max_new_tokens=60, method=method, options=options or {}, **kw)
    it = iter(gen)
    for _ in range(n_pieces):
        next(it)
    return gen, it


@pytest.mark.parametrize("method,options", [("vanilla", {}), ("draft", {"draft": "tiny-random:1"}),
                                            ("auto", {"draft": "tiny-random:1"})], ids=["vanilla", "draft", "auto"])
def test_an_abandoned_generation_gives_its_caches_back(model, method, options):
    runner = ModelRunner(model)
    # close()
    gen, it = started(runner, method, options)
    assert runner.caches_in_use >= 1
    gen.close()
    assert runner.caches_in_use == 0
    assert gen.result.finish_reason == "cancelled" and len(gen.result.tokens) >= 1
    assert list(it) == []  # nothing more comes
    # cancel(): stops at the next step
    gen, it = started(runner, method, options)
    gen.cancel()
    assert list(it) == [] and gen.result.finish_reason == "cancelled"
    assert runner.caches_in_use == 0
    # the consumer drops the iterator (a client went away)
    gen, it = started(runner, method, options)
    assert runner.caches_in_use >= 1
    it.close()
    assert runner.caches_in_use == 0 and gen.result.finish_reason == "cancelled"
    # nothing holds the generation any more: garbage collection returns its caches
    gen, it = started(runner, method, options)
    assert runner.caches_in_use >= 1
    del gen, it
    gc.collect()
    assert runner.caches_in_use == 0
    # stepped by hand (no iterator), then dropped
    gen = leapdecode.start_generation(runner, PROMPTS[1], max_new_tokens=60, method=method, options=options)
    gen.step()
    gen.step()
    assert runner.caches_in_use >= 1
    del gen
    gc.collect()
    assert runner.caches_in_use == 0
    # and the runner still works: a full generation afterwards equals a fresh runner's
    want = leapdecode.generate(ModelRunner(model), PROMPTS[0], max_new_tokens=30, method="vanilla")
    assert leapdecode.generate(runner, PROMPTS[0], max_new_tokens=30, method=method, options=options).tokens \
        == want.tokens
    assert runner.caches_in_use == 0


def test_a_generation_that_never_started_holds_nothing(model):
    runner = ModelRunner(model)
    gen = leapdecode.start_generation(runner, PROMPTS[0], max_new_tokens=10, method="pld")
    assert runner.caches_in_use == 0 and gen.cache is None
    gen.close()
    assert gen.result.finish_reason == "cancelled" and gen.result.tokens == []
    assert runner.caches_in_use == 0


def test_a_failing_step_gives_its_caches_back(model):
    runner = ModelRunner(model)
    gen = leapdecode.start_generation(runner, PROMPTS[0], max_new_tokens=30, method="pld")
    gen.step()

    def broken(tokens, budget):
        raise RuntimeError("proposer bug")

    gen.proposer.propose = broken
    with pytest.raises(RuntimeError, match="proposer bug"):
        gen.step()
    assert runner.caches_in_use == 0


def test_caches_are_reused_across_generations(model):
    runner = ModelRunner(model)
    first = leapdecode.start_generation(runner, PROMPTS[0], max_new_tokens=10, method="vanilla")
    first.run()
    second = leapdecode.start_generation(runner, PROMPTS[1], max_new_tokens=10, method="vanilla")
    second.step()
    assert second.cache is first.cache  # the idle cache was handed out again (reset)
    second.close()


# ============================================================================ bounded memory
def test_proposer_memory_is_a_bounded_lru():
    mem = ProposerMemory(max_entries=3)
    made = []

    def factory(key):
        def make():
            made.append(key)
            return [key]
        return make

    a = mem.get("a", factory("a"))
    mem.get("b", factory("b"))
    mem.get("c", factory("c"))
    assert mem.get("a", factory("a")) is a and made == ["a", "b", "c"]  # kept: no new value
    mem.get("d", factory("d"))  # over the bound: the least recently used ("b") goes
    assert len(mem) == 3 and "b" not in mem and all(k in mem for k in "acd")
    mem.get("b", factory("b"))
    assert made == ["a", "b", "c", "d", "b"] and "c" not in mem  # "c" was the oldest now
    mem.clear()
    assert len(mem) == 0 and "a" not in mem


def test_a_runners_memory_stays_within_its_bound(model):
    runner = ModelRunner(model, memory_entries=2)
    keys_seen = []
    for method, options in itertools.product(["recycling", "sam", "auto"], [{}, {"tree_budget": 5}]):
        leapdecode.generate(runner, PROMPTS[0], max_new_tokens=12, method=method, options=options)
        keys_seen.append(len(runner.memory))
        assert len(runner.memory) <= 2
    for k in (3, 4, 5, 6):  # four matrices, one per k: only two kept
        leapdecode.generate(runner, PROMPTS[0], max_new_tokens=8, method="recycling", options={"k": k})
        assert len(runner.memory) <= 2
    assert max(keys_seen) == 2


class Sized:
    def __init__(self, n: int) -> None:
        self.n = n

    def nbytes(self) -> int:
        return self.n


def test_proposer_memory_keeps_a_byte_budget_least_recently_used_out():
    mem = ProposerMemory(max_entries=10, max_bytes=1000)
    for key in "abc":
        mem.get(key, lambda: Sized(300))
    assert mem.nbytes == 900 and mem.evictions == 0
    mem.get("a", lambda: Sized(0))  # used again: "b" is now the oldest
    mem.get("d", lambda: Sized(300))
    assert "b" not in mem and all(k in mem for k in "acd") and mem.nbytes == 900 and mem.evictions == 1
    grown = mem.get("c", lambda: Sized(0))
    grown.n = 2000  # an entry grows while a generation feeds it: the next settle drops what it must
    mem.settle()
    assert len(mem) == 0 and mem.evictions == 4  # "c" alone is over the budget, and cannot shrink


def test_a_suffix_memory_sheds_its_oldest_documents_before_it_is_dropped():
    from leapdecode.proposers.suffix import SuffixMemory

    memory = SuffixMemory(depth=8, max_tokens=10**9)
    for doc in range(4):
        memory.add([doc * 100 + t for t in range(50)])  # four documents, no shared suffix
    one = memory.nbytes() // 4
    mem = ProposerMemory(max_bytes=3 * one)
    mem.get("suffix", lambda: memory)
    # the oldest documents went (freed nodes are kept for reuse, so more than one had to)
    assert "suffix" in mem and mem.nbytes <= 3 * one and 0 < memory.tokens < 150
    assert list(memory.order)[-1] == 3 and 0 not in memory.order and memory.trie.match([0, 1, 2], 3) == (0, 0)
    assert memory.trie.match([300, 301], 2)[1] == 2  # the newest is still drafted from


def test_the_grammar_tokenizer_and_a_corpus_are_kept_under_memory_keys(model, tmp_path):
    """The two entries that once built their own keys (a tuple with a bare ``id()`` of the tokenizer,
    one with the model's name) are ``MemoryKey``s: their object by ``Identity`` (held weakly), no
    scope (derived from the tokenizer, or the file, alone: the same for every memory scope)."""
    import dataclasses

    from leapdecode.core.proposer import Identity, MemoryKey
    from leapdecode.strategies.superposed import corpus_counts

    runner = ModelRunner(model)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat. " * 3)
    counts = corpus_counts(runner, str(corpus), (1, 2))
    assert corpus_counts(runner, str(corpus), (1, 2)) is counts and len(runner.memory) == 1
    [key] = list(runner.memory._entries)
    assert isinstance(key, MemoryKey) and key.of == Identity(model) and key.scope is None
    assert key.options == (str(corpus), corpus.stat().st_size, corpus.stat().st_mtime_ns, (1, 2))
    assert corpus_counts(runner, str(corpus), (1, 2, 3)) is not counts  # other orders: another entry

    pytest.importorskip("llguidance")
    from leapdecode.constraints.grammar import grammar_tokenizer, tokenizer_key

    tok = grammar_tokenizer(runner)
    assert grammar_tokenizer(runner) is tok and len(runner.memory) == 3
    key = tokenizer_key(model)
    assert key in runner.memory and key.of == Identity(model.tokenizer) and key.scope is None
    # a tokenizer that cannot be weakly referenced: keyed by the model that owns it
    odd = dataclasses.replace(model, tokenizer=None)
    assert tokenizer_key(odd).of == Identity(odd) and tokenizer_key(odd) != tokenizer_key(model)


def test_state_is_kept_per_runner_not_on_the_model(model):
    before = set(vars(model)), set(vars(model.model))
    a, b = ModelRunner(model), ModelRunner(model)
    for r in (a, b, runner_for(model)):
        leapdecode.generate(r, PROMPTS[0], max_new_tokens=16, method="auto", options={"draft": "tiny-random:1"})
        leapdecode.generate(r, PROMPTS[0], max_new_tokens=16, method="recycling")
    assert len(a.memory) > 0 and len(b.memory) > 0
    assert (set(vars(model)), set(vars(model.model))) == before  # nothing hung on the model objects
    assert runner_for(model) is runner_for(model) and runner_for(a) is a
    assert runner_for(model) is not a


# ============================================================================ drafts
def test_a_runner_that_may_not_load_drafts_refuses_an_unloaded_one(model, monkeypatch, fresh_runner):
    from leapdecode.models import loader

    # (a flat verification cost: how much the adaptive draft drafts does not follow this machine's timings)
    runner = fresh_runner(model, verify_cost="flat", allow_draft_loading=False)
    assert not runner.allow_draft_loading

    def no_load(*args, **kwargs):
        raise AssertionError("this runner must not load a model")

    monkeypatch.setattr(loader, "load", no_load)
    for method in ("draft", "auto"):
        with pytest.raises(InvalidParameterError, match="tiny-random:1") as e:
            leapdecode.generate(runner, "hi", max_new_tokens=4, method=method, options={"draft": "tiny-random:1"})
        assert "not loaded" in str(e.value)
        with pytest.raises(InvalidParameterError):
            runner.draft("tiny-random:1")
    assert runner.caches_in_use == 0 and runner.drafts == {}
    # drafts added up front are used
    monkeypatch.undo()
    draft = leapdecode.load("tiny-random:1", dtype="fp32", device="cpu")
    runner.add_draft("small", draft)
    assert runner.drafts == {"small": draft} and runner.draft("small") is draft
    monkeypatch.setattr(loader, "load", no_load)
    want = leapdecode.generate(model, PROMPTS[0], max_new_tokens=20, method="vanilla")
    got = leapdecode.generate(runner, PROMPTS[0], max_new_tokens=20, method="draft", options={"draft": "small"})
    assert got.tokens == want.tokens and got.stats["draft_forwards"] > 0
    with pytest.raises(InvalidParameterError, match="small"):  # the error lists what is loaded
        leapdecode.generate(runner, "hi", max_new_tokens=4, method="draft", options={"draft": "other"})
    # auto without a draft option stays model-free on such a runner (the model has no registered pair)
    assert leapdecode.generate(runner, PROMPTS[0], max_new_tokens=20, method="auto").tokens == want.tokens


def test_a_runner_loads_a_draft_once(model):
    runner = ModelRunner(model)
    assert runner.allow_draft_loading
    first = runner.draft("tiny-random:1")
    assert runner.draft("tiny-random:1") is first and set(runner.drafts) == {"tiny-random:1"}
    assert (first.dtype, first.device) == (model.dtype, model.device)
    with pytest.raises(InvalidParameterError, match="no registered draft"):
        runner.draft()  # tiny models have no registered pair
    with pytest.raises(InvalidParameterError, match="string"):
        runner.draft(5)


def test_a_dropped_model_is_collected_with_its_runner():
    """Issue 44 (item 8): ``runner_for``'s weak dictionary held its runner, and the runner held the
    model: every model ever generated with stayed resident with its caches."""
    import gc
    import weakref

    import leapdecode
    from leapdecode.core.runner import runner_for
    from leapdecode.models.tiny import tiny_loaded

    lm = tiny_loaded(seed=11)
    leapdecode.generate(lm, "hello", max_new_tokens=4, method="pld")
    runner = runner_for(lm)
    assert runner.model is lm and runner.caches_in_use == 0
    gone_model, gone_runner = weakref.ref(lm), weakref.ref(runner)
    del lm, runner
    gc.collect()
    assert gone_model() is None and gone_runner() is None
