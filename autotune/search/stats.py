"""Distribution-free statistics of paired comparisons: the sign test of A/B pairs' ratios and an interval for their
median from order statistics (no assumption about how run times are distributed)."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence


def sign_test(wins: int, n: int) -> float:
    """One-sided p-value of ``wins`` or more successes in ``n`` fair coin flips (the sign test of paired ratios)."""
    return sum(math.comb(n, k) for k in range(wins, n + 1)) / 2**n if n else 1.0


def most_lost(n: int, alpha: float) -> int:
    """The most of ``n`` pairs that may go the baseline's way with the sign test of the rest still at most ``alpha``;
    -1 where so few pairs cannot reach it."""
    return next((lost for lost in range(n, -1, -1) if sign_test(n - lost, n) <= alpha), -1)


@functools.cache
def later_alpha(first: int, most: int, alpha: float) -> float:
    """The sign test's threshold for the looks after the first, where a confirmation looks after every pair from
    ``first`` pairs to ``most`` (accepting at ``alpha`` at the first look, stopping once no more pairs could pass):
    the largest that keeps the chance of accepting a candidate no faster than the baseline (each pair's sign a fair
    coin), over all its looks, within ``alpha``. Looking after every pair and stopping at the first p <= 0.05 accepts
    such a candidate 7.9% of the time at 5 to 15 pairs, not 5%; 0.0176 after the fifth pair keeps it to 4.7%. The
    other stops (an interval clear of 1.0, a tie) only end confirmations earlier, so the chance is at most this."""
    thresholds = sorted({sign_test(w, n) for n in range(first + 1, most + 1) for w in range(n + 1)}, reverse=True)
    return next((a for a in thresholds if a <= alpha and false_accepts(first, most, alpha, a) <= alpha), 0.0)


def false_accepts(first: int, most: int, alpha: float, later: float) -> float:
    """The chance that a candidate whose pairs are fair coins is accepted at some look (``alpha`` at ``first`` pairs,
    ``later`` after), where the confirmation stops once its lost pairs exceed what ``most`` pairs allow."""
    allowed = most_lost(most, later)
    going, accepted = {0: 1.0}, 0.0  # wins -> chance of a confirmation still going with them
    for n in range(1, most + 1):
        step: dict[int, float] = {}
        for wins, chance in going.items():
            for w in (wins, wins + 1):
                step[w] = step.get(w, 0.0) + chance / 2
        going = {}
        for wins, chance in step.items():
            if n >= first and sign_test(wins, n) <= (alpha if n == first else later):
                accepted += chance
            elif n < first or n - wins <= allowed:
                going[wins] = chance
    return accepted


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
