"""How far a script's training carries a rounding difference, and what the loss gate makes of it.

Runs the patched script (every knob at its default) with 2 and with 1 CPU thread, and under each named knob
configuration, records the per-step losses with tests/loss_probe.py, and prints each run's per-step relative
deviation from the 2-thread baseline next to the gate's tolerance with and without the perturbed-baseline floor.
Never asserted; results go to docs/benchmarks.md.

    python bench/bench_gate.py --steps 25 -- fixtures/scripts/char_gpt.py --n-layer 4 --n-embd 256 \
        --block-size 256 --batch-size 8 --dropout 0 --max-iters 400 --eval-interval 100000
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from loss_probe import run_probe  # noqa: E402

from autotune.analysis import load_project  # noqa: E402
from autotune.knob_table import KNOBS  # noqa: E402
from autotune.search.gate import Noise, numerics_of, step_deviations, tolerances  # noqa: E402
from autotune.patch import run, select  # noqa: E402

CONFIGS = {
    "sdpa": {"sdpa.attention": "sdpa"},
    "fused": {"fused_optimizer.impl": "fused"},
    "bf16": {"autocast.dtype": "bf16"},
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print(__doc__)
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--threads", type=int, default=2, help="the baseline's threads; the perturbed run gets one fewer")
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS))
    opts = parser.parse_args(argv[:split])
    script, *args = argv[split + 1:]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        patched = run(load_project(Path(script)), select())
        for f in patched.files:
            (tmp / f.rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / f.rel).write_text(f.new_text, encoding="utf-8")
        entry = tmp / patched.files[0].rel

        def losses(threads: int, knobs: dict) -> list[list[float]]:
            config = tmp / "config.yaml"
            config.write_text(yaml.safe_dump({"knobs": knobs}), encoding="utf-8")
            env = {"OMP_NUM_THREADS": str(threads), "AUTOTUNE_CONFIG": str(config)}
            got = run_probe(entry, args, steps=opts.steps, env=env, timeout=3600)
            return [[float.fromhex(v)] for v in got]

        ref = losses(opts.threads, {})
        other = max(opts.threads - 1, 1) if opts.threads > 1 else 2
        shaken = step_deviations(losses(other, {}), ref)
        running, worst = [], 0.0
        for d in shaken:
            worst = max(worst, d)
            running.append(worst)
        print(f"{script} {' '.join(args)}: {opts.steps} steps, baseline on {opts.threads} threads")
        print(f"  {other} thread(s) instead: deviation up to {max(shaken):.1e} (running max at the last step "
              f"{running[-1]:.1e})")
        floor = Noise(2, (0.0,) * len(ref), None, tuple(running), 1)
        plain = Noise(2, (0.0,) * len(ref), None)
        for name in opts.configs:
            knobs = CONFIGS[name]
            devs = step_deviations(losses(opts.threads, knobs), ref)
            numerics = numerics_of(KNOBS[k] for k in knobs)
            for label, noise in (("class tolerance", plain), ("with the thread floor", floor)):
                tols = tolerances(numerics, len(devs), noise)
                bad = [i + 1 for i, (d, t) in enumerate(zip(devs, tols)) if d > t]
                verdict = f"refused (first at step {bad[0]})" if bad else "passes"
                print(f"  {name:6s} ({numerics}): deviation up to {max(devs):.1e}; {label}: {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
