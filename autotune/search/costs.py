"""Time accounting of one search: what a run costs on this machine at the current run lengths, the time set aside
for confirming the best candidate, the time left, and each run's timeout.

The search (search.py) owns one ``Costs`` and asks it before every run; confirmation and whole runs ask it through
the ``Clock`` port (ports.py). It reads the study through the ``Costed`` interface below, never the search's private
state.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from autotune.search.budget import RUN_MARGIN, run_cost
from autotune.search.confirm import look_alpha
from autotune.search.stats import sign_test
from autotune.search.study import ROLE_PERTURBED
from autotune.search.trial import TrialResult
from autotune.search.whole import plan as plan_whole, predicted as predicted_whole

if TYPE_CHECKING:
    from autotune.search.gate import Noise
    from autotune.search.identity import Programs
    from autotune.search.options import SearchOptions
    from autotune.search.strategy import StrongStart

FIRST_TIMEOUT_S = 600.0  # the first baseline: nothing is known yet about how long the script takes
MIN_TIMEOUT_S = 120.0  # later trials: at least this, and at least TIMEOUT_FACTOR x the slowest baseline
TIMEOUT_FACTOR = 5.0
COMPILE_MIN_TIMEOUT_S = 900.0
NOISY = 0.25  # baseline runs whose step times differ by more than this (relative) make a verdict unreliable
COMPILE_GUESS_S = 60.0  # the compile time expected of a first compiling trial, before any was measured
EXPENSIVE_FACTOR = 10.0  # an expensive choice (max-autotune) is expected to compile this many times longer
EXPENSIVE_MIN_S = 300.0


def own_timeout(baseline_walls: list[float], compiles: bool) -> float:
    """A run's own timeout: 5 times the slowest baseline run (``baseline_walls``), at least 120 s, 900 s where it
    compiles; 600 s before any baseline ran."""
    timeout = max(MIN_TIMEOUT_S, TIMEOUT_FACTOR * max(baseline_walls)) if baseline_walls else FIRST_TIMEOUT_S
    return max(timeout, COMPILE_MIN_TIMEOUT_S) if compiles else timeout


class Costed(Protocol):
    """What the time accounting reads of the search: the study's runs, the run lengths, the budget's ends."""

    o: SearchOptions
    results: list[TrialResult]
    programs: Programs
    strategy: StrongStart
    lengths: tuple[int, int]
    clock: Callable[[], float]
    deadline: float
    hard_end: float

    @property
    def train_steps(self) -> int | None: ...

    def baselines(self, machine: str | None = None) -> list[TrialResult]: ...

    def compiles(self, config: Mapping[str, Any]) -> bool: ...

    def candidates(self) -> list[tuple[dict[str, Any], float]]: ...

    def noise(self, machine: str | None = None) -> Noise: ...

    def found_length(self) -> TrialResult | None: ...


class Costs:
    """What runs cost and what the budget leaves, for the search ``s``."""

    def __init__(self, s: Costed) -> None:
        self.s = s
        self._overheads: list[float] = []  # the search's own seconds around each run (see overhead)
        self._last_end: float | None = None
        self.waited = False  # the search waited for other workers since the last run ended

    def baseline_cost(self) -> float:
        """Seconds one run of the baseline takes on this machine at the current run lengths (0 before any ran)."""
        walls = [self.scaled(r) for r in self.s.baselines()] or [self.scaled(r) for r in self.s.results if r.measured]
        return statistics.median(walls) if walls else 0.0

    def scaled(self, r: TrialResult) -> float:
        """Seconds a run like ``r`` takes the search at the current run lengths (it may have run before they were
        fitted): the run itself, and the search's own time around each run (study, plan, baking)."""
        if not r.measured or not r.step_time or not r.steps_done:
            return r.wall_s + self.overhead()
        return run_cost(r.wall_s, r.step_time, r.steps_done).of(*self.s.lengths) + self.overhead()

    def overhead(self) -> float:
        """The search's own seconds between one run's end and the next one's, beyond the run: the median of the
        last ten (a trainer-step script's confirmation ran out of time at 4 of 5 pairs, its runs planned at 3.5 s
        and taking 4.5 s)."""
        return statistics.median(self._overheads[-10:]) if self._overheads else 0.0

    def count_overhead(self, result: TrialResult) -> None:
        now = self.s.clock()
        if self._last_end is not None and not self.waited and result.wall_s:
            self._overheads.append(max(now - self._last_end - result.wall_s, 0.0))
        self._last_end, self.waited = now, False

    def cost_of(self, config: Mapping[str, Any]) -> float:
        """Seconds the next run of ``config`` is expected to take: as its program's latest run took, else the
        baseline's, plus its compile time if it compiles (from cold: as the compiling programs' first runs took)."""
        base = self.baseline_cost()
        measured = self._latest(config)
        if measured is not None:
            return self.scaled(measured)
        if not self.s.compiles(config):
            return base
        return base + self._compile_s(config, self.compile_extras(warm=False))

    def repeat_cost(self, config: Mapping[str, Any]) -> float:
        """Seconds each run of ``config``'s confirmation is expected to take. A compiling program's first run compiles
        from cold; the runs after it find the compiler's caches warm (bench/scripts/gpt_accum.py on 2 CPU cores: 26 s,
        then 6 s; the baseline 4 s): where a second run of some compiling program has shown that, its extra time over
        the baseline stands for the warm compile of any."""
        programs = self._compiling_programs()
        later = [r for rs in programs.values() for r in rs[1:]]
        if not self.s.compiles(config) or not later:
            return self.cost_of(config)
        runs = programs.get(self.s.programs.program(config), [])
        if len(runs) > 1:
            return self.scaled(runs[-1])
        base = self.baseline_cost()
        warmups = [r.warmup_s for r in later if r.warmup_s is not None]
        if runs and runs[0].warmup_s is not None and warmups:  # its own run, with a warm start-up for its cold one
            return max(self.scaled(runs[0]) - runs[0].warmup_s + max(warmups), base)
        return base + self._compile_s(config, [self.scaled(r) - base for r in later])

    def _compile_s(self, config: Mapping[str, Any], extras: list[float]) -> float:
        compile_s = max(max(extras, default=COMPILE_GUESS_S), 0.0)
        if any(self.s.strategy.is_expensive(n, v) for n, v in config.items()):
            compile_s = max(EXPENSIVE_FACTOR * compile_s, EXPENSIVE_MIN_S)
        return compile_s

    def compile_extras(self, warm: bool) -> list[float]:
        """The compiling programs' runs' time beyond the baseline's: their first runs (``warm`` False), or the runs
        after them."""
        base = self.baseline_cost()
        runs = [r for rs in self._compiling_programs().values() for r in (rs[1:] if warm else rs[:1])]
        return [self.scaled(r) - base for r in runs]

    def _compiling_programs(self) -> dict[str, list[TrialResult]]:
        """The measured runs of each compiling program, in order."""
        programs: dict[str, list[TrialResult]] = {}
        for r in self.s.results:
            if r.measured and r.wall_s and r.role != ROLE_PERTURBED and self.s.compiles(r.config):
                programs.setdefault(self.s.programs.program(r.config), []).append(r)
        return programs

    def program_runs(self, config: Mapping[str, Any]) -> list[TrialResult]:
        """The measured runs of ``config``'s program, in order (not the baseline on other threads: it is slower)."""
        key = self.s.programs.program(config)
        return [r for r in self.s.results if r.measured and r.wall_s and r.role != ROLE_PERTURBED
                and self.s.programs.program(r.config) == key]

    def _latest(self, config: Mapping[str, Any]) -> TrialResult | None:
        runs = self.program_runs(config)
        return runs[-1] if runs else None

    def least_reserve(self) -> float:
        """The least a confirmation could cost: each of its runs as long as the baseline's."""
        return RUN_MARGIN * self.pairs_kept() * 2 * self.baseline_cost()

    def confirm_reserve(self, config: Mapping[str, Any] | None = None) -> float:
        """The time set aside for confirming ``config`` (or the best candidate so far): ``pairs_kept()`` A/B pairs,
        with the margin a single run gets (runs vary: makemore's fifth pair was cut by the budget with four of four
        faster)."""
        ranked = self.s.candidates()
        if config is None:
            config = ranked[0][0] if ranked else None
        cost = self.repeat_cost(config) if config is not None else self.baseline_cost()
        # the whole runs only once a candidate passed: before that they would only stop the search from finding one
        # (a Trainer fine-tune's search gave up with 220 s of 300 left, the whole runs' share counted)
        whole = self._whole_reserve(cost) if ranked else 0.0
        return RUN_MARGIN * (self.pairs_kept() * (self.baseline_cost() + cost) + whole)

    def _whole_reserve(self, cost: float) -> float:
        """The time the winner's whole-run pairs are expected to take (0 where none will run): each run as the
        first baseline's would take to the run's end, the candidate's with its extra start-up (``cost``, its trial
        run, beyond the baseline's)."""
        steps, found = self.s.train_steps, self.s.found_length()
        if not steps or found is None or not found.measured:
            return 0.0
        base = predicted_whole(found, steps)
        return plan_whole(self.s, base, base + max(cost - self.baseline_cost(), 0.0)).seconds or 0.0

    def pairs_kept(self) -> int:
        """The A/B pairs the time set aside for confirmation covers: --confirm; on a machine whose baseline runs
        differ by more than NOISY, as many as it takes for one pair lost to the noise to leave the sign test still
        saying faster at that look (10 with --confirm 5: 9 of 10 faster gives p = 0.011, within the 0.0176 a look
        after the fifth needs). makemore at 300 s: its 1.25x candidate (baseline runs 58% apart) was faster in 5 of
        6 pairs when the budget ended, after a single slow pair."""
        spread = self.s.noise().time
        first = self.s.o.confirm
        if spread is None or spread <= NOISY:
            return first
        return next(n for n in range(first, 64) if sign_test(n - 1, n) <= look_alpha(n, first))

    def time_left(self) -> float:
        return self.s.deadline - self.s.clock()

    def timeout(self, config: Mapping[str, Any], reserve: float = 0.0, to_end: bool = False) -> tuple[float, bool]:
        """A run's timeout, and whether the budget set it (shorter than the run's own: --timeout, else 5 times the
        slowest baseline run, at least 120 s, 900 s where it compiles, 600 s for the first run; a whole run: as the
        slowest baseline run would take to the run's end)."""
        if self.s.o.timeout is not None:
            timeout = self.s.o.timeout
        else:
            steps = self.s.train_steps
            walls = [predicted_whole(r, steps) if to_end and steps else r.wall_s for r in self.s.baselines()]
            timeout = own_timeout(walls, self.s.compiles(config))
        if math.isfinite(self.s.hard_end):  # a run never eats the time set aside for what comes after it
            left = max(self.s.hard_end - self.s.clock() - reserve, 1.0)
            if left < timeout:
                return left, True
        return timeout, False

    def affordable(self, config: Mapping[str, Any]) -> bool:
        """Whether the time left covers a run of ``config`` (with a margin: runs vary) and the confirmation."""
        return self.time_left() >= RUN_MARGIN * self.cost_of(config) + self.reserve_for(config)

    def reserve_for(self, config: Mapping[str, Any] | None) -> float:
        """The time to keep after a run of ``config``: confirming the best candidate so far, or ``config`` itself
        should it become the best, where its cost is known (a compiling configuration tried last costs more to
        confirm: makemore's was tried with 44 s left, won, and its confirmation ran out of time at 4 of 5 pairs).
        Before any compiling run was measured its compile time is a guess (60 s), which must not shut compilation
        out of a short budget: the best candidate's reserve then."""
        best = self.confirm_reserve()
        if config is None or (self.s.compiles(config) and not self.compile_measured()):
            return best
        return max(best, self.confirm_reserve(config))

    def compile_measured(self) -> bool:
        return any(r.measured and self.s.compiles(r.config) for r in self.s.results)
