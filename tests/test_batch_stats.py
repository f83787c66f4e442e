"""The batched scheduler's running statistics (``core/batch.py``'s ``SpeculationScheduler``) on
``core/running_mean.py``'s rule: the pooled acceptance (a ``DiscountedMean``), the plain-step and
extra host seconds (``discounted_mean`` at a rate) learn what the discounted sums they replaced
learned, up to the last bits; the statistics that are not means (a sequence's acceptance with its
prior, the guard's tokens per second, ``BatchCost``'s least squares) keep their sums, with their
rates named."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from leapdecode.core.batch import LoadGuard, Outcome, SequenceStats, SpeculationScheduler
from leapdecode.core.batch_cost import BatchCost
from leapdecode.core.cost_model import VerifyCost


class OldArithmetic:
    """The scheduler's statistics as its discounted sums computed them before ``running_mean``."""

    def __init__(self) -> None:
        self.pool_sum, self.pool_n = 1.0, 2.0
        self.plain_host = self.spec_extra = None
        self.extra: dict[int, float | None] = {}

    def host(self, key, seconds):
        d = 0.9
        if key is None:
            self.plain_host = seconds if self.plain_host is None else d * self.plain_host + (1 - d) * seconds
            return
        e = self.extra.get(key)
        self.extra[key] = seconds if e is None else 0.5 * e + 0.5 * seconds
        self.spec_extra = seconds if self.spec_extra is None else d * self.spec_extra + (1 - d) * seconds

    def step(self, key, drafted, tokens, finished, host_s):
        if key is None or not drafted:
            self.host(None, host_s)
            return
        if not finished:
            accepted = min(max(tokens - 1, 0), drafted)
            self.pool_sum = 0.97 * self.pool_sum + accepted / (accepted + (accepted < drafted))
            self.pool_n = 0.97 * self.pool_n + 1.0
        self.host(key, host_s - (self.plain_host or 0.0) * max(tokens, 1))

    def pooled_rate(self):
        return min(max(self.pool_sum / self.pool_n, 0.01), 0.97)


def test_the_schedulers_running_means_learn_what_the_discounted_sums_learned():
    rng = random.Random(11)
    sched = SpeculationScheduler(SimpleNamespace(batch_cost=lambda cache: None), guard=False)
    old = OldArithmetic()
    gens = [SimpleNamespace(proposer=object() if i else None, done=False, cache=None) for i in range(4)]
    for _ in range(300):
        outcomes = []
        for i, g in enumerate(gens):
            drafted = rng.choice([0, 1, 4, 8]) if g.proposer is not None else 0
            tokens = rng.randint(1, drafted + 1)
            finished = rng.random() < 0.05
            host_s = rng.uniform(1e-4, 3e-3)
            outcomes.append(Outcome(output=SimpleNamespace(tokens=[0] * tokens, finished=finished),
                                    drafted=drafted, host_s=host_s))
            old.step(i if g.proposer is not None else None, drafted, tokens, finished, host_s)
        sched.record(gens, outcomes, None)
        assert sched.pooled_rate() == pytest.approx(old.pooled_rate(), rel=1e-12)
        assert sched._plain_host == pytest.approx(old.plain_host, rel=1e-12)
        assert sched._spec_extra == pytest.approx(old.spec_extra, rel=1e-9, abs=1e-15)
        for i, g in enumerate(gens[1:], 1):
            want = old.extra.get(i)
            got = sched.stats_for(g).extra
            assert (got is None) == (want is None) and (want is None or got == pytest.approx(want, rel=1e-9, abs=1e-15))


def test_the_pooled_acceptance_starts_at_its_prior_and_keeps_its_clamps():
    sched = SpeculationScheduler(SimpleNamespace(batch_cost=lambda cache: None), guard=False)
    assert sched.pooled_rate() == SpeculationScheduler.POOL_PRIOR == 0.5
    assert sched._pool.count == SpeculationScheduler.POOL_PRIOR_STEPS
    for _ in range(400):
        sched._pool.add(1.0)
    assert sched.pooled_rate() == 0.97  # clamped: the mean itself is ~1
    for _ in range(1000):
        sched._pool.add(0.0)
    assert sched.pooled_rate() == 0.01


def test_the_statistics_that_are_not_means_keep_their_named_rates():
    assert SequenceStats.DISCOUNT == 0.85 and SequenceStats.PRIOR_WEIGHT == 0.5
    st = SequenceStats()
    st.update(4, 2)  # 2 hits, 3 trials
    assert st.accept_rate(0.4) == pytest.approx((2 + 0.5 * 0.4) / (3 + 0.5))
    assert LoadGuard.DISCOUNT == 0.85
    cost = BatchCost(VerifyCost([1, 16, 32], [1e-3, 1.6e-3, 2.4e-3]))
    assert cost.discount == BatchCost.DISCOUNT == 0.97
    assert SpeculationScheduler.HOST_RATE == 0.1 and SpeculationScheduler.EXTRA_RATE == 0.5
