"""What a batched target forward costs, measured online (the batched scheduler's cost model,
``core/batch.py``)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .cost_model import VerifyCost


class BatchCost:
    """Seconds of one batched target forward (``core/batch.py``'s ``step_batch``), measured online.

    A linear model of the forward's wall time in what it holds: ``items`` (sequences, each with
    its root or prompt chunk: per-sequence attention and overhead, one logits row for a root),
    ``tree_rows`` (draft nodes: a row through every layer and the LM head) and ``prefill_rows``
    (prompt-chunk tokens past a chunk's first: no LM head),

        seconds = a + b * items + c * tree_rows + e * prefill_rows,

    fitted by exponentially discounted least squares (``discount`` per observation, so it follows
    the machine's load) with a ridge pull towards a prior read off the single-sequence verification
    profile (``VerifyCost``), worth ``prior_weight`` observations per coefficient.  The discounted
    sums (``x x^T`` and ``x * seconds``) are the fit's normal equations, not a running mean of
    anything observed, and the ridge is added to them undiscounted at each solve, so they stay sums
    rather than ``running_mean.discounted_mean`` means.  The pull keeps the coefficients defined
    while nothing varies: a scheduler that stops speculating stops seeing tree rows, and their cost
    then stays where it was last measured (or at the prior).

    Only load-dependent scheduling reads it (greedy and unseeded sampled tree sizes: any tree
    gives the same greedy tokens and an exact sample), never a seeded sequence's tree."""

    FEATURES = 4  # 1, items, tree_rows, prefill_rows
    # not measured; kept as they were: DISCOUNT set with the batched scheduler (commit 5398170),
    # PRIOR_WEIGHT lowered from 4.0 in the scheduler's revision (commit 6d8704e); the scheduler was
    # measured only as a whole (lab notes benchmarks.md section 14b)
    DISCOUNT = 0.97  # per observed forward, of the least-squares sums
    PRIOR_WEIGHT = 0.25  # observations (at typical feature sizes) the prior is worth per coefficient

    def __init__(self, profile: "VerifyCost", discount: float = DISCOUNT,
                 prior_weight: float = PRIOR_WEIGHT) -> None:
        if not 0.0 < discount <= 1.0:
            raise ValueError(f"discount must be in (0, 1], got {discount}")
        one = profile(1)
        per_row = max((profile(16) - one) / 15.0, 0.02 * one)
        # one sequence, one row: a + b = verify(1); a tree row: the profile's slope per token
        self.prior = [0.5 * one, 0.5 * one, per_row, 0.7 * per_row]
        scale = [1.0, 8.0, 8.0, 64.0]  # typical feature sizes: the ridge is per observation at that size
        self._ridge = [prior_weight * s * s for s in scale]
        self.discount = discount
        n = self.FEATURES
        self._xx = [[0.0] * n for _ in range(n)]
        self._xt = [0.0] * n
        self.observations = 0
        self._coef: list[float] | None = None

    @staticmethod
    def _x(items: int, tree_rows: int, prefill_rows: int) -> list[float]:
        return [1.0, float(items), float(tree_rows), float(prefill_rows)]

    def observe(self, items: int, tree_rows: int, prefill_rows: int, seconds: float) -> None:
        """One measured forward."""
        if not (seconds > 0.0 and math.isfinite(seconds)) or items < 1:
            return
        x, g = self._x(items, tree_rows, prefill_rows), self.discount
        for i in range(self.FEATURES):
            self._xt[i] = g * self._xt[i] + x[i] * seconds
            row = self._xx[i]
            for j in range(self.FEATURES):
                row[j] = g * row[j] + x[i] * x[j]
        self.observations += 1
        self._coef = None

    def coefficients(self) -> list[float]:
        """(a, b, c, e): fixed seconds, per item, per tree row, per prefill row."""
        if self._coef is None:
            n = self.FEATURES
            m = [[self._xx[i][j] + (self._ridge[i] if i == j else 0.0) for j in range(n)]
                 + [self._xt[i] + self._ridge[i] * self.prior[i]] for i in range(n)]
            coef = _solve(m)
            self._coef = coef if coef is not None else list(self.prior)
        return self._coef

    def __call__(self, items: int, tree_rows: int = 0, prefill_rows: int = 0) -> float:
        a, b, c, e = self.coefficients()
        return max(a + b * items + self.row_seconds() * tree_rows + max(e, 0.0) * prefill_rows, 1e-6)

    def row_seconds(self) -> float:
        """The marginal seconds of one more draft row (at least a twentieth of the prior's: a row is
        never free)."""
        return max(self.coefficients()[2], 0.05 * self.prior[2])


def _solve(m: list[list[float]]) -> list[float] | None:
    """Gaussian elimination with partial pivoting on an augmented n x (n+1) matrix (in place)."""
    n = len(m)
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-18:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            if f:
                for k in range(col, n + 1):
                    m[r][k] -= f * m[col][k]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        out[r] = (m[r][n] - sum(m[r][k] * out[k] for k in range(r + 1, n))) / m[r][r]
    return out
