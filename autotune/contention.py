"""What else used the machine's processors while a trial timed its steps (Linux: /proc), so that a run slowed by
other work is told apart from a slow configuration.

Two readings, one at each edge of the measured window: the machine's processor time by kind (/proc/stat: busy,
stolen by the hypervisor, all), and the processor time of the trial's own processes (every process below the one the
search started, DataLoader workers and launcher ranks included, whichever session they are in). Between them: how
many processors' worth of other work ran (``others``), how many the trial itself used (``own``), and the share of the
machine's time the hypervisor gave to other guests (``steal``). Standard library only: it runs inside the user's
training process.
"""

from __future__ import annotations

import os
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import NamedTuple

# other work worth this many processors during a run's steps is worth saying (the search's rows, its warnings)
BUSY_OTHERS = 0.5
# the search's pid, in every trial's environment: the trial's own processes are those below its child
SEARCH_PID_ENV = "AUTOTUNE_SEARCH_PID"

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class Reading:
    at: float  # time.monotonic()
    busy: int  # the machine's non-idle processor ticks, steal excluded
    steal: int
    total: int  # every tick of every processor
    own: int  # the ticks of the trial's own processes (this session's, outside a search)


def _machine(text: str) -> tuple[int, int, int]:
    """(busy, steal, total) ticks from /proc/stat's first line."""
    fields = [int(x) for x in text.split("\n", 1)[0].split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    # guest time is counted in user time already (proc(5)): fields past steal add nothing
    return user + nice + system + irq + softirq, steal, user + nice + system + idle + iowait + irq + softirq + steal


def _stat_fields(text: str) -> list[str]:
    """/proc/PID/stat's fields after the command name (which may hold spaces and parentheses): field 3 first."""
    return text[text.rindex(")") + 2:].split()


class Process(NamedTuple):
    """One live process, from /proc/PID/stat."""

    parent: int
    state: str  # "R", "S", "Z" (a zombie: ended, not yet reaped), ...
    session: int
    ticks: int  # user and system time


def process_table(proc: str = "/proc") -> dict[int, Process]:
    """Every live process by pid (empty where there is no /proc to read)."""
    try:
        names = os.listdir(proc)
    except OSError:
        return {}
    table = {}
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(os.path.join(proc, name, "stat"), encoding="ascii", errors="replace") as f:
                rest = _stat_fields(f.read())
        except (OSError, ValueError):
            continue  # ended meanwhile
        if len(rest) > 12:
            table[int(name)] = Process(int(rest[1]), rest[0], int(rest[3]), int(rest[11]) + int(rest[12]))
    return table


def descendants(table: Mapping[int, Process], root: int, skip: Collection[int] = ()) -> list[int]:
    """The processes below ``root`` in ``table``, whichever session they are in, leaving out the subtrees of
    ``skip``."""
    children: dict[int, list[int]] = {}
    for pid, row in table.items():
        children.setdefault(row.parent, []).append(pid)
    found, todo = [], [p for p in children.get(root, ()) if p not in skip]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


def _own_ticks(proc: str, root: int | None = None) -> int:
    """The ticks of the trial's own processes: ``root`` and every process below it, in whichever session (a launcher
    starts each rank in a session of its own, as torchrun does, and a sibling rank is the trial's work, not other
    work). Inside a trial the root is the process the search started (``_trial_root``); outside a search (or where
    that is not found), every process of this session; the search, reading its trial from outside, gives its own pid."""
    table = process_table(proc)
    root = root if root is not None else _trial_root(table)
    if root is None:
        session = os.getsid(0)
        return sum(row.ticks for row in table.values() if row.session == session)
    return (table[root].ticks if root in table else 0) + sum(table[p].ticks for p in descendants(table, root))


def _trial_root(table: Mapping[int, Process]) -> int | None:
    """The process the search started (found from this process up to the child of ``SEARCH_PID_ENV``'s pid), or
    None outside a search."""
    search = os.environ.get(SEARCH_PID_ENV, "")
    pid, seen = os.getpid(), set()
    while search.isdigit() and pid in table and pid not in seen:
        seen.add(pid)
        if table[pid].parent == int(search):
            return pid
        pid = table[pid].parent
    return None


def read(proc: str = "/proc", root: int | None = None) -> Reading | None:
    """The machine's and the trial's processor time now (``root``: the processor time of that process and every
    process below it as the own); None where there is no /proc to read."""
    try:
        with open(os.path.join(proc, "stat"), encoding="ascii") as f:
            busy, steal, total = _machine(f.read())
        own = _own_ticks(proc, root)
    except (OSError, ValueError, IndexError):
        return None
    return Reading(time.monotonic(), busy, steal, total, own)


def between(a: Reading | None, b: Reading | None) -> dict[str, float] | None:
    """What ran from ``a`` to ``b``, in processors' worth: ``own`` (the trial's), ``others`` (everything else), and
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
