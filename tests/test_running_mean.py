"""``core/running_mean.py``: the one running-mean rule (``discounted_mean``) and its discounted-count
form (``DiscountedMean``), which is the ratio of discounted sums kept as a mean."""

from __future__ import annotations

import random

import pytest

from leapdecode.core.running_mean import DiscountedMean, discounted_mean


def test_discounted_mean_weights_by_rate_or_by_count_down_to_the_rate():
    assert discounted_mean(1.0, 3.0, 0.25) == 1.5
    assert discounted_mean(1.0, 3.0, 0.25, count=2) == 2.0  # 1/2 > 0.25
    assert discounted_mean(1.0, 5.0, 0.25, count=8) == 2.0  # 1/8 < 0.25: the rate
    assert discounted_mean(7.0, 3.0, 0.0, count=1) == 3.0  # the first observation is the mean


@pytest.mark.parametrize("discount", [0.5, 0.85, 0.97, 1.0])
def test_discounted_mean_class_is_the_ratio_of_discounted_sums(discount):
    rng = random.Random(5)
    prior, prior_count = 0.5, 2.0
    m = DiscountedMean(prior, prior_count, discount)
    s, n = prior * prior_count, prior_count  # S = g * S + x, N = g * N + 1
    for _ in range(500):
        x = rng.random() * rng.choice([1.0, 10.0])
        s, n = discount * s + x, discount * n + 1.0
        assert m.add(x) == m.mean
        assert m.mean == pytest.approx(s / n, rel=1e-12, abs=1e-15)
        assert m.count == pytest.approx(n, rel=1e-12)


def test_discounted_mean_class_without_discount_is_the_plain_mean():
    xs = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    m = DiscountedMean(0.0, 0.0, 1.0)
    for x in xs:
        m.add(x)
    assert m.count == len(xs) and m.mean == pytest.approx(sum(xs) / len(xs), rel=1e-15)
    # a prior worth two observations is two observations of the prior
    m = DiscountedMean(10.0, 2.0, 1.0)
    for x in xs:
        m.add(x)
    assert m.mean == pytest.approx((20.0 + sum(xs)) / (2 + len(xs)), rel=1e-15)


def test_discounted_mean_class_rejects_a_discount_outside_0_1_and_a_negative_count():
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError):
            DiscountedMean(0.0, 1.0, bad)
    with pytest.raises(ValueError):
        DiscountedMean(0.0, -1.0, 0.9)


def test_autos_bandit_keeps_each_arms_reward_as_a_discounted_mean():
    """``auto``'s bandit: every update discounts the context's counts, and the arm's mean takes the
    reward with weight 1 / its discounted count: the ratio of discounted sums per (context, arm),
    whose sums are discounted at every update of the context (any arm's)."""
    from leapdecode.proposers.auto import BanditStats

    rng, g = random.Random(3), 0.9
    bandit = BanditStats(["a", "b"], discount=g, explore=0.15)
    sums = {(c, a): [0.0, 0.0] for c in (0, 1) for a in ("a", "b")}
    for _ in range(300):
        ctx, arm, reward = rng.randrange(2), rng.choice("ab"), rng.random() * 20
        for a in "ab":
            if (ctx, a) in bandit.n:
                sums[(ctx, a)][0] *= g
                sums[(ctx, a)][1] *= g
        sums[(ctx, arm)][0] += reward
        sums[(ctx, arm)][1] += 1.0
        bandit.update(ctx, arm, reward)
        s, n = sums[(ctx, arm)]
        assert bandit.n[(ctx, arm)] == pytest.approx(n, rel=1e-12)
        assert bandit.mean[(ctx, arm)] == pytest.approx(s / n, rel=1e-9)
