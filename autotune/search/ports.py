"""What the search's collaborators may use of a running search, as typed interfaces.

explore.py, confirm.py, whole.py, carried.py, view.py and live.py work on the running ``Search`` (search.py), which
imports them: each types its argument by the interface here that names what it reads, so that the imports stay
one-way and the search's other state stays its own. ``Search`` provides all of them (tests/test_search_ports.py checks it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from autotune.search.machine import Machine
    from autotune.search.options import SearchOptions
    from autotune.search.outcome import Confirmation
    from autotune.search.identity import Programs
    from autotune.search.space import SearchSpace
    from autotune.search.trial import TrialResult


class Clock(Protocol):
    """The budget (costs.Costs, the search's ``costs``): the time left, what a run is expected to cost, what is set
    aside for confirmation."""

    def time_left(self) -> float: ...

    def baseline_cost(self) -> float: ...

    def cost_of(self, config: Mapping[str, Any]) -> float: ...

    def confirm_reserve(self, config: Mapping[str, Any] | None = None) -> float: ...

    def affordable(self, config: Mapping[str, Any]) -> bool: ...


class Runs(Protocol):
    """The study as this worker sees it: every worker's runs, gated against each machine's own baselines."""

    space: SearchSpace
    programs: Programs
    results: list[TrialResult]
    machine: Machine | None
    claims: set[str]  # what other workers are measuring now

    @property
    def train_steps(self) -> int | None: ...  # the user's run's length, where it was found

    def refresh(self) -> None: ...

    def mine(self, machine: str | None = None) -> str: ...

    def baselines(self, machine: str | None = None) -> list[TrialResult]: ...

    def regate(self, results: list[TrialResult]) -> list[TrialResult]: ...

    def value_of(self, result: TrialResult) -> float: ...

    def settled(self) -> dict[int, float]: ...  # trial number -> speedup against the baseline runs around it

    def speed_of(self, r: TrialResult) -> float: ...

    def compiles(self, config: Mapping[str, Any]) -> bool: ...


class Trials(Protocol):
    """Running trials: one run of a configuration in its own process, recorded in the study."""

    o: SearchOptions
    display: Any  # live.SearchDisplay or QuietDisplay

    def run_trial(
        self, config: Mapping[str, Any] | None, role: str, attrs: Mapping[str, Any] | None = None,
        claim: str | None = None,
    ) -> TrialResult | None: ...

    def wait_for(self, what: str, keys: set[str]) -> None: ...

    def cache_path(self, config: Mapping[str, Any]) -> Path | None: ...


class Confirming(Runs, Trials, Protocol):
    """What confirmation, whole runs and the compile cache's measure use: runs, the budget and the verdict rule."""

    costs: Clock
    clock: Callable[[], float]
    deadline: float  # the end of --time-budget
    hard_end: float  # no run goes past this (the budget's slack, less the outputs' time)
    reserve_now: float  # the time the run starting now must leave for what comes after it

    def candidates(self) -> list[tuple[dict[str, Any], float]]: ...

    def nothing_to_confirm(self) -> bool: ...

    def verdict_of(
        self, config: dict[str, Any], got: Mapping[tuple[int, str], TrialResult], stopped: str | None,
        search_speedup: float | None, machine: str,
    ) -> Confirmation: ...


class Exploring(Confirming, Protocol):
    """What the search phase (explore.py) uses: the strategy and its plan, the study's measured programs, the first
    runs' decisions (run lengths, the thread count a crowded machine favours) and the compiling program's repeat."""

    device: str
    strategy: Any  # strategy.StrongStart
    plan: Any  # strategy.Plan | None
    mode: str  # how the search went on after the descent, for the report
    threads: tuple[int, int] | None
    taken: set[str]  # the programs other workers are measuring now
    started: float

    def target(self) -> int | None: ...

    def measured(self) -> dict[str, TrialResult]: ...

    def view(self) -> Any: ...  # view.StudyView

    def noise(self, machine: str | None = None) -> Any: ...  # gate.Noise

    def crowd(self) -> Any: ...  # crowd.Crowd | None

    def thread_knob(self) -> str | None: ...

    def perturbed(self, machine: str | None = None) -> list[TrialResult]: ...

    def fit_lengths(self) -> bool: ...

    def compiles(self, config: Mapping[str, Any]) -> bool: ...


class Viewed(Runs, Protocol):
    """What the strategy's view of the study (view.py) reads."""

    costs: Clock
    rejected: dict[str, float]  # program -> the speedup the A/B pairs measured, where they did not confirm it


class Shown(Protocol):
    """What the live display (live.py) reads of a running search."""

    o: SearchOptions
    results: list[TrialResult]
    costs: Clock

    def target(self) -> int | None: ...

    def measured(self) -> dict[str, TrialResult]: ...
