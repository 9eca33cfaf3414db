"""The machine a trial ran on: its host and device, so that timings are only ever compared on the same kind."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

HOST_ENV = "AUTOTUNE_HOST"  # names this machine where host names are not unique (containers started alike)
GPU_QUERY_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Machine:
    """Where trials run: the host, and the device as a person would name it (CPU model and cores, or GPU)."""

    host: str
    device: str

    @property
    def key(self) -> str:
        return machine_key(self.host, self.device)


def machine_key(host: str, device: str) -> str:
    """The text that tells machines apart; results are compared only with results of the same key."""
    return f"{host or 'unknown host'} ({device or 'unknown device'})"


def host_name() -> str:
    return os.environ.get(HOST_ENV) or socket.gethostname()


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX): elsewhere bf16 autocast is emulated and slow."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine() == "arm64"  # Apple silicon (M2 and later have bf16); other systems: assume not
    flags = set(text.split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})  # ("bf16": the Arm feature name)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS, Windows
        return os.cpu_count() or 1


def gpu_name(env: Mapping[str, str | None] | None = None) -> str | None:
    """The name of the GPU trials see, asked in a child process: this one must not hold a CUDA context."""
    child = dict(os.environ)
    for k, v in (env or {}).items():
        if v is None:
            child.pop(k, None)
        else:
            child[k] = v
    code = "import torch; print(torch.cuda.get_device_name(0))"
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], env=child, capture_output=True, text=True, timeout=GPU_QUERY_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    name = out.stdout.strip().splitlines()
    return name[-1] if out.returncode == 0 and name else None


def this_machine(device: str, env: Mapping[str, str | None] | None = None) -> Machine:
    """This host and the device trials will run on."""
    if device == "cuda":
        return Machine(host_name(), gpu_name(env) or "cuda (GPU name unknown)")
    return Machine(host_name(), f"{cpu_name()}, {_cores()} cores")
