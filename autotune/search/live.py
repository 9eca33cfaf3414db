"""What a running search shows: a rich progress bar and a live table on a terminal, one line per trial elsewhere."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.console import Console, Group
from rich.live import Live
import shlex
import time

from rich.progress import BarColumn, Progress, ProgressColumn, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.text import Text
from rich.table import Table

from autotune.contention import BUSY_OTHERS
from autotune.search.ports import Shown
from autotune.search.strategy import label
from autotune.search.trial import Outcome, TrialResult

STATUS_STYLE = {
    Outcome.OK: "green",
    Outcome.DIVERGED: "yellow",
    Outcome.UNVERIFIED: "yellow",
    Outcome.UNREACHED: "yellow",
    Outcome.SHORT: "yellow",
    Outcome.INTERRUPTED: "dim",
    Outcome.DISTURBED: "yellow",
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


def duration(s: float) -> str:
    s = max(s, 0.0)
    return f"{int(s // 60)}m{int(s % 60):02d}s" if s >= 60 else f"{s:.0f}s"


class _BudgetColumn(ProgressColumn):
    """The time left in the search's budget, read from its clock at each refresh, so it runs during a trial."""

    def __init__(self, display: "SearchDisplay") -> None:
        super().__init__()
        self.display = display

    def render(self, task) -> Text:
        return Text(self.display.clock_text(), style="progress.remaining")


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
            TimeElapsedColumn(),
            _BudgetColumn(self),
            console=console,
        )
        self.task = None
        self.search: Shown | None = None
        self.phase = ""

    def clock_text(self) -> str:
        """Runs so far and the time left in the budget (the search ends by then, confirmation included)."""
        s = self.search
        if s is None:
            return ""
        runs = f"{len(s.results)} runs"
        if s.o.budget:
            return f"{runs}, {duration(s.costs.time_left())} of {duration(s.o.budget)} left"
        target = s.target()
        return f"{runs}, {len(s.measured())} of {target} configurations" if target else runs

    def begin(self, search: Shown) -> None:
        self.search = search
        self.defaults = search.space.baseline()
        space = search.space
        o = search.o
        knobs = ", ".join(f"{k.name} ({len(space.choices[k.name])})" for k in space.knobs)
        budget = []
        if o.budget:
            budget.append(f"time budget {duration(o.budget)}" + ("" if o.time_budget else " (the default)"))
        if o.trials:
            budget.append(f"at most {o.trials} configurations")
        self.console.print(
            f"[bold]autotune search[/] {search.o.script} on {search.device}: {len(space.knobs)} knobs, "
            f"{space.size} configurations; {search.strategy.name}; {', '.join(budget)}",
            soft_wrap=True,
        )
        self.console.print(
            f"  each run: {shlex.join(['python', str(o.script), *o.args])}: {o.warmup} warm-up + {o.steps} measured "
            f"steps; confirmation: at least {o.confirm} A/B pairs"
            + (f"; objective: time to train {o.train_steps} steps, compile included" if o.train_steps else ""),
            markup=False,
            soft_wrap=True,
        )
        self.console.print(f"  knobs: {knobs}", markup=False, soft_wrap=True)
        found = search.run_length_note() if not o.train_steps else None
        if found:  # a study resumed: its first baseline run read the run's length
            self.console.print(f"  {found}", markup=False, soft_wrap=True)
        start = label(search.strategy.start, space)
        self.console.print(f"  starts from: {start}", markup=False, soft_wrap=True)
        if o.launcher:
            self.console.print(f"  each trial runs under: {o.launcher}", markup=False, soft_wrap=True)
        self.console.print(f"  machine: {search.machine.key}", markup=False, soft_wrap=True)
        if search.isolation:
            self.console.print(f"  your files: {search.isolation}", markup=False, soft_wrap=True)
        if search.results:
            others = sum(r.machine != search.machine.key for r in search.results)
            self.console.print(
                f"  resuming study '{search.study_name}': {len(search.results)} finished trial(s) kept"
                + (f", {others} of them from other machines" if others else ""),
                markup=False,
                soft_wrap=True,
            )
        self.started = time.monotonic()
        self.task = self.progress.add_task("starting", total=o.budget or search.target() or None)
        if self.live_mode:
            self.live = Live(self._render(), console=self.console, refresh_per_second=4, transient=False)
            self.live.start()

    def _tick(self, description: str) -> None:
        s = self.search
        if self.task is None or s is None:
            return
        done = (s.o.budget - s.costs.time_left()) if s.o.budget else len(s.measured())
        self.progress.update(self.task, description=description, completed=done)

    def _render(self):
        table = Table(title=None, expand=False)
        for col in ("#", "role", "configuration", "status", "steps/s", "speedup", "loss dev", "peak mem", "load"):
            table.add_column(col, no_wrap=col != "configuration")
        for row in self.rows[-TABLE_ROWS:]:
            table.add_row(*row)
        return Group(self.progress, table)

    def label(self, config: Mapping[str, Any]) -> str:
        """A configuration by the knobs that change the program (compile.scope without compile is no change)."""
        if self.search is not None:
            return label(self.search.programs.canonical(config), self.search.space)
        return changed_text(config, self.defaults)

    def trial_started(self, config: Mapping[str, Any], role: str) -> None:
        if role != "confirm":
            self._tick(f"{role}: {self.label(config)}")

    def confirming(self, which: tuple[int, int], pair: int, pairs: int, arm: str) -> None:
        more = "" if pair <= self.search.o.confirm else "up to "
        text = f"confirming candidate {which[0]} of {which[1]}: pair {pair} of {more}{pairs}, {arm} run"
        self._tick(text)
        if self.live is None:
            self.console.print(f"  {text}", markup=False, highlight=False)

    def trial_finished(self, r: TrialResult, speedup: float | None) -> None:
        style = STATUS_STYLE.get(r.status, "red")
        status = f"[{style}]{r.status}[/]"
        thr = f"{r.throughput:.2f}" if r.throughput else "-"
        name = self.label(r.config)
        row = (
            str(r.number),
            r.role + (f" ({r.attrs['phase']})" if r.attrs.get("phase") else "")
            + (f" ({r.attrs['threads']} thread{'s' if r.attrs['threads'] != 1 else ''})" if r.attrs.get("threads") else ""),
            name,
            status,
            thr,
            speed_text(speedup) if name != "baseline" else "",
            dev_text(r),
            mib(r.peak_memory),
            f"{r.load:.1f}" if r.load is not None else "-",
        )
        self.rows.append(row)
        self._tick(self.progress.tasks[0].description if self.progress.tasks else "")
        if self.live is not None:
            self.live.update(self._render())
        else:
            why = f"  ({r.error})" if r.error and r.status is not Outcome.OK else ""
            load = f"  load {r.load:.1f}" if r.load is not None else ""
            if r.others is not None and r.others >= BUSY_OTHERS:  # other work took processors from its steps
                load += f"  others {r.others:.1f} cpu"
            self.console.print(
                f"  #{row[0]:>3} {row[1]:<17} {row[2]:<40} {r.status!s:<13} {thr:>8} steps/s "
                f"{row[5]:>7}  dev {row[6]:<7} {row[7]}{load}{why}  [{self.clock_text()}]",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )

    def note(self, text: str) -> None:
        # (soft wrap: piped to a file or a log, a note stays one line; a terminal wraps it where it must)
        if self.live is not None:
            self.live.console.print(text, markup=False, soft_wrap=True)
        else:
            self.console.print(text, markup=False, soft_wrap=True)

    def end(self) -> None:
        if self.task is not None:
            self.progress.update(self.task, description="configurations")
        if self.live is not None:
            self.live.update(self._render())
            self.live.stop()
            self.live = None


class QuietDisplay:
    """No output at all (benchmarks, library use)."""

    def begin(self, search: Shown) -> None: ...
    def trial_started(self, config, role) -> None: ...
    def trial_finished(self, result, speedup) -> None: ...
    def confirming(self, which, pair, pairs, arm) -> None: ...
    def note(self, text) -> None: ...
    def end(self) -> None: ...
