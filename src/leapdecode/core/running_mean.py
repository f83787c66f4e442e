"""The one running-mean rule of what drafters and cost models learn online.

``discounted_mean`` moves a mean towards a new observation by that observation's weight: the plain
mean's ``1 / count`` while it is larger than ``rate``, ``rate`` after (an exponentially discounted
mean, which follows a drifting quantity: a machine's speed, a drafter's step rate).  The arithmetic,
``mean + weight * (x - mean)``, is the one the call sites used before it was shared, kept bit for
bit (a learned value steers greedy tree sizes; moving to ``(1 - w) * mean + w * x`` would change
its last bits).
"""

from __future__ import annotations


def discounted_mean(mean: float, x: float, rate: float, count: float | None = None) -> float:
    """``mean`` after one more observation ``x``: weighted ``rate``, or with ``count`` (the
    observations so far, this one included) ``max(1 / count, rate)``."""
    weight = rate if count is None else max(1.0 / count, rate)
    return mean + weight * (x - mean)
