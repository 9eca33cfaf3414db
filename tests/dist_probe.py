"""Run a (patched) training script on every rank of a distributed job, once per knob config, and record what each
backward() saw: the loss, and every gradient of the optimizer's parameters right after it.

Command line, under any launcher (this is what each rank runs)::

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/dist_probe.py \
        --out DIR --steps N --config off.yaml --config on.yaml -- SCRIPT.py [script args...]

Each config runs the script in the same process, one after the other: ``AUTOTUNE_CONFIG`` names it, the runtime
forgets the previous one, and the process group the script started is destroyed once the script has made N
backward() calls (the N+1-th raises a private BaseException that ends it). Rank r writes ``DIR/rank<r>.json``::

    {"runs": [{"config": "off.yaml", "losses": ["0x1.2p-3", ...], "grads": [[0.1, ...], ...],
               "ended": "steps" | "script_exit", "env": {"NCCL_ALGO": "...", ...}}, ...]}

From Python (tests)::

    from dist_probe import run_dist_probe
    runs = run_dist_probe(script, [cfg_off, cfg_on], steps=8, nproc=2, out=tmp_path)  # runs[rank][config]

``scripts`` runs config i with script i instead (``--pair CONFIG SCRIPT`` on the command line; torchrun would take
``--run`` for its ``--run-path``): a patched script and the baked ones in one launch, where each launch is three
fresh processes that import torch.

The launcher's output is kept in ``DIR/output.txt``.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import runpy
import socket
import subprocess
import sys
from pathlib import Path

_THIS = Path(__file__).resolve()
ENV_RECORDED = ("NCCL_ALGO", "NCCL_MIN_NCHANNELS", "NCCL_BUFFSIZE")


class _Stop(BaseException):
    """Raised from backward() once N calls have been recorded."""


def run_dist_probe(
    script: Path,
    configs: list[Path],
    steps: int,
    out: Path,
    nproc: int = 2,
    args: list[str] | tuple[str, ...] = (),
    env: dict[str, str | None] | None = None,
    timeout: float = 240,
    scripts: list[Path] | None = None,
) -> list[list[dict]]:
    """Run the probe under ``torch.distributed.run`` with ``nproc`` ranks; ``result[rank][i]`` is config i's run (of
    ``scripts[i]`` where given, else of ``script``)."""
    full_env = dict(os.environ)
    full_env["OMP_NUM_THREADS"] = "1"
    full_env.pop("AUTOTUNE_TRIAL", None)
    for key, value in (env or {}).items():
        if value is None:
            full_env.pop(key, None)
        else:
            full_env[key] = value
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        f"--log-dir={out / 'torchrun'}",  # its log folder, else a torchelastic_* left in /tmp by every probe
        str(_THIS), "--out", str(out), "--steps", str(steps),
        *([x for c, one in zip(configs, scripts, strict=True) for x in ("--pair", str(c), str(one))] if scripts
          else [x for c in configs for x in ("--config", str(c))]),
        "--", str(script), *args,
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, env=full_env, cwd=script.parent, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
    )
    (out / "output.txt").write_text(proc.stdout + proc.stderr, encoding="utf-8")
    if proc.returncode != 0:
        raise RuntimeError(f"dist probe failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}")
    return [json.loads((out / f"rank{r}.json").read_text())["runs"] for r in range(nproc)]


def _fresh_store(dist) -> None:
    """Point the next run's process group at a new store on a new port.

    A group started again on torchrun's own store finds the keys the previous group left under the same prefix and
    can hang in its first collective; rank 0 picks a free port and hosts a fresh store there instead.
    """
    port = [_free_port() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(port, src=0)
    os.environ["MASTER_PORT"] = str(port[0])
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_once(script: str, script_args: list[str], steps: int, config: str, last: bool) -> dict:
    import torch
    import torch.distributed as dist

    import autotune.runtime as runtime

    os.environ["AUTOTUNE_CONFIG"] = config
    runtime.reset()
    params: list = []
    record: dict = {"config": Path(config).name, "losses": [], "grads": [], "ended": "script_exit"}
    original_init = torch.optim.Optimizer.__init__
    original_backward = torch.Tensor.backward

    def init(self, *a, **k):
        original_init(self, *a, **k)
        params.extend(p for group in self.param_groups for p in group["params"])

    def backward(self, *a, **k):
        if len(record["losses"]) >= steps:
            raise _Stop()
        record["losses"].append(float.hex(self.detach().float().sum().item()))
        result = original_backward(self, *a, **k)
        grads = [p.grad.detach() for p in params if p.grad is not None]
        grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]  # FSDP2: this rank's shard
        record["grads"].append([v for g in grads for v in g.float().flatten().tolist()])
        return result

    torch.optim.Optimizer.__init__ = init
    torch.Tensor.backward = backward
    sys.argv = [script, *script_args]
    try:
        runpy.run_path(script, run_name="__main__")
    except _Stop:
        record["ended"] = "steps"
    finally:
        torch.optim.Optimizer.__init__ = original_init
        torch.Tensor.backward = original_backward
    if dist.is_initialized():
        if not last:
            _fresh_store(dist)
        dist.barrier()
        dist.destroy_process_group()
    record["env"] = {k: os.environ.get(k) for k in ENV_RECORDED}
    for k in ENV_RECORDED:  # the next config starts from the launcher's environment
        os.environ.pop(k, None)
    return record


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--")
    parser = argparse.ArgumentParser(prog="dist_probe.py")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--config", action="append", default=[])
    parser.add_argument("--pair", nargs=2, action="append", default=[], metavar=("CONFIG", "SCRIPT"),
                        help="a config and the script it runs (instead of the one after --)")
    parser.add_argument("--watchdog", type=float, default=180, help="seconds before a hung rank prints its stack and exits")
    opts = parser.parse_args(argv[:cut])
    script, script_args = argv[cut + 1], argv[cut + 2 :]
    plan = [(config, script) for config in opts.config] + [tuple(run) for run in opts.pair]
    if not plan:
        parser.error("give --config or --pair")
    inherited = {k: os.environ[k] for k in ENV_RECORDED if k in os.environ}
    runs = []
    for i, (config, one) in enumerate(plan):
        # a hang fails the test with a stack, not a timeout (the clock starts again for each run)
        faulthandler.dump_traceback_later(opts.watchdog, exit=True)
        folder = str(Path(one).resolve().parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)
        os.environ.update(inherited)
        runs.append(_run_once(one, script_args, opts.steps, config, last=i == len(plan) - 1))
    rank = int(os.environ.get("RANK", 0))
    Path(opts.out).mkdir(parents=True, exist_ok=True)
    Path(opts.out, f"rank{rank}.json").write_text(json.dumps({"runs": runs}), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
