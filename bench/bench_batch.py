"""Bigger micro-batches at the same samples per optimizer step: samples/s and peak memory, original against split.

The script (by default bench/scripts/gpt_accum.py, micro-batches of --batch-size with --accum accumulation steps)
is patched into a temporary folder, then run under the trial protocol at each setting, interleaved with the
original (every knob at its default) so that a shared machine's load hits both alike. Each run reports the samples
of its optimizer steps and its step times after the warm-up; a setting's speedup is the median over the repeats of
(its samples/s / the original's samples/s in the same repeat), with the range. The per-step losses of the first
repeat are compared with the original's. A micro-batch that does not fit (out of memory) is reported, and the
bigger ones are not run.

    python bench/bench_batch.py --repeat 3 -- --steps 20                                     # CPU, small
    python bench/bench_batch.py --factors 4 16 --bf16 -- --device cuda --n-layer 12 --n-embd 768 \\
        --n-head 12 --block-size 512 --vocab 50304 --batch-size 4 --accum 16 --steps 30      # GPT-2 small on a GPU
    python bench/bench_batch.py --script fixtures/transforms/hf_trainer/plain.in.py --factors \\
        --setting tuned=hf_trainer.precision=bf16,hf_trainer.batch_split=4 -- --steps 40    # any knobs, any script
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from autotune.patch import run, write_outputs
from autotune.project import load_project

HERE = Path(__file__).resolve().parent


def trial(script: Path, args: list[str], knobs: dict, work: Path, warmup: int, steps: int, timeout: float) -> dict:
    """One trial's result (``status`` "ok", or the failure with its ``error_types``)."""
    config = work / "config.yaml"
    config.write_text("knobs:\n" + "".join(f"  {k}: {v}\n" for k, v in knobs.items()))
    spec, result = work / "trial.json", work / "result.json"
    result.unlink(missing_ok=True)
    spec.write_text(json.dumps({"warmup": warmup, "steps": steps, "result": str(result)}))
    env = {**os.environ, "AUTOTUNE_CONFIG": str(config), "AUTOTUNE_TRIAL": str(spec)}
    done = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=work)
    if not result.exists():
        oom = "out of memory" in done.stderr or "OutOfMemoryError" in done.stderr
        return {"status": "oom" if oom else "crash", "error": done.stderr[-1500:], "error_types": []}
    out = json.loads(result.read_text())
    if any(t.endswith("OutOfMemoryError") for t in out.get("error_types") or ()):
        out["status"] = "oom"
    return out


def samples_per_s(result: dict) -> float | None:
    times = result.get("step_times") or []
    if result.get("status") != "ok" or not times or not result.get("batch_size"):
        return None
    return result["batch_size"] / statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--script", type=Path, default=HERE / "scripts" / "gpt_accum.py")
    parser.add_argument("--factors", type=int, nargs="*", default=[4, 16], help="batch_split.factor values")
    parser.add_argument("--bf16", action="store_true", help="also each factor with bf16 autocast (the memory saver "
                        "that goes with bigger micro-batches), and bf16 alone")
    parser.add_argument("--setting", action="append", default=[], metavar="NAME=KNOB=VALUE,KNOB=VALUE",
                        help="another setting to compare, by its knobs (values read as YAML)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=900)
    argv = sys.argv[1:] if argv is None else argv
    if "--" in argv:
        cut = argv.index("--")
        argv, script_args = argv[:cut], argv[cut + 1:]
    else:
        script_args = []
    opts = parser.parse_args(argv)

    settings: dict[str, dict] = {"original": {}}
    for k in opts.factors:
        if k != 1:
            settings[f"split x{k}"] = {"batch_split.factor": k}
    for text in opts.setting:
        name, _, pairs = text.partition("=")
        settings[name] = {k: yaml.safe_load(v) for k, v in (p.split("=", 1) for p in pairs.split(",") if p)}
    if opts.bf16:
        settings["bf16"] = {"autocast.dtype": "bf16"}
        for k in opts.factors:
            if k != 1:
                settings[f"split x{k} + bf16"] = {"batch_split.factor": k, "autocast.dtype": "bf16"}

    with tempfile.TemporaryDirectory(prefix="bench_batch_") as tmp:
        work = Path(tmp)
        result = run(load_project(opts.script))
        write_outputs(result, work / "patched", opts.script.name)
        script = work / "patched" / result.files[0].rel
        print(f"{opts.script.name} {' '.join(script_args)}: load average {os.getloadavg()[0]:.2f}", flush=True)
        speeds: dict[str, list[float | None]] = {name: [] for name in settings}
        memory: dict[str, int | None] = {}
        losses: dict[str, list[float]] = {}
        failed: dict[str, str] = {}
        for r in range(opts.repeat):
            for name, knobs in settings.items():
                k = knobs.get("batch_split.factor", 1)  # a factor that ran out of memory: the bigger ones are not run
                bigger_failed = [f for f in failed if settings[f].get("batch_split.factor", 1) <= k
                                 and settings[f].get("batch_split.factor", 1) > 1
                                 and settings[f].get("autocast.dtype") == knobs.get("autocast.dtype")]
                if name in failed or bigger_failed:
                    speeds[name].append(None)
                    continue
                out = trial(script, script_args, knobs, work, opts.warmup, opts.steps, opts.timeout)
                if out["status"] != "ok":
                    failed[name] = out["status"]
                    print(f"  repeat {r + 1} {name}: {out['status']}", flush=True)
                    speeds[name].append(None)
                    continue
                if knobs and not set(knobs) <= set(out.get("applied") or ()):
                    failed[name] = f"not applied ({out.get('applied')})"
                speed = samples_per_s(out)
                speeds[name].append(speed)
                memory[name] = out.get("peak_memory")
                if r == 0:
                    losses[name] = [v for row in out.get("losses") or () for v in row]
                print(f"  repeat {r + 1} {name}: {speed:.1f} samples/s ({out['batch_size']} per step), peak "
                      f"{(out.get('peak_memory') or 0) / 2**20:.0f} MiB ({out.get('peak_memory_kind')})", flush=True)
        print(f"load average {os.getloadavg()[0]:.2f}")
        base = speeds["original"]
        print(f"{'setting':<18} {'samples/s':>10} {'vs original':>24} {'peak MiB':>9} {'loss dev':>9}")
        for name in settings:
            got = [s for s in speeds[name] if s is not None]
            if not got:
                print(f"{name:<18} {'-':>10} {failed.get(name, 'failed'):>24}")
                continue
            ratios = [s / b for s, b in zip(speeds[name], base) if s is not None and b is not None]
            spread = f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}x)" if ratios else "-"
            dev = max((abs(a - b) / abs(b) for a, b in zip(losses.get(name, []), losses["original"]) if b), default=0.0)
            mib = (memory.get(name) or 0) / 2**20
            print(f"{name:<18} {statistics.median(got):>10.1f} {spread:>24} {mib:>9.0f} {dev:>9.1e}"
                  + (f"  ({failed[name]})" if name in failed else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
