"""How far a script's training carries a rounding difference, and what the loss gate makes of it.

Runs the patched script (every knob at its default) with 2 and with 1 CPU thread, and under each named knob
configuration, records the per-step losses with tests/loss_probe.py, and prints each run's per-step relative
deviation from the 2-thread baseline next to the gate's tolerance with and without the perturbed-baseline floor.
Never asserted; results go to docs/benchmarks.md. ``--json`` saves every curve; ``--replay FILE`` judges saved
curves again with the current gate, as a search would after ``--steps`` steps (no GPU needed for GPU curves).

    python bench/bench_gate.py --steps 25 -- fixtures/scripts/char_gpt.py --n-layer 4 --n-embd 256 \
        --block-size 256 --batch-size 8 --dropout 0 --max-iters 400 --eval-interval 100000
    python bench/bench_gate.py --replay docs/data/h100_gpt_lr3e-3.json --steps 25
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from loss_probe import run_probe  # noqa: E402

from autotune.project import load_project  # noqa: E402
from autotune.knob_table import KNOBS  # noqa: E402
from autotune.search.gate import Noise, judge, measure_noise, numerics_of, step_deviations  # noqa: E402
from autotune.search.trial import Outcome, TrialResult  # noqa: E402
from autotune.patch import run, select  # noqa: E402

CONFIGS = {
    "sdpa": {"sdpa.attention": "sdpa"},
    "fused": {"fused_optimizer.impl": "fused"},
    "bf16": {"autocast.dtype": "bf16"},
    "fp16": {"autocast.dtype": "fp16"},
    "tf32": {"backend_flags.matmul_precision": "high"},
    "bf16_sdpa": {"autocast.dtype": "bf16", "sdpa.attention": "sdpa"},
}


def replay(path: Path, steps: int, runs: int | None = None, perturbed: bool = True) -> None:
    """Judge saved curves (``--json``) with today's gate, as a search would after ``steps`` recorded steps: the
    baseline runs give the run-to-run noise, the perturbed one the reordering floor."""
    curves = json.loads(path.read_text(encoding="utf-8"))["curves"]

    def result(name: str, role: str = "search") -> TrialResult:
        return _result(curves[name][:steps], role)

    baselines = [result(n, "baseline") for n in curves if n.startswith("baseline")][:runs]
    noise = measure_noise(baselines, [result("perturbed", "perturbed")] if perturbed else [])
    print(f"{path.name}: first {steps} steps; {len(baselines)} baseline runs apart by up to {noise.max_loss:.1e}, "
          f"the perturbed one by {noise.max_reorder:.1e}")
    for name in curves:
        if name.startswith("baseline") or name == "perturbed":
            continue
        print(f"  {name:9s} {_verdict(result(name), baselines[0], CONFIGS[name], noise)}")


def _result(curve: list[list[float]], role: str = "search") -> TrialResult:
    losses = tuple(tuple(row) for row in curve)
    return TrialResult({}, role, Outcome.OK, losses=losses, step_times=(1.0,) * len(losses))


def _verdict(trial: TrialResult, reference: TrialResult, knobs: dict, noise: Noise) -> str:
    """The gate's verdict, as a search would give it."""
    verdict = judge(trial, reference, [KNOBS[k] for k in knobs], noise)
    where = (f"mean over steps {verdict.window[0]}..{verdict.window[1]}" if verdict.window
             else f"largest, first out at step {verdict.step}" if verdict.step else "largest")
    return (f"{'passes' if verdict.passed else 'refused'}: deviation {verdict.deviation:.1e} ({where}), "
            f"tolerance {verdict.tolerance:.1e}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--replay"]:
        parser = argparse.ArgumentParser()
        parser.add_argument("--replay", type=Path, nargs="+", required=True)
        parser.add_argument("--steps", type=int, default=25)
        parser.add_argument("--baselines", type=int, help="use only the first N baseline runs")
        parser.add_argument("--no-perturbed", action="store_true", help="as on CUDA, where a search runs none")
        opts = parser.parse_args(argv)
        for path in opts.replay:
            replay(path, opts.steps, opts.baselines, not opts.no_perturbed)
        return 0
    if "--" not in argv:
        print(__doc__)
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--threads", type=int, default=2, help="the baseline's threads; the perturbed run gets one fewer")
    parser.add_argument("--configs", nargs="*", default=["sdpa", "fused", "bf16"], choices=list(CONFIGS))
    parser.add_argument("--repeats", type=int, default=0,
                        help="extra runs of the baseline: its run-to-run noise (on CUDA the thread change is none)")
    parser.add_argument("--json", type=Path, help="write every run's per-step losses here")
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
        curves = {"baseline": ref}
        other = max(opts.threads - 1, 1) if opts.threads > 1 else 2
        curves["perturbed"] = losses(other, {})
        for n in range(opts.repeats):
            curves[f"baseline{n + 2}"] = losses(opts.threads, {})
        baselines = [_result(c, "baseline") for n, c in curves.items() if n.startswith("baseline")]
        plain = measure_noise(baselines)  # the same noise a search measures
        floor = measure_noise(baselines, [_result(curves["perturbed"], "perturbed")])
        print(f"{script} {' '.join(args)}: {opts.steps} steps, baseline on {opts.threads} threads")
        print(f"  {other} thread(s) instead: deviation up to {floor.max_reorder:.1e}")
        if opts.repeats:
            print(f"  {opts.repeats} more baseline run(s): deviation up to {plain.max_loss:.1e}")
        for name in opts.configs:
            knobs = CONFIGS[name]
            curves[name] = got = losses(opts.threads, knobs)
            devs = step_deviations(got, ref)
            numerics = numerics_of(KNOBS[k] for k in knobs)
            for label, noise in (("class tolerance", plain), ("with the thread floor", floor)):
                print(f"  {name:6s} ({numerics}): deviation up to {max(devs):.1e}; {label}: "
                      f"{_verdict(_result(got), baselines[0], knobs, noise)}")
        if opts.json:
            opts.json.write_text(json.dumps({"script": script, "args": args, "curves": curves}), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
