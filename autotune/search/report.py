"""The outputs of a search: the tuned (baked) script, autotune.yaml, tuned.diff, report.md and its plot."""

from __future__ import annotations

import hashlib
import math
import platform
import re
import shlex
import statistics
from collections.abc import Mapping
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from autotune import __version__
from autotune.bake import DIFF_NAME, bake, check_out_dir, write_baked
from autotune.contention import BUSY_OTHERS
from autotune.compile_cache import CACHE_NAME, CACHES_NAME, with_loader
from autotune.files import PLOT_NAME, REPORT_NAME, write_file
from autotune.knobs import Numerics
from autotune.patch import CONFIG_NAME
from autotune.search.gate import LOWP_WINDOW, numerics_of
from autotune.search.live import changed_text, dev_text, mib, speed_text
from autotune.search.machine import cpu_name
from autotune.search.outcome import SearchOutcome, is_baseline_run, train_time
from autotune.search.plot import write_plot
from autotune.search.space import config_key
from autotune.search.study import ROLE_BASELINE, ROLE_CACHE, ROLE_CONFIRM, ROLE_SEARCH, ROLE_WHOLE
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
            "whole_run": o.whole_run,
            # what the chosen configuration's runs compiled, beside the tuned script, which loads it
            "compile_cache": {"file": CACHE_NAME, "bytes": cache.stat().st_size,
                              "saving": o.cache_saving.as_dict() if o.cache_saving else None}
            if (cache := carried_cache(o)) else None,
            "objective": o.run_length or "steady-state speed",
            "max_loss_deviation": _r(max_dev, 3),
            "loss_tolerance": _r(tol, 3),
            "noise": {
                "baseline_runs": o.noise.runs,
                "deterministic": o.noise.deterministic,
                "loss_max_deviation": _r(o.noise.max_loss, 3),
                "perturbed_runs": o.noise.perturbed,
                "reorder_max_deviation": _r(o.noise.max_reorder, 3),
                "time_spread": _r(o.noise.time, 3),
                "time_local_rms": _r(o.noise.time_local, 3),
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
                "configurations_measured": len({config_key(r.config) for r in o.results if r.role not in (ROLE_CONFIRM, ROLE_WHOLE, ROLE_CACHE)}),
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


def _cache_saving(o: SearchOutcome) -> str:
    """What the carried compile cache saves, as the search measured it (or why it did not)."""
    return o.cache_saving.text() if o.cache_saving else "what it saves was not measured"


def carried_cache(o: SearchOutcome) -> Path | None:
    """What the chosen configuration's runs compiled, where the search kept it and the tuned script compiles."""
    cache = o.compile_cache
    return cache if cache is not None and o.options.compile_cache and cache.is_file() else None


def write_outputs(o: SearchOutcome) -> Written:
    """Bake the chosen configuration and write every output file into the output folder."""
    out = check_out_dir(o.options.out, o.project, (REPORT_NAME, PLOT_NAME, CACHE_NAME))  # again: the search took a while
    chosen = o.chosen
    baked = bake(o.project, chosen, o.device)
    cache = carried_cache(o)
    if cache is not None:  # the tuned script loads it, first thing
        entry = baked.files[0]
        baked = replace(baked, files=(replace(entry, new_text=with_loader(entry.new_text)), *baked.files[1:]))
    entry_rel = baked.files[0].rel
    hashes = {f.rel.as_posix(): hashlib.sha256(f.facts.source.encode("utf-8")).hexdigest() for f in baked.files}
    doc = summary_doc(o, hashes[entry_rel.as_posix()], hashes)
    header = (
        f"# Chosen by `autotune search` for {o.project.entry.display}. The tuned script beside this file has these\n"
        f"# knob values written in as plain code; to write them again: autotune bake "
        f"{shlex.quote(o.project.entry.display)} --config {shlex.quote(str(out / CONFIG_NAME))}\n"
    )
    files = write_baked(baked, out, doc, header)
    carried = out / entry_rel.parent / CACHE_NAME
    if cache is not None:
        files.append(write_file(carried, cache.read_bytes()))
    else:
        carried.unlink(missing_ok=True)  # (an older search's, for a configuration that is no longer chosen)
    shutil.rmtree(out / CACHES_NAME, ignore_errors=True)
    plot, skipped = write_plot(o, out / PLOT_NAME)
    report = write_file(out / REPORT_NAME, report_markdown(o, doc, plot, skipped))
    files += [p for p in (plot, report) if p is not None]
    return Written(tuple(files), out / entry_rel, plot, skipped, doc["changed"])


# --- report.md -----------------------------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _plain(text: Any) -> str:
    """Text that may come from a study others write to (a machine's name, an error, a run's note) shown as the
    characters it holds: on one line, no HTML, no link, no code span (``_cell`` still escapes ``|`` in a table)."""
    text = " ".join(str(text).splitlines())
    for char, shown in (("&", "&amp;"), ("<", "&lt;"), (">", "&gt;"), ("[", "\\["), ("]", "\\]"), ("`", "\\`"),
                        ("*", "\\*"), ("_", "\\_")):
        text = text.replace(char, shown)
    return text


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
    """report.md: the verdict, how it was measured, the path, every run, the confirmation, the knobs, the files."""
    lines = [f"# autotune search: {_code(o.project.entry.display)}", ""]
    lines += _verdict_lines(o, doc)
    lines += _about_lines(o, doc)
    lines += _path_lines(o)
    lines += _trial_lines(o)
    lines += _confirmation_lines(o)
    lines += ["", "## Throughput per trial", ""]
    lines.append(f"![throughput per trial]({plot.name})" if plot else f"(plot skipped: {skipped})")
    lines += _knob_lines(o)
    lines += _file_lines(o)
    return "\n".join(lines)


def _verdict_lines(o: SearchOutcome, doc: Mapping[str, Any]) -> list[str]:
    """The verdict: the tuned configuration and its interval, or why the baseline won; the noise warning."""
    lines: list[str] = []
    defaults = o.space.baseline()
    if o.winner:
        w = o.winner
        low, high, cover = w.interval
        lines.append(
            f"**Tuned:** {_code(changed_text(w.config, defaults))} is **{w.speedup:.2f}x** the baseline's speed "
            f"({100 * cover:.0f}% confidence interval {low:.2f}x to {high:.2f}x; faster in {w.wins} of {len(w.ratios)} "
            f"interleaved A/B pairs, sign test p = {w.p_value:.3f}); "
            f"{_deviation_kind(o, w.config)} {_fmt(doc['max_loss_deviation'])} (tolerance {_fmt(doc['loss_tolerance'])})."
        )
        if o.whole_run:
            lines.append(f"Your whole run: {o.whole_run}.")
        if o.startup:
            lines.append(f"It has a one-time cost: {o.startup}.")
        if doc.get("compile_cache"):
            lines.append(
                f"The tuned script loads `{CACHE_NAME}` ({doc['compile_cache']['bytes'] / 1024:.0f} KiB beside it: what "
                "this configuration's runs compiled), so that its first run on this torch and machine finds the "
                f"compiler's caches warm: {_cache_saving(o)} (`--no-compile-cache`: no file).")
    else:
        lines.append(f"**The baseline wins:** {_plain(doc['verdict'].removeprefix('the baseline wins: '))}. "
                     "The tuned script is the original, unchanged.")
    if o.noisy:
        lines += ["", f"> **Warning:** {o.noisy}."]
    return lines


def _about_lines(o: SearchOutcome, doc: Mapping[str, Any]) -> list[str]:
    """How the verdict was measured: command, files, machine, throughput, noise, search, study."""
    lines: list[str] = []
    thr = doc["throughput"]
    lines += [
        "",
        "- Command: "
        + _code(
            f"autotune search {shlex.quote(o.project.entry.display)}"
            + (f" --launcher {shlex.quote(o.options.launcher)}" if o.options.launcher else "")
            + (f" -- {shlex.join(o.options.args)}" if o.options.args else "")
        ),
        "- Files: " + (f"{_plain(o.isolation)}; what a run wrote there (checkpoints, logs) was deleted with it"
                       if o.isolation else "each run ran in a folder of its own (how it was kept off your files is "
                       "said by the search that ran it)"),
        f"- Machine: {_plain(o.machine)} ({o.device}); torch {doc['versions']['torch']}, Python {doc['versions']['python']}",
        f"- Throughput: baseline {_fmt(thr['baseline']['steps_per_s'])} steps/s, tuned "
        f"{_fmt(thr['tuned']['steps_per_s'])} steps/s"
        + (
            f" ({_fmt(thr['baseline']['samples_per_s'])} -> {_fmt(thr['tuned']['samples_per_s'])} samples/s)"
            if thr["baseline"]["samples_per_s"]
            else ""
        ),
        *([f"- Objective: {_plain(o.run_length)}"] if o.run_length else []),
        f"- Noise: {o.noise.runs} baseline runs; step time spread {_pct(o.noise.time)} between them"
        + (f" (one against those beside it: {_pct(o.noise.time_local)} rms, the noise the search's comparisons carry)"
           if o.noise.time_local is not None else "")
        + "; losses "
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
    if len(o.machines) > 1:
        runs = ", ".join(f"{_plain(m)} ({n} runs)" for m, n in doc["search"]["machines"].items())
        lines.append(
            f"- Machines: {runs}. Each run is compared only with baseline runs of its own machine (speedups, loss "
            f"gate, noise); the throughputs, noise and confirmation above are those of {_plain(o.machine)}"
        )
    return lines


def _path_lines(o: SearchOutcome) -> list[str]:
    """The strategy's path to the tuned configuration, and what each of its knobs is worth."""
    lines: list[str] = []
    if o.plan and o.plan.path:
        lines += ["", "## How the search got there", ""]
        lines += [f"{i}. {_cell(s.text)}" + (f" ({s.speedup:.2f}x)" if s.speedup and s.phase in ("start", "accept") else "")
                  for i, s in enumerate(o.plan.path, 1)]
    if o.interactions:
        lines += ["", "What each knob of the tuned configuration is worth (what taking it out costs):", ""]
        lines += [f"- {_cell(_code(x.split(': ', 1)[0]))}: {_cell(x.split(': ', 1)[1])}" for x in o.interactions]
    return lines


def _trial_lines(o: SearchOutcome) -> list[str]:
    """Every run of the study, one row each."""
    lines: list[str] = []
    defaults, several = o.space.baseline(), len(o.machines) > 1
    lines += [
        "",
        "## Trials",
        "",
        "Speedup: the run's speed over the mean of the same machine's baseline runs just before and just after it "
        "(the one before, where none ran after it; the live display showed the run against the last 3 before it, "
        "all it had then); the verdict above comes from the A/B pairs instead. "
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
        elif r.exit_note:
            note = r.exit_note
        if r.role in (ROLE_CONFIRM, ROLE_WHOLE, ROLE_CACHE):
            whole = {ROLE_WHOLE: f", whole run {r.wall_s:.1f}s", ROLE_CACHE: f" the compile cache, empty compiler caches, "
                     f"{r.wall_s:.1f}s"}.get(r.role, "")
            note = f"pair {r.attrs.get('pair', 0) + 1}, {r.attrs.get('arm')}{whole}" + (f"; {note}" if note else "")
        elif r.attrs.get("why"):
            note = str(r.attrs["why"]) + (f"; {note}" if note else "")
        if r.others is not None and r.others >= BUSY_OTHERS and r.status is not Outcome.DISTURBED:
            note = (f"{note}; " if note else "") + f"other work used {r.others:.1f} processors during its steps"
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
                    _plain(note),
                    *((_plain(r.machine),) if several else ()),
                )
            )
            + " |"
        )
    return lines


def _confirmation_lines(o: SearchOutcome) -> list[str]:
    """The A/B pairs of each candidate confirmed against the baseline."""
    lines: list[str] = []
    defaults, several = o.space.baseline(), len(o.machines) > 1
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
                f"{'accepted' if c.accepted else 'rejected'}: {_cell(_plain(c.reason))} |"
                + (f" {_cell(_plain(c.machine))} |" if several else "")
            )
    return lines


def _knob_lines(o: SearchOutcome) -> list[str]:
    """The knobs searched, their choices and the chosen value."""
    lines: list[str] = []
    lines += ["", "## Knobs", "", "| knob | choices searched | numerics | chosen |", "|---|---|---|---|"]
    for k in o.space.knobs:
        cells = (_code(k.name), ", ".join(_code(c) for c in o.space.choices[k.name]), str(k.numerics), _code(o.chosen[k.name]))
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    if o.space.left_out:
        lines += ["", "Not searched: " + "; ".join(f"`{k}` ({why})" for k, why in sorted(o.space.left_out.items()))]
    return lines


def _file_lines(o: SearchOutcome) -> list[str]:
    """What the output folder holds."""
    lines: list[str] = []
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
    return lines


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.3g}" if x else "0"


def _pct(x: float | None) -> str:
    return f"{100 * x:.0f}%" if x is not None else "n/a (one run)"


# --- the plot ----------------------------------------------------------------------------------------------


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
        if o.whole_run:
            console.print(f"  {o.whole_run}", markup=False, highlight=False, soft_wrap=True)
        if o.cache_saving is not None and any(f.name == CACHE_NAME for f in w.files):
            console.print(f"  {CACHE_NAME} carried to the tuned script: {o.cache_saving.text()}", markup=False,
                          highlight=False, soft_wrap=True)
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
