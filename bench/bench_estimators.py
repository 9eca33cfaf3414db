"""Which per-run speed estimate other work on the machine inflates least: from studies that searches left (their
runs' per-step times), the between-run spread of the baseline's runs and the spread of the confirmation pairs'
ratios, under each estimator of a run's step time (the median the search used until session 37, lower quantiles,
the minimum). The search now times a run by its window's mean step: every estimator here leaves out a cost that
comes every few steps, which the run pays (docs/benchmarks.md, the CNN's 180 s searches).

Interference only ever adds time to a step (Python's timeit makes the same argument for its minimum), so a low
quantile of a run's step times is its speed with less of the machine's other work in it; too low, and it keeps only
the luckiest steps. Nothing is asserted; prints one row per study and the median over the studies.

    python bench/bench_estimators.py autotune-out/study.db other/study.db ...

With ``--script``, it runs the unmodified script's baseline ``--runs`` times itself, as the search's runner runs a
trial (``--busy``: with one process beside it that keeps a processor busy throughout), and prints the same spreads
with what other work took from each run's steps (autotune.contention) and the load average:

    python bench/bench_estimators.py --script makemore.py --runs 8 --steps 150 -- --type mlp --max-steps 5000
    python bench/bench_estimators.py --script makemore.py --runs 8 --steps 150 --busy -- --type mlp --max-steps 5000
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autotune.search.trial import TrialResult, quantile  # noqa: E402

ESTIMATORS = {"median": 0.5, "p25": 0.25, "p10": 0.1, "min": 0.0}


def study_results(db: Path) -> list[tuple[str, list[TrialResult]]]:
    """Each study in the SQLite database ``db``: its name and its trials' results, in the order they ran."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url = f"sqlite:///{db}"
    out = []
    for summary in optuna.get_all_study_summaries(url):
        study = optuna.load_study(study_name=summary.study_name, storage=url)
        results = []
        for t in sorted(study.get_trials(), key=lambda t: t.number):
            try:
                results.append(TrialResult.from_attrs(t.user_attrs["result"]))
            except (KeyError, TypeError, ValueError):
                continue
        out.append((summary.study_name, results))
    return out


def _runs(db: Path) -> list[tuple[str, list[TrialResult]]]:
    return [(name, [r for r in results if r.measured and r.device == "cpu"]) for name, results in study_results(db)]


def _spread(xs: list[float]) -> float | None:
    return max(xs) / min(xs) - 1 if len(xs) > 1 and min(xs) > 0 else None


def baselines(script: Path, args: list[str], runs: int, warmup: int, steps: int, busy: bool) -> None:
    """Run ``script``'s baseline ``runs`` times through the search's runner; print each run and the spreads."""
    import os
    import subprocess
    import tempfile

    from autotune.patch import run
    from autotune.project import load_project
    from autotune.search.trial import Runner, TrialSettings

    project = load_project(script.resolve())
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True) if busy else None
    got = []
    try:
        with tempfile.TemporaryDirectory(prefix="estimators-") as tmp:
            settings = TrialSettings(tuple(args), script.resolve().parent, "cpu", warmup, steps, {"CUDA_VISIBLE_DEVICES": ""})
            runner = Runner(run(project), Path(tmp) / "work", settings)
            for i in range(runs):
                r = runner.run({}, "baseline", 600)
                if not r.measured:
                    raise SystemExit(f"run {i + 1}: {r.status} {r.error or ''}")
                got.append(r)
                est = " ".join(f"{n} {1 / quantile(r.step_times, q):.1f}" for n, q in ESTIMATORS.items())
                print(f"run {i + 1}: steps/s {est}; others {r.others if r.others is not None else '-'} cpu; "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)
            runner.cleanup()
    finally:
        if hog is not None:
            hog.kill()
    print(f"{len(got)} baseline runs{' beside one busy process' if busy else ''}: between-run spread (slowest / "
          "fastest - 1) " + ", ".join(f"{n} {100 * _spread([quantile(r.step_times, q) for r in got]):.0f}%"
                                       for n, q in ESTIMATORS.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("studies", nargs="*", type=Path)
    parser.add_argument("--script", type=Path, help="run this script's baseline instead of reading studies")
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--busy", action="store_true", help="one busy process beside the runs")
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    o = parser.parse_args(argv[:cut])
    if o.script is not None:
        baselines(o.script, argv[cut + 1:], o.runs, o.warmup, o.steps, o.busy)
        return 0
    rows: dict[str, list[float]] = {f"{name} {what}": [] for name in ESTIMATORS for what in ("base", "pairs")}
    print(f"{'study':<44} {'runs':>4} " + " ".join(f"{n + ' base':>11} {n + ' pairs':>11}" for n in ESTIMATORS))
    for db in o.studies:
        for name, runs in _runs(db):
            base = [r for r in runs if r.role == "baseline" or (r.role in ("confirm", "duel") and r.attrs.get("arm") == "baseline")]
            if all(len(set(r.step_times)) <= 1 for r in base):
                continue  # a test's fake timings: nothing to say
            pairs: dict[tuple, dict[str, TrialResult]] = {}
            for r in runs:
                if r.role == "confirm":
                    pairs.setdefault((r.attrs.get("candidate"), r.attrs.get("pair")), {})[str(r.attrs.get("arm"))] = r
            cells = []
            for est, q in ESTIMATORS.items():
                b = _spread([quantile(r.step_times, q) for r in base])
                ratios = [quantile(p["baseline"].step_times, q) / quantile(p["candidate"].step_times, q)
                          for p in pairs.values() if "baseline" in p and "candidate" in p]
                # the pairs' ratio spread: what decides whether a confirmation can say "faster"
                pr = statistics.pstdev(ratios) / statistics.mean(ratios) if len(ratios) > 2 else None
                for what, v in (("base", b), ("pairs", pr)):
                    if v is not None:
                        rows[f"{est} {what}"].append(v)
                cells.append(f"{'-' if b is None else f'{100 * b:.0f}%':>11} {'-' if pr is None else f'{100 * pr:.1f}%':>11}")
            print(f"{(str(db.parent.name) + '/' + name)[:44]:<44} {len(base):>4} " + " ".join(cells))
    def med(key: str, digits: int) -> str:
        return f"{100 * statistics.median(rows[key]):.{digits}f}%" if rows[key] else "-"

    print(f"{'median over studies':<49} " + " ".join(f"{med(n + ' base', 0):>11} {med(n + ' pairs', 1):>11}"
                                                    for n in ESTIMATORS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
