"""Which baseline runs a search-phase run should be compared with: from studies that searches left, how far each
baseline run's speed is from what a rule built from the *other* baseline runs predicts. A baseline run is a change
of nothing, so its true speedup is 1 and the rule's error is the noise a real change's speedup carries under it.

Rules (each over one machine's baseline runs in the order they ran):

- ``last 3``: the median of the 3 baseline runs before it (what the search used until session 38);
- ``last``: the one baseline run before it;
- ``neighbours``: the mean of the baseline run before it and the one after it (the first and last runs: the one
  neighbour they have), the rule the search phase uses now (``autotune/search/view.py``).

The machine's speed drifts over minutes (docs/benchmarks.md, issue 33), so a rule that looks close in time should
err less than one that looks at runs minutes old. Prints, per study and as the median over them, twice the root
mean square of the log errors (the margin a change must beat under that rule) and the worst error. Nothing is
asserted.

    python bench/bench_reference.py autotune-out/study.db other/study.db ...
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_estimators import study_results  # noqa: E402  (bench/ is the script's own folder)


def _rules(speeds: list[float]) -> dict[str, list[float]]:
    """Each rule's log error on each baseline run it can predict."""
    errors: dict[str, list[float]] = {"last 3": [], "last": [], "neighbours": []}
    for i, s in enumerate(speeds):
        before = speeds[max(0, i - 3):i]
        if before:
            errors["last 3"].append(math.log(s / statistics.median(before)))
            errors["last"].append(math.log(s / before[-1]))
        near = speeds[i - 1:i] if i else []
        near += speeds[i + 1:i + 2]
        if near:
            errors["neighbours"].append(math.log(s / statistics.fmean(near)))
    return errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("studies", nargs="+", type=Path)
    o = parser.parse_args(argv)
    names = ("last 3", "last", "neighbours")
    margins: dict[str, list[float]] = {n: [] for n in names}
    print(f"{'study':<40} {'runs':>4} " + " ".join(f"{n + ' margin':>18} {'worst':>6}" for n in names))
    for db in o.studies:
        for name, results in study_results(db):
            machines: dict[str, list[float]] = {}
            for r in results:
                if r.role == "baseline" and r.measured and r.step_time:
                    machines.setdefault(r.machine, []).append(1.0 / r.step_time)
            for machine, speeds in machines.items():
                if len(speeds) < 3 or len(set(speeds)) == 1:
                    continue  # too few to say, or a test's fake timings
                errors = _rules(speeds)
                cells = []
                for n in names:
                    e = errors[n]
                    m = 2 * math.sqrt(statistics.fmean(x * x for x in e))
                    margins[n].append(m)
                    cells.append(f"{100 * m:>17.1f}% {100 * (math.exp(max(map(abs, e))) - 1):>5.0f}%")
                print(f"{(db.parent.name + '/' + name)[:40]:<40} {len(speeds):>4} " + " ".join(cells))
    if any(margins.values()):
        print(f"{'median over studies':<45} " + " ".join(
            f"{100 * statistics.median(margins[n]):>17.1f}% {'':>6}" for n in names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
