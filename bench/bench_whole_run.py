"""The user's whole run, as they feel it: the original script and its tuned copy, each from process start to exit.

Runs ORIGINAL and TUNED (a search's output script) with the script's own arguments in interleaved pairs, the
order swapped every pair, each a fresh process timed by the wall clock; ``--cold`` gives every run a new, empty
compiler cache (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR), as a first run on a new machine has; without it the
caches are as earlier runs (the search's among them) left them. Prints each arm's median and the paired ratios
(tuned / original: above 1 is slower) with their spread and the load average. Nothing is asserted.

    python bench/bench_whole_run.py nlp_example.py autotune-out/nlp_example.py --pairs 3 -- --cpu
    python bench/bench_whole_run.py nlp_example.py autotune-out/nlp_example.py --pairs 3 --cold -- --cpu
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def timed(script: Path, args: list[str], cwd: Path, cold: bool, timeout: float) -> float:
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="whole-run-cache-") as cache:
        if cold:
            env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, "inductor")
            env["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")
        started = time.perf_counter()
        done = subprocess.run([sys.executable, str(script), *args], cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, timeout=timeout)
        took = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{script} failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
    return took


def compare(arms: dict[str, Path], args: list[str], cwd: Path, pairs: int, cold: bool, timeout: float) -> None:
    """Run the two ``arms`` (name: script) in ``pairs`` interleaved pairs, the order swapped every pair; print each
    pair, each arm's median and the paired ratios (second / first) with their spread and the load average."""
    (a, b), times = arms, {name: [] for name in arms}
    loads = [os.getloadavg()[0]]
    for pair in range(pairs):
        for arm in (a, b) if pair % 2 == 0 else (b, a):
            times[arm].append(timed(arms[arm], args, cwd, cold, timeout))
        loads.append(os.getloadavg()[0])
        print(f"pair {pair + 1}: {a} {times[a][-1]:.1f}s, {b} {times[b][-1]:.1f}s", flush=True)
    ratios = [y / x for x, y in zip(times[a], times[b])]
    print(f"{'cold' if cold else 'warm'} compiler caches, {pairs} interleaved pairs, whole runs from process start "
          f"to exit: {a} median {statistics.median(times[a]):.1f}s, {b} median {statistics.median(times[b]):.1f}s; "
          f"{b}/{a} {statistics.median(ratios):.2f} ({min(ratios):.2f}..{max(ratios):.2f}); "
          f"load {min(loads):.1f}..{max(loads):.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("original", type=Path)
    parser.add_argument("tuned", type=Path)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--cold", action="store_true", help="a new, empty compiler cache for every run")
    parser.add_argument("--timeout", type=float, default=1800)
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    o = parser.parse_args(argv[:cut])
    args = argv[cut + 1:]  # the script's own arguments, after --
    compare({"original": o.original.resolve(), "tuned": o.tuned.resolve()}, args, o.original.resolve().parent,
            o.pairs, o.cold, o.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
