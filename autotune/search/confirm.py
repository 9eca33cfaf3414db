"""Confirmation: the search's best candidates measured against the baseline in interleaved A/B pairs, and what the
pairs show (the verdict, from the runs alone)."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Mapping
from typing import Any

from autotune.search.budget import ALPHA
from autotune.search.outcome import TIE, Confirmation, is_tie
from autotune.search.ports import Confirming
from autotune.search.stats import false_accepts, later_alpha, median_interval, most_lost, sign_test
from autotune.search.space import config_key
from autotune.search.study import ROLE_CONFIRM, claim_key
from autotune.search.trial import Outcome, TrialResult


MAX_CANDIDATES = 2  # configurations confirmed against the baseline, best first, until one holds
MORE_PAIRS = 3  # while the interval straddles 1.0, pairs are added up to this many times --confirm
MIN_GAIN = 0.01  # a candidate is kept only when its median speedup is above 1 + this
# runs that measured nothing (or the machine's other work more than the configuration): evidence neither way
UNMEASURED = (Outcome.TIMEOUT, Outcome.INTERRUPTED, Outcome.DISTURBED)


def arms(
    results: list[TrialResult], key: str, machine: str, role: str = ROLE_CONFIRM
) -> dict[tuple[int, str], TrialResult]:
    """The confirmation runs (or the whole runs: ``role``) of candidate ``key`` on ``machine``: (pair, arm) -> result."""
    got = {}
    for r in results:
        if r.role == role and r.attrs.get("candidate") == key and r.machine == machine:
            got[(int(r.attrs.get("pair", -1)), str(r.attrs.get("arm")))] = r
    return got


def look_alpha(pairs: int, first: int) -> float:
    """The sign test's threshold for a confirmation's look at ``pairs`` pairs, its first look at ``first``: ALPHA there;
    after it, where the confirmation went on because the first did not settle it, the smaller threshold that keeps
    ALPHA the chance of accepting a candidate no faster than the baseline over all its looks (``stats.later_alpha``:
    0.0176 for 6 to 15 pairs after 5). Looking after each pair at 0.05 accepted such a candidate 7.9% of the time,
    10.9% with --confirm 10."""
    return ALPHA if pairs <= first else later_alpha(first, first * MORE_PAIRS, ALPHA)


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
    (p <= ALPHA at ``confirm`` pairs, at more the smaller ``look_alpha``) and by more than MIN_GAIN in the median
    (``speed`` of each run). A pair with a run that timed out (or
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
    missing = (f"; {lost} pair(s) not measured (a run timed out, the budget cut it, or other work on the machine "
               "disturbed it: no evidence either way)") if lost else ""
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
        needed = look_alpha(len(ratios), confirm)
        accepted = p <= needed and median_ratio > 1.0 + MIN_GAIN
        if accepted:
            word = ""
        elif p <= ALPHA and median_ratio > 1.0 + MIN_GAIN:  # would have passed a single look
            naive = false_accepts(confirm, confirm * MORE_PAIRS, ALPHA, ALPHA)
            word = (f"not shown faster: {len(ratios)} pairs need p <= {needed:.4f} (a confirmation that looks again "
                    f"after each pair past its first {confirm} keeps to {ALPHA} the chance of accepting a candidate no "
                    f"faster than the baseline; at {ALPHA} each look it would be {100 * naive:.1f}%)")
        elif high < 1.0:
            word = f"slower ({100 * cover:.0f}% interval {low:.3f}x to {high:.3f}x)"
        elif low > 1.0:
            word = f"faster by too little to keep (a median of {median_ratio:.3f}x; it needs above {1 + MIN_GAIN:.2f}x)"
        elif is_tie(low, high):
            word = (f"a tie: within {100 * TIE:.0f}% of the baseline either way ({100 * cover:.0f}% interval "
                    f"{low:.3f}x to {high:.3f}x)")
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


def most_slower(pairs: int, first: int) -> int:
    """The most pairs, of ``pairs``, that may go the baseline's way (a ratio of 1.0 or less) with the sign test
    still saying faster at that look (``look_alpha``; the first at ``first`` pairs): with ``first`` 5, 3 of 15, 1 of
    10, none of 8 or 5; -1 where so few pairs cannot say faster."""
    return most_lost(pairs, look_alpha(pairs, first))


def futile(ratios: tuple[float, ...], more: int, first: int) -> str | None:
    """Why no ``more`` pairs beside ``ratios`` can confirm the candidate, where none can: its slower pairs already
    outnumber what the sign test allows at the most pairs it may get (a median near 1.0 that straddles it by more
    than a tie: the README's CNN ran 14 pairs for 8 faster). None where some could."""
    lost, most = sum(r <= 1.0 for r in ratios), len(ratios) + more
    allowed = most_slower(most, first)
    if lost <= allowed:
        return None
    return (f"more pairs could not make it faster by the sign test: {lost} of {len(ratios)} went the baseline's way, "
            f"and {most} pairs allow at most {allowed}")


def over(c: Confirmation, ran: int, first: int) -> tuple[bool, str | None]:
    """Whether a confirmation whose first ``ran`` pairs measured ``c`` (its first look at ``first`` pairs) is over,
    and why where it stopped short of a verdict's evidence: a failed candidate run, an interval clear of 1.0 or a tie,
    no more pairs that could make it faster (``futile``), or the most pairs allowed."""
    limit = first * MORE_PAIRS
    if c.evidence or (len(c.ratios) >= first and c.settled):
        return True, None
    if len(c.ratios) >= first and (why := futile(c.ratios, limit - ran, first)):
        return True, why
    if ran >= limit:
        return True, f"{ran} pairs run, {ran - len(c.ratios)} of them not measured" if len(c.ratios) < first else None
    return False, None


def rejections(s: Confirming) -> dict[str, float]:
    """The programs whose A/B pairs on this machine ended without confirming them by their timing (settled, or
    stopped where no more pairs could make them faster, or at the most pairs allowed; not a failed candidate run,
    which is no measure of its speed), each with the median speedup its pairs measured: what the descent reads for
    them in place of their single search runs, and why none is a candidate again. Read from the study, so that a
    resumed search and ``autotune report`` see what the search saw."""
    me, out = s.mine(), {}
    for key in {str(r.attrs.get("candidate")) for r in s.results if r.role == ROLE_CONFIRM and r.machine == me}:
        got = arms(s.results, key, me)
        config = next((r.config for (_, arm), r in got.items() if arm == "candidate"), None)
        if config is None:
            continue
        c = s.verdict_of(dict(config), got, None, None, me)
        ended, _ = over(c, len({j for j, _ in got}), s.o.confirm)
        if c.accepted or c.evidence or len(c.ratios) < s.o.confirm or not ended:
            continue
        out[s.programs.program(config)] = float(c.speedup)  # type: ignore[arg-type]
    return out


def confirm_candidates(s: Confirming) -> list[Confirmation]:
    """The search's best candidates confirmed in turn on this machine, until one holds (a second one only where
    the time left covers it)."""
    out: list[Confirmation] = []
    if s.nothing_to_confirm():
        return out  # the descent, ties re-measured in pairs, found nothing faster: nothing to confirm
    ranked = s.candidates()[:MAX_CANDIDATES]
    for k, (config, search_speedup) in enumerate(ranked):
        if k and s.costs.time_left() < s.costs.confirm_reserve(config):
            break  # the time set aside was for the first candidate; a second one runs only if it fits
        c = confirm_one(s, config, search_speedup, (k + 1, len(ranked)), must=k == 0)
        out.append(c)
        if c.accepted:
            break
    return out


def confirm_one(
    s: Confirming, config: dict[str, Any], search_speedup: float, which: tuple[int, int] = (1, 1), must: bool = True
) -> Confirmation:
    """Measure ``config`` against the baseline in A/B pairs on this machine (a candidate of any machine).

    --confirm measured pairs first (time was set aside for them when ``must``); then, while the interval of the
    median speedup straddles 1.0 (and is no tie: within TIE of 1.0 either way), more, up to MORE_PAIRS times as
    many, until no more could make the sign test say faster (``futile``). A pair starts only where it can finish
    inside the budget; one that timed out measured nothing and is run again, as time allows.
    """
    key = config_key(config)
    baseline = s.space.baseline()
    me = s.machine.key
    stopped = None
    s.reserve_now = 0.0
    j = 0
    while True:
        so_far = s.verdict_of(config, arms(s.results, key, me), None, search_speedup, me)
        ended, stopped = over(so_far, j, s.o.confirm)
        if ended:
            break
        pair_cost = s.costs.baseline_cost() + s.costs.cost_of(config)
        # the pairs set aside for may use the budget's slack; more than those, or a second candidate, only what
        # is left of the budget itself
        end = s.hard_end if must and len(so_far.ratios) < s.o.confirm else s.deadline
        if s.clock() + pair_cost > end:
            stopped = "the time budget ran out during confirmation"
            break
        order = ("baseline", "candidate") if j % 2 == 0 else ("candidate", "baseline")
        for arm in order:
            s.refresh()
            what = claim_key(ROLE_CONFIRM, me, key, j, arm)
            if (j, arm) in arms(s.results, key, me) or what in s.claims:
                continue  # measured, or being measured by another worker on this machine
            attrs = {"candidate": key, "pair": j, "arm": arm, "of": list(which)}
            shown = max(s.o.confirm, len(so_far.ratios) + 1)
            s.display.confirming(which, min(len(so_far.ratios) + 1, shown), shown, arm)
            s.run_trial(baseline if arm == "baseline" else config, ROLE_CONFIRM, attrs, what)
        j += 1
    while not stopped:  # runs of this confirmation that other workers on this machine are measuring
        busy = {c for c in s.claims if json.loads(c)[:3] == [ROLE_CONFIRM, me, key]}
        if not busy:
            break
        if s.clock() > s.hard_end:
            stopped = "the time budget ran out during confirmation"
            break
        s.wait_for("confirmation run(s) of another worker on this machine", busy)
    return s.verdict_of(config, arms(s.results, key, me), stopped, search_speedup, me)
