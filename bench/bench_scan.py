"""Times scan and patch of a generated 5,000-line training script (prints seconds; never asserted in tests).

    python bench/bench_scan.py [--lines 5000] [--repeat 5] [--split] [--no-command] [--script PATH]

Three figures, each the median and minimum of ``--repeat`` runs, wall clock and CPU time of this process (or, for
the command, of the child): in process (imports already done: ``load_project`` + ``run``, and the diff for patch);
the whole command as a user runs it (``python -m autotune scan FILE`` and ``... patch --diff FILE`` in a fresh
interpreter: start-up and imports included, bytecode cached, output to /dev/null); with ``--split``, where the
in-process time goes. On a shared machine the wall clock follows the load: the load average is printed with the
figures.

The generated script is 226 copies of a small residual block class and a helper function, then one short training
loop: about as many libcst nodes per line as the fixture scripts (19 against 21), but few sites. ``--script`` times a real one
instead (``--split`` needs a single-file script).
"""

from __future__ import annotations

import argparse
import ast
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HEADER = '''"""A long training script: many model blocks and helpers, one training loop at the end."""
import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
'''

BLOCK = '''

class Block{i}(nn.Module):
    """Residual block number {i}."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)  # projection
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(self.norm(x))
        if y.requires_grad:
            y = F.gelu(y)
        return x + 0.5 * y


def helper{i}(values: list[float], scale: float = {i}.0) -> float:
    total = 0.0
    for v in values:
        total += math.sqrt(abs(v)) * scale
    return total / max(len(values), 1)
'''

FOOTER = '''

def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = nn.Sequential(Block0(16), Block1(16)).to(device)
    data = TensorDataset(torch.randn(64, 16), torch.randn(64, 16))
    loader = DataLoader(data, batch_size=8, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step, (x, y) in enumerate(loader):
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad()
        out = model(x)
        loss = F.mse_loss(out, y)
        loss.backward()
        optimizer.step()
        if step >= args.steps:
            break


if __name__ == "__main__":
    main()
'''


def make_script(lines: int) -> str:
    parts, i = [HEADER], 0
    while sum(p.count("\n") for p in parts) + FOOTER.count("\n") < lines:
        parts.append(BLOCK.format(i=i))
        i += 1
    return "".join(parts) + FOOTER


def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall, cpu) seconds of one call."""
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def _child_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _command(argv: list[str]) -> tuple[float, float]:
    """(wall, cpu) seconds of a command run to completion, its output thrown away.

    Bytecode caching on, as for a user (an install compiles its modules once); a first run writes the cache.
    """
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    w, c = time.perf_counter(), _child_cpu()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, check=True, timeout=600)
    return time.perf_counter() - w, _child_cpu() - c


def _line(label: str, runs: list[tuple[float, float]]) -> str:
    wall, cpu = [r[0] for r in runs], [r[1] for r in runs]
    return (
        f"  {label:<14} wall {statistics.median(wall):6.3f} s median, {min(wall):6.3f} s min;"
        f"  cpu {statistics.median(cpu):6.3f} s median, {min(cpu):6.3f} s min"
    )


def _split(path: Path, repeat: int) -> None:
    """Where the in-process time of a patch goes, phase by phase (the same steps as ``run``, checked against it)."""
    import libcst as cst

    from autotune.analysis import ModuleFacts, _collect, _index
    from autotune.source import no_gc, read_source
    from autotune.project import Project, _collect_names, _find_loops
    from autotune.patch import _apply, _code, _step_hooks, run
    from autotune.transform import Edits, Mode, all_transforms

    phases: dict[str, list[float]] = {}

    def phase(name: str, fn: Callable[[], object]) -> object:
        c = time.process_time()
        out = fn()
        phases.setdefault(name, []).append(time.process_time() - c)
        return out

    for _ in range(repeat):
        with no_gc():  # as load_project and run do
            text = phase("read", lambda: read_source(path))
            tree = phase("ast.parse", lambda: ast.parse(text, filename=path.name))
            module = phase("libcst parse", lambda: cst.parse_module(text))
            facts = ModuleFacts(path.resolve(), path.name, path.stem, False, text, module, tree)
            phase("analysis: walk", lambda: _index(facts))
            phase("analysis: facts", lambda: _collect(facts))
            project = Project(path.resolve().parent, facts, [facts])
            phase("analysis: project", lambda: (_collect_names(project), _find_loops(project)))
            edits = Edits()
            for transform in [t(project, Mode()) for t in all_transforms()]:
                phase(f"  {transform.name}", lambda: transform.apply(facts, edits))
            phase("step hook", lambda: _step_hooks(project, facts, edits))
            new_text, check = phase("rewrite + code", lambda: _code(facts, _apply(facts, edits)))
            phase("compile check", lambda: compile(check, path.name, "exec"))
        # the diff of run's result costs the same: timed on it, and the text compared with ours
        result = run(project)
        assert result.files[0].new_text == new_text, "the split no longer follows patch.run"
        phase("diff", result.diff)
    total = sum(statistics.median(v) for v in phases.values())
    print(f"split (in process, cpu, median of {repeat}; transforms indented; sum of medians {total:.3f} s):")
    for name, values in phases.items():
        print(f"  {name:<22} {statistics.median(values) * 1000:7.1f} ms median, {min(values) * 1000:7.1f} ms min")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--split", action="store_true", help="also show where the in-process time goes")
    parser.add_argument("--no-command", action="store_true", help="leave out the whole-command figure")
    parser.add_argument("--script", type=Path, help="time this script instead of a generated one")
    args = parser.parse_args(argv)

    from autotune.project import load_project
    from autotune.patch import run

    with tempfile.TemporaryDirectory() as tmp:
        if args.script is not None:
            path = args.script.resolve()
        else:
            path = Path(tmp) / "long_train.py"
            path.write_text(make_script(args.lines))
        n = len(path.read_text().splitlines())
        load_start = os.getloadavg()[0]
        run(load_project(path))  # warm imports and the transform registry
        scans, patches = [], []
        for _ in range(args.repeat):
            scans.append(_timed(lambda: run(load_project(path))))  # scan = patch with the trees thrown away
            patches.append(_timed(lambda: run(load_project(path)).diff()))
        commands: list[tuple[str, list[tuple[float, float]]]] = []
        if not args.no_command:
            python = [sys.executable, "-m", "autotune"]
            for label, argv_ in (("scan", ["scan", str(path)]), ("patch --diff", ["patch", "--diff", str(path)])):
                _command([*python, *argv_])  # writes the bytecode cache
                commands.append((label, [_command([*python, *argv_]) for _ in range(args.repeat)]))
        load_end = os.getloadavg()[0]
        print(f"{path.name}: {n} lines, {args.repeat} repeats; load average {load_start:.2f} at start, {load_end:.2f} at end "
              f"({os.cpu_count()} CPUs)")
        print("in process (imports warm; load_project + run, and the diff for patch):")
        print(_line("scan", scans))
        print(_line("patch", patches))
        if commands:
            print("whole command (python -m autotune ..., fresh interpreter: start-up and imports included):")
            for label, runs in commands:
                print(_line(label, runs))
        if args.split:
            _split(path, args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
