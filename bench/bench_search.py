"""Judges ``autotune search`` against an exhaustive oracle on fixture scripts (a benchmark: printed, never asserted).

    python bench/bench_search.py [--scripts cnn char_gpt lstm_lm] [--device cpu] [--rounds 5] [--md PATH]

For each script, three phases, every run a real trial (the patched script in a subprocess under autotune's own
Runner: warm-up steps, timed steps, per-step losses, each loss-gated against the baseline's):

1. the oracle: every configuration of the grid over the script's most important knobs (``FIXTURES``), in a
   shuffled order with a baseline run after every few, each judged by the same gate a search uses and timed
   against the baseline runs around it; the oracle is the fastest configuration that passes the gate (with
   ``--oracle-top K``, the fastest in the rounds of phase 3 among the grid's K fastest);
2. ``autotune search`` on the script with its default budget (no --trials, no --time-budget), as a user runs it;
   the chosen knobs, its wall time and number of runs are read from the autotune.yaml it writes;
3. baseline, compile alone, everything on (the start configuration the search begins from), tuned and the
   oracle, side by side in ``--rounds`` rounds, each in a rotating order; each speedup is the median over the
   rounds of the ratio to that round's baseline run.

It prints a table per script and ``tuned / oracle = X.XX (range)``, the search's wall time and runs and the load
average around the script, and with ``--md`` writes the same tables as Markdown for docs/benchmarks.md. With
``--out DIR`` the grid (``--grid-only``, reused by ``--skip-grid``) and the search (reused by ``--skip-search``) are
kept, so that the phases can run at different times.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from autotune.knobs import compiles  # noqa: E402
from autotune.project import load_project  # noqa: E402
from autotune.patch import PatchResult, run as patch_project, select  # noqa: E402
from autotune.search.gate import judge, measure_noise  # noqa: E402
from autotune.search.live import changed_text  # noqa: E402
from autotune.search.costs import own_timeout  # noqa: E402
from autotune.search.search import local_speedups  # noqa: E402
from autotune.search.prepare import start_of  # noqa: E402
from autotune.search.space import build_space, config_key, read_space  # noqa: E402
from autotune.search.study import ROLE_BASELINE, ROLE_SEARCH  # noqa: E402
from autotune.search.trial import Outcome, Runner, TrialResult, TrialSettings  # noqa: E402

BASELINE_EVERY = 3  # grid configurations between two baseline runs of the oracle phase
SEARCH_TIMEOUT_S = 4 * 3600.0  # the search subprocess: its default budget bounds it long before this
ROLES = ("baseline", "compile alone", "all on", "tuned", "oracle")


@dataclass(frozen=True)
class Fixture:
    """A script of the benchmark: its path, its arguments and its grid (knob -> choices), per device."""

    path: str
    args: Mapping[str, tuple[str, ...]]
    grid: Mapping[str, Mapping[str, tuple[Any, ...]]]


# The script arguments run far more steps than a trial needs: a trial ends itself after warm-up + measured steps.
# The grids hold the knobs that decide the speed of each script (the field's experience and issue 11's
# measurements): precision, attention, compilation and the optimizer for the transformers, memory layout and
# loading for the CNN. Choices too slow to be tried on CPU (max-autotune) are left out, as the search space does;
# a CPU grid is 4 two-choice knobs (16 configurations, about 15 minutes of trials on a shared 2-core machine).
FIXTURES: dict[str, Fixture] = {
    "cnn": Fixture(
        "fixtures/scripts/cnn.py",
        {"cpu": ("--epochs", "50"), "cuda": ("--epochs", "50", "--batch-size", "256", "--num-samples", "4096")},
        {
            "cpu": {
                "autocast.dtype": ("default", "bf16"),
                "channels_last.enabled": (False, True),
                "compile.mode": ("none", "default"),
                "fused_optimizer.impl": ("default", "fused"),
            },
            "cuda": {
                "autocast.dtype": ("default", "bf16"),
                "channels_last.enabled": (False, True),
                "compile.mode": ("none", "default"),
                "fused_optimizer.impl": ("default", "fused"),
                "dataloader.num_workers": (0, 4),
            },
        },
    ),
    "char_gpt": Fixture(
        "fixtures/scripts/char_gpt.py",
        {
            "cpu": ("--max-iters", "1000"),
            # the size of issue 11's measurement on an H100
            "cuda": ("--max-iters", "1000", "--n-layer", "6", "--n-embd", "512", "--block-size", "1024",
                     "--batch-size", "16"),
        },
        {
            "cpu": {
                "autocast.dtype": ("default", "bf16"),
                "sdpa.attention": ("manual", "sdpa"),
                "compile.mode": ("none", "default"),
                "fused_optimizer.impl": ("default", "fused"),
            },
            # issue 11's best by hand on an H100: bf16 + SDPA + fused AdamW + compile(reduce-overhead), 9.3x
            "cuda": {
                "autocast.dtype": ("default", "bf16"),
                "sdpa.attention": ("manual", "sdpa"),
                "compile.mode": ("none", "default", "reduce-overhead"),
                "fused_optimizer.impl": ("default", "fused"),
            },
        },
    ),
    "lstm_lm": Fixture(
        "fixtures/scripts/lstm_lm.py",
        {"cpu": ("--epochs", "200"), "cuda": ("--epochs", "200")},
        {
            "cpu": {
                "autocast.dtype": ("default", "bf16"),
                "compile.mode": ("none", "default"),
                "fused_optimizer.impl": ("default", "fused"),
                "gc.freeze": (False, True),
            },
            "cuda": {
                "autocast.dtype": ("default", "bf16", "fp16"),
                "compile.mode": ("none", "default"),
                "fused_optimizer.impl": ("default", "foreach", "fused"),
                "backend_flags.cudnn_benchmark": (False, True),
            },
        },
    ),
    # the smoke test's fixture: two knobs that cost no compilation, one of them a clear win on any machine
    "loader": Fixture(
        "fixtures/search/loader.py",
        {"cpu": ("--iters", "400"), "cuda": ("--iters", "400")},
        {d: {"dataloader.num_workers": (0, 2), "gc.freeze": (False, True)} for d in ("cpu", "cuda")},
    ),
}


# --- measuring -----------------------------------------------------------------------------------------------


class Bench:
    """The trials of one script on one device: a Runner over the patched script and the gate's reference."""

    def __init__(self, key: str, device: str, args: argparse.Namespace, work: Path, console: Console) -> None:
        self.key = key
        self.fixture = FIXTURES[key]
        self.device = device
        self.console = console
        self.script = REPO / self.fixture.path
        self.script_args = self.fixture.args[device]
        self.patch: PatchResult = patch_project(load_project(self.script), select())
        self.knobs = {k.name: k for k in self.patch.knobs}
        self.space = build_space(self.patch.knobs, device, read_space(device))
        self.defaults = {k.name: k.default for k in self.patch.knobs}
        env = {"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {}  # as the search does: CPU means CPU
        settings = TrialSettings(self.script_args, REPO, device, args.warmup, args.steps, env)
        self.runner = Runner(self.patch, work, settings)
        self.results: list[TrialResult] = []

    def full(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """``config`` with every knob of the script it leaves out at its default."""
        return {**self.defaults, **{k: v for k, v in config.items() if k in self.knobs}}

    def changed(self, config: Mapping[str, Any]) -> str:
        return changed_text(self.full(config), self.defaults)

    def timeout(self, config: Mapping[str, Any]) -> float:
        """The search's trial timeout: from the slowest baseline run, longer for configurations that compile."""
        walls = [r.wall_s for r in self.results if r.role == ROLE_BASELINE and r.measured]
        return own_timeout(walls, compiles(self.patch.knobs, config))

    def trial(self, config: Mapping[str, Any], role: str, label: str) -> TrialResult:
        """One trial, numbered in run order (local_speedups pairs it with the baseline runs around it)."""
        r = self.runner.run(self.full(config), role, self.timeout(config)).with_(number=len(self.results))
        self.results.append(r)
        speed = f"{r.throughput:8.2f} steps/s" if r.measured else f"{r.error or ''}"[:120]
        self.console.print(f"    {label:<14} {r.status!s:<13} {speed}  {self.changed(config)}", highlight=False)
        return r

    def baselines(self) -> list[TrialResult]:
        return [r for r in self.results if r.role == ROLE_BASELINE and r.measured]

    def passes(self, r: TrialResult) -> bool:
        """Whether ``r`` finished and its losses match the first baseline run's within the search's gate."""
        base = self.baselines()
        if not r.measured or not base:
            return False
        if r is base[0] or not self.changed_knobs(r.config):
            return True
        changed = self.changed_knobs(r.config)
        return judge(r.with_(status=Outcome.OK), base[0], changed, measure_noise(base)).passed

    def changed_knobs(self, config: Mapping[str, Any]):
        return tuple(k for k in self.patch.knobs if config.get(k.name, k.default) != k.default)

    def cleanup(self) -> None:
        self.runner.cleanup()


@dataclass(frozen=True)
class GridPoint:
    """One grid configuration: its speed over the baseline runs around it (median of repeats) and its gate."""

    config: Mapping[str, Any]
    speedups: tuple[float, ...]
    passed: bool
    status: str

    @property
    def speedup(self) -> float | None:
        return statistics.median(self.speedups) if self.speedups else None


def grid_configs(grid: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    names = list(grid)
    return [dict(zip(names, values)) for values in itertools.product(*(grid[n] for n in names))]


def measure_grid(bench: Bench, grid: Mapping[str, Sequence[Any]], repeat: int, seed: int) -> list[GridPoint]:
    """Every grid configuration ``repeat`` times, shuffled, with baseline runs around them (two to start)."""
    configs = [c for c in grid_configs(grid) if bench.changed_knobs(bench.full(c))]
    bench.console.print(f"  oracle: {len(configs)} grid configurations x {repeat}, a baseline after every "
                        f"{BASELINE_EVERY}", highlight=False)
    for _ in range(2):
        bench.trial({}, ROLE_BASELINE, "baseline")
    if not bench.baselines():
        raise BenchError(f"{bench.key}: the baseline fails as a trial: {bench.results[-1].error}")
    runs: dict[str, list[TrialResult]] = {config_key(c): [] for c in configs}
    rng = random.Random(seed)
    for rep in range(repeat):
        order = list(configs)
        rng.shuffle(order)
        for i, c in enumerate(order):
            runs[config_key(c)].append(bench.trial(c, ROLE_SEARCH, f"grid {rep + 1}:{i + 1}/{len(order)}"))
            if (i + 1) % BASELINE_EVERY == 0 or i + 1 == len(order):
                bench.trial({}, ROLE_BASELINE, "baseline")
    speed = local_speedups(bench.results)
    points = []
    for c in configs:
        rs = runs[config_key(c)]
        failed = [r for r in rs if not bench.passes(r)]
        status = "ok" if not failed else (
            "diverged" if failed[0].measured else f"{failed[0].status}: {(failed[0].error or '')[:80]}")
        ups = tuple(speed[r.number] for r in rs if r.number in speed)
        points.append(GridPoint(c, ups, not failed, status))
    return points


def ranked(points: Sequence[GridPoint]) -> list[GridPoint]:
    """The grid configurations that passed the gate in every repeat and beat the baseline, fastest first."""
    return sorted((p for p in points if p.passed and p.speedup and p.speedup > 1.0), key=lambda p: -p.speedup)


def oracle_of(points: Sequence[GridPoint]) -> GridPoint | None:
    """The fastest grid configuration that passed the gate in every repeat (None: nothing beat the baseline)."""
    return next(iter(ranked(points)), None)


def fastest_of_top(rows: Mapping[str, Row]) -> dict[str, Row]:
    """``rows`` with "oracle" given to the fastest gate-passing one of the grid's top configurations in the rounds.

    (One grid pass on a noisy machine ranks near-equal configurations by chance; the rounds measure them again.)
    """
    top = [n for n in rows if n == "oracle" or n.startswith("grid #")]
    ok = [n for n in top if rows[n].gate == "ok" and rows[n].speedup is not None]
    best = max(ok, key=lambda n: rows[n].speedup, default="oracle")
    if best == "oracle":
        return dict(rows)
    out = {n: r for n, r in rows.items() if n not in ("oracle", best)}
    out["oracle"] = replace(rows[best], name="oracle")
    out[best] = replace(rows["oracle"], name=best)
    return out


# --- the search ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SearchRun:
    """What ``autotune search`` chose (from its autotune.yaml), how long it took and how many runs it made."""

    config: Mapping[str, Any] | None  # None: the search failed
    wall_s: float | None
    runs: int | None
    verdict: str
    command: str
    problem: str | None = None  # how the search failed after writing its outputs


def run_search(bench: Bench, out: Path, args: argparse.Namespace) -> SearchRun:
    """``autotune search`` as a user runs it, with the default budget; its output goes to ``out``.log."""
    cmd = [sys.executable, "-m", "autotune", "search", str(bench.script), "--out", str(out), "--device", bench.device,
           "--steps", str(args.steps), "--warmup", str(args.warmup), *args.search_arg, "--", *bench.script_args]
    shown = "autotune search " + shlex.join([os.path.relpath(bench.script, REPO), *cmd[5:]]).replace(str(out), "OUT")
    log = out.with_suffix(".log")
    bench.console.print(f"  search: {shown} (log: {log})", highlight=False)
    started = time.monotonic()
    with open(log, "wb") as f:
        try:
            proc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=SEARCH_TIMEOUT_S)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = None
    wall = time.monotonic() - started
    if rc == 0:
        return read_search(out / "autotune.yaml", shown, wall)
    tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:]
    why = f"exit status {rc}" if rc is not None else f"still running after {SEARCH_TIMEOUT_S:.0f}s"
    problem = f"the search failed ({why}): {' '.join(tail)}"
    if rc is not None and (out / "autotune.yaml").is_file():  # it failed after choosing: what it chose still counts
        return replace(read_search(out / "autotune.yaml", shown, wall), problem=f"{problem}, after writing its outputs")
    return SearchRun(None, wall, None, problem, shown)


def read_search(path: Path, command: str, wall: float | None = None) -> SearchRun:
    """A finished search's choice from its autotune.yaml (its own wall time when ``wall`` is not measured here)."""
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
        search = doc.get("search") or {}
        return SearchRun(dict(doc["knobs"]), wall if wall is not None else search.get("wall_s"), search.get("runs"),
                         str(doc.get("verdict", "")), command)
    except (OSError, yaml.YAMLError, AttributeError, KeyError, TypeError) as exc:
        raise BenchError(f"{path}: cannot read the search's choice: {exc}") from None


def start_config(bench: Bench) -> tuple[dict[str, Any], str]:
    """Everything on: the start configuration the search begins from (the space file's, as the search adjusts it)."""
    start, _ = start_of(bench.device, read_space(bench.device), False)
    return {k: v for k, v in start.items() if k in bench.space.choices}, f"search_spaces/{bench.device}.yaml start"


# --- side by side -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One contender of the side-by-side phase: its runs and their ratios to the same round's baseline run."""

    name: str
    config: Mapping[str, Any]
    runs: tuple[TrialResult, ...]
    ratios: tuple[float, ...]
    gate: str

    @property
    def speedup(self) -> float | None:
        return statistics.median(self.ratios) if self.ratios else None

    @property
    def spread(self) -> tuple[float, float] | None:
        return (min(self.ratios), max(self.ratios)) if self.ratios else None

    @property
    def steps_per_s(self) -> float | None:
        thr = [r.throughput for r in self.runs if r.measured and r.throughput]
        return statistics.median(thr) if thr else None


def side_by_side(bench: Bench, contenders: Mapping[str, Mapping[str, Any]], rounds: int) -> dict[str, Row]:
    """Each distinct program among ``contenders`` once per round, in a rotating order; name -> Row."""
    programs: dict[str, dict[str, Any]] = {}
    for config in contenders.values():
        programs.setdefault(config_key(bench.full(config)), bench.full(config))
    base_key = config_key(bench.full({}))
    keys = list(programs)
    runs: dict[str, list[TrialResult]] = {k: [] for k in keys}
    for i in range(rounds):
        for k in keys[i % len(keys):] + keys[: i % len(keys)]:
            role = ROLE_BASELINE if k == base_key else ROLE_SEARCH
            runs[k].append(bench.trial(programs[k], role, f"round {i + 1}/{rounds}"))
    rows = {}
    for name, config in contenders.items():
        k = config_key(bench.full(config))
        ratios = tuple(
            r.throughput / b.throughput
            for b, r in zip(runs[base_key], runs[k])
            if b.measured and r.measured and b.throughput and r.throughput and bench.passes(r)
        )
        verdicts = [bench.passes(r) for r in runs[k]]
        failed = [r for r, ok in zip(runs[k], verdicts) if not ok]
        gate = "ok" if not failed else (
            f"diverged {len(failed)}/{rounds}" if failed[0].measured else f"{failed[0].status} {len(failed)}/{rounds}")
        rows[name] = Row(name, config, tuple(runs[k]), ratios, gate)
    return rows


def pair_ratios(a: Row, b: Row) -> tuple[float, ...]:
    """Per round, a's throughput over b's (1.0 exactly where they are one program, measured once)."""
    if a.runs == b.runs:
        return tuple(1.0 for r in a.runs if r.measured)
    return tuple(
        x.throughput / y.throughput for x, y in zip(a.runs, b.runs) if x.measured and y.measured and x.throughput
        and y.throughput
    )


# --- one script -------------------------------------------------------------------------------------------------


class BenchError(Exception):
    """The benchmark cannot go on with a script (its baseline fails, a search's yaml is unreadable)."""


@dataclass(frozen=True)
class ScriptResult:
    key: str
    device: str
    defaults: Mapping[str, Any]  # every knob of the script at its default
    rows: Mapping[str, Row]
    grid: tuple[GridPoint, ...]
    oracle: GridPoint | None
    search: SearchRun
    start_from: str
    load: tuple[tuple[float, float, float], tuple[float, float, float]]
    notes: tuple[str, ...] = field(default_factory=tuple)


def grid_fingerprint(bench: Bench, grid: Mapping[str, Sequence[Any]], args: argparse.Namespace) -> str:
    """What makes a saved grid reusable: the script's source, its arguments, device, trial length and grid.

    (The source as written, not as patched: the oracle is a choice of knobs, which holds across changes in how
    autotune writes them.)
    """
    h = hashlib.sha256()
    for f in bench.patch.files:
        h.update(f.rel.as_posix().encode() + b"\0" + f.facts.source.encode() + b"\0")
    doc = [list(bench.script_args), bench.device, args.steps, args.warmup, {k: list(v) for k, v in grid.items()}]
    h.update(json.dumps(doc, default=str).encode())
    return h.hexdigest()


def save_grid(path: Path, fingerprint: str, points: Sequence[GridPoint]) -> None:
    doc = {"fingerprint": fingerprint, "points": [asdict(p) for p in points]}
    path.write_text(json.dumps(doc, indent=1, default=str), encoding="utf-8")


def load_grid(path: Path, fingerprint: str) -> list[GridPoint]:
    """A grid saved by an earlier run (--grid-only), refused where the script, its patch or the protocol changed."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        points = [GridPoint(p["config"], tuple(p["speedups"]), p["passed"], p["status"]) for p in doc["points"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BenchError(f"{path}: cannot read the saved grid: {exc}") from None
    if doc.get("fingerprint") != fingerprint:
        raise BenchError(f"{path}: saved for another script, arguments, --steps/--warmup or grid: measure it again")
    return points


def bench_script(key: str, args: argparse.Namespace, base: Path, console: Console) -> ScriptResult | None:
    """The three phases for one script (only the grid with --grid-only: then None)."""
    load_start = os.getloadavg()
    device = args.device
    console.print(f"[bold]{key}[/] on {device}: {FIXTURES[key].path} {shlex.join(FIXTURES[key].args[device])}; "
                  f"load average {load_start[0]:.2f}")
    bench = Bench(key, device, args, base / f"work-{key}", console)
    notes = []
    try:
        grid = {k: v for k, v in FIXTURES[key].grid[device].items() if k in bench.space.choices}
        missing = sorted(set(FIXTURES[key].grid[device]) - set(grid))
        if missing:
            notes.append(f"grid knobs that do not apply to this script on {device}: {', '.join(missing)}")
        saved, fingerprint = base / f"{key}.grid.json", grid_fingerprint(bench, grid, args)
        if args.skip_grid:
            points = load_grid(saved, fingerprint)
            notes.append(f"the grid was measured by an earlier run ({saved.name})")
        else:
            points = measure_grid(bench, grid, args.grid_repeat, args.seed)
            save_grid(saved, fingerprint, points)
        best = oracle_of(points)
        console.print(f"  {grid_text(points, best, bench.defaults)}", highlight=False)
        if args.grid_only:
            return None
        out = base / key
        if args.skip_search:
            search = read_search(out / "autotune.yaml", f"(reused {out / 'autotune.yaml'})")
        else:
            search = run_search(bench, out, args)
        if search.problem:
            notes.append(search.problem)
        console.print(f"  search: {search.runs} runs, {search.wall_s or 0:.0f}s: "
                      f"{bench.changed(search.config) if search.config is not None else search.verdict}",
                      highlight=False)
        start, start_from = start_config(bench)
        compile_choice = next((c for c in bench.space.choices.get("compile.mode", ()) if c != "none"), None)
        contenders: dict[str, Mapping[str, Any]] = {"baseline": {}}
        if compile_choice is not None:
            contenders["compile alone"] = {"compile.mode": compile_choice}
        contenders["all on"] = start
        if search.config is not None:
            contenders["tuned"] = search.config
        contenders["oracle"] = best.config if best else {}
        for i, p in enumerate(ranked(points)[1 : args.oracle_top], start=2):
            contenders[f"grid #{i}"] = p.config
        console.print(f"  side by side: {args.rounds} rounds", highlight=False)
        rows = fastest_of_top(side_by_side(bench, contenders, args.rounds))
        if args.oracle_top > 1:
            notes.append(f"oracle: the fastest in the rounds of the grid's top {args.oracle_top} (grid #i: the grid's "
                         "i-th fastest)")
    finally:
        bench.cleanup()
    load = (load_start, os.getloadavg())
    return ScriptResult(key, device, bench.defaults, rows, tuple(points), best, search, start_from, load, tuple(notes))


# --- reporting -------------------------------------------------------------------------------------------------


def _x(v: float | None) -> str:
    return f"{v:.2f}" if v is not None else "-"


def _span(s: tuple[float, float] | None) -> str:
    return f"{s[0]:.2f}-{s[1]:.2f}" if s else "-"


def table_rows(res: ScriptResult) -> list[list[str]]:
    out = []
    for name in [*ROLES, *sorted(n for n in res.rows if n not in ROLES)]:
        row = res.rows.get(name)
        if row is None:
            why = "no compile knob applies" if name == "compile alone" else res.search.verdict
            out.append([name, f"n/a ({why})", "", "", "", ""])
            continue
        thr = f"{row.steps_per_s:.2f}" if row.steps_per_s else "-"
        out.append([name, changed_text({**res.defaults, **row.config}, res.defaults), thr, _x(row.speedup), _span(row.spread),
                    row.gate])
    return out


def summary(res: ScriptResult) -> str:
    tuned, oracle = res.rows.get("tuned"), res.rows["oracle"]
    if tuned is None:
        ratio = f"tuned / oracle = n/a ({res.search.verdict})"
    else:
        r = pair_ratios(tuned, oracle)
        ratio = f"tuned / oracle = {_x(statistics.median(r) if r else None)} ({_span((min(r), max(r)) if r else None)})"
    (a, _, _), (b, _, _) = res.load
    wall = f"{res.search.wall_s:.0f} s" if res.search.wall_s is not None else "? s"
    return (f"{res.key} ({res.device}): {ratio}; search {wall}, {res.search.runs if res.search.runs is not None else '?'}"
            f" runs; load average {a:.2f} at start, {b:.2f} at end")


def grid_text(points: Sequence[GridPoint], best: GridPoint | None, defaults: Mapping[str, Any]) -> str:
    passed = sum(p.passed for p in points)
    what = (f"best {changed_text({**defaults, **best.config}, defaults)} at {best.speedup:.2f}x in the grid"
            if best else "no grid configuration beat the baseline")
    return f"oracle: {len(points)} grid configurations, {passed} passed the gate; {what}"


def grid_line(res: ScriptResult) -> str:
    return grid_text(res.grid, res.oracle, res.defaults)


def print_result(res: ScriptResult, console: Console) -> None:
    table = Table(title=f"{res.key} on {res.device}: throughput relative to the baseline, interleaved rounds")
    for col in ("configuration", "knobs", "steps/s", "x baseline (median)", "range", "gate"):
        table.add_column(col, overflow="fold")
    for cells in table_rows(res):
        table.add_row(*cells)
    console.print(table)
    console.print(grid_line(res), highlight=False)
    console.print(f"all on: {res.start_from}", highlight=False)
    for note in res.notes:
        console.print(f"note: {note}", highlight=False)
    console.print(summary(res), highlight=False)


def markdown(res: ScriptResult, command: str) -> str:
    lines = [f"### {res.key} on {res.device}", "", f"`{command}`", "",
             f"search: `{res.search.command}`", "",
             "| configuration | knobs | steps/s | x baseline (median) | range | gate |", "|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |" for cells in table_rows(res)]
    lines += ["", grid_line(res) + ".", f"All on: {res.start_from}.", *(f"Note: {n}." for n in res.notes),
              "", f"**{summary(res)}**", ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scripts", nargs="+", default=["cnn", "char_gpt", "lstm_lm"], choices=sorted(FIXTURES))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the side-by-side phase")
    parser.add_argument("--steps", type=int, default=20, help="measured steps per trial (the search's default)")
    parser.add_argument("--warmup", type=int, default=5, help="warm-up steps per trial (the search's default)")
    parser.add_argument("--grid-repeat", type=int, default=1, help="measurements of each grid configuration")
    parser.add_argument("--oracle-top", type=int, default=1, metavar="K",
                        help="measure the grid's K fastest in the rounds too; the oracle is the fastest there")
    parser.add_argument("--seed", type=int, default=0, help="seed of the grid's shuffled order")
    parser.add_argument("--out", type=Path, help="keep each search's output folder here, as OUT/<script>")
    parser.add_argument("--skip-search", action="store_true", help="reuse OUT/<script>/autotune.yaml of an earlier run")
    parser.add_argument("--grid-only", action="store_true", help="measure the oracle grid into OUT/<script>.grid.json, "
                        "then stop")
    parser.add_argument("--skip-grid", action="store_true", help="reuse OUT/<script>.grid.json of an earlier run")
    parser.add_argument("--search-arg", action="append", default=[], metavar="ARG",
                        help="an extra option for autotune search, e.g. --search-arg=--trials=3 (the benchmark's "
                             "figures use none: the default budget)")
    parser.add_argument("--md", type=Path, help="also write the tables as Markdown to this file")
    args = parser.parse_args(argv)
    if min(args.rounds, args.grid_repeat, args.oracle_top, args.warmup) < 1 or args.steps < 2:
        return _usage("--rounds, --grid-repeat, --oracle-top and --warmup must be at least 1, --steps at least 2")
    for flag in ("skip_search", "skip_grid", "grid_only"):
        if getattr(args, flag) and args.out is None:
            return _usage(f"--{flag.replace('_', '-')} needs --out DIR: the folder that keeps each script's grid and search")
    if args.skip_grid:
        absent = [k for k in args.scripts if not (args.out / f"{k}.grid.json").is_file()]
        if absent:
            return _usage(f"--skip-grid: no saved grid in {args.out} for {', '.join(absent)} (run --grid-only first)")
    if args.grid_only and (args.skip_grid or args.skip_search):
        return _usage("--grid-only measures the grid and stops: it cannot be combined with --skip-grid or --skip-search")
    if args.skip_search:
        absent = [k for k in args.scripts if not (args.out / k / "autotune.yaml").is_file()]
        if absent:
            return _usage(f"--skip-search: no earlier search in {args.out} for {', '.join(absent)} (no autotune.yaml)")
    elif not args.grid_only and args.out is not None and any((args.out / k).exists() for k in args.scripts):
        # a search into a folder that holds its study resumes it: its trials would not be this run's
        return _usage(f"{args.out}: holds an earlier run's searches; pass --skip-search to reuse them, or another --out")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return _usage("--device cuda: torch sees no CUDA device here")
    console = Console(highlight=False, width=max(160, Console().width))
    command = "python bench/bench_search.py " + shlex.join(sys.argv[1:] if argv is None else list(argv))
    console.print(f"bench_search on {args.device}: {os.cpu_count()} CPUs, OMP_NUM_THREADS="
                  f"{os.environ.get('OMP_NUM_THREADS', 'unset')}, rounds={args.rounds}, steps={args.steps}, "
                  f"warmup={args.warmup}, grid repeat={args.grid_repeat}", highlight=False)
    results, failed = [], []
    with tempfile.TemporaryDirectory(prefix="bench_search_") as tmp:
        base = args.out or Path(tmp)
        base.mkdir(parents=True, exist_ok=True)
        for key in args.scripts:
            try:
                res = bench_script(key, args, base, console)
            except BenchError as exc:
                console.print(f"{key}: {exc}", highlight=False)
                failed.append(key)
                continue
            if res is None:
                continue
            print_result(res, console)
            results.append(res)
    if results:
        console.print()
        for res in results:
            console.print(summary(res), highlight=False)
    if args.md is not None and results:
        args.md.write_text("\n".join(markdown(res, command) for res in results), encoding="utf-8")
        console.print(f"wrote {args.md}", highlight=False)
    return 1 if failed else 0


def _usage(message: str) -> int:
    print(f"bench_search: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
