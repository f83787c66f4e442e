"""Lookahead decoding (``method="lookahead"``) and Jacobi decoding (``method="jacobi"``).

1. the pieces: n-gram pool, window update / re-alignment, aux tree layout;
2. the lookahead branch is a real Jacobi update: an aux column's logits equal a plain forward
   over context + its trajectory;
3. aux nodes are never accepted by the verifier;
4. lossless: greedy tokens equal vanilla; sampling runs complete;
5. lookahead drafts on repetitive output; bad options raise.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import leapdecode
from leapdecode.core.sampling import SamplingParams
from leapdecode.core.tree import TokenTree
from leapdecode.core.verifier import verify
from leapdecode.errors import InvalidParameterError
from leapdecode import ModelRunner
from leapdecode.core.proposer import DecodeContext
from leapdecode.proposers import METHODS, build_proposer, method_config
from leapdecode.proposers.jacobi import JacobiProposer
from leapdecode.proposers.lookahead import LookaheadProposer, LookaheadWindow, NGramPool

METHODS_HERE = ["lookahead", "jacobi"]
REPETITIVE = "hello hello hello hello world, hello world. the cat sat on the mat; the cat sat on the mat."


@pytest.fixture(scope="module")
def model(tiny):
    return tiny(seed=0)


def fake_ctx(n_prompt: int, seed: int = 0) -> DecodeContext:
    return DecodeContext(None, None, SamplingParams(), torch.Generator().manual_seed(seed), n_prompt, 32)


def make(method, model, **options):
    """The proposer the registry builds for ``options`` (validated like ``generate``'s)."""
    return build_proposer(method_config(method, options), ModelRunner(model))


def window(columns, random, root=10):
    w = LookaheadWindow(len(columns), len(columns[0]))
    w.root, w.columns, w.random = root, [list(c) for c in columns], list(random)
    return w


# ----------------------------------------------------------------------------- n-gram pool
def test_pool_keys_dedup_and_capacity():
    pool = NGramPool(capacity=2)
    pool.add([1, 2, 3])
    pool.add([1, 4, 5])
    pool.add([7, 8, 9])
    assert pool.get(1) == [(2, 3), (4, 5)] and pool.get(7) == [(8, 9)] and pool.get(2) == []
    pool.add([1, 2, 3])  # seen again: becomes the newest, no duplicate
    assert pool.get(1) == [(4, 5), (2, 3)]
    pool.add([1, 6, 6])  # over capacity: the oldest goes
    assert pool.get(1) == [(2, 3), (6, 6)]
    assert len(pool) == 3


def test_pool_update_from_a_hand_made_window():
    # W = 3 columns, N = 4 (3 levels); column 2 still holds two random leading tokens
    w = window([[1, 2, 3], [4, 5, 6], [7, 8, 9]], random=[0, 1, 2])
    pool = NGramPool(capacity=4)
    for ng in w.step({0: 11, 1: 12, 2: 13}, new_root=11, source=[42], rng=torch.Generator().manual_seed(0)):
        pool.add(ng)
    # n-grams = column + the target's next token, harvested only from real trajectories
    assert pool.table == {1: [(2, 3, 11)], 4: [(5, 6, 12)]}


# ----------------------------------------------------------------------------- window update
def test_window_shift_one_token():
    w = window([[1, 2, 3], [4, 5, 6], [7, 8, 9]], random=[0, 1, 3], root=10)
    w.step({0: 11, 1: 12, 2: 13}, new_root=11, source=[42], rng=torch.Generator().manual_seed(0))
    # every column drops its oldest level and gains the new one: same index, one position later
    assert w.root == 11
    assert w.columns == [[2, 3, 11], [5, 6, 12], [8, 9, 13]]
    assert w.random == [0, 0, 2]


def test_window_realigns_to_the_new_root_after_accepting_tokens():
    w = window([[1, 2, 3], [4, 5, 6], [7, 8, 9]], random=[0, 0, 0], root=10)
    # 2 drafted tokens accepted + 1: the root moves 3 positions
    w.step({0: 11, 1: 12, 2: 13}, new_root=13, source=[42], rng=torch.Generator().manual_seed(0))
    # column j (after its update) starts at 12 + j; the new frame starts at 14: old column 2 is
    # new column 0, the other two are random fill (never harvested until refreshed)
    assert w.columns == [[8, 9, 13], [42, 42, 42], [42, 42, 42]]
    assert w.random == [0, 3, 3]


def test_window_columns_that_did_not_run_keep_their_positions():
    w = window([[1, 2, 3], [4, 5, 6], [7, 8, 9]], random=[0, 0, 0], root=10)
    # only column 0 ran (a tight budget): it moves one position; 1 and 2 stay where they were
    ngrams = w.step({0: 11}, new_root=11, source=[42], rng=torch.Generator().manual_seed(0))
    assert ngrams == [[1, 2, 3, 11]]
    # new frame starts at 12: column 0 moved there (and wins over the stale column 1), old column 2
    # (start 13) is new column 1, new column 2 is random
    assert w.columns == [[2, 3, 11], [7, 8, 9], [42, 42, 42]]
    assert w.random == [0, 0, 3]


def test_window_reset_draws_prompt_tokens():
    w = LookaheadWindow(5, 3)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    w.reset(7, prompt, torch.Generator().manual_seed(0))
    assert len(w.columns) == 5 and all(len(c) == 3 and set(c) <= set(prompt) for c in w.columns)
    assert w.random == [3] * 5


# ----------------------------------------------------------------------------- aux tree layout
def test_aux_layout_is_the_lookahead_mask():
    w = window([[1, 2, 3], [4, 5, 6]], random=[0, 0])
    tree = TokenTree()
    tree.add(99)  # a candidate first
    cols = w.add_to_tree(tree, 100, "aux")
    tree.validate()
    assert tree.aux == [False] + [True] * 6
    assert tree.tokens == [99, 1, 2, 3, 4, 5, 6]
    # level 0 is a chain off the root; each column's higher levels hang off its level-0 token
    assert tree.parents == [-1, -1, 1, 2, 1, 4, 5]
    assert cols == [(0, 3), (1, 6)]
    depths = tree.depths()
    assert [depths[i] for i in (1, 2, 3)] == [0, 1, 2] and [depths[i] for i in (4, 5, 6)] == [1, 2, 3]
    # a tight room keeps whole columns first
    tree = TokenTree()
    assert w.add_to_tree(tree, 4, "aux") == [(0, 2)] and len(tree) == 4


def test_aux_logits_are_a_jacobi_update(model):
    """The top aux node of column j sees context + level-0 tokens 0..j + its own column, at the
    right positions: its logits equal a plain causal forward over that sequence."""
    target = model.model
    prompt = model.tokenizer.encode("the cat sat on the mat")
    w = window([[10, 20, 30], [40, 50, 60], [70, 80, 90]], random=[0, 0, 0])
    tree = TokenTree()
    tree.add(5)
    tree.add(6, 0)  # a candidate chain first
    cols = w.add_to_tree(tree, 100, "aux")
    with torch.no_grad():
        cache = target.new_cache(batch_size=1, max_len=128)
        target.forward(torch.tensor([prompt[:-1]]), cache, logits_for=slice(0, 0))
        cache.commit()
        flat = torch.tensor([[prompt[-1]] + tree.tokens])
        logits = target.forward(flat, cache, parents=tree.flattened_parents())[0]
        for j, top in cols:
            level0 = [w.columns[i][0] for i in range(j + 1)]
            seq = prompt + level0 + w.columns[j][1:]
            ref_cache = target.new_cache(batch_size=1, max_len=128)
            ref = target.forward(torch.tensor([seq]), ref_cache)[0, -1]
            torch.testing.assert_close(logits[top + 1], ref, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- aux nodes never accepted
def test_verifier_never_descends_into_aux_nodes():
    tree = TokenTree()
    tree.add(3, aux=True)  # equals the root's argmax, but auxiliary
    tree.add(4, 0, aux=True)
    tree.add(7)  # a candidate that does not match
    logits = torch.full((4, 10), -5.0)
    logits[0, 3] = 5.0
    logits[1, 4] = 5.0
    for params, gen in ((SamplingParams(), None), (SamplingParams(temperature=0.01), torch.Generator().manual_seed(0))):
        v = verify(tree, logits, params, generator=gen)
        assert v.accepted == [] and v.tokens == [3]
    tree.add(3)  # the same token as a candidate: accepted there, not at the aux node
    v = verify(tree, torch.cat([logits, torch.full((1, 10), -5.0)]), SamplingParams())
    assert v.accepted == [3]


# ----------------------------------------------------------------------------- proposer round trip
def test_lookahead_propose_observe_round_trip():
    prop = LookaheadProposer(window=2, ngram=3, guesses=2)
    prompt = [1, 2, 3, 4]
    prop.begin(fake_ctx(len(prompt)), prompt)
    prop.win.columns, prop.win.random = [[5, 6], [7, 8]], [0, 1]
    prop.pool.add([4, 9, 9])
    tree = prop.propose(prompt, budget=10)
    tree.validate()
    assert tree.tokens == [9, 9, 5, 6, 7, 8] and tree.aux == [False, False, True, True, True, True]
    assert tree.parents == [-1, 0, -1, 2, 2, 4]
    logits = torch.zeros(7, 12)
    logits[0, 9] = logits[1, 9] = logits[2, 0] = 1.0  # root -> 9 -> 9 -> 0: both candidates accepted
    logits[4, 11] = 1.0  # after column 0's top node (5, 6)
    logits[6, 10] = 1.0  # after column 1's top node (7, 8)
    v = verify(tree, logits, SamplingParams())
    assert v.accepted == [0, 1] and v.tokens == [9, 9, 0]
    prop.observe(prompt + v.tokens, tree, v, logits)
    assert prop.pool.get(5) == [(6, 11)] and prop.pool.get(7) == [(8, 10)]
    # root moved 3: column 0 moved to start 5 (<= new root 6) and column 1 to 6: both gone
    assert prop.win.root == 6 and prop.win.random == [2, 2]


def test_lookahead_respects_the_budget():
    prop = LookaheadProposer(window=5, ngram=4)
    assert prop.default_budget == (5 + 5) * 3
    prompt = list(range(20))
    prop.begin(fake_ctx(len(prompt)), prompt)
    for t in range(8):
        prop.pool.add([19, t, t, t])
    tree = prop.propose(prompt, budget=20)
    # candidates first (the pool keeps G = W = 5 n-grams: 15 nodes), then what fits of the window:
    # one whole column and part of the next
    assert len(tree) == 20 and not any(tree.aux[:15]) and all(tree.aux[15:])
    assert prop._columns == [(0, 17)]
    tree = prop.propose(prompt, budget=10)
    assert len(tree) == 10 and not any(tree.aux)  # aux nodes are dropped first
    assert len(prop.propose(prompt, budget=3)) == 3


# ----------------------------------------------------------------------------- jacobi
def test_jacobi_guess_update():
    prop = JacobiProposer(k=4)
    prompt = [1, 2, 3]
    prop.begin(fake_ctx(3), prompt)
    assert prop.guess == [3, 3, 3, 3]
    prop.guess = [5, 6, 7, 8]
    tree = prop.propose(prompt, budget=4)
    assert tree.tokens == [5, 6, 7, 8] and not any(tree.aux) and not any(tree.sampled)
    logits = torch.zeros(5, 20)
    for row, t in enumerate([5, 6, 9, 10, 11]):  # root -> 5, node 0 -> 6, node 1 -> 9 (guess 7 wrong)
        logits[row, t] = 1.0
    v = verify(tree, logits, SamplingParams())
    assert v.tokens == [5, 6, 9]
    prop.observe(prompt + v.tokens, tree, v, logits)
    # rows 3, 4 (nodes 2, 3) predict the positions after the new root; padded by repetition
    assert prop.root == 5 and prop.guess == [10, 11, 11, 11]
    # a budget cut: the old guesses not submitted are kept, shifted
    prop.guess = [1, 2, 3, 4]
    tree = prop.propose(prompt + v.tokens, budget=1)
    logits = torch.zeros(2, 20)
    logits[0, 7], logits[1, 8] = 1.0, 1.0
    v = verify(tree, logits, SamplingParams())
    assert v.tokens == [7]
    prop.observe(prompt + [5, 6, 9, 7], tree, v, logits)
    assert prop.guess == [8, 3, 4, 4]


# ----------------------------------------------------------------------------- lossless generation
WORDS = ["the cat ", "sat on ", "the mat ", "abc", "xyz ", "aa", "\n", "def f(x):", " return x"]


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(WORDS), min_size=1, max_size=10), st.integers(0, 1),
       st.sampled_from([None, 3, 9]), st.integers(8, 40), st.integers(1, 5), st.integers(2, 4))
def test_lossless_greedy(tiny, words, which, budget, n_new, w, n):
    model = tiny(seed=which)
    prompt = "".join(words)
    want = leapdecode.generate(model, prompt, max_new_tokens=n_new, method="vanilla").tokens
    got = leapdecode.generate(model, prompt, max_new_tokens=n_new, method="lookahead",
                              options=dict(tree_budget=budget, window=w, ngram=n))
    assert got.tokens == want
    got = leapdecode.generate(model, prompt, max_new_tokens=n_new, method="jacobi",
                              options=dict(tree_budget=budget, k=w))
    assert got.tokens == want


def test_sampling_runs(tiny):
    model = tiny(seed=1)
    vocab = model.model.cfg.vocab_size
    for m in METHODS_HERE:
        r = leapdecode.generate(model, REPETITIVE, max_new_tokens=40, temperature=0.9, top_k=20, seed=7, method=m)
        assert r.finish_reason in ("length", "stop") and 1 <= len(r.tokens) <= 40
        assert all(isinstance(t, int) and 0 <= t < vocab for t in r.tokens)
        assert r.stats["target_forwards"] >= 1


# ----------------------------------------------------------------------------- it drafts
def test_lookahead_accepts_several_tokens_per_step_on_repetitive_output(model):
    base = leapdecode.generate(model, REPETITIVE, max_new_tokens=64, method="vanilla")
    r = leapdecode.generate(model, REPETITIVE, max_new_tokens=64, method="lookahead", seed=0)
    assert r.tokens == base.tokens
    assert r.stats["mean_accepted"] > 1.2, r.stats
    assert r.stats["lookahead_ngrams"] > 0 and r.stats["aux_nodes"] > 0
    assert r.stats["target_forwards"] < base.stats["target_forwards"]


# ----------------------------------------------------------------------------- parameters
@pytest.mark.parametrize("method,opts", [
    ("lookahead", {"window": 0}),
    ("lookahead", {"ngram": 1}),
    ("lookahead", {"ngram": 0}),
    ("lookahead", {"guesses": 0}),
    ("lookahead", {"window": 2.5}),
    ("lookahead", {"window": True}),
    ("lookahead", {"tree_budget": 0}),
    ("lookahead", {"bogus": 1}),
    ("jacobi", {"k": 0}),
    ("jacobi", {"k": -1}),
    ("jacobi", {"tree_budget": -2}),
    ("jacobi", {"window": 3}),
])
def test_bad_options_raise(model, method, opts):
    with pytest.raises(InvalidParameterError):
        make(method, model, **opts)
    with pytest.raises(InvalidParameterError):
        leapdecode.generate(model, "hi", max_new_tokens=2, method=method, options=opts)


def test_registered(model):
    for m in METHODS_HERE:
        assert m in METHODS
    p = make("lookahead", model, tree_budget=7, window=3, ngram=2)
    assert isinstance(p, LookaheadProposer) and p.default_budget == 7 and (p.window, p.ngram, p.guesses) == (3, 2, 3)
    p = make("jacobi", model, k=3)
    assert isinstance(p, JacobiProposer) and p.default_budget == 3
