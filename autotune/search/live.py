"""What a running search shows: a rich progress bar and a live table on a terminal, one line per trial elsewhere."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from autotune.search.trial import Outcome, TrialResult

STATUS_STYLE = {
    Outcome.OK: "green",
    Outcome.DIVERGED: "yellow",
    Outcome.SHORT: "yellow",
    Outcome.INTERRUPTED: "dim",
}
TABLE_ROWS = 12


def changed_text(config: Mapping[str, Any], defaults: Mapping[str, Any]) -> str:
    """The knobs of ``config`` that differ from their defaults, as ``name=value`` (``baseline`` when none)."""
    parts = [f"{k}={_value(v)}" for k, v in config.items() if defaults.get(k, v) != v]
    return ", ".join(parts) or "baseline"


def _value(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def mib(n: int | None) -> str:
    return f"{n / 2**20:.0f} MiB" if n else "-"


def speed_text(x: float | None) -> str:
    return f"{x:.3f}x" if x else "-"


def dev_text(r: TrialResult) -> str:
    if r.deviation is None:
        return "-"
    if r.deviation != r.deviation:  # nan: no loss to compare
        return "n/a"
    return f"{r.deviation:.1e}" if r.deviation else "0"


class SearchDisplay:
    """Progress of a search on ``console``: live on a terminal, plain lines in a log."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.live_mode = console.is_terminal
        self.rows: list[tuple[str, ...]] = []
        self.defaults: dict[str, Any] = {}
        self.live: Live | None = None
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
        )
        self.task = None
        self.search = None

    def begin(self, search) -> None:
        self.search = search
        self.defaults = search.space.baseline()
        space = search.space
        done = len(search.measured())
        knobs = ", ".join(f"{k.name} ({len(space.choices[k.name])})" for k in space.knobs)
        self.console.print(
            f"[bold]autotune search[/] {search.o.script} on {search.device}: {len(space.knobs)} knobs, "
            f"{space.size} configurations, {search.mode} up to {search.target()}"
            + (f" within {search.o.time_budget:.0f}s" if search.o.time_budget else ""),
            soft_wrap=True,
        )
        self.console.print(f"  knobs: {knobs}", markup=False, soft_wrap=True)
        if search.o.launcher:
            self.console.print(f"  each trial runs under: {search.o.launcher}", markup=False, soft_wrap=True)
        self.console.print(f"  machine: {search.machine.key}", markup=False, soft_wrap=True)
        if search.results:
            others = sum(r.machine != search.machine.key for r in search.results)
            self.console.print(
                f"  resuming study '{search.study_name}': {len(search.results)} finished trial(s) kept"
                + (f", {others} of them from other machines" if others else ""),
                markup=False,
                soft_wrap=True,
            )
        self.task = self.progress.add_task("configurations", total=search.target(), completed=min(done, search.target()))
        if self.live_mode:
            self.live = Live(self._render(), console=self.console, refresh_per_second=4, transient=False)
            self.live.start()

    def _render(self):
        table = Table(title=None, expand=False)
        for col in ("#", "role", "configuration", "status", "steps/s", "speedup", "loss dev", "peak mem"):
            table.add_column(col, no_wrap=col != "configuration")
        for row in self.rows[-TABLE_ROWS:]:
            table.add_row(*row)
        return Group(self.progress, table)

    def trial_started(self, config: Mapping[str, Any], role: str) -> None:
        if self.task is not None:
            self.progress.update(self.task, description=f"{role}: {changed_text(config, self.defaults)}")

    def trial_finished(self, r: TrialResult, speedup: float | None) -> None:
        style = STATUS_STYLE.get(r.status, "red")
        status = f"[{style}]{r.status}[/]"
        thr = f"{r.throughput:.2f}" if r.throughput else "-"
        row = (
            str(r.number),
            r.role,
            changed_text(r.config, self.defaults),
            status,
            thr,
            speed_text(speedup) if changed_text(r.config, self.defaults) != "baseline" else "",
            dev_text(r),
            mib(r.peak_memory),
        )
        self.rows.append(row)
        if self.task is not None and self.search is not None:
            self.progress.update(self.task, completed=min(len(self.search.measured()), self.search.target()))
        if self.live is not None:
            self.live.update(self._render())
        else:
            why = f"  ({r.error})" if r.error and r.status is not Outcome.OK else ""
            self.console.print(
                f"  #{row[0]:>3} {r.role:<8} {row[2]:<40} {r.status!s:<13} {thr:>8} steps/s "
                f"{row[5]:>7}  dev {row[6]:<7} {row[7]}{why}",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )

    def note(self, text: str) -> None:
        if self.live is not None:
            self.live.console.print(text, markup=False)
        else:
            self.console.print(text, markup=False)

    def end(self) -> None:
        if self.task is not None:
            self.progress.update(self.task, description="configurations")
        if self.live is not None:
            self.live.update(self._render())
            self.live.stop()
            self.live = None


class QuietDisplay:
    """No output at all (benchmarks, library use)."""

    def begin(self, search) -> None: ...
    def trial_started(self, config, role) -> None: ...
    def trial_finished(self, result, speedup) -> None: ...
    def note(self, text) -> None: ...
    def end(self) -> None: ...
