"""Do sdpa, checkpointing and compile help or hurt a script on this machine? Prints ratios; never asserted in tests.

The script is patched (sdpa, checkpointing, compile) into a temporary folder, then run under the trial protocol
with each knob setting, interleaved with the baseline (all knobs at their defaults) so that the load of a shared
machine hits both alike. Each run reports its step times after the warm-up (which holds any compilation); each
setting run is paired with the baseline run just before it, and the speedup is the median over the pairs of
(baseline median step time / setting median step time): above 1, faster.

    python bench/bench_model_transforms.py fixtures/scripts/char_gpt.py --repeat 3 -- --max-iters 40
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

from autotune.project import load_project
from autotune.patch import run, select, write_outputs

SETTINGS = {
    "sdpa": {"sdpa.attention": "sdpa"},
    "ckpt-all": {"checkpointing.blocks": "all"},
    "ckpt-every_2nd": {"checkpointing.blocks": "every_2nd"},
    "compile-default": {"compile.mode": "default"},
    "compile-blocks": {"compile.mode": "default", "compile.scope": "blocks"},
}


def trial(script: Path, args: list[str], knobs: dict, work: Path, warmup: int, steps: int, timeout: float) -> dict:
    config = work / "config.yaml"
    config.write_text("knobs:\n" + "".join(f"  {k}: {v}\n" for k, v in knobs.items()))
    spec = work / "trial.json"
    result = work / "result.json"
    result.unlink(missing_ok=True)
    spec.write_text(json.dumps({"warmup": warmup, "steps": steps, "result": str(result)}))
    env = {**os.environ, "AUTOTUNE_CONFIG": str(config), "AUTOTUNE_TRIAL": str(spec)}
    done = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=timeout)
    if not result.exists():
        raise SystemExit(f"no trial result ({done.returncode}): {done.stderr[-2000:]}")
    out = json.loads(result.read_text())
    if out["status"] != "ok":
        raise SystemExit(f"trial {out['status']}: {out.get('error')}\n{done.stderr[-2000:]}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("script", type=Path)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--only", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--timeout", type=float, default=900)
    argv = sys.argv[1:] if argv is None else argv
    script_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        result = run(load_project(args.script), select(["sdpa", "checkpointing", "compile"]))
        write_outputs(result, work / "patched", args.script.name)
        patched = work / "patched" / args.script.name
        applied = sorted({s.transform for s in result.sites if str(s.status) == "applicable"})
        print(f"{args.script}: applicable transforms: {', '.join(applied) or 'none'}")
        medians: dict[str, list[float]] = {"baseline": []}
        ratios: dict[str, list[float]] = {}
        compile_s: dict[str, list[float]] = {}
        for rep in range(args.repeat):
            for name in args.only:
                for label, knobs in (("baseline", {}), (name, SETTINGS[name])):
                    out = trial(patched, script_args, knobs, work, args.warmup, args.steps, args.timeout)
                    medians.setdefault(label, []).append(statistics.median(out["step_times"]))
                    if out.get("compile_s"):
                        compile_s.setdefault(label, []).append(out["compile_s"])
                    print(f"  rep {rep} {label:16s} median step {medians[label][-1] * 1000:8.1f} ms", flush=True)
                ratios.setdefault(name, []).append(medians["baseline"][-1] / medians[name][-1])
        base = statistics.median(medians["baseline"])
        print(f"baseline: median step {base * 1000:.1f} ms over {len(medians['baseline'])} runs")
        for name in args.only:
            mine = statistics.median(medians[name])
            extra = f", compile {statistics.median(compile_s[name]):.1f} s" if name in compile_s else ""
            spread = f"pairs x{min(ratios[name]):.2f}..x{max(ratios[name]):.2f}"
            print(f"{name:16s} {mine * 1000:8.1f} ms/step  speedup x{statistics.median(ratios[name]):.2f} ({spread}){extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
