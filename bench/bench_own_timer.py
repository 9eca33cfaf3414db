"""A script's variants timed by the script's own timer and whole, in interleaved rounds: the independent check of a
search's verdict (docs/benchmarks.md). Each round runs every variant once, the order reversed every other round;
each run is a fresh process. Per run: the median of the timings its output prints (``--timer``, a regular
expression whose group is one timing; the first ``--skip`` left out) and its wall time from process start to exit.
Prints every run, then each variant's per-round speedup over the first variant (its timing / theirs) and its whole
run's time over the first's, with their median and range, and the load average. Nothing is asserted. A script
that prints no timing of its own (karpathy/ng-video-lecture's gpt.py) is measured whole only: leave out ``--timer``.

    python bench/bench_own_timer.py --rounds 5 --timer 'step time ([0-9.]+)ms' \\
        original=makemore.py tuned=autotune-out/makemore.py -- -i names.txt --type mlp --max-steps 2000 -o work
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path


def one_run(script: Path, args: list[str], timer: re.Pattern | None, skip: int,
            timeout: float) -> tuple[float | None, float]:
    """(median of the script's own timings, None without ``timer``; wall seconds) of one run of ``script``."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{script} failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
    if timer is None:
        return None, wall
    timings = [float(x) for x in timer.findall(done.stdout + done.stderr)][skip:]
    if not timings:
        raise SystemExit(f"{script}: no timing matched {timer.pattern!r} after the first {skip}")
    return statistics.median(timings), wall


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variants", nargs="+", help="NAME=SCRIPT, the first is the reference")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--timer", help="regular expression; its group is one timing (none: whole runs only)")
    parser.add_argument("--skip", type=int, default=2, help="timings left out at the start of each run")
    parser.add_argument("--timeout", type=float, default=1800.0)
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    o = parser.parse_args(argv[:cut])
    args = argv[cut + 1:]
    try:
        arms = dict(v.split("=", 1) for v in o.variants)
    except ValueError:
        parser.error("each variant is NAME=SCRIPT")
    names = list(arms)
    timer = re.compile(o.timer) if o.timer else None
    own: dict[str, list[float | None]] = {n: [] for n in names}
    wall: dict[str, list[float]] = {n: [] for n in names}
    loads = []
    for r in range(o.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            t, w = one_run(Path(arms[name]), args, timer, o.skip, o.timeout)
            own[name].append(t)
            wall[name].append(w)
            loads.append(os.getloadavg()[0])
            said = f"own timer {t:.3f}, " if t is not None else ""
            print(f"round {r + 1} {name}: {said}whole run {w:.1f}s, load {loads[-1]:.1f}", flush=True)
    ref = names[0]
    for name in names[1:]:
        whole = sorted(b / a for a, b in zip(wall[ref], wall[name]))
        said = ""
        if timer is not None:
            speed = sorted(a / b for a, b in zip(own[ref], own[name]))  # type: ignore[operator]
            faster = sum(s > 1.0 for s in speed)
            said = (f" own timer {statistics.median(speed):.2f}x ({speed[0]:.2f}x..{speed[-1]:.2f}x, faster in "
                    f"{faster} of {len(speed)} rounds);")
        quicker = sum(x < 1.0 for x in whole)
        print(f"{name} against {ref}:{said} whole run {name}/{ref} {statistics.median(whole):.2f} "
              f"({whole[0]:.2f}..{whole[-1]:.2f}, shorter in {quicker} of {len(whole)} rounds; median "
              f"{statistics.median(wall[ref]):.1f}s -> {statistics.median(wall[name]):.1f}s)")
    print(f"load average {min(loads):.1f}..{max(loads):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
