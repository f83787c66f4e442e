"""The load-adaptive speculation gate of the batched engine (``core/batch.py``'s
``SpeculationScheduler``, issue 14 section 2: "speculation that helps at batch 1 must not hurt
throughput at batch 8").

1. ``BatchCost`` (``core/batch_cost.py``) recovers a linear batched-forward cost from
   observations, and keeps its prior for what it never sees vary.
2. ``SpeculationScheduler.plan`` on stand-in generations: free rows and high acceptance give full
   trees, costly rows or low acceptance a plain step (no proposer at all); the budget goes to the
   sequences with the highest acceptance; a gated sequence is re-probed after its own plain steps.
3. The engine with oracle proposers (they know each request's solo greedy output): one that is
   never accepted is (almost) never asked to draft after the warm-up, one that is always accepted
   keeps drafting, both mixed in one batch, one that turns good mid-way comes back; every output
   equals its solo greedy output.  A planted check: without the gate the never-accepted proposer
   drafts at every step (so the tests' counts can fail).
4. Seeded sampled requests: planned like any other (drafter-invariant sampling), and the text is
   the same alone and under load.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

import leapdecode
from leapdecode import ModelRunner
from leapdecode.core.batch import PROBE_FIRST, PROBE_ROWS, LoadGuard, Outcome, SpeculationScheduler
from leapdecode.core.batch_cost import BatchCost
from leapdecode.core.cost_model import VerifyCost
from leapdecode.core.generate import Generation
from leapdecode.core.proposer import Proposer
from leapdecode.core.sampling import SamplingParams
from leapdecode.core.tree import TokenTree
from leapdecode.errors import InvalidParameterError
from leapdecode.proposers import method_config
from leapdecode.request import GenerationRequest
from leapdecode.server.engine import Engine, Finished, GenSpec

from helpers.server import collect_job_events

# a plausible single-sequence profile in seconds (no timing probe): rows cost a little each
PROFILE = VerifyCost([1, 16, 32], [1e-3, 1.6e-3, 2.4e-3])


@pytest.fixture(scope="module")
def q4(q4_tiny):
    return q4_tiny


def new_runner(model) -> ModelRunner:
    runner = ModelRunner(model)
    runner.verify_cost = lambda cache: PROFILE
    return runner


# ============================================================================ 1. BatchCost
def test_batch_cost_fits_a_linear_cost_and_keeps_its_prior_for_what_never_varies():
    truth = (2e-3, 1e-3, 4e-4, 1e-4)  # fixed, per item, per tree row, per prefill row
    cost = BatchCost(PROFILE, discount=1.0)
    for items in range(1, 9):
        for rows in (0, 3, 10, 24):
            for pre in (0, 100):
                cost.observe(items, rows, pre, truth[0] + truth[1] * items + truth[2] * rows + truth[3] * pre)
    a, b, c, e = cost.coefficients()  # the ridge pull may trade a little of b for a; rows are what decide
    assert c == pytest.approx(truth[2], rel=0.05) and e == pytest.approx(truth[3], rel=0.05)
    for items, rows in ((1, 0), (4, 8), (8, 24)):
        assert cost(items, rows) == pytest.approx(truth[0] + truth[1] * items + truth[2] * rows, rel=0.05)
    # plain steps only: the per-row cost stays at the prior (the profile's slope), not 0 or noise
    plain = BatchCost(PROFILE, discount=1.0)
    for items in range(1, 9):
        plain.observe(items, 0, 0, 2e-3 + 1e-3 * items)
    assert plain.row_seconds() == pytest.approx(plain.prior[2], rel=0.01)
    assert plain(5) == pytest.approx(2e-3 + 5e-3, rel=0.1)
    with pytest.raises(ValueError):
        BatchCost(PROFILE, discount=0.0)


# ============================================================================ 2. plan()
class FixedCost:
    """A BatchCost stand-in: ``base`` + ``item`` per sequence + ``row`` per draft row."""

    def __init__(self, row: float, base: float = 0.01, item: float = 0.005) -> None:
        self.row, self.base, self.item = row, base, item

    def row_seconds(self) -> float:
        return self.row

    def __call__(self, items, tree_rows=0, prefill_rows=0):
        return self.base + self.item * items + self.row * tree_rows

    def observe(self, *args) -> None:
        pass


def fake_gen(seed=None, temperature=0.0, budget=8):
    return SimpleNamespace(proposer=object(), finished=False, done=False, tree_budget=budget, decoding=True, prefilling=False,
                           cache=object(), prompt_ids=[1, 2, 3],
                           params=SamplingParams(temperature=temperature, seed=seed))


def scheduler_with(row: float) -> SpeculationScheduler:
    cost = FixedCost(row)
    return SpeculationScheduler(SimpleNamespace(batch_cost=lambda cache: cost))


def teach(sched, gen, drafted, accepted, times=6):
    st = sched.stats_for(gen)
    for _ in range(times):
        st.update(drafted, accepted)


def test_plan_gives_trees_where_acceptance_pays_and_a_plain_step_where_nothing_does():
    gens = [fake_gen() for _ in range(4)]
    cheap = scheduler_with(row=1e-5)
    teach(cheap, gens[0], 8, 8)  # always accepted
    teach(cheap, gens[1], 8, 0)  # never accepted
    caps = cheap.plan(gens)
    assert caps[0] == 8 and caps[1] < caps[0]  # nearly free rows: even poor drafts may pay, good ones more
    # rows as costly as a sequence each: even a well-accepted draft does not pay at this batch
    dear = scheduler_with(row=0.05)
    for g in gens:
        teach(dear, g, 8, 1)
    assert dear.plan(gens) == [0, 0, 0, 0]
    # rows of middling cost: the rows go to the sequence whose drafts are accepted most
    mid = scheduler_with(row=2e-3)
    teach(mid, gens[0], 8, 8)
    teach(mid, gens[1], 8, 1)
    teach(mid, gens[2], 8, 0)
    caps = mid.plan(gens[:3])
    assert caps[0] == 8 and 0 < caps[1] < caps[0] and caps[2] == 0


def test_proposer_time_gates_a_sequence_whose_rows_alone_would_pay():
    gens = [fake_gen(), fake_gen()]
    sched = scheduler_with(row=1e-5)
    teach(sched, gens[0], 8, 1)  # p = 0.5: the first row's gain pays for its row
    assert sched.plan(gens)[0] > 0
    sched.stats_for(gens[0]).extra = 0.5  # ... but not for half a second of proposer time
    sched._plain_host = 1e-4
    assert sched.plan(gens)[0] == 0


def test_a_gated_sequence_is_reprobed_after_its_own_plain_steps():
    g = fake_gen()
    sched = scheduler_with(row=0.05)
    teach(sched, g, 8, 0)
    st = sched.stats_for(g)
    assert sched.plan([g]) == [0]
    st.plain_run = PROBE_FIRST
    assert sched.plan([g]) == [min(PROBE_ROWS, g.tree_budget)] and st.planned == "probe"


def test_seeded_sequences_are_planned_by_the_cost_like_greedy_ones():
    # drafter-invariant sampling: a seeded text does not depend on its trees, so a seeded sequence
    # with the same acceptance as a greedy one gets the same cap, full trees when rows are free and
    # a plain step when they are dear
    caps = []
    for row in (1e-6, 0.05):
        sched = scheduler_with(row)
        seeded, greedy = fake_gen(seed=3, temperature=0.8), fake_gen()
        for g in (seeded, greedy):
            teach(sched, g, 8, 3, times=4)
        caps.append(sched.plan([seeded, greedy] + [fake_gen() for _ in range(6)])[:2])
    assert caps[0][0] == caps[0][1] > 0
    assert caps[1] == [0, 0]


def drive(guard: LoadGuard, rates: dict[str, float], decoding: int, iterations: int) -> dict[str, int]:
    """Run ``iterations`` through ``guard`` at one load, each arm committing ``rates[arm]`` tokens
    per second (one token per sequence and iteration); returns how often each arm ran."""
    runs = {"spec": 0, "plain": 0}
    for _ in range(iterations):
        arm = guard.arm(decoding)
        runs[arm] += 1
        guard.record(decoding, arm, decoding, decoding / rates[arm])
    return runs


def test_load_guard_runs_the_arm_that_measures_faster_and_keeps_checking_the_other():
    window, probe, explore = LoadGuard.WINDOW, LoadGuard.PROBE_WINDOW, LoadGuard.EXPLORE
    share = probe / ((explore - 1) * window + probe)  # of the iterations, the arm behind gets at most this
    guard = LoadGuard()
    runs = drive(guard, {"spec": 100.0, "plain": 80.0}, decoding=8, iterations=400)
    # its first window (plain is not measured yet), then looks back at it: at least three times in 400
    assert runs["spec"] > runs["plain"] >= window + 3 * probe, runs
    assert runs["plain"] <= share * 400 + 2 * window, runs
    assert guard.rate(LoadGuard.level(8), "spec") == pytest.approx(100.0)
    # at another load level plain decoding wins: the guard learns that level on its own
    runs = drive(guard, {"spec": 70.0, "plain": 80.0}, decoding=16, iterations=400)
    assert runs["plain"] > runs["spec"] and runs["spec"] <= share * 400 + 2 * window, runs
    assert drive(guard, {"spec": 100.0, "plain": 80.0}, decoding=8, iterations=80)["spec"] >= 48
    # the text drifts at level 8: plain becomes faster, and the guard follows within some windows
    drive(guard, {"spec": 50.0, "plain": 80.0}, decoding=8, iterations=200)
    assert drive(guard, {"spec": 50.0, "plain": 80.0}, decoding=8, iterations=200)["plain"] >= 140
    assert [LoadGuard.level(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [0, 1, 2, 2, 3, 3, 4, 4, 5]


def test_load_guard_looks_back_less_often_while_the_order_holds_and_soon_again_when_it_changes():
    window, probe = LoadGuard.WINDOW, LoadGuard.PROBE_WINDOW
    guard = LoadGuard()
    drive(guard, {"spec": 100.0, "plain": 80.0}, decoding=8, iterations=2000)
    # settled: one look of ``probe`` iterations every EXPLORE_MAX windows (about 2% of the iterations)
    late = drive(guard, {"spec": 100.0, "plain": 80.0}, decoding=8, iterations=1000)
    assert 0 < late["plain"] <= probe * (1000 // (LoadGuard.EXPLORE_MAX * window) + 1), late
    # plain becomes faster: the next look (at most EXPLORE_MAX windows away) finds it, and it leads
    rates = {"spec": 100.0, "plain": 150.0}
    for n in range((LoadGuard.EXPLORE_MAX + 2) * window):
        arm = guard.arm(8)
        guard.record(8, arm, 8, 8 / rates[arm])
        if arm == "plain" and guard.leader(8) == "plain":
            break
    assert guard.leader(8) == "plain", n
    # a new leader: spec, behind now, is looked at again within EXPLORE windows, not EXPLORE_MAX
    soon = drive(guard, rates, decoding=8, iterations=(LoadGuard.EXPLORE + 2) * window)
    assert soon["spec"] >= probe and soon["plain"] > soon["spec"], soon


def test_a_prefill_iteration_follows_the_guards_leader():
    gens = [fake_gen() for _ in range(4)]
    newcomer = SimpleNamespace(proposer=object(), finished=False, done=False, tree_budget=8, decoding=False, prefilling=True,
                               cache=object(), prompt_ids=list(range(40)), params=SamplingParams(),
                               next_chunk_tokens=lambda: 39)
    sched = scheduler_with(row=1e-5)
    for g in gens:
        teach(sched, g, 8, 8)
    level = LoadGuard.level(4)
    assert sched.guard.leader(4) == "spec"  # nothing measured: the plan decides
    assert sched.plan(gens + [newcomer])[:4] == [8, 8, 8, 8]
    state = sched.guard._state(level)
    state["tokens"].update(spec=100.0, plain=100.0)
    state["seconds"].update(spec=2.0, plain=1.0)  # plain decoding measured twice as fast at this load
    assert sched.guard.leader(4) == "plain"
    assert sched.plan(gens + [newcomer])[:4] == [0, 0, 0, 0]
    outcomes = [Outcome(output=SimpleNamespace(tokens=[5], finished=False), drafted=0) for _ in gens] + [Outcome()]
    sched.record(gens + [newcomer], outcomes, None)
    assert all(sched.stats_for(g).plain_run == 0 for g in gens)  # as the guard's own plain iterations
    assert sched.guard.rate(level, "plain") == pytest.approx(100.0)  # a prefill iteration is not measured
    state["seconds"].update(spec=1.0, plain=2.0)
    assert sched.plan(gens + [newcomer])[:4] == [8, 8, 8, 8]


def test_the_guards_plain_arm_plans_no_draft_and_brings_no_reprobe_nearer():
    gens = [fake_gen() for _ in range(4)]
    sched = scheduler_with(row=1e-5)
    for g in gens:
        teach(sched, g, 8, 8)
    assert sched.plan(gens) == [8, 8, 8, 8]  # the guard's first window is the plan's
    sched.guard._state(LoadGuard.level(4)).update(arm="plain", left=3)
    assert sched.plan(gens) == [0, 0, 0, 0]
    outcomes = [Outcome(output=SimpleNamespace(tokens=[5], finished=False), drafted=0) for _ in gens]
    sched.record(gens, outcomes, None)
    assert all(sched.stats_for(g).plain_run == 0 for g in gens)
    assert sched.counters["guard_plain_iterations"] == 1
    assert sched.guard.rate(LoadGuard.level(4), "plain") > 0.0
    # without the guard the plan stands alone
    sched.guard = None
    assert sched.plan(gens) == [8, 8, 8, 8]


def test_bad_speculation_mode_is_a_typed_error(q4):
    with pytest.raises(InvalidParameterError, match="speculation"):
        Engine(new_runner(q4), speculation="always")


# ============================================================================ 3. the engine, oracles
class Oracle(Proposer):
    """Drafts from the request's known solo greedy output ``ref``: the right tokens (``good``
    decides, per output position) or each one plus one (never accepted).  Counts its work."""

    name = "oracle"

    def __init__(self, prompt_len: int, ref: list[int], vocab: int, good) -> None:
        super().__init__(8)
        self.prompt_len, self.ref, self.vocab, self.good = prompt_len, ref, vocab, good
        self.calls: list[int] = []  # the output position of each propose()

    def propose(self, tokens, budget):
        pos = len(tokens) - self.prompt_len
        self.calls.append(pos)
        chain = self.ref[pos : pos + budget]
        if not self.good(pos):
            chain = [(t + 1) % self.vocab for t in chain]
        return TokenTree.chain(chain)


@dataclass(frozen=True)
class OracleSpec(GenSpec):
    oracle: Oracle | None = None

    def start(self, runner):
        return Generation(runner, self.prompt_ids, self.request.sampling, proposer=self.oracle, method="oracle",
                          max_new_tokens=self.request.max_new_tokens, tree_budget=8)


def prompt(model, k: int) -> list[int]:
    return model.tokenizer.encode(["the cat sat on the mat ", "def f(x): return x ", "hello there ",
                                   "abc abc abc "][k % 4] + str(k))


def reference(model, ids, n) -> list[int]:
    return leapdecode.generate(new_runner(model), prompt_ids=ids, method="vanilla", max_new_tokens=n).tokens


def run_oracles(model, goods, n=48, cost=None, **engine_kwargs):
    """One job per entry of ``goods`` (each an acceptance rule), all at once; returns (oracles,
    outputs, references, engine scheduler counters).  ``cost``: a fixed batched-forward cost
    instead of the measured one, and no measured host time (so the decisions do not depend on
    this machine's load)."""
    runner = new_runner(model)
    if cost is not None:
        runner.batch_cost = lambda cache: cost
    vocab = model.model.cfg.vocab_size
    specs, refs = [], []
    for k, good in enumerate(goods):
        ids = prompt(model, k)
        ref = reference(model, ids, n)
        refs.append(ref)
        specs.append(OracleSpec(ids, GenerationRequest(method_config("vanilla"), SamplingParams(), n),
                                oracle=Oracle(len(ids), ref + [0] * 16, vocab, good)))
    engine = Engine(runner, max_batch=len(goods), **engine_kwargs)
    if cost is not None and engine.scheduler is not None:  # and no host time either: no clock decides
        sched = engine.scheduler
        sched._host = lambda st, seconds: SpeculationScheduler._host(sched, st, 0.0)
        sched.guard = None  # nor the load guard's measured throughput
    try:
        async def go():
            return await asyncio.gather(*(collect_job_events(engine, [s]) for s in specs))

        events = asyncio.run(go())
        counters = dict(engine.scheduler.counters) if engine.scheduler is not None else None
    finally:
        engine.stop()
    outs = [next(e for e in ev if isinstance(e, Finished)).result.tokens for ev in events]
    return [s.oracle for s in specs], outs, refs, counters


def never(pos):
    return False


def always(pos):
    return True


def test_never_accepted_proposer_is_gated_off_after_the_warm_up(q4):
    oracles, outs, refs, counters = run_oracles(q4, [never] * 4, n=64)
    assert outs == refs
    for o in oracles:
        late = [p for p in o.calls if p >= 16]  # after the warm-up: re-probes only
        assert len(late) <= 3, o.calls
    assert counters["speculative_steps"] <= 0.2 * counters["decode_steps"], counters


def test_planted_without_the_gate_the_never_accepted_proposer_drafts_every_step(q4):
    oracles, outs, refs, counters = run_oracles(q4, [never] * 4, n=64, speculate_under_load=False)
    assert outs == refs and counters is None
    for o in oracles:
        assert len([p for p in o.calls if p >= 16]) >= 40  # what the gated test must not see


# a machine where a draft row costs a fifth of a sequence's share of the forward
MACHINE = FixedCost(row=2e-4, base=1e-3, item=1e-3)


def test_always_accepted_proposer_keeps_speculating(q4):
    oracles, outs, refs, counters = run_oracles(q4, [always] * 4, n=64, cost=MACHINE)
    assert outs == refs
    for o, out in zip(oracles, outs):
        steps = len(o.calls)
        assert steps <= len(out) // 3, (steps, len(out))  # most tokens came from accepted drafts
    assert counters["speculative_steps"] >= 0.8 * counters["decode_steps"], counters


def test_mixed_batch_spends_the_rows_where_drafts_are_accepted(q4):
    oracles, outs, refs, counters = run_oracles(q4, [always, never, always, never], n=64, cost=MACHINE)
    assert outs == refs
    good, bad = oracles[0::2], oracles[1::2]
    assert all(len([p for p in o.calls if p >= 16]) <= 3 for o in bad), [o.calls for o in bad]
    assert all(len(o.calls) <= 64 // 3 for o in good), [o.calls for o in good]


def test_a_gated_sequence_comes_back_when_its_drafts_turn_good(q4):
    def late(pos):
        return pos >= 24

    oracles, outs, refs, _ = run_oracles(q4, [late, never], n=120, cost=MACHINE)
    assert outs == refs
    o = oracles[0]
    # gated during the bad part; back within a probe gap or two after the switch
    assert len([p for p in o.calls if 12 <= p < 24]) <= 2, o.calls
    first_good = min((p for p in o.calls if p >= 24), default=None)
    assert first_good is not None and first_good <= 24 + 2 * 4 * PROBE_FIRST, o.calls
    steps_after = len([p for p in o.calls if p >= first_good])
    assert steps_after <= (len(outs[0]) - first_good) // 3 + 2, o.calls  # long accepted chains from then on


# ============================================================================ 4. seeded sampling
def test_seeded_sampled_text_is_the_same_alone_and_under_load(q4):
    ids = prompt(q4, 3) * 3  # repetitive: pld finds matches, so trees matter for the draws
    seeded = GenSpec(ids, GenerationRequest(method_config("pld"), SamplingParams(temperature=0.8, seed=11), 40))
    others = [GenSpec(prompt(q4, k), GenerationRequest(method_config(m), SamplingParams(), 40))
              for k, m in enumerate(["pld", "vanilla", "sam"])]

    def run(specs):
        engine = Engine(new_runner(q4), max_batch=4)
        try:
            async def go():
                return await asyncio.gather(*(collect_job_events(engine, [s]) for s in specs))

            events = asyncio.run(go())
        finally:
            engine.stop()
        return [next(e for e in ev if isinstance(e, Finished)).result for ev in events]

    alone = run([seeded])[0]
    loaded = run([seeded] + others)
    assert loaded[0].tokens == alone.tokens and loaded[0].text == alone.text
    for spec, res in zip(others, loaded[1:]):  # greedy ones: their solo output
        ref = leapdecode.generate(new_runner(q4), prompt_ids=spec.prompt_ids, method=spec.request.method.method,
                                  max_new_tokens=40)
        assert res.tokens == ref.tokens
