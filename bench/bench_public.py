"""Public training scripts, searched as a new user would, and the result checked outside autotune.

For each case of a spec file (bench/public.yaml) and each time budget:

1. ``search``: ``autotune search SCRIPT --time-budget B -- ARGS``, as a user types it; records the verdict, the
   wall time against the budget, why it stopped, and the load average before and after.
2. ``ab``: the original script, each budget's tuned script and the hand configurations of the case (knob settings a
   person would switch on, baked with ``autotune bake``) run in interleaved rounds, the order rotated each round;
   each run is timed by the script's own timer (the lines it prints, parsed with the case's pattern), never by
   autotune. Prints, per variant: its median time per step, and its speed over the original's and over the best
   hand configuration's (per round, paired: median and min..max), with the load average of the rounds.

The scripts are not part of this repository: fetch them (their repositories are named in the spec) and pass
``--root`` where they are. Nothing here is asserted; docs/benchmarks.md records what it printed.

    python bench/bench_public.py --root /tmp/pub --out /tmp/eval --budgets 300,1200 search
    python bench/bench_public.py --root /tmp/pub --out /tmp/eval --budgets 300,1200 ab --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
SPEC = Path(__file__).resolve().parent / "public.yaml"


def load_avg() -> float:
    return os.getloadavg()[0]


def autotune(*args: str, cwd: Path, log: Path | None = None, timeout: float | None = None) -> int:
    cmd = [sys.executable, "-m", "autotune", *args]
    with open(log, "w") if log else open(os.devnull, "w") as out:
        return subprocess.run(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout).returncode


def run_search(name: str, case: dict, root: Path, out: Path, budget: int) -> dict:
    """One search as a user types it, and what came of it."""
    folder = root / case["dir"]
    dest = out / f"{name}-{budget}"
    before, started = load_avg(), time.monotonic()
    rc = autotune("search", case["script"], "--out", str(dest), "--time-budget", str(budget), "--",
                  *case["search_args"], cwd=folder, log=out / f"{name}-{budget}.log", timeout=budget * 3)
    wall = time.monotonic() - started
    doc = yaml.safe_load((dest / "autotune.yaml").read_text()) if (dest / "autotune.yaml").is_file() else {}
    return {
        "case": name, "budget": budget, "rc": rc, "wall_s": round(wall, 1), "used": round(wall / budget, 3),
        "winner": doc.get("winner"), "changed": doc.get("changed"), "speedup": doc.get("speedup"),
        "spread": doc.get("speedup_spread"), "verdict": doc.get("verdict"), "warning": doc.get("warning"),
        "stopped": (doc.get("search") or {}).get("stopped"), "load": [round(before, 2), round(load_avg(), 2)],
    }


def variants(name: str, case: dict, root: Path, out: Path, budgets: list[int]) -> dict[str, tuple[Path, list[str]]]:
    """label -> (the script to run, arguments added to the case's): the original, each budget's tuned script, and
    each hand configuration: knobs baked with ``autotune bake``, or the script's own switches (``args``)."""
    folder = root / case["dir"]
    found = {"original": (folder / case["script"], [])}
    for budget in budgets:
        tuned = out / f"{name}-{budget}" / case["script"]
        doc = out / f"{name}-{budget}" / "autotune.yaml"
        if tuned.is_file() and doc.is_file() and yaml.safe_load(doc.read_text()).get("winner") == "tuned":
            found[f"tuned@{budget}"] = (tuned, [])
    for i, hand in enumerate(case.get("hand") or []):
        if "args" in hand:
            found["hand: " + " ".join(hand["args"])] = (folder / case["script"], list(hand["args"]))
            continue
        dest = out / f"{name}-hand{i}"
        config = out / f"{name}-hand{i}.yaml"
        config.write_text(yaml.safe_dump({"device": "cpu", "knobs": hand["knobs"]}))
        if autotune("bake", case["script"], "--config", str(config), "--out", str(dest), cwd=folder) == 0:
            found["hand: " + ", ".join(f"{k}={v}" for k, v in hand["knobs"].items())] = (dest / case["script"], [])
    return found


def time_run(script: Path, extra: list[str], case: dict, root: Path) -> float | None:
    """Seconds per step of one run of ``script``, from the lines its own timer prints (the case's ``timer``
    pattern; its first ``skip`` values left out, the median of the next ``take``); None if it printed too few."""
    pattern = re.compile(case["timer"])
    scale = {"ms": 1e-3, "s": 1.0}[case.get("unit", "ms")]
    proc = subprocess.Popen([sys.executable, str(script), *case["time_args"], *extra], cwd=root / case["dir"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    values: list[float] = []
    deadline = time.monotonic() + case.get("timeout", 300)
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            m = pattern.search(line)
            if m:
                values.append(float(m.group(1)) * scale)
                if len(values) >= case["skip"] + case["take"]:
                    break
            if time.monotonic() > deadline:
                break
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    kept = values[case["skip"]:]
    return statistics.median(kept) if len(kept) >= case["take"] else None


def run_ab(name: str, case: dict, root: Path, out: Path, budgets: list[int], rounds: int) -> dict:
    scripts = variants(name, case, root, out, budgets)
    labels = list(scripts)
    times: dict[str, list[float | None]] = {label: [] for label in labels}
    loads = []
    for r in range(rounds):
        order = labels[r % len(labels):] + labels[: r % len(labels)]  # rotated: no variant always runs first
        for label in order:
            times[label].append(time_run(*scripts[label], case, root))
            loads.append(load_avg())
    hand = [label for label in labels if label.startswith("hand")]
    rows = []
    for label in labels:
        over_orig = _ratios(times["original"], times[label])
        best_hand = max(hand, key=lambda h: statistics.median(_ratios(times["original"], times[h]) or [0.0]),
                        default=None)
        over_hand = _ratios(times[best_hand], times[label]) if best_hand else []
        ok = [t for t in times[label] if t]
        rows.append({
            "variant": label, "step_s": statistics.median(ok) if ok else None, "runs": len(ok),
            "over_original": _summary(over_orig), "over_best_hand": _summary(over_hand),
        })
    return {"case": name, "rounds": rounds, "rows": rows, "best_hand": best_hand,
            "load": [round(min(loads), 2), round(max(loads), 2)]}


def _ratios(base: list[float | None], other: list[float | None]) -> list[float]:
    """Per round, the speed of ``other`` over ``base`` (rounds where both printed their timer)."""
    return [b / o for b, o in zip(base, other) if b and o]


def _summary(ratios: list[float]) -> dict | None:
    if not ratios:
        return None
    return {"median": round(statistics.median(ratios), 3), "min": round(min(ratios), 3), "max": round(max(ratios), 3),
            "faster": sum(r > 1.0 for r in ratios), "pairs": len(ratios)}


def _fmt(s: dict | None) -> str:
    if not s:
        return "-"
    return f"{s['median']:.2f}x ({s['min']:.2f}x..{s['max']:.2f}x, faster in {s['faster']}/{s['pairs']})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, required=True, help="where the public scripts' folders are")
    parser.add_argument("--out", type=Path, required=True, help="searches, baked scripts and results go here")
    parser.add_argument("--spec", type=Path, default=SPEC)
    parser.add_argument("--cases", type=lambda text: text.split(","), help="cases of the spec, comma-separated (default: all)")
    parser.add_argument("--budgets", type=lambda text: [int(b) for b in text.split(",")], default=[300, 1200],
                        help="time budgets, comma-separated (default 300,1200)")
    sub = parser.add_subparsers(dest="phase", required=True)
    sub.add_parser("search")
    ab = sub.add_parser("ab")
    ab.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    cases = yaml.safe_load(args.spec.read_text())["cases"]
    names = args.cases or list(cases)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in names:
        if args.phase == "search":
            for budget in args.budgets:
                got = run_search(name, cases[name], args.root, args.out, budget)
                results.append(got)
                (args.out / "search.json").write_text(json.dumps(results, indent=2))  # kept as each search ends
                print(f"{name} @ {budget}s: {got['winner']} {got['changed']} {got['speedup']}x in {got['wall_s']}s "
                      f"({100 * got['used']:.0f}% of the budget), load {got['load']}; stopped: {got['stopped']}",
                      flush=True)
        else:
            got = run_ab(name, cases[name], args.root, args.out, args.budgets, args.rounds)
            results.append(got)
            print(f"\n{name}: {got['rounds']} interleaved rounds, the script's own timer, load average "
                  f"{got['load'][0]}..{got['load'][1]}; best hand configuration: {got['best_hand']}")
            for row in got["rows"]:
                step = f"{1000 * row['step_s']:.1f} ms" if row["step_s"] else "-"
                print(f"  {row['variant']:<60} {step:>10}/step  over original {_fmt(row['over_original'])}  "
                      f"over best hand {_fmt(row['over_best_hand'])}")
    (args.out / f"{args.phase}.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
