"""Runs ``autotune search`` on fixture scripts, then measures side by side, interleaved in one run, the throughput
of the baseline, torch.compile alone, every optimization switched on, and the tuned result (never asserted).

    python bench/bench_search.py [--scripts cnn char_gpt lstm_lm] [--trials 16] [--rounds 5] [--out DIR]

For each script: the search (its number of runs and wall time), then ``--rounds`` rounds in which each of the four
configurations runs once, in a rotating order, as the same kind of trial the search runs (the patched script in a
subprocess, per-step times, losses gated against the baseline). Ratios are per round against that round's
baseline run; the table gives their median and range.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from autotune.search.gate import judge, measure_noise  # noqa: E402
from autotune.search.live import QuietDisplay, SearchDisplay, changed_text  # noqa: E402
from autotune.search.report import write_outputs  # noqa: E402
from autotune.search.search import SearchOptions, run_search  # noqa: E402
from autotune.search.trial import Outcome, Runner, TrialSettings  # noqa: E402

SCRIPTS = {
    # script, its arguments: enough steps for the warm-up and the measured window
    "cnn": ("fixtures/scripts/cnn.py", ["--epochs", "4"]),
    "char_gpt": ("fixtures/scripts/char_gpt.py", ["--max-iters", "40"]),
    "lstm_lm": ("fixtures/scripts/lstm_lm.py", ["--epochs", "12"]),
    "tiny": ("fixtures/search/tiny.py", ["--iters", "40"]),
}


def contenders(outcome) -> dict[str, dict | None]:
    """baseline, torch.compile alone (None where no compile knob applies), everything on, and the tuned config."""
    space = outcome.space
    base = space.baseline()
    compile_knob = next((k for k in space.knobs if k.name == "compile.mode"), None)
    compiled = {**base, "compile.mode": next(c for c in space.choices["compile.mode"] if c != "none")} if compile_knob else None
    everything = {k.name: space.choices[k.name][-1] for k in space.knobs}  # each knob's last (strongest) choice
    return {"baseline": base, "compile alone": compiled, "all on": everything, "tuned": outcome.chosen}


def measure(outcome, configs: dict[str, dict], rounds: int, work: Path, console: Console) -> dict[str, list]:
    """Run every configuration once per round, rotating the order; returns name -> list of TrialResults."""
    o = outcome.options
    runner = Runner(
        outcome.patch, work, TrialSettings(tuple(o.args), Path.cwd(), outcome.device, o.warmup, o.steps, dict(o.env))
    )
    names = [n for n, c in configs.items() if c is not None]
    runs: dict[str, list] = {n: [] for n in names}
    timeout = max(600.0, 10 * max(r.wall_s for r in outcome.results if r.role == "baseline"))
    try:
        for i in range(rounds):
            order = names[i % len(names):] + names[: i % len(names)]
            for name in order:
                r = runner.run(configs[name], "bench", timeout)
                runs[name].append(r)
                console.print(f"    round {i + 1}: {name:<14} {r.status!s:<9} "
                              f"{(r.throughput or 0):8.2f} steps/s", highlight=False)
    finally:
        runner.cleanup()
    return runs


def summarise(outcome, configs, runs):
    base_runs = runs["baseline"]
    noise = measure_noise([r for r in base_runs if r.measured])
    ref = outcome.reference
    rows = {}
    for name, rs in runs.items():
        ratios = []
        for b, r in zip(base_runs, rs):
            if b.measured and r.measured and r.throughput and b.throughput:
                ratios.append(r.throughput / b.throughput)
        statuses = []
        for r in rs:
            if r.status is Outcome.OK and name != "baseline":
                v = judge(r, ref, outcome.space.changed(r.config), noise, outcome.options.rtol)
                statuses.append("ok" if v.passed else "diverged")
            else:
                statuses.append(str(r.status))
        thr = [r.throughput for r in rs if r.measured and r.throughput]
        rows[name] = {
            "config": changed_text(configs[name], outcome.space.baseline()),
            "steps_per_s": statistics.median(thr) if thr else None,
            "ratio": statistics.median(ratios) if ratios else None,
            "range": (min(ratios), max(ratios)) if ratios else None,
            "status": max(set(statuses), key=statuses.count),
        }
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scripts", nargs="+", default=["cnn", "char_gpt", "lstm_lm"], choices=sorted(SCRIPTS))
    parser.add_argument("--trials", type=int, default=16, help="search budget: configurations per script")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the side-by-side measurement")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--confirm", type=int, default=5)
    parser.add_argument("--out", type=Path, help="keep each search's outputs here (default: a temporary folder)")
    parser.add_argument("--verbose", action="store_true", help="show each search's live progress")
    args = parser.parse_args(argv)
    console = Console(highlight=False, width=max(160, Console().width))
    console.print(f"bench_search: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
                  f"{os.cpu_count()} CPUs, trials={args.trials}, rounds={args.rounds}, steps={args.steps}")
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_search_") as tmp:
        base_out = args.out or Path(tmp)
        for key in args.scripts:
            rel, script_args = SCRIPTS[key]
            console.print(f"[bold]{key}[/]: searching {rel} -- {' '.join(script_args)}")
            options = SearchOptions(
                script=REPO / rel, args=tuple(script_args), out=base_out / key, trials=args.trials,
                steps=args.steps, warmup=args.warmup, confirm=args.confirm,
            )
            started = time.monotonic()
            outcome = run_search(options, SearchDisplay(console) if args.verbose else QuietDisplay())
            write_outputs(outcome)
            wall = time.monotonic() - started
            configs = contenders(outcome)
            console.print(f"  search: {len(outcome.results)} runs, {wall:.0f}s, winner: "
                          f"{changed_text(outcome.chosen, outcome.space.baseline())}; measuring side by side")
            runs = measure(outcome, configs, args.rounds, Path(tmp) / f"work-{key}", console)
            results.append((key, outcome, wall, configs, summarise(outcome, configs, runs)))

    table = Table(title="autotune search bench: throughput relative to the baseline, measured interleaved")
    for col in ("script", "configuration", "knobs", "steps/s", "x baseline (median)", "range", "gate",
                "search runs", "search wall"):
        table.add_column(col, overflow="fold")
    notes = []
    for key, outcome, wall, configs, rows in results:
        for name in ("baseline", "compile alone", "all on", "tuned"):
            if configs.get(name) is None:
                table.add_row(key, name, "n/a (no compile knob applies)", "", "", "", "", "", "")
                continue
            row = rows[name]
            ratio = f"{row['ratio']:.3f}" if row["ratio"] else "-"
            spread = f"{row['range'][0]:.2f}-{row['range'][1]:.2f}" if row["range"] else "-"
            thr = f"{row['steps_per_s']:.2f}" if row["steps_per_s"] else "-"
            extra = (str(len(outcome.results)), f"{wall:.0f}s") if name == "tuned" else ("", "")
            table.add_row(key, name, row["config"], thr, ratio, spread, row["status"], *extra)
        tuned = rows["tuned"]
        for name in ("compile alone", "all on"):
            other = rows.get(name)
            if other is None or other["ratio"] is None or tuned["ratio"] is None:
                continue
            if other["ratio"] > tuned["ratio"]:
                why = ("it does not pass the loss gate" if other["status"] == "diverged"
                       else f"it ended {other['status']}" if other["status"] != "ok"
                       else "within the noise of this measurement" if other["range"][0] <= tuned["range"][1]
                       else "the search did not find or confirm it")
                notes.append(f"{key}: {name} measured {other['ratio']:.3f}x vs tuned {tuned['ratio']:.3f}x: {why}")
    console.print(table)
    for note in notes:
        console.print(f"note: {note}")
    if not notes:
        console.print("the tuned result is at least as fast as every other contender on every script")
    return 0


if __name__ == "__main__":
    sys.exit(main())
