"""REST (``method="rest"``): the datastore, the draft trees, the cost-aware sizing, errors, the CLI.

1. ``Datastore`` against brute force on random token documents over small alphabets
   (so that matches happen): the suffix array, ``longest_suffix_match`` (the longest
   suffix of the query, ``min_suffix <= length <= max_suffix``, that occurs inside one
   document, and an ``sa`` range holding exactly its occurrences) and ``continuations``
   (what followed those occurrences, cut at ``draft_len`` and at the document end, with
   the documented evenly-spaced sampling of ``max_candidates`` occurrences).
2. ``frequency_tree``: a tree (parents first) of the ``budget`` highest-count trie nodes.
3. The cost-aware tree (``RestProposer._sized_tree``): free extra verification keeps
   ``min(budget, nodes)`` nodes ranked by calibrated cumulative probability (with an
   exact identity calibration: the same nodes as ``frequency_tree`` up to ties; with the
   default binned prior a deep chain is discounted), an expensive verification keeps
   fewer or none, and ``observe`` updates the calibration of the verified nodes whose
   parent was accepted.  End to end: greedy ``method="rest"`` gives vanilla's tokens,
   cost-aware or not, with free and with prohibitive verification costs.
4. Bad input: missing / corrupt / foreign / non-datastore files, another tokenizer,
   out-of-range or unknown options -- each a ``LeapdecodeError`` naming the problem.
5. ``leapdecode datastore build`` (in-process, ``tiny-random:0``'s tokenizer) on small
   text / jsonl / source files and a directory; failed builds leave no file behind.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from types import SimpleNamespace
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import leapdecode
from leapdecode import ModelRunner
from leapdecode.cli import main as cli_main
from leapdecode.core.cost_model import VerifyCost
from leapdecode.core.sizing import AcceptanceCalibration
from leapdecode.core.generate import Generation
from leapdecode.core.sampling import SamplingParams
from leapdecode.core.verifier import Verdict
from leapdecode.errors import InvalidParameterError, LeapdecodeError, ModelFileError
from leapdecode.models.tiny import byte_tokenizer
from leapdecode.proposers.datastore import (
    FORMAT,
    SEPARATOR,
    VERSION,
    Datastore,
    build_datastore,
    encode_batch,
    suffix_array,
)
from leapdecode.proposers.rest import MATCH_BUCKETS, RestProposer, frequency_tree, resolve_datastore

FAST = settings(max_examples=100, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# a document: random tokens over {0, 1, 2}, or a short unit repeated (long repeats: several doubling rounds)
tok3 = st.integers(0, 2)
doc_st = st.one_of(
    st.lists(tok3, max_size=24),
    st.builds(lambda unit, k: unit * k, st.lists(tok3, min_size=1, max_size=3), st.integers(1, 14)),
)
docs_st = st.lists(doc_st, max_size=5)


# ============================================================================ brute force helpers
def joined(docs: list[list[int]]) -> tuple[list[int], list[int]]:
    """Non-empty documents joined by SEPARATOR, and each document's start (``None`` for empty ones)."""
    out: list[int] = []
    starts = []
    for d in docs:
        if not d:
            starts.append(None)
            continue
        if out:
            out.append(SEPARATOR)
        starts.append(len(out))
        out += d
    return out, starts


def occurrences(docs, s) -> list[tuple[int, int]]:
    """(document, offset) of every occurrence of ``s`` inside one document."""
    L = len(s)
    return [(di, i) for di, d in enumerate(docs) for i in range(len(d) - L + 1) if d[i : i + L] == s]


def brute_longest(docs, query, max_suffix, min_suffix):
    """(length, occurrences) of the longest suffix of ``query`` in [min_suffix, max_suffix] found in a document."""
    for L in range(min(max_suffix, len(query)), min_suffix - 1, -1):
        occ = occurrences(docs, query[len(query) - L :])
        if occ:
            return L, occ
    return 0, []


def brute_trie(cands) -> dict[tuple[int, ...], int]:
    """Every prefix (a trie node, its root path) of the candidates -> total count through it."""
    counts: Counter = Counter()
    for toks, w in cands:
        toks = tuple(toks)
        for d in range(1, len(toks) + 1):
            counts[toks[:d]] += w
    return dict(counts)


def tree_paths(tree) -> list[tuple[int, ...]]:
    """The root path (tokens) of every node of a TokenTree; checks parents come first."""
    paths: list[tuple[int, ...]] = []
    for i, (t, p) in enumerate(zip(tree.tokens, tree.parents)):
        assert -1 <= p < i, f"node {i} has parent {p}: parents must precede children"
        paths.append((paths[p] if p >= 0 else ()) + (t,))
    assert len(set(paths)) == len(paths), "a trie node was added twice"
    return paths


def assert_top(kept: list[tuple], score: dict[tuple, float], k: int, tol: float = 0.0) -> None:
    """``kept`` is a set of ``k`` nodes with the highest ``score`` (ties at the boundary allowed)."""
    assert len(kept) == k
    rest = [v for v in score if v not in set(kept)]
    if kept and rest:
        assert min(score[v] for v in kept) >= max(score[v] for v in rest) - tol, (kept, rest)


# ============================================================================ 1. the datastore
@FAST
@given(docs_st)
def test_suffix_array_matches_sorted_suffixes(docs):
    ds = Datastore.from_documents(docs)
    toks, _ = joined(docs)
    assert ds.tokens.tolist() == toks
    assert ds.tokens.dtype == np.int32
    assert ds.sa.tolist() == sorted(range(len(toks)), key=lambda i: toks[i:])
    assert ds.meta["n_docs"] == sum(1 for d in docs if d)
    assert ds.meta["n_tokens"] == sum(len(d) for d in docs)


@FAST
@given(st.lists(st.sampled_from([0, 1, 7, 2**31 - 2]), max_size=40))
def test_suffix_array_large_token_ids(text):
    # big ids leave room for one token per round-0 key: everything is sorted by doubling
    assert suffix_array(text).tolist() == sorted(range(len(text)), key=lambda i: text[i:])


@FAST
@given(docs_st, st.data())
def test_longest_suffix_match_against_brute_force(docs, data):
    ds = Datastore.from_documents(docs)
    nonempty = [d for d in docs if d]
    # queries: random, or the end of a piece of a document (+ maybe a random tail), so long matches happen
    if nonempty and data.draw(st.booleans()):
        d = data.draw(st.sampled_from(nonempty))
        i = data.draw(st.integers(0, len(d)))
        j = data.draw(st.integers(i, len(d)))
        query = data.draw(st.lists(tok3, max_size=4)) + d[i:j] + data.draw(st.lists(tok3, max_size=2))
    else:
        query = data.draw(st.lists(tok3, max_size=12))
    max_suffix = data.draw(st.integers(1, 12))
    min_suffix = data.draw(st.integers(1, max_suffix + 1))

    length, lo, hi = ds.longest_suffix_match(query, max_suffix, min_suffix)
    want_len, occ = brute_longest(docs, query, max_suffix, min_suffix)
    assert length == want_len
    if not length:
        assert (lo, hi) == (0, 0)
        return
    assert min_suffix <= length <= max_suffix
    _, starts = joined(docs)
    assert sorted(ds.sa[lo:hi].tolist()) == sorted(starts[di] + i for di, i in occ)
    # find() agrees with brute force for the matched suffix and for any other string
    assert ds.count(query[len(query) - length :]) == len(occ)
    probe = data.draw(st.lists(tok3, min_size=1, max_size=5))
    assert ds.count(probe) == len(occurrences(docs, probe))


@FAST
@given(docs_st, st.data())
def test_continuations_against_brute_force(docs, data):
    ds = Datastore.from_documents(docs)
    nonempty = [d for d in docs if d]
    if nonempty:
        d = data.draw(st.sampled_from(nonempty))
        i = data.draw(st.integers(0, len(d) - 1))
        query = d[: i + 1]
    else:
        query = data.draw(st.lists(tok3, min_size=1, max_size=6))
    max_suffix = data.draw(st.integers(1, 6))
    draft_len = data.draw(st.integers(1, 6))
    max_candidates = data.draw(st.integers(1, 10))
    length, lo, hi = ds.longest_suffix_match(query, max_suffix, 1)
    got = ds.continuations(lo, hi, length, draft_len, max_candidates)
    L, occ = brute_longest(docs, query, max_suffix, 1)
    if not L:
        assert got == []
        return
    # the occurrences in suffix order (what the suffix array range is sorted by)
    toks, starts = joined(docs)
    occ.sort(key=lambda o: toks[starts[o[0]] + o[1] :])
    if len(occ) > max_candidates:  # evenly spaced over the sorted range
        occ = [occ[(j * len(occ)) // max_candidates] for j in range(max_candidates)]
    want = Counter()
    for di, i in occ:
        follow = tuple(docs[di][i + L : i + L + draft_len])  # never past the document's end
        if follow:
            want[follow] += 1
    assert dict(got) == dict(want)
    assert len(got) == len(want), "identical continuations must be merged"
    counts = [c for _, c in got]
    assert counts == sorted(counts, reverse=True), "most frequent first"
    assert all(SEPARATOR not in cont and 1 <= len(cont) <= draft_len for cont, _ in got)
    assert ds.continuations(lo, hi, length, 0, max_candidates) == []
    assert ds.continuations(lo, lo, length, draft_len, max_candidates) == []


def test_empty_datastore_matches_nothing():
    ds = Datastore.from_documents([[], []])
    assert len(ds) == 0 and ds.meta["n_docs"] == 0
    assert ds.longest_suffix_match([0, 1, 2], 4, 1) == (0, 0, 0)
    with pytest.raises(InvalidParameterError, match="token ids"):
        Datastore.from_documents([[0, -3]])


def test_save_load_roundtrip(tmp_path):
    ds = Datastore.from_documents([[1, 2, 3, 1, 2], [2, 3]], {"vocab_sha256": "ab" * 32, "model": "m"})
    path = ds.save(tmp_path / "sub" / "ds.npz")
    assert ds.path == path and path.is_file()
    assert [p.name for p in path.parent.iterdir()] == ["ds.npz"], "no temporary file left behind"
    back = Datastore.load(path)
    assert back.tokens.tolist() == ds.tokens.tolist()
    assert back.sa.tolist() == ds.sa.tolist()
    assert back.meta == ds.meta
    assert back.path == path
    assert back.longest_suffix_match([9, 1, 2], 3, 1) == ds.longest_suffix_match([9, 1, 2], 3, 1)


# ============================================================================ 2. frequency_tree
cands_st = st.lists(st.tuples(st.lists(tok3, min_size=1, max_size=5).map(tuple), st.integers(1, 6)),
                    min_size=1, max_size=8)


@FAST
@given(cands_st, st.integers(0, 24))
def test_frequency_tree_keeps_the_top_budget_trie_nodes(cands, budget):
    tree = frequency_tree(cands, budget)
    trie = brute_trie(cands)
    paths = tree_paths(tree)
    assert set(paths) <= set(trie)
    assert_top(paths, trie, min(max(budget, 0), len(trie)))
    # best first, and ties at equal count go to the shallower node
    counts = [trie[p] for p in paths]
    assert counts == sorted(counts, reverse=True)
    kept = set(paths)
    for u in trie:
        if u not in kept and paths:
            assert not any(trie[p] == trie[u] and len(p) > len(u) for p in paths), (u, paths)
    assert tree.sampled == [False] * len(tree) and set(tree.sources) <= {"rest"}
    # a smaller budget keeps a prefix of the tree ("any prefix is the best smaller tree")
    if budget > 1:
        small = frequency_tree(cands, budget - 1)
        assert small.tokens == tree.tokens[: len(small)] and small.parents == tree.parents[: len(small)]


# ============================================================================ 3. the cost-aware tree
class IdentityCalibration(AcceptanceCalibration):
    """P(accept | parent accepted) = the continuation frequency itself (no binning)."""

    def __call__(self, p: float) -> float:
        return p


FREE = VerifyCost([1, 64], [1.0, 1.0])  # extra verified tokens cost nothing
PROHIBITIVE = VerifyCost([1, 2], [1.0, 100.0])


def costed(calibration=None, verify: VerifyCost = FREE) -> RestProposer:
    """A RestProposer in cost-aware mode without a generation (begin() needs a live cache)."""
    prop = RestProposer(Datastore.from_documents([[0, 1, 2]]))
    prop.ctx = sizing_context(verify)
    prop.calibration = calibration if calibration is not None else [AcceptanceCalibration() for _ in MATCH_BUCKETS]
    return prop


def sizing_context(verify: VerifyCost) -> SimpleNamespace:
    """What a cost-aware proposer reads its sizing cost from: greedy decoding and a measured profile."""
    return SimpleNamespace(params=SamplingParams(), verify_cost=verify)


def binned_cum(cands) -> dict[tuple[int, ...], float]:
    """Brute-force cumulative acceptance under the default calibration prior: the product over the path of
    the bin centre (min(floor(10 * p), 9) + 0.5) / 10 of each node's frequency p given its parent."""
    trie = brute_trie(cands)
    total = sum(w for _, w in cands)
    out = {}
    for path in sorted(trie, key=len):
        p = Fraction(trie[path], trie[path[:-1]] if len(path) > 1 else total)
        centre = Fraction(min(int(p * 10), 9) * 2 + 1, 20)
        out[path] = float(centre * Fraction(out[path[:-1]] if len(path) > 1 else 1))
    return out


@FAST
@given(cands_st, st.integers(1, 24))
def test_sized_tree_with_free_verification_and_identity_calibration_is_the_frequency_tree(cands, budget):
    prop = costed([IdentityCalibration() for _ in MATCH_BUCKETS])
    tree = prop._sized_tree(cands, budget, 2)
    trie = brute_trie(cands)
    paths = tree_paths(tree)
    k = min(budget, len(trie))  # every node has p > 0 and costs nothing: all of the budget is used
    assert_top(paths, trie, k)
    freq = tree_paths(frequency_tree(cands, budget))
    # cumulative identity-calibrated probability == count / total: the same counts are kept, and the same
    # nodes unless equal counts straddle the budget (float products may break those ties differently)
    assert sorted(trie[p] for p in paths) == sorted(trie[p] for p in freq)
    ranked = sorted(trie.values(), reverse=True)
    if k == len(trie) or ranked[k - 1] > ranked[k]:
        assert set(paths) == set(freq)
    assert tree.sampled == [False] * len(tree)


@FAST
@given(cands_st, st.integers(1, 24))
def test_sized_tree_with_free_verification_ranks_by_calibrated_probability(cands, budget):
    prop = costed()  # the default prior: binned identity
    tree = prop._sized_tree(cands, budget, 2)
    cum = binned_cum(cands)
    paths = tree_paths(tree)
    assert set(paths) <= set(cum)
    assert_top(paths, cum, min(budget, len(cum)), tol=1e-9)


def test_default_prior_discounts_deep_chains():
    # a chain of count 5 and a single token of count 4 (of 9): frequency_tree keeps the whole chain;
    # the calibrated tree values chain depth d at 0.55 * 0.95**d and prefers (7,) (0.45) to depth 4 (0.448)
    cands = [((1, 2, 3, 4, 5, 6), 5), ((7,), 4)]
    freq = tree_paths(frequency_tree(cands, 6))
    assert set(freq) == {(1, 2, 3, 4, 5, 6)[:d] for d in range(1, 7)}
    sized = tree_paths(costed()._sized_tree(cands, 6, 2))
    assert set(sized) == {(1, 2, 3, 4, 5)[:d] for d in range(1, 6)} | {(7,)}
    cum = binned_cum(cands)
    assert cum[(7,)] > cum[(1, 2, 3, 4, 5)]


@FAST
@given(cands_st, st.integers(1, 24))
def test_sized_tree_shrinks_as_verification_gets_dearer(cands, budget):
    cum = binned_cum(cands)
    best = sorted(cum.values(), reverse=True)[:budget]
    sizes = []
    for slope in (0.0, 0.01, 0.05, 0.2, 1.0, 10.0):
        verify = VerifyCost([1, 64], [1.0, 1.0 + 63 * slope])  # verify(n) = 1 + slope * (n - 1)
        tree = costed(verify=verify)._sized_tree(cands, budget, 2)
        n = len(tree)
        assert_top(tree_paths(tree), cum, n, tol=1e-9)
        # n maximises expected tokens per second: (1 + sum of the n best probabilities) / verify(n + 1)
        rates = [(1 + sum(best[:i])) / verify(i + 1) for i in range(len(best) + 1)]
        assert rates[n] >= max(rates) - 1e-9, (slope, n, rates)
        sizes.append(n)
    assert sizes[0] == min(budget, len(cum))
    assert sizes == sorted(sizes, reverse=True), sizes
    assert sizes[-1] == 0  # at 11x the cost of a 1-token forward, no draft pays (p <= 0.95)
    assert len(costed(verify=PROHIBITIVE)._sized_tree(cands, budget, 2)) == 0


def test_propose_with_prohibitive_cost_drafts_nothing_but_counts_the_hit():
    ds = Datastore.from_documents([[1, 2, 3, 4, 1, 2, 3, 5]])
    prop = RestProposer(ds)
    prop.ctx, prop.calibration = sizing_context(PROHIBITIVE), [AcceptanceCalibration() for _ in MATCH_BUCKETS]
    assert len(prop.propose([9, 1, 2], 8)) == 0
    assert prop.stats()["rest_hit_rate"] == 1.0 and prop.stats()["draft_nodes"] == 0
    prop.ctx.verify_cost = FREE
    tree = prop.propose([9, 1, 2], 8)
    assert set(tree_paths(tree)) == set(brute_trie([((3, 4, 1, 2, 3, 5), 1), ((3, 5), 1)]))
    prop.cost_aware = False  # the paper's fixed budget
    assert set(tree_paths(prop.propose([9, 1, 2], 3))) == {(3,), (3, 4), (3, 5)}
    assert set(tree_paths(frequency_tree([((3, 4, 1), 1), ((3, 5), 1)], 3))) == {(3,), (3, 4), (3, 5)}


@FAST
@given(cands_st, st.integers(1, 16), st.sampled_from([2, 3, 4, 7, 8, 12]), st.data())
def test_observe_updates_the_calibration_of_nodes_whose_parent_was_accepted(cands, budget, match_len, data):
    calib = [AcceptanceCalibration() for _ in MATCH_BUCKETS]
    prop = costed(calib)
    tree = prop._sized_tree(cands, budget, match_len)
    paths = tree_paths(tree)
    # an accepted path: a random node and its ancestors (or nothing)
    accepted: list[int] = []
    if paths and data.draw(st.booleans()):
        v = data.draw(st.integers(0, len(paths) - 1))
        while v >= 0:
            accepted.insert(0, v)
            v = tree.parents[v]
    cut = data.draw(st.integers(0, len(tree)))  # generate() may truncate the tree to its budget
    accepted = [a for a in accepted if a < cut]
    verdict = Verdict(accepted=accepted, next_token=0, tokens=[tree.tokens[a] for a in accepted] + [0])
    before = [(list(c.hits), list(c.seen)) for c in calib]
    prop.observe([], tree.truncated(cut), verdict, None)

    bucket = max(i for i, lo in enumerate(MATCH_BUCKETS) if match_len >= lo)
    trie = brute_trie(cands)
    total = sum(w for _, w in cands)
    d_hits, d_seen = [0.0] * AcceptanceCalibration.BINS, [0.0] * AcceptanceCalibration.BINS
    for i, path in enumerate(paths[:cut]):
        if tree.parents[i] < 0 or tree.parents[i] in accepted:
            p = Fraction(trie[path], trie[path[:-1]] if len(path) > 1 else total)
            b = min(int(p * 10), 9)
            d_seen[b] += 1
            d_hits[b] += i in accepted
    for j, c in enumerate(calib):
        hits0, seen0 = before[j]
        if j == bucket:
            assert [h - h0 for h, h0 in zip(c.hits, hits0)] == pytest.approx(d_hits)
            assert [s - s0 for s, s0 in zip(c.seen, seen0)] == pytest.approx(d_seen)
        else:
            assert (c.hits, c.seen) == (hits0, seen0), "only the match length's bucket learns"
    # the verdict is consumed: a second observe (no new tree) changes nothing
    after = [(list(c.hits), list(c.seen)) for c in calib]
    prop.observe([], tree, verdict, None)
    assert [(c.hits, c.seen) for c in calib] == after


def test_observe_learns_a_lower_probability_from_rejections():
    calib = [AcceptanceCalibration() for _ in MATCH_BUCKETS]
    prop = costed(calib)
    cands = [((1, 2), 3), ((4,), 1)]  # (1,) p = 0.75 -> bin 7; (1, 2) p = 1 -> bin 9; (4,) p = 0.25 -> bin 2
    p0 = calib[0](0.75)
    for _ in range(5):
        tree = prop._sized_tree(cands, 8, 3)
        assert tree_paths(tree) == [(1,), (1, 2), (4,)]
        prop.observe([], tree, Verdict(accepted=[], next_token=0, tokens=[0]), None)
    # roots were rejected five times; (1, 2) was never verified with its parent accepted
    assert calib[0].seen[7] == 2 + 5 and calib[0].hits[7] == pytest.approx(2 * 0.75)
    assert calib[0].seen[2] == 2 + 5 and calib[0].seen[9] == 2
    assert calib[0](0.75) < p0


def test_a_match_bucket_judged_worthless_is_tried_again():
    """A calibration that learned a match bucket's continuations are never accepted cuts every tree
    to nothing, and nothing undrafted can revise it: every few cuts the best node beyond the cut is
    verified too (``TryAgain``, as for ``suffix``); a rejection doubles the wait, an acceptance
    starts it over, and the verdicts reach the calibration.  Where a row is prohibitive nothing is
    ever tried."""
    calib = [AcceptanceCalibration() for _ in MATCH_BUCKETS]
    for _ in range(200):
        for b in range(AcceptanceCalibration.BINS):
            calib[0].update(b, False)
    prop = costed(calib, verify=VerifyCost([1, 64], [1.0, 1.0 + 63 * 0.3]))  # a row costs 0.3 of a forward
    cands = [((1, 2), 3), ((4,), 1)]

    def step(accept: bool) -> int:
        tree = prop._sized_tree(cands, 8, 2)
        if len(tree):
            assert tree_paths(tree) == [(1,)]  # the best node beyond an empty cut
        prop.observe([], tree, Verdict(accepted=[0] if accept and len(tree) else [], next_token=0, tokens=[0]), None)
        return len(tree)

    seen = calib[0].seen[7]
    assert [step(False) for _ in range(4)] == [0, 0, 0, 1]  # tried at the 4th cut, rejected
    assert [step(False) for _ in range(8)] == [0] * 7 + [1]  # then after 8
    assert [step(True) for _ in range(16)] == [0] * 15 + [1]  # after 16; accepted: the wait starts over
    assert [step(False) for _ in range(4)] == [0, 0, 0, 1]
    assert calib[0].seen[7] == seen + 4  # each try's verdict calibrates
    dear = costed(calib, verify=PROHIBITIVE)
    assert all(len(dear._sized_tree(cands, 8, 2)) == 0 for _ in range(40))


# ----------------------------------------------------------------------------- end to end
WORDS = ["the cat ", "sat on ", "the mat ", "hello ", "world ", "def f(x):", " return x", "\n"]
REPETITIVE = "hello hello hello world, hello world. the cat sat on the mat; the cat sat on the mat."


def vanilla(model, prompt, **kw):
    return leapdecode.generate(model, prompt, method="vanilla", **kw)


@pytest.fixture(scope="module")
def store(tiny, tmp_path_factory):
    """A datastore of the prompt words and of the tiny model's own greedy continuations (so REST hits)."""
    model = tiny(seed=0)
    texts = ["".join(WORDS), REPETITIVE]
    for prompt in ("the cat sat on the mat", "hello hello", REPETITIVE):
        texts.append(prompt + vanilla(model, prompt, max_new_tokens=48).text)
    ds = build_datastore(texts, model.tokenizer, model.name)
    path = ds.save(tmp_path_factory.mktemp("rest") / "tiny.npz")
    return ds, path


@pytest.mark.parametrize("cost_aware", [True, False])
@pytest.mark.parametrize("prompt", ["the cat sat on the mat", "hello hello", REPETITIVE])
def test_generate_rest_equals_vanilla(tiny, store, prompt, cost_aware):
    model = tiny(seed=0)
    ds, path = store
    want = vanilla(model, prompt, max_new_tokens=40)
    got = leapdecode.generate(model, prompt, method="rest", max_new_tokens=40,
                              options={"datastore": str(path), "cost_aware": cost_aware})
    assert got.tokens == want.tokens
    assert got.stats["rest_hit_rate"] > 0
    assert got.stats["rest_datastore_tokens"] == len(ds)
    if not cost_aware:  # the fixed budget drafts whenever retrieval hits
        assert got.stats["draft_nodes"] > 0 and got.stats["mean_accepted"] > 1.0
    # a Datastore object (the proposer takes one, e.g. built in memory) gives the same tokens
    prop = RestProposer(resolve_datastore(ModelRunner(model), ds), cost_aware=cost_aware)
    ids = model.tokenizer.encode(prompt)
    by_object = Generation(ModelRunner(model), ids, SamplingParams(), prop, method="rest", max_new_tokens=40).run()
    assert by_object.tokens == want.tokens


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(WORDS), min_size=1, max_size=6), st.integers(1, 30),
       st.sampled_from([None, 1, 3, 8]), st.integers(1, 8), st.integers(1, 3), st.integers(1, 6),
       st.integers(1, 16), st.booleans())
def test_generate_rest_options_equal_vanilla(tiny, store, words, n, budget, max_suffix, min_suffix, draft_len,
                                             max_candidates, cost_aware):
    model = tiny(seed=0)
    prompt = "".join(words)
    want = vanilla(model, prompt, max_new_tokens=n)
    got = leapdecode.generate(model, prompt, method="rest", max_new_tokens=n,
                              options=dict(datastore=str(store[1]), tree_budget=budget, max_suffix=max_suffix,
                                           min_suffix=min(min_suffix, max_suffix), draft_len=draft_len,
                                           max_candidates=max_candidates, cost_aware=cost_aware))
    assert got.tokens == want.tokens


def test_generate_cost_aware_follows_the_verify_cost(tiny, store, fresh_runner):
    # runners of its own, with hand-set verification costs (nothing measured, nothing learned before)
    model = tiny(seed=0)
    path = str(store[1])
    dear_runner = fresh_runner(model, verify_cost=PROHIBITIVE)
    free_runner = fresh_runner(model, verify_cost=FREE)

    def rest_on(runner, **kw):
        gen = leapdecode.start_generation(runner, REPETITIVE, method="rest", options={"datastore": path}, **kw)
        return gen.run(), gen.proposer

    want = vanilla(model, REPETITIVE, max_new_tokens=40)
    dear, _ = rest_on(dear_runner, max_new_tokens=40)
    assert dear.tokens == want.tokens
    assert dear.stats["rest_hit_rate"] > 0 and dear.stats["draft_nodes"] == 0
    assert dear.stats["target_forwards"] == want.stats["target_forwards"]  # one token per forward
    free, first = rest_on(free_runner, max_new_tokens=40)
    assert free.tokens == want.tokens
    assert free.stats["draft_nodes"] > 0 and free.stats["mean_accepted"] > 1.0
    # the calibration is learned per (runner, datastore) across generations
    again, second = rest_on(free_runner, max_new_tokens=40)
    assert again.tokens == want.tokens
    calib = second.calibration
    assert calib is first.calibration
    assert sum(sum(c.seen) for c in calib) > 2 * AcceptanceCalibration.BINS * len(MATCH_BUCKETS)
    assert rest_on(fresh_runner(model, verify_cost=FREE), max_new_tokens=4)[1].calibration is not calib
    # sampling never uses the clock: the fixed budget drafts even at a prohibitive cost
    sampled, _ = rest_on(dear_runner, max_new_tokens=20, temperature=0.8, seed=1)
    assert sampled.stats["draft_nodes"] > 0
    assert sampled.tokens == leapdecode.generate(model, REPETITIVE, method="vanilla", max_new_tokens=20,
                                                 temperature=0.8, seed=1).tokens


# ============================================================================ 4. bad input
class WordTokenizer:
    """A tokenizer with another vocabulary (one id per letter)."""

    def get_vocab(self):
        return {c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz ")}

    def __call__(self, texts, add_special_tokens=False):
        v = self.get_vocab()
        return {"input_ids": [[v[c] for c in t if c in v] for t in texts]}


def rest(model, datastore, **options):
    return leapdecode.generate(model, "hello", method="rest", options={"datastore": datastore, **options},
                               max_new_tokens=4)


def test_missing_datastore_file(tiny, tmp_path):
    missing = tmp_path / "nope.npz"
    with pytest.raises(ModelFileError, match="not found") as e:
        rest(tiny(seed=0), str(missing))
    assert str(missing) in str(e.value)
    with pytest.raises(ModelFileError, match="not a file"):
        rest(tiny(seed=0), str(tmp_path))


def test_no_datastore_and_no_default(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("LEAPDECODE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(InvalidParameterError, match="needs a datastore") as e:
        leapdecode.generate(tiny(seed=0), "hello", method="rest", max_new_tokens=4)
    assert "datastore build" in str(e.value)


def test_default_datastore_is_used(tiny, store, tmp_path, monkeypatch):
    from leapdecode.proposers.datastore import default_path

    model = tiny(seed=0)
    monkeypatch.setenv("LEAPDECODE_CACHE", str(tmp_path / "cache"))
    ds = store[0]
    Datastore(ds.tokens, ds.sa, dict(ds.meta)).save(default_path(model.name))  # (a copy: store[0] keeps its path)
    assert rest(model, None).tokens == vanilla(model, "hello", max_new_tokens=4).tokens  # datastore=None: default
    got = leapdecode.generate(model, REPETITIVE, method="rest", max_new_tokens=20)
    assert got.tokens == vanilla(model, REPETITIVE, max_new_tokens=20).tokens
    assert got.stats["rest_hit_rate"] > 0


def _write_npz(path: Path, **arrays) -> Path:
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    return path


def _meta(**kw) -> np.ndarray:
    meta = {"format": FORMAT, "version": VERSION, "vocab_sha256": "0" * 64, **kw}
    return np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)


@pytest.mark.parametrize("kind", ["truncated", "garbage", "text", "empty", "zip-of-other-arrays", "other-format",
                                  "old-version", "bad-json", "no-vocab", "sa-out-of-range", "wrong-dtype"])
def test_corrupt_or_foreign_files(tiny, store, tmp_path, kind):
    path = tmp_path / "bad.npz"
    ok = np.array([1, 2, 3], dtype=np.int32)
    sa = suffix_array(ok)
    if kind == "truncated":
        data = Path(store[1]).read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif kind == "garbage":
        path.write_bytes(bytes(range(256)) * 8)
    elif kind == "text":
        path.write_text("the cat sat on the mat\n")
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "zip-of-other-arrays":
        _write_npz(path, weights=np.zeros(3))
    elif kind == "other-format":
        _write_npz(path, tokens=ok, sa=sa, meta=_meta(format="something-else"))
    elif kind == "old-version":
        _write_npz(path, tokens=ok, sa=sa, meta=_meta(version=VERSION + 1))
    elif kind == "bad-json":
        _write_npz(path, tokens=ok, sa=sa, meta=np.frombuffer(b"{not json", dtype=np.uint8))
    elif kind == "no-vocab":
        _write_npz(path, tokens=ok, sa=sa, meta=_meta(vocab_sha256=None))
    elif kind == "sa-out-of-range":
        _write_npz(path, tokens=ok, sa=sa + 5, meta=_meta())
    elif kind == "wrong-dtype":
        _write_npz(path, tokens=ok.astype(np.float64), sa=sa, meta=_meta())
    with pytest.raises(ModelFileError, match="cannot read datastore") as e:
        rest(tiny(seed=0), str(path))
    assert str(path) in str(e.value)
    expect = {"zip-of-other-arrays": "missing arrays", "other-format": FORMAT, "old-version": "version",
              "no-vocab": "vocab_sha256", "sa-out-of-range": "out of range", "wrong-dtype": "dtype"}
    if kind in expect:
        assert expect[kind] in str(e.value)


def test_npy_file_is_not_a_datastore(tiny, tmp_path):
    path = tmp_path / "array.npy"
    np.save(path, np.arange(10, dtype=np.int32))
    with pytest.raises(ModelFileError, match="cannot read datastore"):
        rest(tiny(seed=0), str(path))


def test_datastore_for_another_tokenizer(tiny, tmp_path):
    model = tiny(seed=0)
    ds = build_datastore(["hello hello world"], WordTokenizer(), "word-model")
    assert len(ds) > 0
    path = ds.save(tmp_path / "words.npz")
    with pytest.raises(InvalidParameterError, match="different tokenizer") as e:
        rest(model, str(path))
    assert "word-model" in str(e.value) and model.name in str(e.value)
    with pytest.raises(InvalidParameterError, match="different tokenizer") as e:
        resolve_datastore(ModelRunner(model), ds)  # a Datastore object is checked too
    assert "word-model" in str(e.value) and model.name in str(e.value)
    # the same vocabulary under another model name is fine: the check is on the tokenizer
    ok = build_datastore(["hello hello world"], byte_tokenizer(), "some-other-name")
    assert rest(model, str(ok.save(tmp_path / "ok.npz"))).tokens == vanilla(model, "hello", max_new_tokens=4).tokens


@pytest.mark.parametrize("options, pattern", [
    ({"max_suffix": 0}, "max_suffix"),
    ({"max_suffix": -2}, "max_suffix"),
    ({"min_suffix": 0}, "min_suffix"),
    ({"min_suffix": 5, "max_suffix": 4}, "min_suffix.* must be <= max_suffix"),
    ({"draft_len": 0}, "draft_len"),
    ({"max_candidates": 0}, "max_candidates"),
    ({"max_suffix": 2.5}, "max_suffix"),
    ({"draft_len": True}, "draft_len"),
    ({"nonsense": 1}, "method 'rest' has no option 'nonsense'"),
    ({"tree_budget": 0}, "tree_budget"),
])
def test_bad_options(tiny, store, options, pattern):
    with pytest.raises(InvalidParameterError, match=pattern):
        rest(tiny(seed=0), str(store[1]), **options)


def test_cheap_options_are_checked_before_the_datastore_is_loaded(tiny, tmp_path):
    with pytest.raises(InvalidParameterError, match="draft_len"):
        rest(tiny(seed=0), str(tmp_path / "missing.npz"), draft_len=0)
    with pytest.raises(InvalidParameterError, match="has no option 'suffix'"):
        rest(tiny(seed=0), str(tmp_path / "missing.npz"), suffix=3)


def test_datastore_of_the_wrong_type(tiny):
    with pytest.raises(InvalidParameterError, match="option 'datastore' of method 'rest' must be a string"):
        rest(tiny(seed=0), 42)
    with pytest.raises(InvalidParameterError, match="path or a Datastore"):
        resolve_datastore(ModelRunner(tiny(seed=0)), 42)


# ============================================================================ 5. the CLI
@pytest.fixture
def corpus(tmp_path):
    files = tmp_path / "corpus"
    (files / "sub").mkdir(parents=True)
    (files / "notes.txt").write_text("the cat sat on the mat. the cat sat on the mat.\n")
    lines = [{"text": "hello world, hello again"}, {"turns": ["what is 2 + 2?", "2 + 2 = 4"]},
             {"messages": [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hi!"}]},
             {"id": 3, "question": "why?"}]
    (files / "chat.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    (files / "sub" / "mod.py").write_text("def f(x):\n    return x + 1\n")
    (files / "sub" / "b.md").write_text("# title\n")
    (files / "sub" / "skip.bin").write_bytes(b"\x00\x01binary")
    (files / "sub" / ".hidden.txt").write_text("hidden")
    texts = ["the cat sat on the mat. the cat sat on the mat.\n", "hello world, hello again", "what is 2 + 2?",
             "2 + 2 = 4", "hi there", "hi!", "why?", "# title\n", "def f(x):\n    return x + 1\n"]
    args = [str(files / "notes.txt"), str(files / "chat.jsonl"), str(files / "sub")]
    return tmp_path, args, texts


def split_docs(ds: Datastore) -> list[list[int]]:
    docs, cur = [], []
    for t in ds.tokens.tolist():
        if t == SEPARATOR:
            docs.append(cur)
            cur = []
        else:
            cur.append(t)
    return docs + [cur] if cur else docs


def test_cli_build_then_retrieve(tiny, corpus, capsys):
    tmp, args, texts = corpus
    out = tmp / "out" / "ds.npz"
    rc = cli_main(["datastore", "build", *args, "--model", "tiny-random:0", "--out", str(out), "--no-progress",
                   "--json"])
    assert rc == 0
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert info["n_docs"] == len(texts) and info["path"] == str(out)
    assert sorted(p.name for p in out.parent.iterdir()) == ["ds.npz"]

    ds = Datastore.load(out)
    tok = byte_tokenizer()
    assert split_docs(ds) == encode_batch(tok, texts)
    assert ds.meta["model"] == "tiny-random:0" and ds.meta["sources"]["files"] == 4
    assert ds.sa.tolist() == sorted(range(len(ds)), key=lambda i: ds.tokens[i:].tolist())
    model = tiny(seed=0)
    ds.check_tokenizer(model)
    on = tuple(encode_batch(tok, [" on "])[0])
    # "the cat sat" occurs twice (in one document); " the cat sat" once; "x the cat sat" nowhere
    length, lo, hi = ds.longest_suffix_match(encode_batch(tok, ["the cat sat"])[0], 16, 2)
    assert (length, hi - lo) == (len("the cat sat"), 2)
    assert dict(ds.continuations(lo, hi, length, 4, 8)) == {on: 2}
    length, lo, hi = ds.longest_suffix_match(encode_batch(tok, ["xx the cat sat"])[0], 16, 2)
    assert (length, hi - lo) == (len(" the cat sat"), 1)
    assert dict(ds.continuations(lo, hi, length, 4, 8)) == {on: 1}
    assert ds.longest_suffix_match(encode_batch(tok, ["xx the cat sat"])[0], 6, 2)[0] == 6
    got = leapdecode.generate(model, "the cat sat", method="rest", options={"datastore": str(out)},
                              max_new_tokens=12)
    assert got.tokens == vanilla(model, "the cat sat", max_new_tokens=12).tokens
    assert got.stats["rest_hit_rate"] > 0

    # `datastore info` reads it back
    assert cli_main(["datastore", "info", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["n_docs"] == len(texts)


def test_cli_build_max_tokens(corpus, capsys):
    tmp, args, texts = corpus
    out = tmp / "small.npz"
    assert cli_main(["datastore", "build", *args, "--model", "tiny-random:0", "-o", str(out), "--no-progress",
                     "--max-tokens", "30"]) == 0
    ds = Datastore.load(out)
    assert ds.meta["n_tokens"] == 30
    assert sum(split_docs(ds), []) == sum(encode_batch(byte_tokenizer(), texts), [])[:30]


@pytest.mark.parametrize("case, pattern", [
    ("no-files", "nothing to index"),
    ("missing-path", "corpus path not found"),
    ("bad-jsonl", r"bad\.jsonl:2: invalid JSON"),
    ("empty-file", "holds no text"),
    ("empty-dir", "no corpus files found"),
    ("no-out", "--out PATH is needed"),
    ("max-tokens-0", "--max-tokens must be >= 1"),
    ("out-is-dir", "is a directory"),
])
def test_cli_build_errors_leave_no_file(corpus, capsys, case, pattern):
    tmp, args, _ = corpus
    outdir = tmp / "out"
    out = outdir / "ds.npz"
    extra = ["--model", "tiny-random:0", "--no-progress", "--out", str(out)]
    if case == "no-files":
        argv = extra
    elif case == "missing-path":
        argv = [*args, str(tmp / "missing.txt"), *extra]
    elif case == "bad-jsonl":
        bad = tmp / "bad.jsonl"
        bad.write_text('{"text": "fine"}\n{"text": oops}\n')
        argv = [*args, str(bad), *extra]
    elif case == "empty-file":
        empty = tmp / "empty.txt"
        empty.write_text("  \n")
        argv = [str(empty), *extra]
    elif case == "empty-dir":
        (tmp / "nothing").mkdir()
        (tmp / "nothing" / "x.bin").write_bytes(b"\x00")
        argv = [str(tmp / "nothing"), *extra]
    elif case == "no-out":
        argv = [*args, "--model", "tiny-random:0", "--no-progress"]
    elif case == "out-is-dir":
        argv = [*args, "--model", "tiny-random:0", "--no-progress", "--out", str(tmp)]
    else:
        argv = [*args, *extra, "--max-tokens", "0"]
    before = sorted(p for p in tmp.rglob("*"))
    assert cli_main(["datastore", "build", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("leapdecode: error: ")
    assert re.search(pattern, err), err
    assert not out.exists() and not outdir.exists()
    assert sorted(p for p in tmp.rglob("*")) == before, "a failed build must leave nothing behind"


def test_library_build_errors_are_leapdecode_errors(tmp_path):
    from leapdecode.proposers.datastore import corpus_files, read_documents

    bad = tmp_path / "bad.jsonl"
    bad.write_text("[1, 2\n")
    with pytest.raises(LeapdecodeError, match="invalid JSON"):
        list(read_documents(bad))
    with pytest.raises(InvalidParameterError, match="not found"):
        corpus_files([tmp_path / "nope"])
    assert os.listdir(tmp_path) == ["bad.jsonl"]
