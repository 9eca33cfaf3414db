"""The outputs of a search: the tuned (baked) script, autotune.yaml, tuned.diff, report.md and its plot."""

from __future__ import annotations

import hashlib
import io
import math
import platform
import re
import shlex
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune import __version__
from autotune.bake import DIFF_NAME, bake, check_out_dir, write_baked
from autotune.files import PLOT_NAME, REPORT_NAME, write_file
from autotune.knobs import Numerics
from autotune.patch import CONFIG_NAME
from autotune.search.gate import LOWP_WINDOW, numerics_of
from autotune.search.live import changed_text, dev_text, mib, speed_text
from autotune.search.machine import cpu_name
from autotune.search.outcome import SearchOutcome, is_baseline_run, train_time
from autotune.search.study import ROLE_BASELINE, ROLE_CONFIRM, ROLE_PERTURBED, ROLE_SEARCH
from autotune.search.trial import Outcome, TrialResult, stderr_summary



@dataclass(frozen=True)
class Written:
    """What write_outputs wrote, and where the plot went (or why it did not)."""

    files: tuple[Path, ...]
    entry: Path
    plot: Path | None
    plot_skipped: str | None
    changed: Mapping[str, Any]


def versions(device: str) -> dict[str, Any]:
    import optuna
    import torch

    out: dict[str, Any] = {
        "autotune": __version__,
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "optuna": optuna.__version__,
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cpu_threads": torch.get_num_threads(),
    }
    if device == "cuda" and torch.cuda.is_available():
        out["cuda"] = str(torch.version.cuda)
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


def _r(x: float | None, digits: int = 4) -> float | None:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return None
    return float(f"{x:.{digits}g}")


def _throughput(runs: list[TrialResult]) -> dict[str, float | None]:
    steps = [r.throughput for r in runs if r.measured and r.throughput]
    samples = [r.samples_per_s for r in runs if r.measured and r.samples_per_s]
    return {
        "steps_per_s": _r(statistics.median(steps)) if steps else None,
        "samples_per_s": _r(statistics.median(samples)) if samples else None,
    }


def summary_doc(o: SearchOutcome, entry_hash: str, file_hashes: Mapping[str, str]) -> dict[str, Any]:
    """The contents of the output autotune.yaml."""
    chosen = o.chosen
    defaults = o.space.baseline()
    changed = {k: v for k, v in chosen.items() if defaults.get(k) != v}
    win = o.winner
    here = [r for r in o.results if r.machine == o.machine]  # throughputs of one machine only are comparable
    baseline_runs = list(win.baseline) if win else [r for r in here if r.role == ROLE_BASELINE]
    tuned_runs = list(win.candidate) if win else baseline_runs
    same = [r for r in here if r.measured and r.config == chosen and r.deviation is not None]
    max_dev = max((r.deviation for r in same if r.deviation == r.deviation), default=0.0 if not changed else None)
    tol = max((r.tolerance for r in same if r.tolerance is not None), default=None)
    best = o.confirmations[0] if o.confirmations else None
    doc: dict[str, Any] = {
        "script": o.project.entry.display,
        "script_sha256": entry_hash,
    }
    if len(file_hashes) > 1:
        doc["files_sha256"] = dict(file_hashes)
    doc.update(
        {
            "args": list(o.options.args),
            "launcher": o.options.launcher,  # every run went through it: the measurements hold under it only
            "device": o.device,
            "machine": o.machine,
            "knobs": {k: chosen[k] for k in sorted(chosen)},
            "changed": changed,
            "winner": "tuned" if win else "baseline",
            "verdict": win.reason if win else _baseline_reason(o),
            "throughput": {"baseline": _throughput(baseline_runs), "tuned": _throughput(tuned_runs)},
            "speedup": _r(win.speedup) if win else 1.0,
            "speedup_spread": [_r(x) for x in win.spread] if win and win.spread else None,
            "confirmation_pairs": len(win.ratios) if win else (len(best.ratios) if best else 0),
            "confidence": _confidence(win or best),
            "warning": o.noisy,
            "startup": o.startup,
            "max_loss_deviation": _r(max_dev, 3),
            "loss_tolerance": _r(tol, 3),
            "noise": {
                "baseline_runs": o.noise.runs,
                "deterministic": o.noise.deterministic,
                "loss_max_deviation": _r(o.noise.max_loss, 3),
                "perturbed_runs": o.noise.perturbed,
                "reorder_max_deviation": _r(o.noise.max_reorder, 3),
                "time_spread": _r(o.noise.time, 3),
            },
            "search": {
                "study": o.study_name,
                "storage": o.storage,
                "mode": o.mode,
                "strategy": "strong start + descent",
                "path": [s.text for s in o.plan.path] if o.plan else [],
                "blamed": [{"knob": b.knob, "value": b.value, "reason": b.reason} for b in o.plan.blamed] if o.plan else [],
                "interactions": list(o.interactions),
                "time_budget_s": o.options.budget,
                "confirmation_reserved_s": _r(o.reserved_s),
                "space_size": o.space.size,
                "configurations_measured": len({_key(r.config) for r in o.results if r.role != ROLE_CONFIRM}),
                "runs": len(o.results),
                "machines": {m: sum(r.machine == m for r in o.results) for m in o.machines},
                "stopped": o.stopped,
                "steps": o.options.steps,
                "warmup": o.options.warmup,
                "wall_s": round(o.wall_s, 1),
            },
            "versions": versions(o.device),
        }
    )
    return doc


def _confidence(c) -> dict[str, Any] | None:
    """The A/B verdict's statistics: pairs won, the sign test's p-value, an interval for the median speedup."""
    if c is None or not c.ratios:
        return None
    low, high, cover = c.interval
    return {
        "pairs": len(c.ratios),
        "wins": c.wins,
        "sign_test_p": _r(c.p_value, 3),
        "median_interval": [_r(low), _r(high)],
        "interval_coverage": _r(cover, 3),
    }


def _key(config: Mapping[str, Any]) -> tuple:
    return tuple(sorted(config.items()))


def _baseline_reason(o: SearchOutcome) -> str:
    if o.confirmations:
        c = o.confirmations[0]
        return f"the baseline wins: best candidate ({changed_text(c.config, o.space.baseline())}) {c.reason}"
    tried = [r for r in o.results if r.role == ROLE_SEARCH]
    if not tried:
        return f"the baseline wins: no other configuration was tried ({o.stopped})"
    ok = [r for r in tried if r.status is Outcome.OK]
    if not ok:
        return f"the baseline wins: none of the {len(tried)} configurations tried finished and passed the loss gate"
    if o.plan is not None and o.plan.done and changed_text(o.plan.incumbent, o.space.baseline()) == "baseline":
        untried = (f"; {o.plan.untried} knob change(s) the time left did not cover were not tried (a larger "
                   "--time-budget tries them)") if o.plan.untried else ""
        return (
            "the baseline wins: the descent found no knob change faster than the noise (ties re-measured in A/B "
            f"pairs), so no candidate was confirmed{untried}"
        )
    faster = [r for r in ok if r.role == ROLE_SEARCH and o.speedups.get(r.number, 0.0) > 1.0]
    if faster:  # a study reported before any worker got to its confirmation
        best = max(faster, key=lambda r: o.speedups[r.number])
        return (
            f"the baseline wins: no candidate was confirmed in A/B pairs yet (the fastest in the search: "
            f"{changed_text(best.config, o.space.baseline())}, {o.speedups[best.number]:.3f}x); "
            "a search that runs to its end confirms it"
        )
    return "the baseline wins: no configuration was faster than the baseline runs before it"


def write_outputs(o: SearchOutcome) -> Written:
    """Bake the chosen configuration and write every output file into the output folder."""
    out = check_out_dir(o.options.out, o.project, (REPORT_NAME, PLOT_NAME))  # again: the search took a while
    chosen = o.chosen
    baked = bake(o.project, chosen, o.device)
    entry_rel = baked.files[0].rel
    hashes = {f.rel.as_posix(): hashlib.sha256(f.facts.source.encode("utf-8")).hexdigest() for f in baked.files}
    doc = summary_doc(o, hashes[entry_rel.as_posix()], hashes)
    header = (
        f"# Chosen by `autotune search` for {o.project.entry.display}. The tuned script beside this file has these\n"
        f"# knob values written in as plain code; to write them again: autotune bake "
        f"{shlex.quote(o.project.entry.display)} --config {shlex.quote(str(out / CONFIG_NAME))}\n"
    )
    files = write_baked(baked, out, doc, header)
    plot, skipped = write_plot(o, out / PLOT_NAME)
    report = write_file(out / REPORT_NAME, report_markdown(o, doc, plot, skipped))
    files += [p for p in (plot, report) if p is not None]
    return Written(tuple(files), out / entry_rel, plot, skipped, doc["changed"])


# --- report.md -----------------------------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _code(value: Any) -> str:
    """``value`` as a Markdown code span, whatever it holds (values can come from a study others write to): a run of
    backticks inside cannot end it, a line break cannot start a new block, and nothing in it is read as Markdown or
    HTML. In a table, pass the result through ``_cell`` too (GitHub reads ``|`` as a column even in code)."""
    text = " ".join(str(value).splitlines()) if value is not None else "None"
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _deviation_kind(o: SearchOutcome, config: Mapping[str, Any]) -> str:
    """What the gate measured: reduced precision is judged on the mean over the last half of the steps."""
    if numerics_of(o.space.changed(config)) is Numerics.LOWP:
        return f"loss deviation (mean over the last {100 * LOWP_WINDOW:.0f}% of the steps)"
    return "largest loss deviation"


def report_markdown(o: SearchOutcome, doc: Mapping[str, Any], plot: Path | None, skipped: str | None) -> str:
    defaults = o.space.baseline()
    lines = [f"# autotune search: {_code(o.project.entry.display)}", ""]
    if o.winner:
        w = o.winner
        low, high, cover = w.interval
        lines.append(
            f"**Tuned:** {_code(changed_text(w.config, defaults))} is **{w.speedup:.2f}x** the baseline's speed "
            f"({100 * cover:.0f}% confidence interval {low:.2f}x to {high:.2f}x; faster in {w.wins} of {len(w.ratios)} "
            f"interleaved A/B pairs, sign test p = {w.p_value:.3f}); "
            f"{_deviation_kind(o, w.config)} {_fmt(doc['max_loss_deviation'])} (tolerance {_fmt(doc['loss_tolerance'])})."
        )
        if o.startup:
            lines.append(f"It has a one-time cost: {o.startup}.")
    else:
        lines.append(f"**The baseline wins:** {doc['verdict'].removeprefix('the baseline wins: ')}. "
                     "The tuned script is the original, unchanged.")
    if o.noisy:
        lines += ["", f"> **Warning:** {o.noisy}."]
    thr = doc["throughput"]
    lines += [
        "",
        "- Command: "
        + _code(
            f"autotune search {shlex.quote(o.project.entry.display)}"
            + (f" --launcher {shlex.quote(o.options.launcher)}" if o.options.launcher else "")
            + (f" -- {shlex.join(o.options.args)}" if o.options.args else "")
        ),
        "- Files: each run ran in a mirror of the working directory; what it wrote there (checkpoints, logs) went "
        "into the run's own folder and was deleted with it, and your files were only read",
        f"- Machine: {o.machine} ({o.device}); torch {doc['versions']['torch']}, Python {doc['versions']['python']}",
        f"- Throughput: baseline {_fmt(thr['baseline']['steps_per_s'])} steps/s, tuned "
        f"{_fmt(thr['tuned']['steps_per_s'])} steps/s"
        + (
            f" ({_fmt(thr['baseline']['samples_per_s'])} -> {_fmt(thr['tuned']['samples_per_s'])} samples/s)"
            if thr["baseline"]["samples_per_s"]
            else ""
        ),
        f"- Noise: {o.noise.runs} baseline runs; step time spread {_pct(o.noise.time)} between them; losses "
        + (
            "bit-identical run to run"
            if o.noise.deterministic
            else f"differ run to run by up to {o.noise.max_loss:.1e} (the script is not deterministic: "
            "the loss tolerance is widened to twice that)"
        )
        + (
            f"; a baseline run on another number of CPU threads (only the order of sums changes) moved them by up "
            f"to {o.noise.max_reorder:.1e}"
            + (" (knobs that reorder sums or lower precision are never held tighter than twice that)" if o.noise.max_reorder else "")
            if o.noise.perturbed
            else ""
        ),
        f"- Search: {o.mode} {doc['search']['configurations_measured']} of {o.space.size} configurations, "
        f"{len(o.results)} runs in {o.wall_s:.0f}s{_span_note(o)}; stopped: {o.stopped}; "
        f"{_lengths(o)[0]} warm-up + {_lengths(o)[1]} measured steps per run"
        + (f" ({o.fit_note})" if o.fit_note else ""),
        f"- Study: {_code(o.study_name)} in {_code(o.storage)} (run the same command again to resume or extend it)",
    ]
    if o.foreign:
        odd = "; ".join(
            f"#{n}: " + ", ".join(f"{_code(k)} = {_code(repr(v))}" for k, v in values) for n, values in sorted(
                o.foreign.items(), key=lambda item: -1 if item[0] is None else item[0])
        )
        lines.append(
            f"- Left out: {len(o.foreign)} run(s) of the study hold a knob value that is not one of that knob's "
            f"choices in this search (or a knob it does not search); they were neither ranked nor shown below: {odd}"
        )
    if o.hidden:
        lines.append(
            f"- {o.hidden} sampler proposal(s) repeated a configuration already measured: told its result, not run "
            "again, and not listed below"
        )
    several = len(o.machines) > 1
    if several:
        runs = ", ".join(f"{m} ({n} runs)" for m, n in doc["search"]["machines"].items())
        lines.append(
            f"- Machines: {runs}. Each run is compared only with baseline runs of its own machine (speedups, loss "
            f"gate, noise); the throughputs, noise and confirmation above are those of {o.machine}"
        )
    if o.plan and o.plan.path:
        lines += ["", "## How the search got there", ""]
        lines += [f"{i}. {_cell(s.text)}" + (f" ({s.speedup:.2f}x)" if s.speedup and s.phase in ("start", "accept") else "")
                  for i, s in enumerate(o.plan.path, 1)]
    if o.interactions:
        lines += ["", "What each knob of the tuned configuration is worth (what taking it out costs):", ""]
        lines += [f"- {_cell(_code(x.split(': ', 1)[0]))}: {_cell(x.split(': ', 1)[1])}" for x in o.interactions]
    lines += [
        "",
        "## Trials",
        "",
        "Speedup: the run's speed over the median of the same machine's last 3 baseline runs when it finished (the "
        "live display showed the same number); the verdict above comes from the A/B pairs instead. "
        "Start-up: the run's one-time cost before it trains at its measured speed (compilation, autotuning, data "
        "set-up): its warm-up time less its warm-up steps at that speed. "
        "Load: the machine's 1-minute load average when the run ended (the run's own threads included). "
        "Loss deviation: largest relative difference of any step's loss from the machine's first baseline run "
        f"(for knobs that lower precision, the mean over the last {100 * LOWP_WINDOW:.0f}% of the steps); a baseline "
        "run's shows its run-to-run noise (the gate allows twice that).",
        "",
        "| # | role | configuration | status | steps/s | samples/s | speedup | start-up | loss deviation | peak memory "
        "| load | note |" + (" machine |" if several else ""),
        "|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|" + ("---|" if several else ""),
    ]
    for r in o.results:
        note = ""
        if r.status is not Outcome.OK:
            note = r.error or stderr_summary(r.stderr_tail)
        if r.role == ROLE_CONFIRM:
            note = f"pair {r.attrs.get('pair', 0) + 1}, {r.attrs.get('arm')}" + (f"; {note}" if note else "")
        elif r.attrs.get("why"):
            note = str(r.attrs["why"]) + (f"; {note}" if note else "")
        lines.append(
            "| "
            + " | ".join(
                _cell(x)
                for x in (
                    str(r.number),
                    r.role,
                    _code(o.labels.get(r.number) or changed_text(r.config, defaults)),
                    str(r.status),
                    f"{r.throughput:.2f}" if r.throughput else "-",
                    f"{r.samples_per_s:.0f}" if r.samples_per_s else "-",
                    speed_text(o.speedups.get(r.number)) if r.number in o.speedups and not is_baseline_run(r) else "",
                    f"{train_time(r, 0, o.options.warmup):.1f}s" if r.measured and r.warmup_s is not None else "-",
                    dev_text(r) + (f" (tol {r.tolerance:.1e})" if r.tolerance else ""),
                    mib(r.peak_memory),
                    f"{r.load:.1f}" if r.load is not None else "-",
                    note,
                    *((r.machine,) if several else ()),
                )
            )
            + " |"
        )
    if o.confirmations:
        lines += [
            "",
            "## Confirmation",
            "",
            "| candidate | search speedup | A/B ratios (candidate / baseline) | verdict |" + (" machine |" if several else ""),
            "|---|---:|---|---|" + ("---|" if several else ""),
        ]
        for c in o.confirmations:
            ratios = ", ".join(f"{x:.3f}" for x in c.ratios) or "-"
            lines.append(
                f"| {_cell(_code(changed_text(c.config, defaults)))} | {speed_text(c.search_speedup)} | {ratios} | "
                f"{'accepted' if c.accepted else 'rejected'}: {_cell(c.reason)} |"
                + (f" {_cell(c.machine)} |" if several else "")
            )
    lines += ["", "## Throughput per trial", ""]
    lines.append(f"![throughput per trial]({plot.name})" if plot else f"(plot skipped: {skipped})")
    lines += ["", "## Knobs", "", "| knob | choices searched | numerics | chosen |", "|---|---|---|---|"]
    for k in o.space.knobs:
        cells = (_code(k.name), ", ".join(_code(c) for c in o.space.choices[k.name]), str(k.numerics), _code(o.chosen[k.name]))
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    if o.space.left_out:
        lines += ["", "Not searched: " + "; ".join(f"`{k}` ({why})" for k, why in sorted(o.space.left_out.items()))]
    lines += [
        "",
        "## Files",
        "",
        f"- `{o.patch.files[0].rel.as_posix()}`"
        + (f" (+ {len(o.patch.files) - 1} local module(s))" if len(o.patch.files) > 1 else "")
        + ": the tuned script, plain code (no autotune import)",
        f"- `{DIFF_NAME}`: original -> tuned" if o.winner else f"- no `{DIFF_NAME}`: the tuned script is the original",
        f"- `{CONFIG_NAME}`: the chosen knobs and the measurements behind them",
        "",
    ]
    return "\n".join(lines)


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.3g}" if x else "0"


def _pct(x: float | None) -> str:
    return f"{100 * x:.0f}%" if x is not None else "n/a (one run)"


# --- the plot ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlotRow:
    """One configuration in throughput.png: its search speedups, its confirmation pairs, and how it ended."""

    label: str  # the knobs it changes
    status: str  # "ok", "diverged" (losses outside the gate) or how it failed
    search: tuple[float, ...]  # speedup of each of its search runs (over the last 3 baseline runs when it ended)
    pairs: tuple[float, ...] = ()  # its A/B confirmation ratios
    accepted: bool = False  # the confirmation held
    winner: bool = False

    @property
    def value(self) -> float | None:
        """Its best estimate: the median of its pairs when confirmed in some, else its best search run."""
        if self.pairs:
            return statistics.median(self.pairs)
        return max(self.search) if self.search else None


@dataclass(frozen=True)
class PlotData:
    """What throughput.png shows: each configuration's speedup (top), and every run's steps/s in order (bottom)."""

    points: dict[str, list[tuple[int, float]]]  # group -> (trial number, y), the runs in order
    ylabel: str
    level: float | None  # the baseline median on that axis
    level_label: str
    rows: tuple[PlotRow, ...] = ()  # best first; those that failed last
    limits: tuple[float, float] = (0.5, 2.0)  # the speedup axis; points outside it are drawn at its edge
    hidden: int = 0  # configurations left out of a long list (the slowest)


MAX_ROWS = 16
STATUS_COLOR = {"ok": "tab:blue", "diverged": "tab:orange", "unverified": "tab:orange"}  # else red: it failed
SLOWEST_SHOWN = 0.25  # slower configurations sit at the axis' left edge, so they do not squash the rest


def plot_data(o: SearchOutcome) -> PlotData:
    """Speedups per configuration, and steps/s per run on one machine; on several, each run's steps/s over its own
    machine's baseline median, since steps/s of different machines do not compare."""
    several = len(o.machines) > 1
    base: dict[str, float] = {}
    for m in o.machines:
        runs = [r.throughput for r in o.results if r.role == ROLE_BASELINE and r.throughput and r.machine == m]
        if runs:
            base[m] = statistics.median(runs)
    points: dict[str, list[tuple[int, float]]] = {"baseline": [], "ok": [], "diverged": [], "failed": []}
    for r in o.results:
        if r.role == ROLE_PERTURBED:
            continue  # another thread count: its speed compares with nothing
        y = r.throughput or 0.0
        if several:
            if r.machine not in base:
                continue  # no baseline of its own machine to compare it with
            y /= base[r.machine]
        if r.role == ROLE_BASELINE or (r.role == ROLE_CONFIRM and r.attrs.get("arm") == "baseline"):
            g = "baseline"
        elif r.status is Outcome.OK:
            g = "ok"
        elif r.status in (Outcome.DIVERGED, Outcome.UNVERIFIED):
            g = "diverged"
        else:
            g = "failed"
        points[g].append((r.number, y))
    rows, hidden, limits = _rows(o)
    if several:
        return PlotData(points, "steps/s over the same machine's baseline median", 1.0 if base else None,
                        "baseline median (each machine's own)", rows, limits, hidden)
    level = base.get(o.machine)
    return PlotData(points, "steps/s (median step time)", level, "baseline median", rows, limits, hidden)


def _rows(o: SearchOutcome) -> tuple[tuple[PlotRow, ...], int, tuple[float, float]]:
    """One row per configuration the search tried, best first, and the speedup axis' limits."""
    defaults = o.space.baseline()

    def changed(config: Mapping[str, Any]) -> set:
        return {(k, v) for k, v in config.items() if defaults.get(k, v) != v}

    runs: dict[tuple, list[TrialResult]] = {}
    for r in o.results:
        if r.role == ROLE_SEARCH and changed(r.config):
            runs.setdefault(_key(r.config), []).append(r)
    speed = {key: [o.speedups[r.number] for r in rs if r.number in o.speedups] for key, rs in runs.items()}
    # a candidate is confirmed as its canonical configuration (knobs that bake to the same code left out, such as
    # persistent workers without workers): the search run it stands for is the one it is a part of, whose
    # speedup it was picked with
    confirmed: dict[tuple, Any] = {}
    for c in o.confirmations:
        want = changed(c.config)
        fits = [k for k in runs if want <= changed(dict(k)) and k not in confirmed]
        if not fits:
            confirmed[_key(c.config)] = c
            continue
        near = lambda k: (abs(max(speed[k], default=0.0) - (c.search_speedup or 0.0)), len(changed(dict(k))))  # noqa: E731
        confirmed[min(fits, key=near)] = c
    win = o.winner
    rows = []
    for key in [*runs, *(k for k in confirmed if k not in runs)]:
        rs, c = runs.get(key, []), confirmed.get(key)
        ok = [r for r in rs if r.status is Outcome.OK]
        differ = (Outcome.DIVERGED, Outcome.UNVERIFIED)
        status = "ok" if ok or not rs else str(next((r.status for r in rs if r.status in differ), rs[-1].status))
        search = tuple(o.speedups[r.number] for r in (ok or rs) if r.number in o.speedups)
        if not rs and c is not None and c.search_speedup:
            search = (c.search_speedup,)
        rows.append(
            PlotRow(
                changed_text(c.config if c else dict(key), defaults),
                status,
                search,
                tuple(c.ratios) if c else (),
                bool(c and c.accepted),
                c is not None and win is not None and _key(c.config) == _key(win.config),
            )
        )
    # the winner first, then those that trained the same by speedup, then those whose losses differ, then failures
    rank = {"ok": 0, "diverged": 1, "unverified": 1}
    rows.sort(key=lambda row: (not row.winner, rank.get(row.status, 2), -(row.value or 0.0)))
    # a long list leaves out its slowest configurations that trained the same; those that diverged or failed stay
    slowest = [row for row in reversed(rows) if row.status == "ok" and not row.winner][: max(0, len(rows) - MAX_ROWS)]
    shown, hidden = [row for row in rows if row not in slowest], len(slowest)
    # the axis spans the speedups of the configurations that trained the same, 1.0 and the winner's pairs; runs
    # beyond Tukey's fences (in log scale) or that diverged are drawn at its edge with their value, so that one
    # wild run on a busy machine does not squash the rest
    core = sorted(math.log(x) for row in shown if row.status == "ok" for x in (*row.search, *row.pairs) if x > 0)
    keep = [0.0, *(math.log(x) for row in shown if row.winner for x in row.pairs if x > 0)]
    if core:
        q1, q3 = _quantile(core, 0.25), _quantile(core, 0.75)
        fence = 1.5 * (q3 - q1)
        core = [x for x in core if q1 - fence <= x <= q3 + fence]
    lo = max(min(core + keep), min(keep) + math.log(SLOWEST_SHOWN))
    hi = max(core + keep)
    pad = max(hi - lo, math.log(1.5)) * 0.06
    return tuple(shown), hidden, (math.exp(lo - pad), math.exp(hi + pad))


def _quantile(xs: list[float], q: float) -> float:
    """The ``q`` quantile of sorted ``xs``, interpolated."""
    at = q * (len(xs) - 1)
    i = int(at)
    return xs[i] + (xs[min(i + 1, len(xs) - 1)] - xs[i]) * (at - i)


def _ticks(lo: float, hi: float) -> list[float]:
    """Speedup ticks a person reads at a glance (0.5x, 1x, 1.5x, 2x ...) within [lo, hi]."""
    nice = [0.1, 0.2, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 5.0, 7.0, 10.0, 15.0, 20.0, 30.0, 50.0, 100.0]
    inside = [t for t in nice if lo <= t <= hi]
    if len(inside) > 9:  # a wide range: every other one, keeping 1x
        inside = [t for i, t in enumerate(inside) if i % 2 == inside.index(1.0) % 2]
    return inside


def write_plot(o: SearchOutcome, path: Path) -> tuple[Path | None, str | None]:
    """throughput.png: how much faster each configuration ran, with its confirmation pairs and the winner marked;
    below, every run's steps/s in order; (None, why) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.transforms import blended_transform_factory
    except ImportError:
        return None, "matplotlib is not installed (pip install matplotlib)"
    import textwrap

    data = plot_data(o)
    rows = data.rows
    labels = [textwrap.fill(row.label, 50) for row in rows]
    # rows as tall as their labels: a row's centre on the y axis, in units of one label line
    heights = [0.7 + label.count("\n") + 1 for label in labels]
    ys = [sum(heights[:i]) + h / 2 for i, h in enumerate(heights)]
    top_h = 1.6 + 0.14 * sum(heights)
    fig, (ax, runs_ax) = plt.subplots(
        2, 1, figsize=(11, top_h + 2.8), dpi=100, gridspec_kw={"height_ratios": [top_h, 2.0]}, layout="constrained"
    )
    lo, hi = data.limits
    ax.set_xscale("log")
    ax.set_xlim(lo, hi)
    ticks = _ticks(lo, hi)
    ax.set_xticks(ticks, [f"{t:g}x" + ("\n(baseline)" if t == 1.0 else "") for t in ticks])
    ax.minorticks_off()
    ax.axvline(1.0, color="0.35", linestyle="--", linewidth=1, zorder=1)
    right = blended_transform_factory(ax.transAxes, ax.transData)

    def clip(x: float) -> tuple[float, bool]:
        return min(max(x, lo), hi), not lo <= x <= hi

    for y, h, row in zip(ys, heights, rows):
        if row.winner:
            ax.axhspan(y - h / 2, y + h / 2, color="tab:green", alpha=0.12, zorder=0)
        color = STATUS_COLOR.get(row.status, "tab:red")
        for x in row.search:
            cx, out = clip(x)
            marker = ("<" if x < lo else ">") if out else "o"
            ax.scatter([cx], [y], s=46, marker=marker, facecolors=color if row.status == "ok" else "none",
                       edgecolors=color, zorder=3, clip_on=False)
            if out:
                ax.annotate(f"{x:.2g}x", (cx, y), xytext=(6 if x < lo else -6, 5), textcoords="offset points",
                            ha="left" if x < lo else "right", fontsize=7, color=color)
        if row.pairs:
            pair_color = "tab:green" if row.accepted else "0.45"
            xs = [clip(x)[0] for x in row.pairs]
            ax.plot([min(xs), max(xs)], [y + 0.45, y + 0.45], color=pair_color, linewidth=1, zorder=2)
            ax.scatter(xs, [y + 0.45] * len(xs), s=40, marker="|", color=pair_color, zorder=3, clip_on=False)
            med = clip(statistics.median(row.pairs))[0]
            ax.scatter([med], [y + 0.45], s=120 if row.winner else 50, marker="*" if row.winner else "D",
                       color=pair_color, edgecolors="black" if row.winner else pair_color, linewidths=0.5, zorder=4,
                       clip_on=False)
        if row.winner:
            note = f"winner: {row.value:.2f}x, faster in {sum(x > 1 for x in row.pairs)} of {len(row.pairs)} pairs"
        elif row.pairs:
            wins = f"faster in {sum(x > 1 for x in row.pairs)} of {len(row.pairs)}"
            note = f"{row.value:.2f}x in A/B pairs ({wins}): {'confirmed' if row.accepted else 'not confirmed'}"
        elif row.status == "ok":
            note = f"{row.value:.2f}x (one search run, not confirmed)" if row.value else "no speedup measured"
        elif row.status == "diverged":
            note = "losses differ: rejected"
        elif row.status == "unverified":
            note = "losses cannot be compared: not taken"
        else:
            note = f"failed: {row.status}"
        ax.text(1.03, y, note, transform=right, va="center", fontsize=8, color="black" if row.status == "ok" else color,
                fontweight="bold" if row.winner else "normal")
    ax.set_yticks(ys, labels, fontsize=8)
    for tick, row in zip(ax.get_yticklabels(), rows):
        if row.winner:
            tick.set_fontweight("bold")
            tick.set_color("darkgreen")
    ax.set_ylim(sum(heights) or 1.0, 0.0)
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_xlabel("speedup over the baseline (steps/s ratio; log scale)")
    if not rows:
        ax.text(0.5, 0.5, "no configuration besides the baseline ran", transform=ax.transAxes, ha="center")
    from matplotlib.lines import Line2D

    # the legend names what is drawn, in the colours it is drawn in
    legend = [Line2D([], [], marker="o", linestyle="", color="tab:blue",
                     label="search run (vs the last 3 baseline runs): not confirmed by itself")]
    if any(row.pairs and row.accepted for row in rows):
        legend.append(Line2D([], [], marker="*", linestyle="-", color="tab:green", markeredgecolor="black",
                             label="A/B pairs that confirmed it (\u2605 median)"))
    if any(row.pairs and not row.accepted for row in rows):
        legend.append(Line2D([], [], marker="D", linestyle="-", color="0.45",
                             label="A/B pairs that did not confirm it (\u2666 median)"))
    if any(row.status in ("diverged", "unverified") for row in rows):
        legend.append(Line2D([], [], marker="o", linestyle="", markerfacecolor="none", color="tab:orange",
                             label="losses differ, or cannot be compared"))
    if any(row.status not in STATUS_COLOR for row in rows):
        legend.append(Line2D([], [], marker="o", linestyle="", markerfacecolor="none", color="tab:red",
                             label="failed (crash, timeout, out of memory...)"))
    ax.legend(handles=legend, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, fontsize=8, frameon=False)
    machines = f", {len(o.machines)} machines" if len(o.machines) > 1 else ""
    if o.winner:
        headline = f"{o.winner.speedup:.2f}x faster: {o.winner.reason}"
    else:
        headline = "the baseline stays: no configuration was confirmed faster"
    more = f" ({data.hidden} slower configurations not shown)" if data.hidden else ""
    fig.suptitle(f"autotune search: {o.project.entry.display} on {o.device}{machines}\n{headline}{more}", fontsize=10)

    styles = {"baseline": ("0.5", "s"), "ok": ("tab:blue", "o"), "diverged": ("tab:orange", "D"), "failed": ("tab:red", "x")}
    names = {"baseline": "baseline", "ok": "trained the same", "diverged": "losses differ or unverified",
             "failed": "failed"}
    # the runs that trained the same set the height; a faster run whose losses differ is drawn at the top edge
    top = max((y for g in ("baseline", "ok") for _, y in data.points[g]), default=0.0) * 1.15 or None
    for label, pts in data.points.items():
        if pts:
            color, marker = styles[label]
            ys_ = [min(y, top) if top else y for _, y in pts]
            runs_ax.scatter([x for x, _ in pts], ys_, c=color, marker=marker, s=16, label=names[label], zorder=3,
                            clip_on=False)
            for (x, y) in pts:
                if top and y > top:
                    runs_ax.annotate(f"{y:.3g}", (x, top), xytext=(4, -10), textcoords="offset points", fontsize=7,
                                     color=color)
    if top:
        runs_ax.set_ylim(0, top)
    if data.level is not None:
        runs_ax.axhline(data.level, color="0.5", linestyle="--", linewidth=1, label=data.level_label)
    confirm = [r.number for r in o.results if r.role == ROLE_CONFIRM]
    if confirm:
        runs_ax.axvline(min(confirm) - 0.5, color="black", linestyle=":", linewidth=1)
        runs_ax.text(min(confirm) - 0.3, 0.97, "confirmation (A/B pairs)", fontsize=7, va="top",
                     transform=blended_transform_factory(runs_ax.transData, runs_ax.transAxes))
    runs_ax.set_xlabel("run, in order (the baseline's own spread shows how noisy the machine was)")
    runs_ax.set_ylabel(data.ylabel, fontsize=8)
    runs_ax.grid(True, alpha=0.3)
    runs_ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=7, frameon=False)
    image = io.BytesIO()
    fig.savefig(image, format="png")
    plt.close(fig)
    write_file(path, image.getvalue())
    return path, None


def _lengths(o: SearchOutcome) -> tuple[int, int]:
    return o.lengths or (o.options.warmup, o.options.steps)


def _span_note(o: SearchOutcome) -> str:
    return " (first trial start to last trial end)" if o.from_study else ""


def print_summary(o: SearchOutcome, w: Written, console) -> None:
    """The short summary at the end of a search."""
    defaults = o.space.baseline()
    if o.winner:
        win = o.winner
        low, high, cover = win.interval
        console.print(
            f"[bold green]tuned:[/] {changed_text(win.config, defaults)}: [bold]{win.speedup:.2f}x[/] the baseline "
            f"({100 * cover:.0f}% interval {low:.2f}x..{high:.2f}x; faster in {win.wins} of {len(win.ratios)} A/B "
            f"pairs, p = {win.p_value:.3f})",
            highlight=False,
            soft_wrap=True,
        )
    else:
        console.print(f"[bold yellow]{_baseline_reason(o)}[/]", highlight=False, soft_wrap=True)
    if o.noisy:
        console.print(f"[yellow]warning: {o.noisy}[/]", highlight=False, soft_wrap=True)
    counts: dict[str, int] = {}
    for r in o.results:
        counts[str(r.status)] = counts.get(str(r.status), 0) + 1
    took = f"the study's runs took {o.wall_s:.0f}s{_span_note(o)}" if o.from_study else f"this search took {o.wall_s:.0f}s"
    console.print(
        f"{len(o.results)} runs in the study ({', '.join(f'{n} {s}' for s, n in sorted(counts.items()))}); "
        f"{took}; stopped: {o.stopped}",
        highlight=False,
        soft_wrap=True,
    )
    diff = w.entry.parent / DIFF_NAME
    console.print(
        f"wrote {w.entry} (" + ("tuned script" if w.changed else "your script, unchanged: no tuned.diff") + "), "
        f"{w.entry.parent / CONFIG_NAME}, " + (f"{diff}, " if w.changed else "")
        + f"{w.entry.parent / REPORT_NAME}" + (f" and {w.plot.name}" if w.plot else f" (plot skipped: {w.plot_skipped})"),
        highlight=False,
        markup=False,
        soft_wrap=True,
    )
