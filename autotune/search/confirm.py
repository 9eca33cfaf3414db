"""What interleaved A/B pairs of a candidate and the baseline show: the verdict, from the runs alone."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from typing import Any

from autotune.search.budget import ALPHA
from autotune.search.outcome import Confirmation
from autotune.search.strategy import median_interval, sign_test
from autotune.search.study import ROLE_CONFIRM
from autotune.search.trial import Outcome, TrialResult

MIN_GAIN = 0.01  # a candidate is kept only when its median speedup is above 1 + this
UNMEASURED = (Outcome.TIMEOUT, Outcome.INTERRUPTED)  # runs that measured nothing: evidence neither way


def arms(results: list[TrialResult], key: str, machine: str) -> dict[tuple[int, str], TrialResult]:
    """The confirmation runs of candidate ``key`` on ``machine``: (pair, arm) -> result."""
    got = {}
    for r in results:
        if r.role == ROLE_CONFIRM and r.attrs.get("candidate") == key and r.machine == machine:
            got[(int(r.attrs.get("pair", -1)), str(r.attrs.get("arm")))] = r
    return got


def verdict(
    config: dict[str, Any],
    got: Mapping[tuple[int, str], TrialResult],
    stopped: str | None,
    search_speedup: float | None,
    machine: str,
    confirm: int,
    speed: Callable[[TrialResult], float],
) -> Confirmation:
    """Whether the A/B pairs ``got`` confirm ``config``: at least ``confirm`` pairs, faster by the sign test
    (p <= ALPHA) and by more than MIN_GAIN in the median (``speed`` of each run). A pair with a run that timed out (or
    was interrupted) measured nothing: it counts neither way. A candidate run that failed otherwise (a crash, a loss
    outside the gate) is evidence against."""
    ratios, base_runs, cand_runs, evidence, lost = [], [], [], [], 0
    for j in sorted({j for j, _ in got}):
        b, c = got.get((j, "baseline")), got.get((j, "candidate"))
        if c is not None:
            cand_runs.append(c)
            if c.status not in (Outcome.OK, *UNMEASURED):
                evidence.append(c)
        if b is not None:
            base_runs.append(b)
        if b is not None and c is not None:
            if b.measured and c.status is Outcome.OK:
                ratios.append(speed(c) / speed(b))
            elif b.status in UNMEASURED or c.status in UNMEASURED:
                lost += 1
    missing = f"; {lost} pair(s) not measured (a run timed out or the budget cut it: no evidence either way)" if lost else ""
    if evidence:
        bad = evidence[0]
        accepted, reason = False, f"not reproducible: a confirmation run ended {bad.status} ({bad.error}){missing}"
    elif len(ratios) < confirm:
        why = stopped or "the search stopped"
        accepted, reason = False, (
            f"not shown faster: {why} ({len(ratios)} of the {confirm} pairs needed measured{missing})")
    else:
        median_ratio = statistics.median(ratios)
        wins = sum(r > 1.0 for r in ratios)
        p = sign_test(wins, len(ratios))
        low, high, cover = median_interval(ratios)
        accepted = p <= ALPHA and median_ratio > 1.0 + MIN_GAIN
        if accepted:
            word = ""
        elif high < 1.0:
            word = f"slower ({100 * cover:.0f}% interval {low:.3f}x to {high:.3f}x)"
        elif low > 1.0:
            word = f"faster by too little to keep (a median of {median_ratio:.3f}x; it needs above {1 + MIN_GAIN:.2f}x)"
        else:
            word = f"not shown faster ({100 * cover:.0f}% interval {low:.3f}x to {high:.3f}x holds 1.0)"
        reason = (
            (f"{word}: " if word else "") + f"faster in {wins} of {len(ratios)} A/B pairs (sign test p = {p:.3f}), median speedup "
            f"{median_ratio:.3f}x, {100 * cover:.0f}% interval {low:.3f}x to {high:.3f}x{missing}"
            + (f"; {stopped}" if stopped and not accepted else "")
        )
    return Confirmation(
        config, tuple(ratios), accepted, reason, tuple(base_runs), tuple(cand_runs), search_speedup, machine,
        bool(evidence),
    )


