"""Times scan and patch of a generated 5,000-line training script (prints seconds; never asserted in tests).

    python bench/bench_scan.py [--lines 5000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)

    from autotune.analysis import load_project
    from autotune.patch import run

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "long_train.py"
        path.write_text(make_script(args.lines))
        n = len(path.read_text().splitlines())
        run(load_project(path))  # warm imports and the transform registry
        scans, patches = [], []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            project = load_project(path)
            run(project)  # scan = patch with the trees thrown away
            t1 = time.perf_counter()
            project = load_project(path)
            result = run(project)
            result.diff()
            t2 = time.perf_counter()
            scans.append(t1 - t0)
            patches.append(t2 - t1)
        print(f"{n} lines, {args.repeat} repeats (median, min):")
        print(f"  scan : {statistics.median(scans):.3f} s, {min(scans):.3f} s")
        print(f"  patch: {statistics.median(patches):.3f} s, {min(patches):.3f} s (incl. diff)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
