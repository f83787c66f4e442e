"""Model-free drafters: pld (n-gram lookup), sam (suffix automaton), recycling (Token Recycling).

1. their data structures against brute force on random token sequences;
2. lossless: the same tokens as vanilla decoding on tiny random models;
3. they actually draft on repetitive text;
4. bad options raise InvalidParameterError.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import leapdecode
from leapdecode import ModelRunner
from leapdecode.core.generate import Generation
from leapdecode.core.sampling import SamplingParams
from leapdecode.core.tree import TokenTree
from leapdecode.core.verifier import Verdict
from leapdecode.errors import InvalidParameterError
from leapdecode.proposers import METHODS, build_proposer, method_config
from leapdecode.proposers.common import copy_continuation, merge_candidates
from leapdecode.proposers.pld import NGramIndex, PromptLookupProposer
from leapdecode.proposers.recycling import (
    AdjacencyMatrix,
    TokenRecyclingProposer,
    compile_template,
    default_template,
)
from leapdecode.proposers.sam import SEPARATOR, SuffixAutomaton, SuffixAutomatonProposer, build_static

MODEL_FREE = ["pld", "sam", "recycling"]
seqs = st.lists(st.integers(0, 2), min_size=1, max_size=40)
FAST = settings(max_examples=100, deadline=None)


# ----------------------------------------------------------------------------- brute force helpers
def occurrences(text: list[int], s: list[int], end_limit: int) -> list[int]:
    """End positions e <= end_limit of occurrences of s in text (s non-empty)."""
    n = len(s)
    return [e for e in range(n - 1, min(end_limit, len(text) - 1) + 1) if text[e - n + 1 : e + 1] == s]


def longest_earlier_suffix(text: list[int]) -> int:
    """Longest L such that text's length-L suffix also ends at some position <= len(text) - 2."""
    T = len(text)
    best = 0
    for L in range(1, T):
        if occurrences(text, text[T - L :], T - 2):
            best = L
        else:
            break  # a suffix that never occurred earlier has no longer suffix that did
    return best


def walk(sa: SuffixAutomaton, s: list[int]) -> int:
    v = 0
    for c in s:
        v = sa.next[v].get(c, -1)
        if v < 0:
            return -1
    return v


# ----------------------------------------------------------------------------- suffix automaton
@FAST
@given(seqs, st.sampled_from(["recent", "first"]))
def test_dynamic_automaton_matches_brute_force(text, occurrence):
    prop = SuffixAutomatonProposer(occurrence=occurrence)
    for T in range(1, len(text) + 1):
        prop.sync(text[:T])  # one new token per call, as in generation
        cur = text[:T]
        L = longest_earlier_suffix(cur)
        assert prop.dyn_len == L
        if L == 0:
            assert prop.dyn_pos == -1
            continue
        occ = occurrences(cur, cur[T - L :], T - 2)
        assert prop.dyn_pos in occ, "draft source must be an earlier occurrence of the match"
        if occurrence == "first":
            assert prop.dyn_pos == occ[0]
        # the match state is link(last) and holds exactly the matched string as its longest
        sa = prop.dyn
        assert walk(sa, cur[T - L :]) == sa.link[sa.last]


@FAST
@given(seqs, st.lists(st.integers(0, 2), max_size=6))
def test_automaton_recognises_exactly_the_substrings(text, probe):
    sa = SuffixAutomaton()
    for c in text:
        sa.append(c)
    T = len(text)
    for i in range(T):
        for j in range(i + 1, T + 1):
            s = text[i:j]
            v = walk(sa, s)
            assert v > 0
            occ = occurrences(text, s, T - 1)
            assert sa.first[v] == occ[0]
            assert sa.recent[v] in occ
            assert sa.length[sa.link[v]] < len(s) <= sa.length[v]
    is_sub = any(text[i : i + len(probe)] == probe for i in range(T - len(probe) + 1))
    assert (walk(sa, probe) >= 0) == is_sub
    assert sa.n_states <= max(2 * T - 1, 1) + 1  # the classic bound (2n - 1 states, root included)


@FAST
@given(st.lists(st.lists(st.integers(0, 2), max_size=15), min_size=1, max_size=3), seqs,
       st.sampled_from(["recent", "first"]))
def test_static_automaton_matching_walk(corpus, text, occurrence):
    prop = SuffixAutomatonProposer(corpus_tokens=corpus, occurrence=occurrence)
    concat = prop.static.text
    for T in range(1, len(text) + 1):
        prop.sync(text[:T])
        # naive: longest suffix of text[:T] that is a substring of some document
        best = 0
        for L in range(1, T + 1):
            s = text[T - L : T]
            if any(doc[i : i + L] == s for doc in corpus for i in range(len(doc) - L + 1)):
                best = L
            else:
                break
        assert prop.st_len == best
        if best:
            occ = occurrences(concat, text[T - best : T], len(concat) - 1)
            assert prop.st_pos in occ
            if occurrence == "first":
                assert prop.st_pos == occ[0]
            for length, kind, cont in prop.matches():
                if kind == "static":
                    assert SEPARATOR not in cont
                    assert cont == concat[prop.st_pos + 1 : prop.st_pos + 1 + len(cont)]


@FAST
@given(seqs, st.integers(1, 12))
def test_sam_draft_is_the_continuation_of_the_longest_match(text, budget):
    prop = SuffixAutomatonProposer(draft_len=5)
    tree = prop.propose(text, budget)
    tree.validate()
    L = longest_earlier_suffix(text)
    if L == 0:
        assert len(tree) == 0
        return
    assert tree.parents == list(range(-1, len(tree) - 1))  # one chain without a corpus
    assert tree.tokens == copy_continuation(text, prop.dyn_pos + 1, min(5, budget))
    assert not any(tree.sampled)


# ----------------------------------------------------------------------------- n-gram index
@FAST
@given(seqs, st.integers(1, 4))
def test_ngram_index_matches_brute_force(text, max_ngram):
    idx = NGramIndex(max_ngram)
    for t in text:  # incremental, one token at a time
        idx.append(t)
    T = len(text)
    naive: dict[tuple[int, ...], list[int]] = {}
    for n in range(1, max_ngram + 1):
        for p in range(n, T):
            naive.setdefault(tuple(text[p - n : p]), []).append(p)
    assert idx.positions == naive
    for n in range(1, max_ngram + 1):
        want = [p for p in range(n, T) if n <= T and text[p - n : p] == text[T - n :]] if n <= T else []
        assert idx.lookup(n) == want


@FAST
@given(seqs, st.integers(1, 4), st.integers(1, 3), st.integers(1, 30))
def test_pld_candidates_and_tree(text, max_ngram, max_matches, budget):
    prop = PromptLookupProposer(max_ngram=max_ngram, max_matches=max_matches, draft_len=6)
    for T in range(1, len(text) + 1):  # incremental sync
        prop.sync(text[:T])
    T = len(text)
    cands = prop.candidates(budget)
    seen = set()
    for cont, n, p in cands:
        assert p not in seen and 0 < p < T
        seen.add(p)
        assert text[p - n : p] == text[T - n :]
        longest = max(m for m in range(1, min(max_ngram, p, T) + 1) if text[p - m : p] == text[T - m :])
        assert n <= longest  # == unless max_matches cut this position at a longer level
        if max_matches >= T:
            assert n == longest
        assert cont == copy_continuation(text, p, min(6, budget))
    # every level with matches contributes its most recent new positions first
    for n in range(1, min(max_ngram, T) + 1):
        pos = [p for p in range(n, T) if text[p - n : p] == text[T - n :]]
        if pos:
            assert any(c[2] == pos[-1] for c in cands)
    tree = prop.propose(text, budget)
    tree.validate()
    assert len(tree) <= budget and not any(tree.sampled)
    paths = {tuple(tree.tokens[v] for v in tree.path_to(i)) for i in range(len(tree))}
    assert len(paths) == len(tree)  # a trie: no duplicate siblings
    for path in paths:
        assert any(tuple(c[0][: len(path)]) == path for c in cands)
    if cands:
        # the best node comes from a longest-n candidate
        assert any(c[1] == cands[0][1] and c[0][0] == tree.tokens[0] for c in cands)


@FAST
@given(st.lists(st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=5), st.integers(0, 3),
                          st.integers(0, 50)), max_size=8), st.integers(0, 25))
def test_merge_candidates_keeps_the_best_prefix_closed_nodes(cands, budget):
    tree = merge_candidates(cands, budget, "t")
    tree.validate()
    full = merge_candidates(cands, 10**6, "t")
    # the full trie holds exactly the candidate prefixes
    prefixes = {tuple(c[0][:k]) for c in cands for k in range(1, len(c[0]) + 1)}
    full_paths = [tuple(full.tokens[v] for v in full.path_to(i)) for i in range(len(full))]
    assert set(full_paths) == prefixes and len(full_paths) == len(prefixes)
    # a budget keeps the first nodes of the full order
    assert len(tree) == min(budget, len(full))
    assert [tuple(tree.tokens[v] for v in tree.path_to(i)) for i in range(len(tree))] == full_paths[: len(tree)]


def test_copy_continuation_overlaps():
    assert copy_continuation([5, 1, 2, 1, 2], 3, 5) == [1, 2, 1, 2, 1]
    assert copy_continuation([7, 7], 1, 3) == [7, 7, 7]
    assert copy_continuation([1, 2, 3, 4], 1, 2) == [2, 3]


# ----------------------------------------------------------------------------- token recycling
@FAST
@given(st.lists(st.lists(st.integers(0, 600), min_size=0, max_size=10), max_size=10), st.integers(1, 4))
def test_adjacency_matrix_matches_a_dict(batches, k):
    m = AdjacencyMatrix(k, vocab=50)  # ids beyond 50 force the slot table to grow
    naive: dict[int, list[int]] = {}
    rng = np.random.default_rng(len(batches))
    for toks in batches:
        top = rng.integers(0, 1000, size=(len(toks), k)).astype(np.int32)
        m.update(toks, top)
        for t, row in zip(toks, top):
            naive[t] = row.tolist()
        for t in range(0, 601):
            assert m.row(t) == naive.get(t)
    assert m.n == len(naive)


def test_adjacency_matrix_restore_forgets_later_rows():
    m = AdjacencyMatrix(2, vocab=8)
    m.update([1, 2], np.array([[3, 4], [5, 6]], dtype=np.int32))
    snap = m.snapshot()
    m.update([2, 30, 31], np.array([[7, 7], [1, 1], [2, 2]], dtype=np.int32))  # a new row, a grown table
    m.restore(snap)
    assert [m.row(t) for t in (1, 2, 30, 31)] == [[3, 4], [5, 6], None, None] and m.n == 2
    m.update([30], np.array([[9, 9]], dtype=np.int32))  # still usable after the restore
    assert m.row(30) == [9, 9]


def test_recycling_observe_updates_rows_accepted_path_last():
    prop = TokenRecyclingProposer(k=2, persist=False)
    prop.matrix = AdjacencyMatrix(2, vocab=10)
    # root 3 -> nodes: 0:[4] 1:[4] 2:[5]; node 1 (token 4) is on the accepted path, node 0 (token 4) is not
    tree = TokenTree()
    tree.add(4, -1)
    tree.add(4, -1)
    tree.add(5, 1)
    logits = torch.full((4, 10), -10.0)
    for row, (a, b) in enumerate([(1, 2), (6, 7), (8, 9), (0, 1)]):
        logits[row, a], logits[row, b] = 5.0, 4.0
    verdict = Verdict(accepted=[1], next_token=8, tokens=[4, 8])
    prop.observe([9, 3, 4, 8], tree, verdict, logits)
    assert prop.matrix.row(3) == [1, 2]  # root
    assert prop.matrix.row(4) == [8, 9]  # from node 1 (accepted), not node 0
    assert prop.matrix.row(5) == [0, 1]
    assert prop.matrix.row(8) is None


def test_recycling_template_and_drafting():
    paths = default_template()
    assert len(paths) == 80 and len(set(paths)) == 80
    tmpl = compile_template(paths, 8)
    assert all(p < i for i, (p, _) in enumerate(tmpl))
    assert sum(1 for p, _ in tmpl[:28] if p == -1) == 5  # default 28-node template: 5 root branches
    prop = TokenRecyclingProposer(persist=False)
    assert prop.default_budget == 28
    prop.matrix = AdjacencyMatrix(8, vocab=100)
    assert len(prop.propose([1, 2], 28)) == 0  # nothing seen yet
    prop.matrix.update(list(range(100)), np.array([[(t + r + 1) % 100 for r in range(8)] for t in range(100)]))
    tree = prop.propose([1, 2], 28)
    tree.validate()
    assert len(tree) == 28 and not any(tree.sampled)
    for i, (p, r) in enumerate(tmpl[:28]):
        src = 2 if p == -1 else tree.tokens[p]
        assert tree.parents[i] == p and tree.tokens[i] == (src + r + 1) % 100
    assert len(prop.propose([2], 5)) == 5


def test_recycling_state_is_small_for_a_large_vocabulary():
    m = AdjacencyMatrix(8, vocab=151_936)
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 151_936, size=20_000).tolist()
    m.update(toks, rng.integers(0, 151_936, size=(20_000, 8)).astype(np.int32))
    assert m.nbytes() < 2 * 1024 * 1024


# ----------------------------------------------------------------------------- lossless generation
@pytest.fixture(scope="module")
def tiny_models():
    return [leapdecode.load(f"tiny-random:{s}", dtype="float32", device="cpu") for s in (0, 1)]


WORDS = ["the cat ", "sat on ", "the mat ", "abc", "xyz ", "aa", "\n", "def f(x):", " return x"]


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(WORDS), min_size=1, max_size=12), st.text(max_size=12),
       st.integers(0, 1), st.sampled_from([None, 3, 12]), st.integers(8, 40))
def test_lossless_greedy(tiny_models, words, noise, which, budget, n_new):
    model = tiny_models[which]
    prompt = "".join(words) + noise
    if not model.tokenizer.encode(prompt):
        prompt = "x"
    want = leapdecode.generate(model, prompt, max_new_tokens=n_new, method="vanilla").tokens
    for m in MODEL_FREE:
        got = leapdecode.generate(model, prompt, max_new_tokens=n_new, method=m, options={"tree_budget": budget})
        assert got.tokens == want, m


def test_lossless_sampling_fixed_seed(tiny_models):
    # deterministic nodes consume the generator exactly like vanilla: one draw per emitted token
    prompt = "the cat sat on the mat; the cat sat on the mat; the cat"
    model = tiny_models[1]
    want = leapdecode.generate(model, prompt, max_new_tokens=40, temperature=0.9, seed=7, method="vanilla").tokens
    for m in MODEL_FREE:
        got = leapdecode.generate(model, prompt, max_new_tokens=40, temperature=0.9, seed=7, method=m)
        assert got.tokens == want, m


def test_corpus_drafting_is_lossless(tiny_models):
    model = tiny_models[0]
    prompt = "hello world, hello"
    vanilla = leapdecode.generate(model, prompt, max_new_tokens=48, method="vanilla")
    corpus = [model.tokenizer.encode(prompt) + vanilla.tokens[:30], [1, 2, 3]]
    got = leapdecode.generate(model, prompt, max_new_tokens=48, method="sam", options={"corpus_tokens": corpus})
    assert got.tokens == vanilla.tokens
    assert got.stats["sam_static_drafts"] > 0  # the corpus held the continuation


# ----------------------------------------------------------------------------- they draft
def test_repetitive_text_is_drafted(tiny_models, fresh_runner):
    """Own runner (nothing learned before, e.g. the recycling matrix), flat verification cost (sam's
    cost-aware chains do not follow this machine's timings)."""
    model = tiny_models[0]
    prompt = "hello hello hello hello world, hello world. the cat sat on the mat; the cat sat on the mat."
    base = leapdecode.generate(model, prompt, max_new_tokens=64, method="vanilla")
    out = base.tokens
    assert len(set(out[len(out) // 2 :])) < len(out) // 4, "tiny model's greedy output should repeat"
    for m in MODEL_FREE:
        r = leapdecode.generate(fresh_runner(model, verify_cost="flat"), prompt, max_new_tokens=64, method=m)
        assert r.tokens == base.tokens
        assert r.stats["mean_accepted"] > 1.5, (m, r.stats)
        assert r.stats["target_forwards"] < base.stats["target_forwards"]


def test_pld_cost_aware_chain_follows_the_verify_cost(tiny_models, fresh_runner):
    """Greedy pld keeps the longest match's chain only, cut by the verify cost: nothing when another
    row costs 100 tokens, long chains when rows are free, the same tokens either way; the per-n
    acceptance is learned per runner; sampling keeps the fixed tree whatever the cost."""
    from leapdecode.core.cost_model import VerifyCost

    model = tiny_models[0]
    prompt = "hello hello hello hello world, hello world. the cat sat on the mat; the cat sat on the mat."
    base = leapdecode.generate(model, prompt, max_new_tokens=48, method="vanilla")
    dear = fresh_runner(model, verify_cost=VerifyCost([1, 2], [1.0, 100.0]))
    free = fresh_runner(model, verify_cost=VerifyCost([1, 64], [1.0, 1.0]))

    def pld(runner, **kw):
        gen = leapdecode.start_generation(runner, prompt, method="pld", max_new_tokens=48, **kw)
        return gen.run(), gen.proposer

    costly, _ = pld(dear)
    assert costly.tokens == base.tokens
    assert costly.stats["pld_hit_rate"] > 0 and costly.stats["draft_nodes"] == 0
    cheap, first = pld(free)
    assert cheap.tokens == base.tokens
    assert cheap.stats["mean_accepted"] > 1.5 and cheap.stats["target_forwards"] < base.stats["target_forwards"]
    # a chain: every drafted tree is one path (no node beside the main chain)
    assert cheap.stats["draft_nodes"] <= cheap.stats["target_forwards"] * first.draft_len
    again, second = pld(free)
    assert again.tokens == base.tokens and second.acceptance is first.acceptance
    assert sum(map(sum, first.acceptance.seen)) > 2.0 * (first.max_ngram + 1) * first.draft_len
    # the fixed tree when cost_aware is off, or when sampling (no clock may steer)
    fixed, _ = pld(dear, options={"cost_aware": False})
    assert fixed.tokens == base.tokens and fixed.stats["draft_nodes"] > 0
    sampled, _ = pld(dear, temperature=0.8, seed=3)
    assert sampled.stats["draft_nodes"] > 0
    assert sampled.tokens == leapdecode.generate(model, prompt, method="vanilla", max_new_tokens=48,
                                                 temperature=0.8, seed=3).tokens


def test_pld_cost_aware_drafts_chains_only(tiny_models, fresh_runner):
    """Under a cost model that pays for any row, every greedy tree is a single chain of the longest
    match (the uncosted tree of the same text has branches)."""
    from leapdecode.core.cost_model import VerifyCost

    model = tiny_models[0]
    prompt = "a b c a b d a b e a b c a b d a b"
    trees = []
    gen = leapdecode.start_generation(fresh_runner(model, verify_cost=VerifyCost([1, 64], [1.0, 1.0])), prompt,
                                      method="pld", max_new_tokens=24)
    orig = gen.proposer.propose

    def spy(tokens, budget):
        t = orig(tokens, budget)
        trees.append(list(t.parents))
        return t

    gen.proposer.propose = spy
    gen.run()
    drafted = [p for p in trees if p]
    assert drafted, "the repetitive prompt should give matches"
    for parents in drafted:
        assert parents == list(range(-1, len(parents) - 1)), parents


# ----------------------------------------------------------------------------- parameters
@pytest.mark.parametrize("method,opts", [
    ("pld", {"max_ngram": 0}),
    ("pld", {"min_ngram": 0}),
    ("pld", {"min_ngram": 4, "max_ngram": 2}),
    ("pld", {"draft_len": 0}),
    ("pld", {"max_matches": -1}),
    ("pld", {"max_ngram": 2.5}),
    ("pld", {"bogus": 1}),
    ("sam", {"draft_len": 0}),
    ("sam", {"min_match": 0}),
    ("sam", {"occurrence": "last"}),
    ("sam", {"corpus_tokens": "abc"}),
    ("sam", {"corpus_tokens": [[1, -5]]}),
    ("recycling", {"k": 0}),
    ("recycling", {"template": [(0, 1)]}),  # child before parent
    ("recycling", {"template": [(9,)]}),  # rank >= k
    ("recycling", {"template": []}),
    ("recycling", {"template": "[[0]]"}),
])
def test_bad_options_raise(tiny_models, method, opts):
    with pytest.raises(InvalidParameterError):
        build_proposer(method_config(method, opts), ModelRunner(tiny_models[0]))
    with pytest.raises(InvalidParameterError):
        leapdecode.generate(tiny_models[0], "hi", max_new_tokens=2, method=method, options=opts)


@pytest.mark.parametrize("cls", [PromptLookupProposer, SuffixAutomatonProposer, TokenRecyclingProposer])
@pytest.mark.parametrize("budget", [0, -3, True])
def test_bad_budget_raises(cls, budget):
    with pytest.raises(InvalidParameterError, match="tree_budget"):
        cls(tree_budget=budget)


def test_registered(tiny_models):
    for m in MODEL_FREE:
        assert m in METHODS
    runner = ModelRunner(tiny_models[0])
    assert build_proposer(method_config("vanilla"), runner) is None
    p = build_proposer(method_config("pld", {"tree_budget": 7, "max_ngram": 2}), runner)
    assert isinstance(p, PromptLookupProposer) and p.default_budget == 7 and p.max_ngram == 2
    assert isinstance(build_proposer(method_config("sam"), runner), SuffixAutomatonProposer)
    p = build_proposer(method_config("recycling", {"k": 3}), runner)
    assert isinstance(p, TokenRecyclingProposer) and p.k == 3
    p = build_proposer(method_config("sam", {"corpus_tokens": [[1, 2], [3]]}), runner)
    assert p.static is not None and p.static.text == [1, 2, SEPARATOR, 3]


def test_recycling_matrix_persists_in_the_runner_only(tiny_models, fresh_runner):
    """``persist=True``: one adjacency matrix per runner (target) and k, learned across its generations,
    kept in the runner's memory, not on the model object; ``persist=False``: a new one per generation."""
    model = tiny_models[0]
    before = dict(vars(model)), dict(vars(model.model))
    runner = fresh_runner(model)
    prompt = "the cat sat on the mat; the cat sat on the mat"

    def matrix(r, **options):
        gen = leapdecode.start_generation(r, prompt, max_new_tokens=12, method="recycling", options=options)
        gen.run()
        return gen.proposer.matrix

    first = matrix(runner)
    assert first.n > 0
    assert matrix(runner) is first  # the same runner: learned across generations
    assert matrix(runner, k=4) is not first  # another k: another matrix
    assert matrix(fresh_runner(model)) is not first  # another runner starts from nothing
    assert matrix(runner, persist=False) is not first
    assert (dict(vars(model)), dict(vars(model.model))) == before  # nothing hung on the model objects


def test_corpus_proposer_in_a_generation(tiny_models):
    """A proposer built by hand runs in a ``Generation`` on a runner (the loop knows proposers only
    through their interface)."""
    model = tiny_models[0]
    prompt = "hello world, hello"
    ids = model.tokenizer.encode(prompt)
    want = leapdecode.generate(model, prompt, max_new_tokens=24, method="vanilla")
    prop = SuffixAutomatonProposer(corpus_tokens=[ids + want.tokens[:20]])
    got = Generation(ModelRunner(model), ids, SamplingParams(), prop, method="sam", max_new_tokens=24).run()
    assert got.tokens == want.tokens and got.text == want.text
    assert got.stats["sam_static_drafts"] > 0


def test_resync_on_a_different_text():
    for prop in (PromptLookupProposer(), SuffixAutomatonProposer()):
        prop.propose([1, 2, 3, 1, 2], 8)
        tree = prop.propose([4, 5, 4], 8)  # not an extension: the index starts over
        assert tree.tokens[:1] == [5]
    static = build_static([[1, 2], [3]])
    assert static.text == [1, 2, SEPARATOR, 3]
