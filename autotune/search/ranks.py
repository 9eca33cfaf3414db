"""A launcher's ranks (torchrun, mpirun): their result files merged into one trial's, and the ``--launcher`` command
checked."""

from __future__ import annotations

import json
import math
import shlex
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from autotune.errors import UsageError

RANK_RESULTS = "result.rank*.json"


def _mean_rows(per_rank: Sequence[Sequence[Sequence[float]]]) -> list[list[float]]:
    """Per step, each loss averaged over the ranks that recorded that step (in rank order, so the same inputs give
    the same bits)."""
    out = []
    for i in range(max((len(rows) for rows in per_rank), default=0)):
        at = [rows[i] for rows in per_rank if i < len(rows)]
        at = [row for row in at if len(row) == len(at[0])]
        out.append([sum(column) / len(column) for column in zip(*at)])
    return out


def merge_ranks(results: Sequence[Mapping[str, Any]], started: Mapping[int, int] | None = None) -> dict[str, Any] | None:
    """One trial result from the result files of a launcher's ranks (None when there are none and no rank started).

    Timing comes from rank 0; the losses are each step's mean over the ranks (every rank's own are kept under
    ``rank_losses``); peak memory is the largest rank's; samples per step add up over the ranks (data parallel).
    The trial fails when any rank failed, or left no result: as the rank that failed first (by the wall-clock time
    each rank wrote its result: the others then failed because it was gone). ``started``: rank -> world size of
    the ranks that started, which tells the world size when no rank lived to write a result (torchrun stops the
    others with SIGTERM when one is killed, and may do so before they notice).
    """
    started = dict(started or {})
    if not results and not started:
        return None
    by_rank = {int(r.get("rank") or 0): r for r in results}
    ranks = [by_rank[k] for k in sorted(by_rank)]
    sizes = [int(r.get("world_size") or 1) for r in ranks] + list(started.values()) + [k + 1 for k in started]
    world = max(*sizes, len(ranks))
    missing = [k for k in range(world) if k not in by_rank]
    out = dict(by_rank.get(0, ranks[0])) if ranks else {}  # no rank wrote one: every rank is missing, below
    out["rank_losses"] = [by_rank.get(k, {}).get("losses") or [] for k in range(world)]  # [] for a rank without one
    out["losses"] = _mean_rows(out["rank_losses"])
    out["ranks"] = world
    out["steps_done"] = min((int(r.get("steps_done") or 0) for r in ranks), default=0)
    out["peak_memory"] = max((r["peak_memory"] for r in ranks if r.get("peak_memory") is not None), default=None)
    if ranks and all(r.get("applied") is not None for r in ranks):  # a knob reached the program when it did on any rank
        out["applied"] = list(dict.fromkeys(k for r in ranks for k in r["applied"]))
    batches = [r.get("batch_size") for r in ranks]
    out["batch_size"] = sum(batches) if not missing and None not in batches else None
    failed = sorted((r for r in ranks if r.get("status") != "ok"), key=lambda r: r.get("ended") or math.inf)
    errors = []
    if failed:
        first = failed[0]
        out.update(status=first.get("status"), error_type=first.get("error_type"), error_types=first.get("error_types"))
        if first.get("error"):
            errors.append(f"rank {first.get('rank', 0)}: {first['error']}")
    elif missing:
        out.update(status="error", error_type=None, error_types=[])
    if missing:
        ids = ", ".join(map(str, missing))
        errors.append(f"no result from rank {ids} (killed by a signal, or stopped by the launcher)")
    out["error"] = "; ".join(errors) or None
    return out


def rank_results(tdir: Path) -> list[dict[str, Any]]:
    out = []
    for path in tdir.glob(RANK_RESULTS):
        try:
            out.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError):  # written by os.replace, so never half a file; gone with the trial folder
            pass
    return out


def started_ranks(tdir: Path) -> dict[int, int]:
    """rank -> world size of the ranks that started, from the files the runtime writes into the trial's pids folder."""
    out = {}
    for f in (tdir / "pids").glob("*"):
        try:
            rank, world = (int(v) for v in f.read_text(encoding="utf-8").split())
        except (OSError, ValueError):  # being written, or not ours
            continue
        out[rank] = world
    return out


def launcher_logs(tdir: Path, launcher: Sequence[str], log_dir: str | None) -> list[Path]:
    """The folders torchrun made in the temporary folder for a trial's logs (``torchelastic_*``, one a launch, which
    torchrun leaves behind: 34 after the launcher tests), from the error file each rank was told of; none where its
    logs go to a folder of the user's (``--log-dir``, or ``log_dir``: the environment's PET_LOG_DIR)."""
    if log_dir or any(a.startswith(("--log-dir", "--log_dir")) for a in launcher):
        return []
    base = Path(tempfile.gettempdir())
    found = set()
    for f in (tdir / "pids").glob("logs.*"):
        try:
            path = Path(f.read_text(encoding="utf-8"))
        except OSError:
            continue
        first = path.relative_to(base).parts[:1] if path.is_relative_to(base) else ()
        if first and first[0].startswith("torchelastic_"):
            found.add(base / first[0])
    return sorted(found)


def teardown_fatal(tdir: Path, world: int) -> str | None:
    """The fatal error (``Fatal Python error: Aborted``) a whole run met in the interpreter's teardown, where every
    one of its ``world`` ranks ran its script to the end without an uncaught exception (the ``result*.exit`` files
    the runtime writes at exit); else None: an exit that failed before that is the run's own failure."""
    marks = []
    for path in tdir.glob("result*.exit"):
        try:
            marks.append(path.read_text(encoding="utf-8", errors="replace"))
        except OSError:
            return None
    if len(marks) < world or not all(m.startswith("ended") for m in marks):
        return None
    return next((line for m in marks for line in m.splitlines() if line.startswith("Fatal Python error")), None)


def never() -> bool:
    """A whole run's report: it is done when its process ends, not when its window's result is written."""
    return False


def ranks_reported(tdir: Path) -> bool:
    """Whether a launcher's ranks have told how the trial ends: every rank finished its window, or one failed."""
    results = rank_results(tdir)
    if any(r.get("status") != "ok" for r in results):
        return True
    world = max((int(r.get("world_size") or 1) for r in results), default=1)
    return len({r.get("rank") for r in results}) >= world


def parse_launcher(text: str) -> tuple[str, ...]:
    """The ``--launcher`` command as arguments, checked: a UsageError when it is empty, unparseable or not found."""
    try:
        argv = tuple(shlex.split(text))
    except ValueError as exc:
        raise UsageError(f"--launcher {text!r}: cannot split it into arguments ({exc})") from None
    if not argv:
        raise UsageError('--launcher is empty: give the command that runs the script ("torchrun --nproc_per_node=2")')
    if shutil.which(argv[0]) is None:
        raise UsageError(f"--launcher {text!r}: {argv[0]!r} is not an executable file or a command found on PATH")
    return argv
