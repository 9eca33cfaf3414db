"""Distribution-free statistics of paired comparisons: the sign test of A/B pairs' ratios and an interval for their
median from order statistics (no assumption about how run times are distributed)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def sign_test(wins: int, n: int) -> float:
    """One-sided p-value of ``wins`` or more successes in ``n`` fair coin flips (the sign test of paired ratios)."""
    return sum(math.comb(n, k) for k in range(wins, n + 1)) / 2**n if n else 1.0


def median_interval(values: Sequence[float], coverage: float = 0.9) -> tuple[float, float, float] | None:
    """A distribution-free interval for the median of ``values`` from their order statistics: (low, high, its
    coverage), the narrowest that covers at least ``coverage``, else (min, max) with what it covers; None if empty."""
    xs = sorted(values)
    n = len(xs)
    if not n:
        return None
    best = (xs[0], xs[-1], _coverage(n, 1))
    for k in range(2, n // 2 + 1):
        if _coverage(n, k) < coverage:
            break
        best = (xs[k - 1], xs[n - k], _coverage(n, k))
    return best


def _coverage(n: int, k: int) -> float:
    """How often [x_(k), x_(n-k+1)] holds the median of ``n`` values: 1 - 2 P(Binomial(n, 1/2) < k)."""
    return 1 - 2 * sum(math.comb(n, j) for j in range(k)) / 2**n
