"""What ``autotune search`` was asked to do, and how a search that cannot go on ends."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from autotune.errors import AutotuneError
from autotune.isolate import OVERLAY

DEFAULT_BUDGET_S = 900.0  # when neither --trials nor --time-budget is given
DEFAULT_STEPS = 20  # measured steps per run
DEFAULT_WARMUP = 5  # and warm-up steps before them


class SearchFailed(AutotuneError):
    """The search could not run: the unmodified script itself fails as a trial."""

    exit_code = 1


class SearchInterrupted(AutotuneError):
    """The user stopped the search; every finished trial is kept in the study."""

    exit_code = 130


@dataclass(frozen=True)
class SearchOptions:
    """Everything ``autotune search`` was asked to do."""

    script: Path
    args: tuple[str, ...] = ()
    out: Path = Path("autotune-out")
    trials: int | None = None  # distinct configurations, the baseline included; None: no limit but the budget
    time_budget: float | None = None  # seconds for the whole command; None with trials None: DEFAULT_BUDGET_S
    steps: int = DEFAULT_STEPS
    warmup: int = DEFAULT_WARMUP
    lengthen: bool = False  # runs longer than steps + warmup where those time too little (the CLI's default)
    device: str = "auto"
    storage: str | None = None
    study_name: str | None = None
    space: Path | None = None
    rtol: float | None = None
    timeout: float | None = None
    confirm: int = 5
    whole_runs: int = 3  # A/B pairs of whole runs (process start to exit) that check the winner; 0: none
    compile_cache: bool = True  # carry what the winner's runs compiled to the tuned script (autotune.compile_cache)
    baseline_every: int = 4
    seed: int = 0
    env: Mapping[str, str | None] = field(default_factory=dict)  # extra environment for every trial
    launcher: str | None = None  # a command that runs each trial as a distributed job ("torchrun --nproc_per_node=2")
    train_steps: int | None = None  # the real run's length: the objective becomes time to train, compile included
    isolation: str = OVERLAY  # how trials are kept off the user's files (autotune.isolate.ISOLATIONS)

    @property
    def budget(self) -> float | None:
        """The time budget in force: the one given, or the default when no budget at all was given."""
        if self.time_budget is None and self.trials is None:
            return DEFAULT_BUDGET_S
        return self.time_budget
