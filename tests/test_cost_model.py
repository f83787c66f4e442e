"""The cost model behind greedy tree sizes (core/cost_model.py), the draft's acceptance
calibration and its frequency-ranked vocabulary subset (proposers/draft_model.py)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import leapdecode
from leapdecode import ModelRunner
from leapdecode.core.cost_model import VerifyCost, measure_verify_cost
from leapdecode.core.sizing import (AcceptanceCalibration, Chain, ChainAcceptance, Sizer, TryAgain, best_tree_gain,
                                    best_tree_size)
from leapdecode.core.proposer import DecodeContext
from leapdecode.core.sampling import SamplingParams
from leapdecode.core.tree import TokenTree
from leapdecode.errors import InvalidParameterError
from leapdecode.proposers import method_config
from leapdecode.proposers.common import subset_head
from leapdecode.proposers.draft_model import DraftModelProposer
from leapdecode.proposers.tree_cost import TreeSizer, TrieSizer


# ------------------------------------------------------------------ verify cost
def test_verify_cost_interpolates_and_is_monotone():
    cost = VerifyCost([1, 8, 16], [0.10, 0.09, 0.20])  # a noisy dip at 8 must not make 8 cheaper than 1
    assert cost(1) == pytest.approx(0.10)
    assert cost(8) == pytest.approx(0.10)
    assert cost(12) == pytest.approx(0.15)
    assert cost(24) == pytest.approx(0.30)  # extrapolated with the last slope
    assert cost(0) == pytest.approx(0.10)
    assert all(cost(n) <= cost(n + 1) for n in range(40))
    with pytest.raises(ValueError):
        VerifyCost([1, 2], [0.1])


def test_a_fixed_profile_ignores_observations():
    cost = VerifyCost([1, 8], [0.1, 0.2])
    for _ in range(20):
        cost.observe(4, 1.0)
    assert cost.observations == 0 and cost(4) == pytest.approx(cost.profile(4))


def test_online_correction_learns_a_misstated_ratio_and_follows_the_machine():
    """A probe that mis-stated 4 tokens as 1.6x one token's while the forwards that follow take
    1.3x: the learned curve comes to the observed ratio; a machine that gets 20% slower moves
    every size by about that much and keeps the ratio; the curve stays monotone."""
    cost = VerifyCost([1, 4, 8, 16], [0.10, 0.16, 0.24, 0.40], learn=True)
    truth = {1: 0.10, 2: 0.11, 4: 0.13, 5: 0.15}
    rng = random.Random(0)
    for _ in range(300):
        n = rng.choice(list(truth))
        cost.observe(n, truth[n] * rng.uniform(0.97, 1.03))
    assert cost(4) / cost(1) == pytest.approx(1.3, rel=0.05)
    assert cost(1) == pytest.approx(0.10, rel=0.05)
    assert cost(3) == pytest.approx(0.12, rel=0.08)  # between learned sizes: interpolated
    assert cost(8) / cost(5) == pytest.approx(cost.profile(8) / cost.profile(5), rel=0.01)  # beyond: held flat
    for _ in range(200):  # the machine slows down by 20%
        n = rng.choice(list(truth))
        cost.observe(n, 1.2 * truth[n])
    assert cost(1) == pytest.approx(0.12, rel=0.05) and cost(4) / cost(1) == pytest.approx(1.3, rel=0.05)
    assert all(cost(n) <= cost(n + 1) for n in range(80))
    assert cost(100) > cost(64) > 0
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        before = cost(4)
        cost.observe(4, bad)
        assert cost(4) == before


def test_probe_ratios_come_from_within_a_round(monkeypatch):
    """A burst of load that hit one size in one round (the 4-token forward 3x slower once), or a
    quiet moment that favoured one (the 1-token forward 0.7x once), does not move the ratios: each
    round's ratios are taken within the round and the median kept (a minimum per size would pair
    the quiet 1-token time with ordinary ones: 4 tokens at 1.86x one token's)."""
    from leapdecode.core import cost_model

    clock = {"t": 0.0, "calls": 0}
    base = {1: 0.010, 4: 0.013, 8: 0.020}

    class FakeCache:
        def room(self):
            return 100

        max_pending = 64

        def rollback(self):
            pass

    class FakeModel:
        def forward(self, tokens, cache, parents=None):
            n = tokens.shape[1]
            clock["calls"] += 1
            c = clock["calls"]
            # round 1 (calls 4-6, after the warm-up): 4 tokens 3x slower; round 2: 1 token 0.7x
            factor = 3.0 if (n == 4 and c == 5) else 0.7 if (n == 1 and c == 7) else 1.0
            clock["t"] += base[n] * factor

    loaded = type("L", (), {"model": FakeModel(), "device": torch.device("cpu")})()
    monkeypatch.setattr(cost_model.time, "perf_counter", lambda: clock["t"])
    cost = cost_model.measure_verify_cost(loaded, FakeCache(), sizes=(1, 4, 8), repeats=5)
    assert cost.learn
    assert [t / cost.seconds[0] for t in cost.seconds] == pytest.approx([1.0, 1.3, 2.0])


def test_the_generation_loop_teaches_a_learning_profile(tiny, fresh_runner):
    """Every decoding step of a cost-aware greedy generation is timed into the runner's learning
    profile (one observation per target forward); the greedy tokens stay vanilla's."""
    model = tiny(seed=0)
    prompt = "the cat sat on the mat the cat sat on the"
    want = leapdecode.generate(model, prompt, max_new_tokens=24, method="vanilla")
    cost = VerifyCost([1, 8, 32], [1.0, 1.2, 2.0], learn=True)
    runner = fresh_runner(model, verify_cost=cost)
    got = leapdecode.generate(runner, prompt, max_new_tokens=24, method="pld")
    assert got.tokens == want.tokens
    assert cost.observations == got.stats["target_forwards"] > 0
    assert cost(1) < 0.5  # a tiny model's forward takes milliseconds, not the profile's second


def test_measure_verify_cost_leaves_the_cache_as_it_was(tiny):
    model = tiny(seed=0)
    cache = model.model.new_cache(max_len=128)
    model.model.forward(torch.tensor([[5, 6, 7]]), cache)
    cache.commit()
    k_before = cache.k[:, :, :, :3].clone()
    cost = measure_verify_cost(model, cache, sizes=(1, 4, 8), repeats=1)
    assert cost.sizes == [1, 4, 8] and all(t > 0 for t in cost.seconds)
    assert cache.length == 3 and cache.n_pending == 0
    assert torch.equal(cache.k[:, :, :, :3], k_before)


def test_profile_is_kept_per_model_file_and_machine(tiny, tmp_path, monkeypatch):
    """A model loaded from a file has its profile stored in the cache directory: another load of
    the same file reuses it without measuring; a changed file, an unreadable store or an old
    profile is measured again; a model with no file (built in-process) never touches the store."""
    import dataclasses
    import json
    import os
    import time

    from leapdecode.core import cost_model

    monkeypatch.setenv("LEAPDECODE_CACHE", str(tmp_path / "cache"))
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"weights")
    base = tiny(seed=0)
    calls = []
    real = cost_model.measure_verify_cost

    def counting(loaded, cache, **kw):
        calls.append(loaded)
        return real(loaded, cache, sizes=(1, 4), repeats=1)

    monkeypatch.setattr(cost_model, "measure_verify_cost", counting)

    def fresh(path=weights):
        m = dataclasses.replace(base, path=path)  # a new object (its own runner: nothing kept yet)
        cache = m.model.new_cache(max_len=64)
        m.model.forward(torch.tensor([[5, 6, 7]]), cache)
        cache.commit()
        return m, cache

    store = tmp_path / "cache" / "verify_cost.json"
    first = cost_model.verify_cost_for(*fresh())
    assert len(calls) == 1 and store.is_file()
    assert [p.name for p in store.parent.iterdir()] == ["verify_cost.json"]  # no temporary file left
    again = cost_model.verify_cost_for(*fresh())
    assert len(calls) == 1 and again.seconds == first.seconds  # read back, not measured
    # entries of a model file that is gone (a test's temporary model), or too old to be read, are
    # dropped when the next profile is stored
    profiles = json.loads(store.read_text())
    (live,) = profiles
    gone = live.replace(str(weights.resolve()), str(tmp_path / "deleted" / "model"))
    stale = live.replace("probe", "older-probe")
    profiles[gone] = dict(profiles[live])
    profiles[stale] = dict(profiles[live], measured_at=time.time() - cost_model.PROFILE_MAX_AGE_S - 1)
    store.write_text(json.dumps(profiles))

    os.utime(weights, ns=(time.time_ns(), time.time_ns() + 10**9))  # another version of the file
    cost_model.verify_cost_for(*fresh())
    assert len(calls) == 2
    assert len(json.loads(store.read_text())) == 2 and gone not in json.loads(store.read_text())

    profiles = json.loads(store.read_text())
    for entry in profiles.values():
        entry["measured_at"] -= cost_model.PROFILE_MAX_AGE_S + 1
    store.write_text(json.dumps(profiles))
    cost_model.verify_cost_for(*fresh())
    assert len(calls) == 3  # too old: measured again

    store.write_text("{not json")
    cost_model.verify_cost_for(*fresh())
    assert len(calls) == 4 and json.loads(store.read_text())  # rewritten whole

    store.unlink()
    cost_model.verify_cost_for(*fresh(path=None))
    assert len(calls) == 5 and not store.exists()

    # a runner measures (or reads) its target's profile once, and keeps it for its generations
    m, cache = fresh()
    runner = ModelRunner(m)
    first = runner.verify_cost(cache)
    assert len(calls) == 6 and runner.verify_cost(cache) is first
    assert ModelRunner(m).verify_cost(cache).seconds == first.seconds and len(calls) == 6  # read back


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), max_size=12), st.floats(0.0, 0.5),
       st.lists(st.floats(0.01, 1.0), min_size=4, max_size=4))
def test_best_tree_size_against_brute_force(probs, fixed, steps):
    probs = sorted(probs, reverse=True)
    sizes = [1, 4, 8, 16]
    seconds = [sum(steps[: i + 1]) for i in range(4)]
    cost = VerifyCost(sizes, seconds)
    n, rate = best_tree_size(probs, fixed, cost)
    rates = [(1 + sum(probs[:k])) / (fixed + cost(k + 1)) for k in range(len(probs) + 1)]
    assert rate == pytest.approx(max(rates))
    assert rates[n] == pytest.approx(max(rates))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), max_size=12), st.floats(0.1, 50.0),
       st.lists(st.floats(0.01, 1.0), min_size=4, max_size=4))
def test_best_tree_gain_against_brute_force(probs, rate, steps):
    probs = sorted(probs, reverse=True)
    cost = VerifyCost([1, 4, 8, 16], [sum(steps[: i + 1]) for i in range(4)])
    n, value = best_tree_gain(probs, rate, cost)
    values = [1 + sum(probs[:k]) - rate * cost(k + 1) for k in range(len(probs) + 1)]
    assert value == pytest.approx(max(values))
    assert values[n] == pytest.approx(max(values))


def test_best_tree_gain_takes_a_row_worth_its_seconds():
    verify = VerifyCost([1, 2], [0.1, 0.12])  # a row: 0.02 s
    assert best_tree_gain([0.5], 10.0, verify)[0] == 1  # 0.5 tokens against 0.2 earned at 10 tokens/s
    assert best_tree_gain([0.5], 30.0, verify)[0] == 0  # against 0.6


def test_best_tree_size_follows_the_hardware():
    probs = [0.9, 0.8, 0.7, 0.5, 0.4, 0.3, 0.2, 0.1]
    flat = VerifyCost([1, 32], [0.1, 0.1])  # verification free up to 32 tokens: take every node
    steep = VerifyCost([1, 2], [0.1, 0.2])  # each node costs a whole forward: take none worth less than 1
    assert best_tree_size(probs, 0.0, flat)[0] == len(probs)
    assert best_tree_size(probs, 0.0, steep)[0] == 0


# ------------------------------------------------------- acceptance estimates
def test_chain_acceptance_counts_only_the_tokens_that_had_their_chance():
    acc = ChainAcceptance(n_buckets=2, max_depth=4, prior=0.5, strength=2.0)
    acc.update(1, verified=4, accepted=1)  # depth 0 accepted, depth 1 rejected, depths 2-3 never judged
    assert acc.seen[1] == [3.0, 3.0, 2.0, 2.0]
    assert acc.hits[1] == [2.0, 1.0, 1.0, 1.0]
    assert acc.seen[0] == [2.0] * 4  # other buckets untouched
    for _ in range(200):
        acc.update(0, verified=4, accepted=4)
    cum = acc.cumulative(0, 6)
    assert len(cum) == 4 and cum[-1] > 0.95
    assert all(a >= b for a, b in zip(cum, cum[1:]))


def _tries(acc: ChainAcceptance, verify: VerifyCost, judgements: int, accept_first: bool) -> list[int]:
    """``judgements`` one-token-or-nothing decisions for bucket 0; each drafted token is accepted or
    rejected as ``accept_first`` says.  Returns the judgements at which a token was drafted."""
    drafted = []
    for j in range(judgements):
        n = acc.size(Chain(0, 1), None, verify).length
        if n:
            drafted.append(j)
            acc.update(0, verified=1, accepted=int(accept_first))
    return drafted


def test_a_depth_judged_worthless_is_tried_again_and_learned():
    """The lock-in: one rejected first token put a bucket below a dear row's break-even (~0.36 here),
    and it was never drafted again, so never learned.  Now it is tried again after ``explore_after``
    judgements, and a bucket whose tokens are in fact accepted comes back for good."""
    verify = VerifyCost([1, 4], [1.0, 2.07])  # a row costs 0.36 of a forward (the AVX2-only VM's profile)
    acc = ChainAcceptance(n_buckets=1, max_depth=4)
    acc.update(0, verified=1, accepted=0)  # 1 of 3 with the prior: below break-even
    assert best_tree_size(acc.cumulative(0, 1), 0.0, verify)[0] == 0
    drafted = _tries(acc, verify, 40, accept_first=True)
    assert drafted[0] == 2 * acc.tries.explore_after - 1  # the rejection doubled the patience: tried at the 8th
    assert len(drafted) > 30  # then learned: drafted at (nearly) every judgement
    never = ChainAcceptance(n_buckets=1, max_depth=4, explore_after=0)  # exploration off: locked out
    never.update(0, verified=1, accepted=0)
    assert _tries(never, verify, 40, accept_first=True) == []


def test_tries_of_a_depth_that_never_pays_are_logarithmic():
    verify = VerifyCost([1, 4], [1.0, 2.07])
    acc = ChainAcceptance(n_buckets=1, max_depth=4)
    acc.update(0, verified=1, accepted=0)
    drafted = _tries(acc, verify, 4000, accept_first=False)
    # patience 8 (4, doubled by the first rejection), 16, 32, ...: each try waits twice as long
    assert drafted[:4] == [7, 23, 55, 119]
    assert len(drafted) <= 11
    # an accepted token starts the patience over
    acc.update(0, verified=1, accepted=1)
    assert acc.tries.patience((0, 0)) == acc.tries.explore_after


def test_a_depth_that_could_not_pay_is_never_tried():
    """A row dearer than what a sure token saves: no try, whatever the patience."""
    acc = ChainAcceptance(n_buckets=1, max_depth=4)
    acc.update(0, verified=1, accepted=0)
    assert _tries(acc, VerifyCost([1, 2], [1.0, 100.0]), 200, accept_first=True) == []


def test_a_deeper_depth_is_tried_beyond_a_chain_that_stops():
    """Exploration is per depth: a chain cut at one token gets its second token tried."""
    verify = VerifyCost([1, 4], [1.0, 2.07])
    acc = ChainAcceptance(n_buckets=1, max_depth=4)
    for _ in range(30):
        acc.update(0, verified=1, accepted=1)  # depth 0: always accepted; depth 1: the prior (0.5)
    lengths = [acc.size(Chain(0, 4), None, verify).length for _ in range(8)]
    assert min(lengths) >= 1 and max(lengths) >= lengths[0] + 1


def test_a_chain_is_sized_to_its_budget_and_learns_from_the_leading_run_of_its_nodes():
    """``size`` cuts at the budget before it sizes; ``learn`` counts the chain nodes (0, 1, ...) the verdict
    accepted in a row, over the nodes the verified tree still held."""
    free = VerifyCost([1, 64], [1.0, 1.0])
    acc = ChainAcceptance(n_buckets=2, max_depth=6)
    assert acc.size(Chain(1, 5), None, free) == Chain(1, 5) and acc.size(Chain(1, 5), 3, free) == Chain(1, 3)
    tree = TokenTree()
    for t in range(3):  # the chain's first three tokens survived (a fourth, a branch)
        tree.add(10 + t, t - 1)
    tree.add(20, -1)
    acc.learn(Chain(1, 5), tree, [0, 1, 3])  # nodes 0 and 1 on the chain, then a branch
    want = ChainAcceptance(n_buckets=2, max_depth=6)
    want.update(1, verified=4, accepted=2)
    assert acc.seen == want.seen and acc.hits == want.hits


def test_the_three_ways_of_sizing_are_sizers():
    """Chains, tries and level-by-level trees are sized through the same two calls."""
    for sizer in (ChainAcceptance(n_buckets=1, max_depth=2), TrieSizer(TryAgain()), TreeSizer()):
        assert isinstance(sizer, Sizer)
    assert not isinstance(AcceptanceCalibration(), Sizer)


def test_acceptance_calibration_learns_an_overconfident_draft():
    cal = AcceptanceCalibration()
    assert cal(0.95) == pytest.approx(0.95)  # starts from the identity
    rng = random.Random(0)
    for _ in range(2000):  # the draft says 0.95, the target agrees half the time
        cal.update(cal.bin(0.95), rng.random() < 0.5)
    assert cal(0.95) == pytest.approx(0.5, abs=0.05)
    assert cal(0.15) == pytest.approx(0.15)  # other bins keep their prior


# ---------------------------------------------------------- vocabulary subset
def _ctx(runner: ModelRunner) -> DecodeContext:
    return DecodeContext(runner, None, SamplingParams(), torch.Generator().manual_seed(0), 0, 0)


def test_subset_head_scores_exactly_the_chosen_rows(tiny):
    draft = tiny(seed=0, copy=7)  # vocab 259
    prompt = [3, 100, 200, 100, 258]
    runner = ModelRunner(draft)
    attrs = set(vars(draft)), set(vars(draft.model))
    head = subset_head(_ctx(runner), draft, 64, prompt)
    assert head is not None
    assert head.ids.tolist() == list(range(64)) + [100, 200, 258]
    ids = torch.tensor([[5, 100, 42]])
    full = draft.model.forward(ids, draft.model.new_cache(max_len=16))
    sub = draft.model.forward(ids, draft.model.new_cache(max_len=16), head=head)
    torch.testing.assert_close(sub, full[..., head.ids])
    assert subset_head(_ctx(runner), draft, 200, prompt) is None  # 259 <= 2 * 200: not worth a subset
    # the packed base rows are kept in the runner's memory (one per draft and size), not on the model
    again = subset_head(_ctx(runner), draft, 64, [7])
    assert again.base is head.base and again.ids.tolist() == list(range(64))
    assert subset_head(_ctx(ModelRunner(draft)), draft, 64, [7]).base is not head.base
    assert (set(vars(draft)), set(vars(draft.model))) == attrs


def test_subset_of_a_quantized_head_is_the_heads_own_rows():
    """On the default format's block-quantized head (``QLinear``) the subset slices the packed rows:
    its logits are the target's own logits for those ids, bit for bit, and the head is never
    dequantized to a float copy (``model.head_weight``)."""
    from leapdecode.models.kernel_library import kernel_problem
    from leapdecode.models.qkernel import QLinear

    if kernel_problem() is not None:
        pytest.skip(f"the block-quantized kernel is not available here: {kernel_problem()}")
    target = leapdecode.load("tiny-random", weights="int4")
    model = target.model
    assert isinstance(model.lm_head, QLinear)
    runner = ModelRunner(target)
    prompt = [3, 100, 200, 100, 258, 64]
    head = subset_head(_ctx(runner), target, 64, prompt)
    assert head.ids.tolist() == list(range(64)) + [64, 100, 200, 258]
    ids = torch.tensor([[5, 100, 42, 7]])
    full = model.forward(ids, model.new_cache(max_len=16))
    sub = model.forward(ids, model.new_cache(max_len=16), head=head)
    assert torch.equal(sub, full[..., head.ids])
    assert head.base.parts[0].codes.data_ptr() == model.lm_head.parts[0].codes.data_ptr()  # views, no copy
    assert getattr(model, "_head_weight", None) is None  # nothing dequantized
    assert subset_head(_ctx(runner), target, 64, [7]).extra is None  # no ids beyond the base rows


def test_draft_with_a_vocabulary_subset_equals_vanilla(tiny, fresh_runner):
    target = tiny(seed=0)
    runner = fresh_runner(target, verify_cost="flat", drafts={"copy-8": tiny(seed=0, copy=8)})
    for prompt in ("the cat sat on the mat the cat", "def f(x): return x", "hello hello hello"):
        want = leapdecode.generate(target, prompt, max_new_tokens=24, method="vanilla")
        gen = leapdecode.stream(runner, prompt, max_new_tokens=24, method="draft",
                                options={"draft": "copy-8", "draft_vocab": 64})
        got = gen.run()
        assert gen.proposer.head is not None and len(gen.proposer.head.ids) < 259  # the subset was used
        assert got.tokens == want.tokens
        assert got.stats["draft_forwards"] > 0


@pytest.mark.parametrize("opts", [dict(top_k=0), dict(beam=0), dict(max_depth=-1), dict(draft_vocab=-5),
                                  dict(tau=0.0), dict(tau=1.5), dict(context_window=0), dict(context_window=2.5)])
def test_draft_options_out_of_range(tiny, opts):
    with pytest.raises(InvalidParameterError):
        DraftModelProposer(tiny(seed=0, copy=9), **opts)
    with pytest.raises(InvalidParameterError, match=next(iter(opts))):
        method_config("draft", opts)


# ------------------------------------------------------------- staged speculation
def test_staged_speculation_drafts_several_levels_in_one_forward(tiny, fresh_runner):
    """On text that repeats, the automaton's guess runs through the draft in one forward and the
    draft agrees with it for several levels; the output is still exactly vanilla's.  (Own runner,
    flat verification cost: how deep the adaptive draft goes does not follow this machine's timings.)"""
    target = tiny(seed=0)
    # the target's weights: the draft agrees with the true continuation
    runner = fresh_runner(target, verify_cost="flat", drafts={"copy-10": tiny(seed=0, copy=10)})
    prompt = "the cat sat on the mat. " * 6
    want = leapdecode.generate(target, prompt, max_new_tokens=40, method="vanilla")
    on = leapdecode.generate(runner, prompt, max_new_tokens=40, method="draft", options={"draft": "copy-10"})
    off = leapdecode.generate(runner, prompt, max_new_tokens=40, method="draft",
                              options={"draft": "copy-10", "staged": False})
    assert on.tokens == want.tokens == off.tokens
    assert on.stats["staged_forwards"] > 0 and on.stats["staged_tokens"] > 0, on.stats
    assert "staged_forwards" not in off.stats


def test_a_probe_that_got_little_cpu_is_marked_contended_and_kept_for_minutes(tiny, tmp_path, monkeypatch):
    # the CPU time the process got against the wall time of its threads: a probe during which
    # other processes held the cores must not size trees for a week
    import dataclasses
    import json
    import time

    from leapdecode.core import cost_model

    monkeypatch.setenv("LEAPDECODE_CACHE", str(tmp_path / "cache"))
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"weights")
    lm = dataclasses.replace(tiny(seed=0), path=weights)

    def probe(**kw):
        cache = lm.model.new_cache(max_len=64)
        return cost_model.measure_verify_cost(lm, cache, sizes=(1, 4), repeats=1, **kw)

    full = lambda: time.perf_counter() * torch.get_num_threads()  # noqa: E731  every thread busy all along
    monkeypatch.setattr(cost_model, "process_seconds", full)
    assert not probe().contended
    monkeypatch.setattr(cost_model, "process_seconds", lambda: 0.0)  # no CPU time at all
    assert probe().contended

    calls = []
    real = cost_model.measure_verify_cost
    monkeypatch.setattr(cost_model, "measure_verify_cost",
                        lambda loaded, cache, **kw: calls.append(1) or real(loaded, cache, sizes=(1, 4), repeats=1))
    cache = lm.model.new_cache(max_len=64)
    first = cost_model.verify_cost_for(lm, cache)
    store = tmp_path / "cache" / "verify_cost.json"
    assert first.contended and json.loads(store.read_text()) and len(calls) == 1
    assert cost_model.verify_cost_for(lm, cache).contended and len(calls) == 1  # kept for now
    profiles = json.loads(store.read_text())
    for entry in profiles.values():
        entry["measured_at"] -= cost_model.CONTENDED_MAX_AGE_S + 1
    store.write_text(json.dumps(profiles))
    cost_model.verify_cost_for(lm, cache)
    assert len(calls) == 2  # minutes later: measured again (an uncontended one lasts a week)
    monkeypatch.setattr(cost_model, "process_seconds", full)
    profiles = json.loads(store.read_text())
    for entry in profiles.values():
        entry["measured_at"] -= cost_model.CONTENDED_MAX_AGE_S + 1
    store.write_text(json.dumps(profiles))
    assert not cost_model.verify_cost_for(lm, cache).contended and len(calls) == 3
    profiles = json.loads(store.read_text())
    for entry in profiles.values():
        entry["measured_at"] -= cost_model.CONTENDED_MAX_AGE_S + 1
    store.write_text(json.dumps(profiles))
    cost_model.verify_cost_for(lm, cache)
    assert len(calls) == 3  # not contended: still fresh


def test_a_runner_measures_again_after_a_contended_profile_expires(tiny, monkeypatch):
    # a long-lived runner (the server's) must not size trees for its whole life from a profile
    # measured while other processes held the cores; an uncontended one it keeps
    from leapdecode.core import cost_model, runner as runner_mod
    from leapdecode.core.runner import ModelRunner

    lm = tiny(seed=0)
    contended = [True]
    calls = []

    def fake(loaded, cache):
        calls.append(1)
        return cost_model.VerifyCost([1, 4], [0.01, 0.02], contended=contended[0])

    monkeypatch.setattr(cost_model, "verify_cost_for", fake)
    clock = [1000.0]
    monkeypatch.setattr(runner_mod.time, "monotonic", lambda: clock[0])
    runner = ModelRunner(lm)
    cache = lm.model.new_cache(max_len=64)
    assert runner.verify_cost(cache).contended and len(calls) == 1
    clock[0] += cost_model.CONTENDED_MAX_AGE_S - 1
    runner.verify_cost(cache)
    assert len(calls) == 1  # still fresh
    contended[0] = False
    clock[0] += 2
    assert not runner.verify_cost(cache).contended and len(calls) == 2  # expired: measured again
    clock[0] += 10 * cost_model.CONTENDED_MAX_AGE_S
    runner.verify_cost(cache)
    assert len(calls) == 2  # an uncontended profile stays for the process's life


def test_a_pessimistic_draft_sizer_learns_again(tiny, fresh_runner, pessimistic_sizers):
    """Issue 46 (as for eagle, tests/test_heads.py): the draft model's tree sizer noted the draft's
    forward time and best child only for deeper levels, so a pessimistic state (a slow first forward)
    stopped deeper drafting for good. The root's forward teaches it at every step."""
    import leapdecode.proposers.draft_model as draft_module

    made = pessimistic_sizers(draft_module)
    target = tiny(seed=0)
    runner = fresh_runner(target, verify_cost="flat", drafts={"copy-8": tiny(seed=0, copy=8)})
    prompt = "the cat sat on the mat the cat"
    got = leapdecode.generate(runner, prompt, max_new_tokens=24, method="draft", options={"draft": "copy-8"})
    assert got.tokens == leapdecode.generate(target, prompt, max_new_tokens=24, method="vanilla").tokens
    assert len(made) == 1 and made[0].forward_s < 5.0 and made[0].top_accept > 0.01, vars(made[0])
