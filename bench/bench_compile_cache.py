"""What the compile cache carried to a tuned script saves: SCRIPT with ``compile.mode`` baked in and the loader at
its top, run whole with and without ``compile_cache.bin`` beside it, in interleaved pairs (the order swapped every
pair), each run with a new, empty compiler cache (``--cold``, a first run on a fresh machine) or the caches as they
are. The file is made the way a search makes it: one trial run of the configuration through the search's runner.
Prints each arm's median, the paired ratios (with / without) and the load average. Nothing is asserted.

    python bench/bench_compile_cache.py bench/scripts/gpt_accum.py --pairs 3 --cold -- --steps 30
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_whole_run import compare  # noqa: E402

from autotune.bake import bake  # noqa: E402
from autotune.compile_cache import CACHE_NAME, with_loader  # noqa: E402
from autotune.patch import run  # noqa: E402
from autotune.project import load_project  # noqa: E402
from autotune.search.trial import Outcome, Runner, TrialSettings  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("script", type=Path)
    parser.add_argument("--mode", default="default", help="compile.mode to bake (default: default)")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--cold", action="store_true", help="a new, empty compiler cache for every run")
    parser.add_argument("--timeout", type=float, default=1800)
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    o = parser.parse_args(argv[:cut])
    args = argv[cut + 1:]  # the script's own arguments, after --
    project = load_project(o.script.resolve())
    config = {"compile.mode": o.mode}
    with tempfile.TemporaryDirectory(prefix="compile-cache-bench-") as tmp:
        top = Path(tmp)
        saved = top / "work" / "keep" / CACHE_NAME
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        settings = TrialSettings(tuple(args), o.script.resolve().parent, device, 2, 5, {})
        result = Runner(run(project), top / "work", settings).run(config, "confirm", o.timeout, compile_cache=saved)
        if result.status is not Outcome.OK or not saved.is_file():
            raise SystemExit(f"the trial run left no compile cache: {result.status} {result.error or ''}\n{result.stderr_tail}")
        text = with_loader(bake(project, config, settings.device).files[0].new_text)
        for arm in ("with", "without"):
            (top / arm).mkdir()
            (top / arm / project.entry.path.name).write_text(text)
        (top / "with" / CACHE_NAME).write_bytes(saved.read_bytes())
        print(f"{CACHE_NAME}: {saved.stat().st_size / 1024:.0f} KiB")
        compare({"without": top / "without" / project.entry.path.name, "with": top / "with" / project.entry.path.name},
                args, o.script.resolve().parent, o.pairs, o.cold, o.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
