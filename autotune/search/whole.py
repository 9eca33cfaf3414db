"""Whole runs: the confirmed winner and the baseline each run from process start to their own end, with the script's
own arguments, in interleaved A/B pairs. What the user's run costs, measured rather than predicted: start-up,
compilation, every evaluation pass and its recompiles, the data loader's start-up, checkpoints, exit.

The search ranks by a prediction (one-time start-up plus the run's steps at the measured step time); the A/B
pairs confirm the steady state. Neither sees what happens after the measured window: Accelerate's nlp_example got
"1.44x faster" for a tuned script whose 240-step run took 3.1x longer, its evaluation recompiling. A winner whose
whole run is slower than the baseline's, or fails, is not kept.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from autotune.search.budget import RUN_MARGIN
from autotune.search.confirm import arms as confirm_arms
from autotune.search.live import duration
from autotune.search.ports import Confirming
from autotune.search.outcome import Confirmation, WholeRuns
from autotune.search.space import config_key
from autotune.search.study import ROLE_WHOLE, claim_key
from autotune.search.trial import Outcome, TrialResult

# whole runs are measured only where their pairs take at most this share of the time budget: a long run is
# predicted from the A/B pairs, which measure the same steps
BUDGET_SHARE = 0.5
UNMEASURED = (Outcome.TIMEOUT, Outcome.INTERRUPTED)


def arms(results: list[TrialResult], key: str, machine: str) -> dict[tuple[int, str], TrialResult]:
    """The whole runs of candidate ``key`` on ``machine``: (pair, arm) -> result."""
    return confirm_arms(results, key, machine, ROLE_WHOLE)


def judge(got: Mapping[tuple[int, str], TrialResult], steps: int | None, skipped: str | None = None) -> WholeRuns:
    """What the pairs ``got`` show: each pair where both runs ended ok, and the first candidate run that failed
    (a timeout or an interrupted run measured nothing: no evidence either way)."""
    pairs, failed, teardown = [], None, 0
    for j in sorted({j for j, _ in got}):
        b, c = got.get((j, "baseline")), got.get((j, "candidate"))
        if c is not None and failed is None and c.status not in (Outcome.OK, *UNMEASURED):
            failed = c
        if b is not None and c is not None and b.status is Outcome.OK and c.status is Outcome.OK:
            pairs.append((b.wall_s, c.wall_s))
            teardown += (b.exit_note is not None) + (c.exit_note is not None)
    return WholeRuns(steps, tuple(pairs), failed, skipped, teardown)


def kept(c: Confirmation, w: WholeRuns) -> Confirmation:
    """``c`` with its whole runs: no longer accepted where a whole run of it failed or was slower."""
    c = replace(c, whole=w)
    if not c.accepted:
        return c
    if w.failed is not None:
        f = w.failed
        return replace(c, accepted=False, evidence=True, reason=(
            f"its whole run failed after the measured steps: {f.status} ({f.error}); the A/B pairs of its steps "
            f"said {c.reason}"))
    if w.slower:
        return replace(c, accepted=False, reason=(
            f"its whole run is slower: {w.text()}; the steps alone were faster ({c.reason}), but what the run does "
            "besides them (compilation, evaluation and its recompiles, start-up) costs more than they save"))
    return c


def predicted(r: TrialResult, steps: int) -> float:
    """Seconds a whole run like ``r`` would take: the trial's own wall time and the steps it did not run."""
    return r.wall_s + max(steps - r.steps_done, 0) * (r.step_time or 0.0)


@dataclass(frozen=True)
class Plan:
    """The whole-run pairs the budget covers: how many, the seconds they are expected to take, and what was cut."""

    pairs: int = 0
    seconds: float | None = None
    note: str | None = None  # why none run, or why fewer than asked, where a reason deserves saying


def plan(search: Confirming, base_s: float | None, cand_s: float | None) -> Plan:
    """The whole-run pairs to run, each baseline run expected to take ``base_s`` and each candidate run ``cand_s``:
    as many of the --whole-runs asked as fit in BUDGET_SHARE of the time budget. A run too long for three pairs is
    still measured where one fits: makemore's 5000-step run (30 s) had three pairs cut by a 300 s budget, and its
    prediction said 1.33x where its whole runs, start to exit, gave 1.13x (inductor's start-up and teardown, the
    evaluations between windows)."""
    s = search
    if not s.o.whole_runs or not s.train_steps or base_s is None or cand_s is None:
        return Plan()
    if s.o.train_steps:
        return Plan(note=(f"--train-steps {s.o.train_steps} sets the run's length, so the script's own whole run is "
                          "not the run it means"))
    pair, asked = base_s + cand_s, s.o.whole_runs
    fit = min(asked, int(BUDGET_SHARE * s.o.budget // pair)) if s.o.budget and pair > 0 else asked
    if fit == asked:
        return Plan(asked, asked * pair)
    share = f"more than {BUDGET_SHARE:.0%} of the time budget"
    if fit < 1:
        return Plan(note=f"one pair of whole runs would take about {duration(pair)}, {share}")
    return Plan(fit, fit * pair, f"{fit} of the {asked} pairs asked: {asked} would take about {duration(asked * pair)}, "
                                 f"{share}")


def measure(search: Confirming, c: Confirmation) -> Confirmation:
    """Run ``c``'s whole-run pairs (alternating which arm goes first) as far as the budget allows, and keep ``c``
    only where they show its whole run no slower than the baseline's."""
    s = search
    steps = s.train_steps
    base = [predicted(r, steps) for r in c.baseline if r.measured] if steps else []
    cand = [predicted(r, steps) for r in c.candidate if r.measured] if steps else []
    p = plan(s, statistics.median(base) if base else None, statistics.median(cand) if cand else None)
    if not p.pairs or p.seconds is None:
        return replace(c, whole=WholeRuns(s.train_steps, skipped=p.note)) if p.note else c
    key, me = config_key(c.config), s.machine.key
    s.display.note(f"your whole run: {p.pairs} A/B pair{'s' if p.pairs != 1 else ''} of whole runs (process start to "
                   f"exit, your arguments), about {duration(p.seconds)}")
    # once a candidate run fails (the tuned script's run would), no more pairs are needed to say so
    stopped = run_pairs(s, ROLE_WHOLE, key, {"baseline": s.space.baseline(), "candidate": c.config}, p.pairs,
                        p.seconds / p.pairs, lambda got: judge(got, steps).failed is not None)
    why = "; ".join(x for x in (p.note, stopped) if x) or None
    return kept(c, judge(arms(s.results, key, me), s.train_steps, why))


def run_pairs(
    search: Confirming, role: str, key: str, configs: Mapping[str, Mapping[str, Any]], pairs: int, pair_s: float,
    enough: Callable[[dict[tuple[int, str], TrialResult]], bool],
) -> str | None:
    """Run up to ``pairs`` pairs of ``role`` for candidate ``key``: each pair one run of each arm of ``configs``
    (arm -> configuration), the first arm first in even pairs and last in odd ones, skipping what this machine's
    workers measured or are measuring; stop once ``enough(the runs so far)``. A pair starts only where the time left
    covers it: ``pair_s`` seconds until one pair has run, then the longest pair measured, longer or shorter than
    planned (word_language_model's whole runs were planned at 93 s a pair and took 153 s, its evaluation after the
    epoch in them: the third pair's candidate was stopped by the budget's end, measuring nothing, after its baseline
    had run 84 s). Why it stopped short (the budget), else None."""
    s, me = search, search.machine.key
    names = tuple(configs)
    for j in range(pairs):
        got = confirm_arms(s.results, key, me, role)
        took = [sum(got[(i, arm)].wall_s or 0.0 for arm in names) for i in range(j)
                if all((i, arm) in got for arm in names)]
        need, left = RUN_MARGIN * max(took, default=pair_s), s.hard_end - s.clock()
        if need > left:
            return (f"the time budget ran out after {j} of {pairs} pairs (another needs about {duration(need)}, "
                    f"{duration(left)} left)")
        for arm in names if j % 2 == 0 else names[::-1]:
            s.refresh()
            what = claim_key(role, me, key, j, arm)
            if (j, arm) in confirm_arms(s.results, key, me, role) or what in s.claims:
                continue  # measured, or being measured by another worker on this machine
            s.run_trial(configs[arm], role, {"candidate": key, "pair": j, "arm": arm}, what)
        if enough(confirm_arms(s.results, key, me, role)):
            break
    return None
