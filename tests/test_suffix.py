"""``method="suffix"`` (proposers/suffix.py): the counted suffix trie against brute force, the
speculation tree's probabilities, the runner's bounded cross-request memory, and exactness."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import leapdecode
from leapdecode.core.proposer import MemoryKey
from leapdecode.core.runner import ModelRunner
from leapdecode.core.sampling import SamplingParams
from leapdecode.errors import InvalidParameterError
from leapdecode.core.cost_model import VerifyCost
from leapdecode.core.sizing import AcceptanceCalibration
from leapdecode.proposers.sam import MATCH_BUCKETS, match_bucket
from leapdecode.proposers.suffix import SOURCES, SuffixDecodingProposer, SuffixMemory, SuffixTrie

docs_strategy = st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=30), min_size=1, max_size=4)


def occurrences(docs: list[list[int]], pattern: tuple[int, ...]) -> int:
    n = len(pattern)
    return sum(1 for d in docs for i in range(len(d) - n + 1) if tuple(d[i:i + n]) == pattern)


def paths(trie: SuffixTrie) -> dict[tuple[int, ...], int]:
    """Every root path of the trie and its count."""
    out, stack = {}, [(0, ())]
    while stack:
        v, path = stack.pop()
        for t, c in trie.children[v].items():
            out[path + (t,)] = trie.count[c]
            stack.append((c, path + (t,)))
    return out


@settings(max_examples=60, deadline=None)
@given(docs=docs_strategy, depth=st.integers(1, 6), drop=st.integers(0, 3))
def test_counts_are_the_occurrences_of_every_short_substring(docs, depth, drop):
    trie = SuffixTrie(depth)
    for i, d in enumerate(docs):
        half = len(d) // 2  # documents grow token by token, in two calls here
        trie.extend(i, d[:half])
        trie.extend(i, d[half:])
    want = {tuple(d[i:i + n]): 0 for d in docs for n in range(1, depth + 1) for i in range(len(d) - n + 1)}
    assert paths(trie) == {p: occurrences(docs, p) for p in want}
    if drop < len(docs):  # forgetting a document takes back exactly its counts, and frees its nodes
        trie.remove(drop)
        rest = [d for i, d in enumerate(docs) if i != drop]
        want = {tuple(d[i:i + n]) for d in rest for n in range(1, depth + 1) for i in range(len(d) - n + 1)}
        assert paths(trie) == {p: occurrences(rest, p) for p in want}
        assert trie.nodes == len(want) + 1


@settings(max_examples=60, deadline=None)
@given(docs=docs_strategy, context=st.lists(st.integers(0, 4), min_size=1, max_size=10), longest=st.integers(1, 5),
       exclude=st.integers(0, 2))
def test_match_is_the_longest_suffix_that_occurs(docs, context, longest, exclude):
    """The longest suffix with more than ``exclude`` occurrences (``exclude=1``: the request's own
    trie, which holds the context itself: a match needs an earlier occurrence)."""
    trie = SuffixTrie(6)
    for i, d in enumerate(docs):
        trie.extend(i, d)
    node, length = trie.match(context, longest, exclude)
    best = max((n for n in range(1, min(longest, len(context)) + 1)
                if occurrences(docs, tuple(context[len(context) - n:])) > exclude), default=0)
    assert length == best and (node > 0) == (best > 0)


def test_the_requests_own_trie_matches_an_earlier_occurrence():
    """The request's trie holds its whole text, so its last ``max_match`` tokens always form a path;
    the match is the longest suffix that occurred *before* (it was the whole ``max_match`` suffix,
    so the request's own text drafted only where 16 tokens repeated: replayed on Spec-Bench dev,
    HumanEval and the ``similar`` workload, 1.01-1.07x against 1.07-1.16x now)."""
    text = [5, 6, 1, 2, 3] + list(range(10, 30)) + [1, 2]  # "1 2" occurred before, followed by 3
    p = SuffixDecodingProposer(cost_aware=False)
    p.local = SuffixTrie(p.depth)
    p.local.extend("request", text)
    assert p.local.match(text, p.max_match) == p.local.match(text, p.max_match, 0) and \
        p.local.match(text, p.max_match)[1] == p.max_match  # its own occurrence: a 16-token path
    assert p.local.match(text, p.max_match, exclude=1)[1] == 2
    nodes, _, _ = p._candidate(p.local, text, 8, "suffix-local")
    assert nodes and nodes[0][0] == 3


def test_speculation_follows_the_empirical_probabilities():
    # after "a b": "c" twice, "d" once, and "c" is followed by "e" both times
    trie = SuffixTrie(6)
    trie.extend(0, [1, 2, 3, 5, 1, 2, 3, 5, 1, 2, 4, 9])
    node, length = trie.match([7, 1, 2], 4)
    assert length == 2
    nodes, score = trie.speculate(node, max_nodes=8, min_prob=0.0)
    assert nodes[0] == (3, -1, pytest.approx(2 / 3)) and nodes[1] == (5, 0, pytest.approx(2 / 3))
    assert (4, -1, pytest.approx(1 / 3)) in nodes
    assert score == pytest.approx(sum(p for _, _, p in nodes))
    assert all(parent < i for i, (_, parent, _) in enumerate(nodes))  # parents first
    assert len(trie.speculate(node, max_nodes=2, min_prob=0.0)[0]) == 2
    assert [t for t, _, _ in trie.speculate(node, max_nodes=8, min_prob=0.5)[0]][:2] == [3, 5]
    assert all(p >= 0.5 for _, _, p in trie.speculate(node, max_nodes=8, min_prob=0.5)[0])
    # the request's own text: its newest occurrence (the suffix being matched) has no continuation yet
    own = SuffixTrie(6)
    own.extend(0, [1, 2, 3, 1, 2])
    node, _ = own.match([1, 2], 4)
    assert own.speculate(node, 4, 0.0, exclude=1)[0][0] == (3, -1, pytest.approx(1.0))
    assert own.speculate(node, 4, 0.0)[0][0] == (3, -1, pytest.approx(0.5))


def test_memory_is_bounded_and_forgets_the_oldest():
    mem = SuffixMemory(depth=4, max_tokens=10)
    for i in range(5):
        mem.add([10 * i + j for j in range(4)])
    assert mem.tokens <= 10 and list(mem.order) == [3, 4]
    assert mem.trie.match([0, 1], 2) == (0, 0) and mem.trie.match([40, 41], 2)[1] == 2
    mem.add(list(range(100, 125)))  # longer than the whole memory: its end is kept
    assert mem.tokens == 10 and list(mem.order) == [5]


@settings(max_examples=40, deadline=None)
@given(before=docs_strategy, after=docs_strategy, cap=st.integers(4, 40))
def test_restore_puts_the_memory_back(before, after, cap):
    """What the bench's repeats rely on: after ``restore(snapshot())`` the memory holds exactly the
    documents (and trie counts) it held, although later documents evicted some of them."""
    mem = SuffixMemory(depth=3, max_tokens=cap)
    for d in before:
        mem.add(d)
    want_paths, want_order, want_tokens = paths(mem.trie), list(mem.order), mem.tokens
    snap = mem.snapshot()
    for d in after:
        mem.add(d)
    mem.restore(snap)
    assert (paths(mem.trie), list(mem.order), mem.tokens) == (want_paths, want_order, want_tokens)
    kept = [mem.trie.docs[d] for d in mem.order]
    for pattern in want_paths:
        assert want_paths[pattern] == occurrences(kept, pattern)


def test_bad_options_are_named():
    with pytest.raises(InvalidParameterError, match="min_prob"):
        leapdecode.generate(leapdecode.load("tiny-random"), "hi", method="suffix", max_new_tokens=2,
                            options={"min_prob": -1})
    # a match longer than the stored depth leaves no room for a continuation: it is cut to depth - 1
    assert SuffixDecodingProposer(depth=8, max_match=8).max_match == 7


PROMPT = "Extract the name and the city: Ada lives in London and likes maths."


def test_a_second_similar_request_drafts_from_the_first(tiny):
    """The cross-request memory: the first request's output is in the runner's memory, so a
    request whose text runs like it drafts from it (many tokens a forward) where the first could
    only draft from its own prompt; both give vanilla's tokens."""
    model = tiny(seed=0)
    runner = ModelRunner(model)
    want = leapdecode.generate(model, PROMPT, method="vanilla", max_new_tokens=64)
    first = leapdecode.generate(runner, PROMPT, method="suffix", max_new_tokens=64)
    second = leapdecode.generate(runner, PROMPT, method="suffix", max_new_tokens=64)
    assert first.tokens == want.tokens == second.tokens
    assert second.stats["suffix_global_drafts"] > 0
    assert second.stats["mean_accepted"] > max(2.0, first.stats["mean_accepted"] + 0.5), (first.stats, second.stats)
    assert second.stats["target_forwards"] < first.stats["target_forwards"]
    other = ModelRunner(model)  # another runner (another server): nothing remembered
    fresh = leapdecode.generate(other, PROMPT, method="suffix", max_new_tokens=64)
    assert fresh.stats["suffix_global_drafts"] == 0


@pytest.mark.parametrize("method,options", [("suffix", {}), ("auto", {"use_memory": True})])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampling_with_memory_keeps_the_seeded_tokens(tiny, seed, method, options):
    """Seeded sampling gives vanilla's tokens while the memory fills (suffix, and auto's memory arm)."""
    model = tiny(seed=0)
    runner = ModelRunner(model)
    kw = dict(max_new_tokens=48, temperature=0.8, seed=seed)
    want = leapdecode.generate(model, PROMPT, method="vanilla", **kw)
    for _ in range(3):
        assert leapdecode.generate(runner, PROMPT, method=method, options=options, **kw).tokens == want.tokens


def test_a_rewound_runner_drafts_as_the_first_time(tiny, fresh_runner):
    """``ProposerMemory.restore``: after a rewind the same request drafts exactly as its first run did
    (the bench's repeats), not from its own earlier output.  (A fixed verification profile: a measured
    one is corrected online from the forwards' timings, so under load the sized trees of two runs
    could differ by a node for that reason alone.)"""
    model = tiny(seed=0)
    runner = fresh_runner(model, verify_cost="flat")
    leapdecode.generate(runner, "A different text about Paris and Rome.", method="suffix", max_new_tokens=32)
    mark = runner.memory.snapshot()
    first = leapdecode.generate(runner, PROMPT, method="suffix", max_new_tokens=64)
    runner.memory.restore(mark)
    again = leapdecode.generate(runner, PROMPT, method="suffix", max_new_tokens=64)
    assert again.tokens == first.tokens
    assert again.stats["target_forwards"] == first.stats["target_forwards"]
    unrewound = leapdecode.generate(runner, PROMPT, method="suffix", max_new_tokens=64)
    assert unrewound.stats["target_forwards"] < first.stats["target_forwards"]


def test_auto_memory_arm_drafts_from_earlier_requests(tiny, fresh_runner):
    """``auto`` with ``use_memory``: its first request adds its output to the runner's memory, and a
    second request of the same kind drafts from it (the memory arm wins steps and saves forwards)
    with vanilla's tokens; the memory is the one ``method="suffix"`` uses on that runner.  (A fixed
    verification profile: a measured one, taken while other tests load the cores, moved the trees'
    sizes and with them the forwards compared here.)"""
    model = tiny(seed=0)
    runner = fresh_runner(model, verify_cost="flat")
    want = leapdecode.generate(model, PROMPT, method="vanilla", max_new_tokens=64)
    opts = {"use_memory": True}
    first = leapdecode.generate(runner, PROMPT, method="auto", options=opts, max_new_tokens=64)
    second = leapdecode.generate(runner, PROMPT, method="auto", options=opts, max_new_tokens=64)
    assert first.tokens == want.tokens == second.tokens
    assert "memory" not in first.stats["auto_arms"] and second.stats["auto_arms"].get("memory", 0) > 0
    assert second.stats["target_forwards"] < first.stats["target_forwards"], (first.stats, second.stats)
    assert (first.stats["auto_memory_tokens"], second.stats["auto_memory_tokens"]) == (64, 128)  # outputs only
    shared = leapdecode.generate(runner, PROMPT, method="suffix", max_new_tokens=64)
    assert shared.stats["suffix_global_drafts"] > 0 and shared.tokens == want.tokens
    plain = leapdecode.generate(ModelRunner(model), PROMPT, method="auto", max_new_tokens=64)
    assert "auto_memory_tokens" not in plain.stats  # off by default


def test_the_memory_arm_matches_the_memory_once_per_step(tiny, monkeypatch):
    """auto asks the memory how long its match is, then (memory arm) drafts from it: one match of the
    memory's trie per text, not two; a memory changed in between is matched again."""
    model = tiny(seed=0)
    runner = ModelRunner(model)
    opts = {"use_memory": True}
    leapdecode.generate(runner, PROMPT, method="auto", options=opts, max_new_tokens=64)
    from leapdecode.proposers.registry import SuffixConfig

    c = SuffixConfig()  # (auto's memory arm: suffix's defaults)
    memory = runner.memory.get(MemoryKey("suffix", "memory", (c.depth, c.memory_tokens)), lambda: pytest.fail("no memory"))
    calls: list[int] = []
    real = SuffixTrie.match

    def counted(self, tokens, limit, *args):
        if self is memory.trie:
            calls.append(len(tokens))
        return real(self, tokens, limit, *args)

    monkeypatch.setattr(SuffixTrie, "match", counted)
    second = leapdecode.generate(runner, PROMPT, method="auto", options=opts, max_new_tokens=64)
    assert second.stats["auto_arms"].get("memory", 0) > 0
    assert calls and len(calls) == len(set(calls)), calls  # each text length matched once
    p = SuffixDecodingProposer(local=False)
    p.memory = memory
    calls.clear()
    ids = model.tokenizer.encode(PROMPT)
    p.memory_match(ids)
    memory.add([1, 2, 3])  # the memory changed (another request ended): the kept match is stale
    p.propose(ids, 8)
    assert calls == [len(ids), len(ids)]


def test_random_documents_drafts_stay_exact(tiny):
    """Memory full of unrelated texts (drafts mostly wrong): greedy tokens are still vanilla's."""
    model = tiny(seed=1)
    runner = ModelRunner(model)
    rng = random.Random(0)
    words = ["the", "cat", "sat", "on", "mat", "dog", "ran", "far", "and", "then"]
    for _ in range(4):
        text = " ".join(rng.choice(words) for _ in range(30))
        want = leapdecode.generate(model, text, method="vanilla", max_new_tokens=40)
        got = leapdecode.generate(runner, text, method="suffix", max_new_tokens=40,
                                  options={"remember_prompts": True, "min_prob": 0.0})
        assert got.tokens == want.tokens


FREE = VerifyCost([1, 64], [1.0, 1.0])  # extra verified rows cost nothing
PROHIBITIVE = VerifyCost([1, 2], [1.0, 100.0])


def sized(verify: VerifyCost) -> SuffixDecodingProposer:
    """A cost-aware proposer without a generation, its calibrations fresh."""
    p = SuffixDecodingProposer()
    p.ctx = SimpleNamespace(params=SamplingParams(), verify_cost=verify)  # greedy, with a measured profile
    p.calibration = {s: [AcceptanceCalibration() for _ in MATCH_BUCKETS] for s in SOURCES}
    return p


def test_cost_aware_trees_are_sized_by_calibrated_probability_and_cost():
    trie = SuffixTrie(8)
    trie.extend(0, [1, 2, 3, 5, 6, 1, 2, 3, 5, 6, 1, 2, 4, 9, 9])
    budget = 16
    # the paper's rule: a 2-token match drafts at most spec_factor x 2 nodes
    paper = SuffixDecodingProposer()
    assert len(paper._candidate(trie, [7, 1, 2], budget, "suffix-global")[0]) == 2
    # free rows: every node above min_prob, parents first, ranked by calibrated path probability
    free = sized(FREE)
    nodes, value, cut = free._candidate(trie, [7, 1, 2], budget, "suffix-global")
    calib, cond, attempt = cut.record.calibration, cut.record.cond, cut.record.attempt
    assert attempt is None  # free rows: every candidate is in the cut, none is tried beyond it
    assert calib is free.calibration["suffix-global"][match_bucket(2)]
    want, _ = trie.speculate(trie.match([7, 1, 2], 16)[0], budget, 0.1)
    assert sorted(t for t, _, _ in nodes) == sorted(t for t, _, _ in want) and len(nodes) > 2
    for i, (token, parent, q) in enumerate(nodes):
        assert parent < i
        expect = calib(cond[i]) * (nodes[parent][2] if parent >= 0 else 1.0)
        assert q == pytest.approx(expect)
    assert cond[0] == pytest.approx(2 / 3)  # "3" follows "1 2" in two of three places
    assert value == pytest.approx((1 + sum(q for _, _, q in nodes)) / FREE(len(nodes) + 1))
    # a prohibitive second row: nothing is worth verifying
    assert sized(PROHIBITIVE)._candidate(trie, [7, 1, 2], budget, "suffix-global")[0] == []
    # a calibration that learned this trie's guesses are never accepted: nothing either
    never = sized(VerifyCost([1, 64], [1.0, 1.0 + 63 * 0.3]))
    for _ in range(200):
        for b in range(AcceptanceCalibration.BINS):
            never.calibration["suffix-global"][match_bucket(2)].update(b, False)
    assert never._candidate(trie, [7, 1, 2], budget, "suffix-global")[0] == []
    assert never._candidate(trie, [7, 1, 2], budget, "suffix-local")[0] != []  # calibrated apart


def test_a_trie_judged_worthless_is_tried_again():
    """A calibration that learned a trie's guesses are never accepted cuts its trees to nothing, and
    nothing it does not draft can revise it: every few cuts one node is drafted beyond the cut
    (``TryAgain``); a rejection doubles the wait, an acceptance starts it over.  Replayed, without
    the tries the request's own trie stopped drafting its 16-token repeats after a few early misses
    (the ``similar`` workload's pytest files: 1.05x against 1.51x)."""
    from leapdecode.core.tree import TokenTree
    from leapdecode.core.verifier import Verdict

    trie = SuffixTrie(8)
    trie.extend(0, [1, 2, 3, 5, 6, 1, 2, 3, 5, 6, 1, 2, 4, 9, 9])
    p = sized(VerifyCost([1, 64], [1.0, 1.0 + 63 * 0.3]))  # a row costs 0.3 of a forward
    calib = p.calibration["suffix-global"][match_bucket(2)]
    for _ in range(200):
        for b in range(AcceptanceCalibration.BINS):
            calib.update(b, False)

    def step(accept: bool) -> int:
        nodes, _, learn = p._candidate(trie, [7, 1, 2], 16, "suffix-global")
        if nodes:  # verified: the tried node (the best one, "3") accepted or not
            tree = TokenTree()
            for token, parent, _ in nodes:
                tree.add(token, parent, source="suffix-global")
            p._last = learn
            p.observe([7, 1, 2], tree, Verdict([0] if accept else [], 0, []), None)
        return len(nodes)

    assert [step(False) for _ in range(4)] == [0, 0, 0, 1]  # tried at the 4th cut, rejected
    assert [step(False) for _ in range(8)] == [0] * 7 + [1]  # then after 8
    assert [step(True) for _ in range(16)] == [0] * 15 + [1]  # after 16; accepted: the wait starts over
    assert [step(False) for _ in range(4)] == [0, 0, 0, 1]
    # a prohibitive row is never tried
    q = sized(PROHIBITIVE)
    assert all(q._candidate(trie, [7, 1, 2], 16, "suffix-global")[0] == [] for _ in range(40))


def test_cost_aware_suffix_follows_the_verify_cost(tiny, fresh_runner):
    """Greedy, cost-aware (the default): vanilla's tokens; a prohibitive verification drafts nothing,
    a free one drafts, and the calibration is learned per runner across generations.  Sampling never
    reads the clock: it drafts by the paper's rule even at a prohibitive cost."""
    model = tiny(seed=0)
    want = leapdecode.generate(model, PROMPT, method="vanilla", max_new_tokens=64)
    dear = fresh_runner(model, verify_cost=PROHIBITIVE)
    for _ in range(2):
        got = leapdecode.generate(dear, PROMPT, method="suffix", max_new_tokens=64)
        assert got.tokens == want.tokens
        assert got.stats["draft_nodes"] == 0 and got.stats["target_forwards"] == want.stats["target_forwards"]
    free = fresh_runner(model, verify_cost=FREE)
    gens, outs = [], []
    for _ in range(2):  # one after the other: the second drafts from the first's output too
        gens.append(leapdecode.start_generation(free, PROMPT, method="suffix", max_new_tokens=64))
        outs.append(gens[-1].run())
    assert all(o.tokens == want.tokens for o in outs)
    assert outs[1].stats["draft_nodes"] > 0 and outs[1].stats["mean_accepted"] > 2.0
    calib = gens[1].proposer.calibration
    assert calib is gens[0].proposer.calibration  # kept in the runner's memory
    assert sum(sum(c.seen) for cs in calib.values() for c in cs) > 2 * AcceptanceCalibration.BINS * 8
    sampled = dict(max_new_tokens=48, temperature=0.8, seed=3)
    s = leapdecode.generate(dear, PROMPT, method="suffix", **sampled)
    assert s.tokens == leapdecode.generate(model, PROMPT, method="vanilla", **sampled).tokens
    assert s.stats["draft_nodes"] > 0
