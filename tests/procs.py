"""Checks that a test's processes are gone: by process id, and by what their command lines name."""

from __future__ import annotations

import os
import time
from pathlib import Path


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie nobody reaped yet is not running
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids, seconds=15.0) -> list[int]:
    """The processes of ``pids`` still running after up to ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


def naming(text: str) -> list[int]:
    """Running processes whose command line contains ``text`` (Linux /proc; none elsewhere)."""
    out = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline and int(entry.name) != os.getpid() and alive(int(entry.name)):
            out.append(int(entry.name))
    return out


def wait_none_naming(text: str, seconds=15.0) -> list[int]:
    """The processes whose command line contains ``text`` still running after up to ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and naming(text):
        time.sleep(0.2)
    return naming(text)
