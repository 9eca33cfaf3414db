"""The outputs of a search: the tuned (baked) script, autotune.yaml, tuned.diff, report.md and its plot."""

from __future__ import annotations

import hashlib
import math
import platform
import shlex
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune import __version__
from autotune.bake import DIFF_NAME, bake, write_baked
from autotune.patch import CONFIG_NAME
from autotune.search.live import changed_text, dev_text, mib, speed_text
from autotune.search.machine import cpu_name
from autotune.search.search import SearchOutcome, train_time
from autotune.search.study import ROLE_BASELINE, ROLE_CONFIRM, ROLE_SEARCH
from autotune.search.trial import Outcome, TrialResult, stderr_summary

REPORT_NAME = "report.md"
PLOT_NAME = "throughput.png"


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
    faster = [r for r in ok if r.role == ROLE_SEARCH and o.speedups.get(r.number, 0.0) > 1.0]
    if faster:  # a study reported before any worker got to its confirmation
        best = max(faster, key=lambda r: o.speedups[r.number])
        return (
            f"the baseline wins: no candidate was confirmed in A/B pairs yet (the fastest in the search: "
            f"{changed_text(best.config, o.space.baseline())}, {o.speedups[best.number]:.3f}x); "
            "a search that runs to its end confirms it"
        )
    return "the baseline wins: no configuration was faster than the baseline runs around it"


def write_outputs(o: SearchOutcome) -> Written:
    """Bake the chosen configuration and write every output file into the output folder."""
    out = o.options.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    chosen = o.chosen
    baked = bake(o.project, chosen, o.device)
    entry_rel = baked.files[0].rel
    hashes = {f.rel.as_posix(): hashlib.sha256(f.facts.source.encode("utf-8")).hexdigest() for f in baked.files}
    doc = summary_doc(o, hashes[entry_rel.as_posix()], hashes)
    header = (
        f"# Chosen by `autotune search` for {o.project.entry.display}. The tuned script beside this file has these\n"
        f"# knob values written in as plain code; to write them again: autotune bake {o.project.entry.display} "
        f"--config {out / CONFIG_NAME}\n"
    )
    files = write_baked(baked, out, doc, header)
    plot, skipped = write_plot(o, out / PLOT_NAME)
    report = out / REPORT_NAME
    report.write_text(report_markdown(o, doc, plot, skipped), encoding="utf-8")
    files += [p for p in (plot, report) if p is not None]
    return Written(tuple(files), out / entry_rel, plot, skipped, doc["changed"])


# --- report.md -----------------------------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def report_markdown(o: SearchOutcome, doc: Mapping[str, Any], plot: Path | None, skipped: str | None) -> str:
    defaults = o.space.baseline()
    lines = [f"# autotune search: `{o.project.entry.display}`", ""]
    if o.winner:
        w = o.winner
        low, high, cover = w.interval
        lines.append(
            f"**Tuned:** `{changed_text(w.config, defaults)}` is **{w.speedup:.2f}x** the baseline's speed "
            f"({100 * cover:.0f}% confidence interval {low:.2f}x to {high:.2f}x; faster in {w.wins} of {len(w.ratios)} "
            f"interleaved A/B pairs, sign test p = {w.p_value:.3f}); "
            f"largest loss deviation {_fmt(doc['max_loss_deviation'])} (tolerance {_fmt(doc['loss_tolerance'])})."
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
        f"- Command: `autotune search {o.project.entry.display}"
        + (f" --launcher {shlex.quote(o.options.launcher)}" if o.options.launcher else "")
        + (f" -- {shlex.join(o.options.args)}" if o.options.args else "")
        + "`",
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
        ),
        f"- Search: {o.mode} {doc['search']['configurations_measured']} of {o.space.size} configurations, "
        f"{len(o.results)} runs in {o.wall_s:.0f}s{_span_note(o)}; stopped: {o.stopped}; "
        f"{o.options.warmup} warm-up + {o.options.steps} measured steps per run",
        f"- Study: `{o.study_name}` in `{o.storage}` (run the same command again to resume or extend it)",
    ]
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
        lines += ["", "What each knob of the tuned configuration is worth (speedups of single search runs):", ""]
        lines += [f"- `{_cell(x.split(': ', 1)[0])}`: {_cell(x.split(': ', 1)[1])}" for x in o.interactions]
    lines += [
        "",
        "## Trials",
        "",
        "Speedup: the run's speed over the median of the same machine's last 3 baseline runs when it finished (the "
        "live display showed the same number); the verdict above comes from the A/B pairs instead. "
        "Start-up: the run's one-time cost before it trains at its measured speed (compilation, autotuning, data "
        "set-up): its warm-up time less its warm-up steps at that speed. "
        "Loss deviation: largest relative difference of any step's loss from the machine's first baseline run.",
        "",
        "| # | role | configuration | status | steps/s | samples/s | speedup | start-up | loss deviation | peak memory | note |"
        + (" machine |" if several else ""),
        "|---:|---|---|---|---:|---:|---:|---:|---:|---:|---|" + ("---|" if several else ""),
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
                    f"`{o.labels.get(r.number) or changed_text(r.config, defaults)}`",
                    str(r.status),
                    f"{r.throughput:.2f}" if r.throughput else "-",
                    f"{r.samples_per_s:.0f}" if r.samples_per_s else "-",
                    speed_text(o.speedups.get(r.number)) if r.number in o.speedups else "",
                    f"{train_time(r, 0, o.options.warmup):.1f}s" if r.measured and r.warmup_s is not None else "-",
                    dev_text(r) + (f" (tol {r.tolerance:.1e})" if r.tolerance else ""),
                    mib(r.peak_memory),
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
                f"| `{_cell(changed_text(c.config, defaults))}` | {speed_text(c.search_speedup)} | {ratios} | "
                f"{'accepted' if c.accepted else 'rejected'}: {_cell(c.reason)} |"
                + (f" {_cell(c.machine)} |" if several else "")
            )
    lines += ["", "## Throughput per trial", ""]
    lines.append(f"![throughput per trial]({plot.name})" if plot else f"(plot skipped: {skipped})")
    lines += ["", "## Knobs", "", "| knob | choices searched | numerics | chosen |", "|---|---|---|---|"]
    for k in o.space.knobs:
        choices = ", ".join(f"`{c}`" for c in o.space.choices[k.name])
        lines.append(f"| `{k.name}` | {choices} | {k.numerics} | `{o.chosen[k.name]}` |")
    if o.space.left_out:
        lines += ["", "Not searched: " + "; ".join(f"`{k}` ({why})" for k, why in sorted(o.space.left_out.items()))]
    lines += [
        "",
        "## Files",
        "",
        f"- `{o.patch.files[0].rel.as_posix()}`"
        + (f" (+ {len(o.patch.files) - 1} local module(s))" if len(o.patch.files) > 1 else "")
        + ": the tuned script, plain code (no autotune import)",
        f"- `{DIFF_NAME}`: original -> tuned",
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
class PlotData:
    """What throughput.png shows: points per group, the y axis, and the baseline's level."""

    points: dict[str, list[tuple[int, float]]]  # group -> (trial number, y)
    ylabel: str
    level: float | None  # the baseline median on that axis
    level_label: str


def plot_data(o: SearchOutcome) -> PlotData:
    """Steps/s per run on one machine; on several, each run's steps/s over its own machine's baseline median,
    since steps/s of different machines do not compare."""
    several = len(o.machines) > 1
    base: dict[str, float] = {}
    for m in o.machines:
        runs = [r.throughput for r in o.results if r.role == ROLE_BASELINE and r.throughput and r.machine == m]
        if runs:
            base[m] = statistics.median(runs)
    points: dict[str, list[tuple[int, float]]] = {"baseline": [], "ok": [], "diverged": [], "failed": []}
    for r in o.results:
        y = r.throughput or 0.0
        if several:
            if r.machine not in base:
                continue  # no baseline of its own machine to compare it with
            y /= base[r.machine]
        if r.role == ROLE_BASELINE or (r.role == ROLE_CONFIRM and r.attrs.get("arm") == "baseline"):
            g = "baseline"
        elif r.status is Outcome.OK:
            g = "ok"
        elif r.status is Outcome.DIVERGED:
            g = "diverged"
        else:
            g = "failed"
        points[g].append((r.number, y))
    if several:
        return PlotData(points, "steps/s over the same machine's baseline median", 1.0 if base else None,
                        "baseline median (each machine's own)")
    level = base.get(o.machine)
    return PlotData(points, "steps/s (median step time)", level, "baseline median")


def write_plot(o: SearchOutcome, path: Path) -> tuple[Path | None, str | None]:
    """throughput.png: steps/s per trial, baseline runs and failures marked; (None, why) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None, "matplotlib is not installed (pip install 'autotune[plot]')"
    data = plot_data(o)
    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=100)
    styles = {"baseline": ("tab:gray", "s"), "ok": ("tab:green", "o"), "diverged": ("tab:orange", "D"), "failed": ("tab:red", "x")}
    for label, pts in data.points.items():
        if pts:
            color, marker = styles[label]
            ax.scatter([x for x, _ in pts], [y for _, y in pts], c=color, marker=marker, label=label, zorder=3)
    if data.level is not None:
        ax.axhline(data.level, color="tab:gray", linestyle="--", linewidth=1, label=data.level_label)
    confirm = [r.number for r in o.results if r.role == ROLE_CONFIRM]
    if confirm:
        ax.axvline(min(confirm) - 0.5, color="black", linestyle=":", linewidth=1)
        ax.text(min(confirm) - 0.3, ax.get_ylim()[1], "confirmation (A/B pairs)", fontsize=8, va="top")
    ax.set_xlabel("trial")
    ax.set_ylabel(data.ylabel)
    machines = f", {len(o.machines)} machines" if len(o.machines) > 1 else ""
    ax.set_title(f"autotune search: {o.project.entry.display} on {o.device}{machines}")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path, None


def _span_note(o: SearchOutcome) -> str:
    return " (first trial start to last trial end)" if o.from_study else ""


def print_summary(o: SearchOutcome, w: Written, console) -> None:
    """The short summary at the end of a search."""
    defaults = o.space.baseline()
    if o.winner:
        w = o.winner
        low, high, cover = w.interval
        console.print(
            f"[bold green]tuned:[/] {changed_text(w.config, defaults)}: [bold]{w.speedup:.2f}x[/] the baseline "
            f"({100 * cover:.0f}% interval {low:.2f}x..{high:.2f}x; faster in {w.wins} of {len(w.ratios)} A/B pairs, "
            f"p = {w.p_value:.3f})",
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
    console.print(
        f"wrote {w.entry} (tuned script), {w.entry.parent / CONFIG_NAME}, {w.entry.parent / DIFF_NAME}, "
        f"{w.entry.parent / REPORT_NAME}" + (f" and {w.plot.name}" if w.plot else f" (plot skipped: {w.plot_skipped})"),
        highlight=False,
        markup=False,
        soft_wrap=True,
    )
