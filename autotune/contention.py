"""What else used the machine's processors while a trial timed its steps (Linux: /proc), so that a run slowed by
other work is told apart from a slow configuration.

Two readings, one at each edge of the measured window: the machine's processor time by kind (/proc/stat: busy,
stolen by the hypervisor, all), and the processor time of the trial's own processes (every process of its session,
DataLoader workers and launcher ranks included). Between them: how many processors' worth of other work ran
(``others``), how many the trial itself used (``own``), and the share of the machine's time the hypervisor gave to
other guests (``steal``). Standard library only: it runs inside the user's training process.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

# other work worth this many processors during a run's steps is worth saying (the search's rows, its warnings)
BUSY_OTHERS = 0.5

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class Reading:
    at: float  # time.monotonic()
    busy: int  # the machine's non-idle processor ticks, steal excluded
    steal: int
    total: int  # every tick of every processor
    own: int  # the ticks of the processes in this session


def _machine(text: str) -> tuple[int, int, int]:
    """(busy, steal, total) ticks from /proc/stat's first line."""
    fields = [int(x) for x in text.split("\n", 1)[0].split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    # guest time is counted in user time already (proc(5)): fields past steal add nothing
    return user + nice + system + irq + softirq, steal, user + nice + system + idle + iowait + irq + softirq + steal


def _stat_fields(text: str) -> list[str]:
    """/proc/PID/stat's fields after the command name (which may hold spaces and parentheses): field 3 first."""
    return text[text.rindex(")") + 2:].split()


def _session_ticks(session: int, proc: str = "/proc") -> int:
    """User and system ticks of every live process in ``session``."""
    ticks = 0
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        try:
            with open(os.path.join(proc, name, "stat"), encoding="ascii", errors="replace") as f:
                rest = _stat_fields(f.read())
        except (OSError, ValueError):
            continue  # ended meanwhile
        if len(rest) > 12 and int(rest[3]) == session:
            ticks += int(rest[11]) + int(rest[12])  # utime, stime
    return ticks


def read(proc: str = "/proc") -> Reading | None:
    """The machine's and this session's processor time now; None where there is no /proc to read."""
    try:
        with open(os.path.join(proc, "stat"), encoding="ascii") as f:
            busy, steal, total = _machine(f.read())
        own = _session_ticks(os.getsid(0), proc)
    except (OSError, ValueError, IndexError):
        return None
    return Reading(time.monotonic(), busy, steal, total, own)


def between(a: Reading | None, b: Reading | None) -> dict[str, float] | None:
    """What ran from ``a`` to ``b``, in processors' worth: ``own`` (this session), ``others`` (everything else), and
    ``steal`` (the hypervisor's share of all processor time); ``cores`` the processors counted. None where either
    reading is missing or the span is too short for the clock's ticks to say anything (under 0.2 s)."""
    if a is None or b is None:
        return None
    wall = b.at - a.at
    if wall < 0.2 or b.total <= a.total:
        return None
    cores = (b.total - a.total) / _TICK / wall  # processors' worth of ticks per second: the processors counted
    own = (b.own - a.own) / _TICK / wall
    others = max((b.busy - a.busy) / _TICK / wall - own, 0.0)  # (a process that ended meanwhile: counted as others)
    return {"own": round(own, 2), "others": round(others, 2), "steal": round((b.steal - a.steal) / (b.total - a.total), 3),
            "cores": round(cores, 1), "span_s": round(wall, 3)}
