"""The time budget: what a run costs, the least search that can give a verdict, and run lengths that fit.

``--time-budget`` is the user's constraint. After the first baseline run (the one thing that must run to know
anything) the search knows what a run costs; it then fits the plan to what is left: shorter runs where the least
search plus a few candidates would not fit at the asked length, and a refusal only where not even the least search
fits at the shortest length, naming the smallest budget that would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from autotune.errors import UsageError
from autotune.search.stats import sign_test

ALPHA = 0.05  # a candidate is accepted when the sign test of its A/B pairs says faster with p <= this
# the fewest A/B pairs that can ever confirm: n pairs, all faster, give p = 2**-n, which must be <= ALPHA
MIN_PAIRS = next(n for n in range(1, 64) if sign_test(n, n) <= ALPHA)
SLACK = 0.05  # a search with a time budget ends within this share past it, compilation and confirmation included
OUTPUT_S = 5.0  # kept at the end for writing the outputs (baking the tuned script, the report and its plot)
MIN_WARMUP = 2  # the shortest runs a search shortens to: the first steps pay for lazy set-up
MIN_STEPS = 8  # and reduced precision is judged on the last half of the measured steps
ROOM = 3  # candidates beyond the least search's one that are worth running shorter for
# where a step is cheap next to the start-up (a character MLP: 25 steps timed 0.15 s after 3 s of start-up, and its
# baseline's step time varied by 65% between runs), runs are lengthened to time about this many seconds
WINDOW_S = 1.0
MAX_LONGER = 50  # at most this many times the asked steps
WARMUP_S = 0.5  # and the warm-up grows with them up to about this long


class BudgetTooSmall(UsageError):
    """--time-budget cannot fit the least search (baselines, one candidate and the minimum confirmation)."""


def check_pairs(confirm: int) -> None:
    """Refuse a --confirm that can never confirm a candidate, naming the least that can."""
    if confirm < MIN_PAIRS:
        raise UsageError(
            f"--confirm {confirm} can never confirm a candidate: the sign test needs at least {MIN_PAIRS} A/B pairs "
            f"to say faster with p <= {ALPHA} (all {MIN_PAIRS} faster gives p = {sign_test(MIN_PAIRS, MIN_PAIRS):.3f}); "
            f"give --confirm {MIN_PAIRS} or more"
        )


RUN_MARGIN = 1.25  # a run is started only where the time left covers this many times its expected time;
# the confirmation's time is set aside with the same margin


@dataclass(frozen=True)
class RunCost:
    """What one run of the script costs: a fixed start-up (process, imports, data) and a time per step."""

    startup_s: float
    step_s: float

    def of(self, warmup: int, steps: int) -> float:
        return self.startup_s + (warmup + steps) * self.step_s


def run_cost(wall_s: float, step_s: float, steps_run: int) -> RunCost:
    """The cost model of a run that took ``wall_s`` for ``steps_run`` steps at ``step_s`` each."""
    return RunCost(max(wall_s - steps_run * step_s, 0.0), step_s)


@dataclass(frozen=True)
class Least:
    """The least search that can give a verdict, after the first baseline run: the runs it still needs."""

    baselines: int  # baseline runs still to come (the second; the perturbed one on a CPU; a third on a GPU)
    pairs: int  # A/B pairs of the confirmation

    @property
    def runs(self) -> int:
        return self.baselines + 1 + 2 * self.pairs  # + the one candidate

    def describe(self) -> str:
        return f"{self.baselines + 1} baseline runs, 1 candidate and {self.pairs} A/B pairs"

    def seconds(self, run_s: float, room: int = 0) -> float:
        """Its time at ``run_s`` a run, with ``room`` more candidates: the candidates and the pairs with the margin
        the search starts them with (it starts one only where the time left covers it and the pairs, margins
        included)."""
        return (self.baselines + RUN_MARGIN * (1 + room + 2 * self.pairs)) * run_s


@dataclass(frozen=True)
class Fit:
    """Run lengths that fit the budget, and what was given up for them."""

    warmup: int
    steps: int
    note: str | None = None  # what was shortened, for the report (None: the lengths asked for)


def fit(left_s: float, spent_s: float, budget: float, cost: RunCost, warmup: int, steps: int, least: Least) -> Fit:
    """The longest runs (at most ``warmup`` + ``steps``) whose least search plus ROOM candidates fit the ``left_s``
    seconds left (within SLACK of ``budget``); without the ROOM if need be; a BudgetTooSmall where even the least
    search does not fit at the shortest runs, naming the smallest budget that would."""
    left = left_s + SLACK * budget - OUTPUT_S
    lengths = _lengths(warmup, steps)
    for room in (ROOM, 0):
        for w, n in lengths:
            if least.seconds(cost.of(w, n), room) <= left:
                if (w, n) == (warmup, steps):
                    return Fit(w, n)
                why = "to fit the time budget" + ("" if room else ", which leaves room for the start configuration only")
                return Fit(w, n, f"runs shortened from {warmup} + {steps} to {w} + {n} steps {why}")
    w, n = lengths[-1]
    shortest = cost.of(w, n)
    need = spent_s + least.seconds(shortest) + OUTPUT_S
    smallest = math.ceil(need / (1 + SLACK) / 10) * 10
    raise BudgetTooSmall(
        f"--time-budget {budget:.0f}s is too small for this script: a run takes about {cost.of(warmup, steps):.0f}s "
        f"({shortest:.0f}s at the shortest, {w} + {n} steps), and after the first baseline the least search still "
        f"needs {least.runs} runs ({least.describe()}); give --time-budget {smallest} or more"
    )


def longer(cost: RunCost, warmup: int, steps: int) -> Fit | None:
    """Longer runs where the asked ones time less than half of WINDOW_S (None: the asked ones do): about WINDOW_S
    of measured steps (at most MAX_LONGER times as many), the warm-up grown in proportion up to WARMUP_S; its note
    says why."""
    if cost.step_s <= 0 or steps * cost.step_s >= WINDOW_S / 2:
        return None
    n = min(math.ceil(WINDOW_S / cost.step_s), MAX_LONGER * steps)
    w = max(warmup, min(round(warmup * n / steps), math.ceil(WARMUP_S / cost.step_s)))
    return Fit(w, n, (
        f"a step takes {cost.step_s * 1e3:.1f} ms next to {cost.startup_s:.1f}s of start-up, and {steps} steps "
        f"({steps * cost.step_s:.2f}s) are too short to time without much noise"
    ))


def run_lengths(
    cost: RunCost, warmup: int, steps: int, lengthen: bool, least: Least, left_s: float | None, spent_s: float,
    budget: float, run_steps: int | None = None,
) -> Fit:
    """The run lengths after the first baseline run, with what changed and why: ``longer`` ones where ``lengthen``
    and the asked ones time too little (as long as the least search, one more baseline at that length and ROOM
    candidates fit the ``left_s`` seconds left; not at all where only the asked ones do; no longer than the
    ``run_steps`` the script trains, where the first run read them), else the asked ones fitted to the time left
    (``fit``); ``left_s`` None: no time budget."""
    grown = longer(cost, warmup, steps) if lengthen else None
    if grown is not None and run_steps is not None and grown.warmup + grown.steps > run_steps:
        w = max(warmup, grown.warmup * run_steps // (grown.warmup + grown.steps))
        grown = (Fit(w, run_steps - w, f"{grown.note}; no longer than the {run_steps} steps the script trains")
                 if run_steps - w > steps else None)
    if grown is not None and left_s is not None:
        try:
            fitted: Fit | None = fit(left_s, spent_s, budget, cost, grown.warmup, grown.steps,
                                     replace(least, baselines=least.baselines + 1))
        except BudgetTooSmall:
            fitted = None
        if fitted is None or fitted.warmup + fitted.steps <= warmup + steps:
            grown = None
        else:
            grown = Fit(fitted.warmup, fitted.steps, grown.note + ("" if fitted.note is None else
                                                                   "; no longer, to fit the time budget"))
    if grown is not None:
        return Fit(grown.warmup, grown.steps,
                   f"runs lengthened from {warmup} + {steps} to {grown.warmup} + {grown.steps} steps: {grown.note}")
    if left_s is None:
        return Fit(warmup, steps)
    return fit(left_s, spent_s, budget, cost, warmup, steps, least)


def _lengths(warmup: int, steps: int) -> list[tuple[int, int]]:
    """Run lengths from the asked ones down to the shortest, each about a tenth of the asked length shorter."""
    low_w, low_n = min(warmup, MIN_WARMUP), min(steps, MIN_STEPS)
    out: list[tuple[int, int]] = []
    for tenth in range(10, -1, -1):
        pair = (max(low_w, round(warmup * tenth / 10)), max(low_n, round(steps * tenth / 10)))
        if pair not in out:
            out.append(pair)
    return out


def first_run_too_long(budget: float, ran_s: float, least: Least) -> BudgetTooSmall:
    """The refusal when the budget ran out before the first baseline run finished: only a bound is known."""
    runs = least.runs + 1
    shown = f"{budget:.0f}s" if budget >= 1 else f"{budget:.2g}s"  # 1e-300 is not "0s"
    return BudgetTooSmall(
        f"--time-budget {shown} ran out before the first baseline run finished (stopped after {ran_s:.0f}s); "
        f"a search needs at least {runs} runs of the script ({least.describe()}), so more than "
        f"{math.ceil(runs * ran_s)}s: give --time-budget at least {runs} times one run's time"
    )
