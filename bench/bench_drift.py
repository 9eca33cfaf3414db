"""Whether the machine's drift over minutes shows in a fixed reference workload: one process alternates a small
MLP training step (makemore's size, 1 thread) with a fixed reference (a Python loop and a chain of 128x128 matmuls)
for ``--seconds``, and prints, per ``--bucket`` seconds, the median step time, the median reference time and their
ratio, then the range (slowest / fastest - 1) of each over the buckets and the load average. If the reference moved
with the steps, the ratio's range would be far below the steps' and a search could correct its runs by it
(docs/benchmarks.md, issue 33). Nothing is asserted.

    python bench/bench_drift.py --seconds 300 --bucket 30
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--bucket", type=float, default=30.0)
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    emb = torch.nn.Embedding(27, 64)
    mlp = torch.nn.Sequential(torch.nn.Linear(64 * 3, 512), torch.nn.Tanh(), torch.nn.Linear(512, 27))
    opt = torch.optim.AdamW([*emb.parameters(), *mlp.parameters()], lr=1e-3)
    x, y = torch.randint(0, 27, (32, 3)), torch.randint(0, 27, (32,))
    a = torch.randn(128, 128)

    def step() -> None:
        loss = torch.nn.functional.cross_entropy(mlp(emb(x).view(32, -1)), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def reference() -> None:
        s = 0
        for i in range(2000):
            s += i * i
        b = a
        for _ in range(20):
            b = torch.tanh(a @ b)

    def median_time(fn, n: int) -> float:
        times = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    for _ in range(50):
        step()
    began = time.perf_counter()
    buckets: dict[int, list[tuple[float, float]]] = {}
    while (now := time.perf_counter()) - began < args.seconds:
        s = (median_time(step, 300) + median_time(step, 300)) / 2
        r = median_time(reference, 30)
        buckets.setdefault(int((now - began) // args.bucket), []).append((s, r))
    rows = []
    for k, pairs in sorted(buckets.items()):
        s = statistics.median(p[0] for p in pairs)
        r = statistics.median(p[1] for p in pairs)
        rows.append((s, r, s / r))
        print(f"{k * args.bucket:6.0f} s  step {s * 1e3:.3f} ms  reference {r * 1e3:.3f} ms  ratio {s / r:.4f}")
    for i, name in enumerate(("step", "reference", "ratio")):
        values = [row[i] for row in rows]
        print(f"{name}: range over {len(rows)} buckets {100 * (max(values) / min(values) - 1):.0f}%")
    print("load average: " + " ".join(f"{v:.2f}" for v in os.getloadavg()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
