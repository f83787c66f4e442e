"""The one running-mean rule of what drafters and cost models learn online.

``discounted_mean`` moves a mean towards a new observation by that observation's weight: the plain
mean's ``1 / count`` while it is larger than ``rate``, ``rate`` after (an exponentially discounted
mean, which follows a drifting quantity: a machine's speed, a drafter's step rate).  The arithmetic,
``mean + weight * (x - mean)``, is the one the call sites used before it was shared, kept bit for
bit (a learned value steers greedy tree sizes; moving to ``(1 - w) * mean + w * x`` would change
its last bits).

``DiscountedMean`` is the same rule with a discounted count: each observation counts ``discount``
less for every one after it, and the mean takes each with weight ``1 / count`` (``rate`` 0).  That
is the ratio of discounted sums ``sum(discount ** age * x) / sum(discount ** age)`` kept as a
mean, the form for a mean whose start is a prior worth a few observations that fades like them.
"""

from __future__ import annotations


def discounted_mean(mean: float, x: float, rate: float, count: float | None = None) -> float:
    """``mean`` after one more observation ``x``: weighted ``rate``, or with ``count`` (the
    observations so far, this one included) ``max(1 / count, rate)``."""
    weight = rate if count is None else max(1.0 / count, rate)
    return mean + weight * (x - mean)


class DiscountedMean:
    """A running mean of observations discounted by ``discount`` each (1: the plain mean).

    ``count`` is the discounted number of observations (``discount * count + 1`` after each), and
    ``mean`` moves by ``discounted_mean`` with that count and no floor rate: mathematically the
    ratio ``S / N`` of the discounted sums ``S = discount * S + x``, ``N = discount * N + 1``
    (``m + (x - m) / N``), not bit for bit.  The start, ``mean`` worth ``count`` observations, is
    a prior that is discounted like an observation."""

    __slots__ = ("mean", "count", "discount")

    def __init__(self, mean: float, count: float, discount: float) -> None:
        if not 0.0 < discount <= 1.0:
            raise ValueError(f"discount must be in (0, 1], got {discount}")
        if count < 0.0:
            raise ValueError(f"count must be >= 0, got {count}")
        self.mean, self.count, self.discount = mean, count, discount

    def add(self, x: float) -> float:
        """One more observation ``x``; returns the new mean."""
        self.count = self.discount * self.count + 1.0
        self.mean = discounted_mean(self.mean, x, 0.0, self.count)
        return self.mean
