"""Trials: the patched script run as a subprocess under one knob configuration, and what came of it."""

from __future__ import annotations

import contextlib
import functools
import getpass
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from enum import Enum
from pathlib import Path
from typing import Any

import yaml

from autotune.contention import SEARCH_PID_ENV, descendants, process_table
from autotune.knobs import Knob
from autotune.patch import CONFIG_NAME, PatchResult, knob_table
from autotune.isolate import OVERLAY, Isolation, IsolationError, sweep
from autotune.runtime import CONFIG_ENV, TRIAL_ENV
from autotune.trial_files import shared_caches
from autotune.search.machine import machine_key
from autotune.search.ranks import (
    launcher_logs, merge_ranks, never, rank_results, ranks_reported, started_ranks, teardown_fatal,
)

STDERR_TAIL_CHARS = 2000
LAUNCHER_TAIL_CHARS = 8000  # a launcher's own failure summary alone fills a few thousand characters
POLL_S = 0.1
EXIT_GRACE_S = 10.0  # how long a trial may take to exit after writing its result
LAUNCHER_STOP_S = 10.0  # how long a launcher may take to stop its ranks when asked to (SIGTERM) before SIGKILL


class Outcome(str, Enum):
    """How a trial ended."""

    OK = "ok"
    OOM = "oom"  # out of memory, by exception type
    NAN = "nan"  # a non-finite loss
    COMPILE_ERROR = "compile_error"  # torch.compile (dynamo / inductor) failed
    TIMEOUT = "timeout"  # killed after the trial timeout
    CRASH = "crash"  # any other failure: the stderr tail says what
    SHORT = "short"  # the script ended before the warm-up and measured steps were done
    DIVERGED = "diverged"  # finished, but its losses are outside the gate's tolerance
    # finished, but its losses cannot be compared with the baseline's (the script's loss is not visible to autotune),
    # and it changes numerics: it may be right, it may not; never ranked
    UNVERIFIED = "unverified"
    UNREACHED = "unreached"  # finished, but a knob it changes never took effect: it measured another program
    INTERRUPTED = "interrupted"  # the search was stopped during this trial: not a measurement
    # finished, but other work on the machine took processors from its measured steps well beyond what the other runs
    # saw (autotune.contention): its time says more about the machine than the configuration; measured again
    DISTURBED = "disturbed"

    def __str__(self) -> str:
        return self.value


def quantile(xs: Iterable[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (0: the least, 0.5: the median), interpolated between neighbours."""
    s = sorted(xs)
    at = q * (len(s) - 1)
    lo = int(at)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (at - lo)


@dataclass(frozen=True)
class TrialResult:
    """One run of the patched script under one configuration: its outcome, timings and losses."""

    config: Mapping[str, Any]
    role: str  # "baseline", "perturbed", "search" or "confirm"
    status: Outcome
    device: str = "cpu"
    error: str | None = None
    stderr_tail: str = ""
    step_times: tuple[float, ...] = ()
    losses: tuple[tuple[float, ...], ...] = ()  # per step; under a launcher, the mean over the ranks
    steps_done: int = 0
    batch_size: int | None = None
    peak_memory: int | None = None  # under a launcher, the largest of the ranks'
    peak_memory_kind: str | None = None
    warmup_s: float | None = None
    first_step_s: float | None = None
    window_s: float | None = None
    wall_s: float = 0.0
    pid: int | None = None
    number: int | None = None  # the Optuna trial number
    deviation: float | None = None  # largest relative loss deviation from the reference baseline
    tolerance: float | None = None  # the gate's tolerance at the step of that deviation
    attrs: Mapping[str, Any] = field(default_factory=dict)  # the role's bookkeeping (confirmation pair, arm)
    ranks: int = 1  # processes in the trial: the launcher's world size
    rank_losses: tuple[tuple[tuple[float, ...], ...], ...] = ()  # under a launcher, each rank's own losses
    # speed over the median of the same machine's last 3 baseline runs when it finished: what the live display shows
    # (the descent and the report compare it with the baseline runs around it: Search.settled)
    speedup: float | None = None
    host: str = ""  # the machine it ran on: timings are compared only between runs of the same machine key
    device_name: str = ""  # CPU model and cores, or GPU name
    # the knobs whose code ran with a non-default value (runtime.took_effect); None where the run did not say
    applied: tuple[str, ...] | None = None
    load: float | None = None  # the machine's 1-minute load average when the run ended (this run's own work included)
    # the optimizer steps of the user's whole run as the run read them (the framework's count, the loops' lengths),
    # and where from; None with the reason where it could not be read
    run_steps: int | None = None
    run_steps_from: str | None = None
    # a run given a carried compile cache to load (Runner.run's load_cache): whether torch took it
    compile_cache_loaded: bool | None = None
    # what else ran on the machine during the measured window, in processors' worth (autotune.contention): own,
    # others, steal (a share), cores; None where it could not be read
    contention: Mapping[str, float] | None = None
    # a whole run that ended its script, then died in the interpreter's teardown: what killed it (its time counts)
    exit_note: str | None = None

    @property
    def machine(self) -> str:
        """The key of the machine it ran on (host and device)."""
        return machine_key(self.host, self.device_name)

    @property
    def measured(self) -> bool:
        """Whether the run finished its window, so its time and losses mean something."""
        return self.status in (Outcome.OK, Outcome.DIVERGED, Outcome.UNVERIFIED) and bool(self.step_times)

    @property
    def others(self) -> float | None:
        """Processors' worth of other work on the machine during the measured steps (None: not read)."""
        return self.contention.get("others") if self.contention else None

    @property
    def step_time(self) -> float | None:
        """Seconds per step: the mean over the measured window (its time over its steps; on CUDA the synchronised
        window's), what a run pays. Not the median: a cost that comes every few steps is the run's too, and the
        median drops it (a DataLoader worker started again each 8-step epoch took 60-70 ms of every eighth step: the
        median of the CNN's steps said 1.40x faster where the mean, and the script's whole run, said 0.8x)."""
        if not self.step_times:
            return None
        if self.device == "cuda" and self.window_s:
            return self.window_s / len(self.step_times)
        return statistics.fmean(self.step_times)

    @property
    def throughput(self) -> float | None:
        """Training steps per second."""
        t = self.step_time
        return 1.0 / t if t else None

    @property
    def samples_per_s(self) -> float | None:
        t = self.throughput
        return t * self.batch_size if t and self.batch_size else None

    @property
    def finite(self) -> bool:
        return all(math.isfinite(v) for row in self.losses for v in row)

    def to_attrs(self) -> dict[str, Any]:
        """A JSON-ready dict (the Optuna trial's user attributes keep it, so nothing measured is lost)."""
        d = asdict(self)
        d["status"] = self.status.value
        d["config"] = dict(self.config)
        d["attrs"] = dict(self.attrs)
        return d

    @classmethod
    def from_attrs(cls, d: Mapping[str, Any]) -> TrialResult:
        """The result ``to_attrs`` stored; a TypeError or ValueError where ``d`` does not have its shape."""
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        if not isinstance(kw.get("config"), Mapping) or not isinstance(kw.get("attrs", {}), Mapping):
            raise TypeError("its configuration is not a mapping")
        kw["status"] = Outcome(kw["status"])
        kw["step_times"] = tuple(float(t) for t in kw.get("step_times") or ())
        kw["losses"] = tuple(tuple(float(v) for v in row) for row in kw.get("losses") or ())
        kw["rank_losses"] = tuple(tuple(tuple(float(v) for v in row) for row in rows) for rows in kw.get("rank_losses") or ())
        if kw.get("applied") is not None:
            kw["applied"] = tuple(str(a) for a in kw["applied"])
        return cls(**kw)

    def with_(self, **changes: Any) -> TrialResult:
        return replace(self, **changes)


def unreached(result: TrialResult, changed_knobs: Iterable[Knob | str]) -> list[str]:
    """The knobs of ``changed_knobs`` (those set away from their default) whose code never ran in a trial that
    measured something: the trial timed the original program, so its ranking would credit them with nothing.

    Empty where the run did not record what took effect (a runtime older than the record).
    """
    if result.applied is None or not result.measured:
        return []
    names = [k if isinstance(k, str) else k.name for k in changed_knobs]
    return [n for n in names if n not in result.applied]


# --- failure types -----------------------------------------------------------------------------------------

OOM_TYPES = ("OutOfMemoryError", "MemoryError")
OOM_MESSAGES = ("CUDA out of memory", "DefaultCPUAllocator: not enough memory", "DefaultCPUAllocator: can't allocate")
COMPILE_MODULES = ("torch._dynamo", "torch._inductor")
COMPILE_TYPES = ("BackendCompilerFailed", "InductorError")


def classify(
    returncode: int | None, timed_out: bool, result: Mapping[str, Any] | None, stderr_tail: str, wanted_steps: int
) -> tuple[Outcome, str | None]:
    """The outcome of a finished subprocess from its exit status, its result file and its stderr."""
    if timed_out:
        return Outcome.TIMEOUT, None
    result = result or {}
    losses = result.get("losses") or []
    nonfinite = next((i for i, row in enumerate(losses) if not all(math.isfinite(v) for v in row)), None)
    error = result.get("error")
    types = result.get("error_types") or ([result["error_type"]] if result.get("error_type") else [])
    short_names = {t.rsplit(".", 1)[-1] for t in types}
    if result.get("status") == "error" or (returncode not in (0, None) and types):
        if short_names & set(OOM_TYPES) or any(m in (error or "") for m in OOM_MESSAGES):
            return Outcome.OOM, error
        if short_names & set(COMPILE_TYPES) or any(t.startswith(COMPILE_MODULES) for t in types):
            return Outcome.COMPILE_ERROR, error
    if nonfinite is not None:
        return Outcome.NAN, f"non-finite loss at step {nonfinite + 1}" + (f", then {error}" if error else "")
    if result.get("status") == "ok" and returncode == 0:
        return Outcome.OK, None
    if result.get("status") == "short" and returncode == 0:
        done = result.get("steps_done", 0)
        return Outcome.SHORT, (
            f"the script ended after {done} training steps; the trial needs {wanted_steps} "
            "(pass more iterations to the script after --, or lower --warmup/--steps)"
        )
    if returncode is not None and returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return Outcome.CRASH, f"killed by {name}" + (" (out of memory?)" if name == "SIGKILL" else "")
    if error:
        return Outcome.CRASH, error
    # (the last line that says something: a launcher ends its failure summary with a rule of '=')
    last = next((line for line in reversed(stderr_tail.strip().splitlines()) if any(c.isalnum() for c in line)), "")
    if result.get("status") == "ok":  # the window finished, but the script's exit failed
        return Outcome.CRASH, f"exit status {returncode} after the measured steps" + (f": {last}" if last else "")
    return Outcome.CRASH, f"exit status {returncode}" + (f": {last}" if last else "")


# --- the runner --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrialSettings:
    """What every trial of one search shares."""

    args: tuple[str, ...]  # the script's own arguments
    cwd: Path  # the user's working directory
    device: str
    warmup: int
    steps: int
    env: Mapping[str, str | None] = field(default_factory=dict)  # layered over os.environ; None removes
    launcher: tuple[str, ...] = ()  # runs ``launcher + [script] + args`` in place of ``python script args``
    # OVERLAY: each trial sees ``cwd`` and ``folders`` as overlays in a private mount namespace (autotune.isolate);
    # PYTHON: only the runtime's guard of Python's own writes (a mirror of links and an audit hook)
    isolation: str = OVERLAY
    folders: tuple[Path, ...] = ()  # the user's folders protected besides ``cwd`` (the script's project)


def protected(settings: TrialSettings) -> tuple[Path, ...]:
    """The folders whose files a trial must leave as they were."""
    return (settings.cwd, *settings.folders)


def compile_cache_default() -> Path:
    """torch.compile's cache where no variable names one, and where its precompiled headers go whatever names one
    (torch._inductor.runtime.cache_dir_utils.default_cache_dir): ``torchinductor_USER`` in the temporary folder."""
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    return Path(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def _kept(own: Path) -> list[Path]:
    """What stays the real thing inside the overlays: the search's own folder (where a trial's result is written)
    and the caches libraries share between runs, written and locked by every run (``SHARED_CACHES``), torch.compile's
    default one among them: where the temporary folder is inside a folder a trial sees as an overlay (a search run
    from /tmp), every compiling run would otherwise compile cold and rebuild torch's precompiled headers. An overlay
    keeps only a folder that exists: that one is made, as the first compiling run would."""
    compiled = compile_cache_default()
    with contextlib.suppress(OSError):
        compiled.mkdir(parents=True, exist_ok=True)
    return [own, *map(Path, shared_caches()), compiled]


def probe_isolation(folders: Iterable[Path]) -> float:
    """Seconds an overlay adds to a run's start (a run that does nothing, with and without it); IsolationError
    with the system's reason where this machine cannot isolate ``folders``."""
    iso = Isolation.make(folders)
    try:
        spec = iso.write(Path(iso.scratch) / "spec.json")
        bare = [sys.executable, "-I", "-c", "pass"]
        times = []
        for cmd in (bare, iso.command(spec, bare)):
            started = time.perf_counter()
            done = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
            times.append(time.perf_counter() - started)
            if done.returncode != 0:
                lines = done.stderr.strip().splitlines()
                raise IsolationError(0, lines[-1].removeprefix("autotune: ") if lines else f"exit {done.returncode}")
        return max(0.0, times[1] - times[0])
    except (OSError, subprocess.SubprocessError) as exc:
        raise IsolationError(0, str(exc)) from None
    finally:
        iso.remove()


def mirror(cwd: Path, root: Path, own: Path) -> Path:
    """A folder under ``root`` that mirrors ``cwd`` and each folder above it with links to their entries (but
    ``own``'s): a trial run there reads the user's files by the same relative paths, ``../`` included, and what
    it writes lands under ``root``; returns the mirror of ``cwd``."""
    cwd = cwd.resolve()
    for folder in (cwd, *cwd.parents):
        here = root / folder.relative_to(folder.anchor)
        here.mkdir(parents=True, exist_ok=True)
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for e in entries:
            path = Path(e.path)
            if path in (cwd, *cwd.parents) or own == path or path in own.parents:
                continue  # on the way down (mirrored itself), or the search's own folder (a loop)
            try:
                (here / e.name).symlink_to(path)
            except OSError:  # a name the file system refuses here: the trial does without it
                pass
    return root / cwd.relative_to(cwd.anchor)


def link_beside(original: Path, copy: Path, own: Path) -> None:
    """Link into ``copy`` (the patched project's files) each entry of ``original`` it lacks, and into each of its
    folders the entries of the original folder that it lacks; never ``__pycache__``, the search's own folder
    ``own``, nor a folder above it (a loop)."""
    try:
        entries = list(os.scandir(original))
    except OSError:
        return
    for e in entries:
        path = Path(e.path)
        if e.name == "__pycache__" or path == own or path in own.parents:
            continue
        target = copy / e.name
        if target.is_dir() and not target.is_symlink():
            if e.is_dir(follow_symlinks=False):
                link_beside(path, target, own)
            continue
        if target.exists() or target.is_symlink():
            continue  # a patched file
        try:
            target.symlink_to(path)
        except OSError:  # a name the file system refuses here: the trial does without it
            pass


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# Every process a trial starts is ended with it. A process group is not enough: a child that calls setsid()
# leaves it, and once its parent exits it is re-parented to init, out of sight. So the search makes itself a
# child subreaper (prctl, Linux 3.4+, no privileges needed): a trial's orphans are re-parented to the search
# instead, and after a trial every process below the search that was not there before is one the trial started,
# however it forked or whichever session it moved to. (A cgroup per trial would hold them too, but needs a
# delegated, writable cgroup v2 tree, which an unprivileged user seldom has; watching the tree while the trial
# runs misses a child that double-forks between two looks.)
PR_SET_CHILD_SUBREAPER, PR_GET_CHILD_SUBREAPER = 36, 37
REAP_S = 10.0  # how long killed processes get to be gone (a GPU process may take seconds to exit)


def _subreaper(on: bool | None = None) -> bool:
    """Whether this process is a child subreaper, after making it one (``on``) or not; False where it cannot be."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if on is not None and libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
            return False
        flag = ctypes.c_int(0)
        return libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) == 0 and bool(flag.value)
    except (OSError, AttributeError):
        return False


def _end_descendants(skip: set[int], trial_pid: int) -> None:
    """SIGKILL every process below this one but ``skip`` (the children it had before the trial), reaping each that
    became its child, until none is left; ``trial_pid`` is left for its Popen to reap."""
    me = os.getpid()
    deadline = time.monotonic() + REAP_S
    while True:
        table = process_table()
        left = [p for p in descendants(table, me, skip) if not (p == trial_pid and table[p].state == "Z")]
        if not left or time.monotonic() > deadline:
            return
        for pid in left:
            if table[pid].state != "Z":
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            if table[pid].parent == me and pid != trial_pid:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
        time.sleep(0.01)


def _tail(path: Path, chars: int = STDERR_TAIL_CHARS) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - chars))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


MP_PREFIX = "atmp-"  # short: a listening socket's path in the folder has at most 107 bytes (AF_UNIX)
SOCKET_NAME = len("/listener-12345678")  # multiprocessing's name for one (connection.arbitrary_address)


def _mp_tempdir() -> str | None:
    """A new folder for a trial's multiprocessing temporary files (autotune.trial_files.share_mp_tempdir), removed
    after the trial: the sockets of the DataLoader workers the search kills as a trial ends, which left about four
    ``pymp-*`` folders in the temporary folder a run (190 a 300 s makemore search). Its name carries the search's
    pid, so that those a killed search left are swept by the next. None where the temporary folder's path is so long
    that a socket's path in it would not fit where multiprocessing's own would: the trial makes its own then."""
    base = tempfile.gettempdir()
    if len(os.path.join(base, f"{MP_PREFIX}{os.getpid()}-12345678")) + SOCKET_NAME > 107:
        return None
    sweep(base, MP_PREFIX)
    return tempfile.mkdtemp(prefix=f"{MP_PREFIX}{os.getpid()}-", dir=base)


class Runner:
    """Writes the patched files once into ``work`` and runs each trial as its own process group there."""

    def __init__(self, patch: PatchResult, work: Path, settings: TrialSettings) -> None:
        self.settings = settings
        self.work = work
        self.script_dir = work / "script"
        if self.script_dir.exists():
            shutil.rmtree(self.script_dir)
        for f in patch.files:
            dest = self.script_dir / f.rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(f.new_text, encoding="utf-8")
        self.entry = self.script_dir / patch.files[0].rel
        if settings.isolation == OVERLAY:
            # what the script reads beside itself (``os.path.dirname(__file__)``: a data folder next to a module) is
            # found beside the copy, as links to the project's own entries; the project's folder is an overlay in
            # every run, so what a run writes through them lands in its scratch layer
            for root in settings.folders[:1]:
                link_beside(root.resolve(), self.script_dir, work.resolve())
        # the knob table beside the patched entry: the runtime checks every configured knob against it
        table = {"script": patch.project.entry.display, "knobs": knob_table(patch.knobs)}
        (self.entry.parent / CONFIG_NAME).write_text(yaml.safe_dump(table, sort_keys=False), encoding="utf-8")
        # an entry below the project's root (scripts/train.py importing mypkg/) imports from the root, as
        # `python -m scripts.train` run there would
        self.pythonpath = str(self.script_dir) if self.entry.parent != self.script_dir else None
        self.knob_names = {k.name for k in patch.knobs}
        self._count = 0
        self._was_subreaper = _subreaper()
        self.subreaper = self._was_subreaper or _subreaper(True)

    def run(
        self,
        config: Mapping[str, Any],
        role: str,
        timeout: float,
        on_start: Callable[[int], None] | None = None,
        attrs: Mapping[str, Any] | None = None,
        whole: bool = False,
        compile_cache: Path | None = None,
        fresh_caches: bool = False,
        load_cache: Path | None = None,
        watch: Callable[[], None] | None = None,
    ) -> TrialResult:
        """Run one trial; a failure is a typed result, never an exception (KeyboardInterrupt still propagates).
        ``whole``: the script runs on past the measured window to its own end, and ``wall_s`` is its whole run.
        ``compile_cache``: where the run leaves what torch.compile compiled, as it exits (the folder must be one the
        trial writes for real: the search's own).
        ``fresh_caches``: the run gets new, empty compiler caches (a first run on a fresh machine); ``load_cache``:
        it first loads this file of compiled artifacts, as a tuned script carrying it does. ``watch``: called at
        every poll while the run goes (the search's look at the machine during its first run)."""
        self._count += 1
        tdir = self.work / "trials" / f"{self._count:04d}"
        if tdir.exists():
            shutil.rmtree(tdir)
        tdir.mkdir(parents=True)
        iso: Isolation | None = None
        mp_tempdir = _mp_tempdir()
        try:
            cmd, cwd, env = self._setup(tdir, config, attrs, {
                "whole": whole, "compile_cache": compile_cache and str(compile_cache),
                "load_compile_cache": load_cache and str(load_cache), "mp_tempdir": mp_tempdir})
            if fresh_caches:  # in the trial's own folder: gone with it
                env.update(TORCHINDUCTOR_CACHE_DIR=str(tdir / "compiler" / "inductor"),
                           TRITON_CACHE_DIR=str(tdir / "compiler" / "triton"))
            if self.settings.isolation == OVERLAY:
                iso = Isolation.make(protected(self.settings), _kept(self.work.resolve()))
                cmd = iso.command(iso.write(tdir / "isolate.json"), cmd)
            started = time.perf_counter()
            pid, rc, timed_out, hung_at_exit = self._execute(tdir, cmd, cwd, env, timeout, on_start, whole, watch)
            wall = time.perf_counter() - started
            return self._result(tdir, config, role, attrs, (rc, timed_out, hung_at_exit), timeout, wall, pid, whole)
        finally:
            if iso is not None:
                iso.remove()  # what the trial wrote into your folders goes with it
            if self.settings.launcher:
                log_dir = self.settings.env.get("PET_LOG_DIR", os.environ.get("PET_LOG_DIR"))
                for folder in launcher_logs(tdir, self.settings.launcher, log_dir):
                    shutil.rmtree(folder, ignore_errors=True)
            shutil.rmtree(tdir, ignore_errors=True)
            if mp_tempdir is not None:  # every process of the trial has ended (_execute)
                shutil.rmtree(mp_tempdir, ignore_errors=True)

    def _setup(
        self, tdir: Path, config: Mapping[str, Any], attrs: Mapping[str, Any] | None, more: Mapping[str, Any] | None = None
    ) -> tuple[list[str], Path, dict[str, str]]:
        """Write the trial's config and spec into ``tdir``; its command, working directory and environment."""
        s = self.settings
        knobs = {k: v for k, v in config.items() if k in self.knob_names}
        (tdir / "config.yaml").write_text(yaml.safe_dump({"device": s.device, "knobs": knobs}), encoding="utf-8")
        result_path = tdir / "result.json"
        # the search's own pid: under a launcher the trial's ranks are not its children, yet end when it dies
        spec = {"warmup": s.warmup, "steps": s.steps, "result": str(result_path), "search_pid": os.getpid(), **(more or {})}
        # the trial's working directory is a mirror of the user's: a checkpoint it saves lands here, not on theirs
        own = self.work.resolve()
        cwd = mirror(s.cwd, tdir / "cwd", own)
        spec.update(mirror=str(tdir / "cwd"), cwd=str(s.cwd.resolve()), own=str(own), isolated=s.isolation == OVERLAY)
        if s.launcher:
            spec.update(per_rank=True, pids=str(tdir / "pids"))
        (tdir / "spec.json").write_text(json.dumps(spec), encoding="utf-8")
        env = dict(os.environ)
        for key, value in s.env.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        if attrs and attrs.get("threads"):  # a perturbed baseline: the same program on another number of threads
            env["OMP_NUM_THREADS"] = str(int(attrs["threads"]))
        if self.pythonpath is not None:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (self.pythonpath, env.get("PYTHONPATH")) if p)
        env[CONFIG_ENV] = str(tdir / "config.yaml")
        env[TRIAL_ENV] = str(tdir / "spec.json")
        env[SEARCH_PID_ENV] = str(os.getpid())  # the trial's own processes are those below its process (contention)
        cmd = [*(s.launcher or [sys.executable]), str(self.entry), *s.args]
        return cmd, cwd, env

    def _execute(
        self, tdir: Path, cmd: list[str], cwd: Path, env: dict[str, str], timeout: float,
        on_start: Callable[[int], None] | None, whole: bool = False, watch: Callable[[], None] | None = None,
    ) -> tuple[int, int | None, bool, bool]:
        """Run the trial's process until it reports (a whole run: until it ends), ends or times out, and stop
        everything it started: (its pid, exit status, timed out, stopped after its result was written)."""
        s = self.settings
        result_path = tdir / "result.json"
        reported = functools.partial(ranks_reported, tdir) if s.launcher else result_path.exists
        if whole:
            reported = never
        # output goes to files, not pipes: a pipe stays open as long as any orphaned DataLoader worker holds it
        others = {p for p, row in process_table().items() if row.parent == os.getpid()}
        with open(tdir / "stdout.log", "wb") as out, open(tdir / "stderr.log", "wb") as err:
            try:
                proc = subprocess.Popen(
                    cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True
                )
            except OSError as exc:  # an interpreter or launcher that cannot be executed: a crash that says why
                err.write(f"autotune: cannot run {cmd[0]}: {exc.strerror or exc}\n".encode(errors="replace"))
                return -1, 127, False, False
            try:
                if on_start is not None:
                    on_start(proc.pid)
                stop = functools.partial(self._stop, proc, tdir, others)
                rc, timed_out, hung_at_exit = self._wait(proc, reported, timeout, stop, watch)
            finally:
                # whatever happened (an interrupt included), nothing the trial started outlives it
                self._stop(proc, tdir, others)
        return proc.pid, rc, timed_out, hung_at_exit

    def _result(
        self, tdir: Path, config: Mapping[str, Any], role: str, attrs: Mapping[str, Any] | None,
        ended_how: tuple[int | None, bool, bool], timeout: float, wall: float, pid: int, whole: bool = False,
    ) -> TrialResult:
        """What the trial's files and its exit say, as a typed result."""
        s = self.settings
        rc, timed_out, hung_at_exit = ended_how
        result_path = tdir / "result.json"
        if s.launcher:
            result = merge_ranks(rank_results(tdir), started_ranks(tdir))
        else:
            try:
                result = json.loads(result_path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                result = None
        tail = _tail(tdir / "stderr.log", LAUNCHER_TAIL_CHARS if s.launcher else STDERR_TAIL_CHARS)
        ended = result.get("status") if result is not None else None
        if hung_at_exit and ended == "ok":
            rc = 0  # the measured window completed; only the exit hung, and the group is gone now
        elif hung_at_exit and s.launcher:
            # a rank failed or ended early, and the others waited for it until they were stopped: what that rank
            # wrote is the outcome, not the signal that stopped the launcher
            rc = 0 if ended == "short" else None
        exit_note = None
        if whole and ended == "ok" and not timed_out and rc not in (0, None):
            fatal = teardown_fatal(tdir, int((result or {}).get("ranks") or 1))
            if fatal is not None:  # the script's work is done: torch's gloo teardown aborted it (runtime.mark_exit)
                exit_note = f"exit status {rc} in the interpreter's teardown, after the script ended ({fatal})"
                rc = 0
        status, error = classify(rc, timed_out, result, tail, s.warmup + s.steps)
        if timed_out:
            error = f"still running after {timeout:.0f}s (--timeout): killed with everything it started"
        r = result or {}
        out = TrialResult(
            config=dict(config),
            role=role,
            status=status,
            device=s.device,
            error=error,
            stderr_tail=tail if status is not Outcome.OK else "",
            step_times=tuple(r.get("step_times") or ()) if r.get("status") == "ok" else (),
            losses=tuple(tuple(row) for row in r.get("losses") or ()),
            steps_done=int(r.get("steps_done") or 0),
            batch_size=r.get("batch_size"),
            peak_memory=r.get("peak_memory"),
            peak_memory_kind=r.get("peak_memory_kind"),
            warmup_s=r.get("warmup_s"),
            first_step_s=r.get("first_step_s"),
            window_s=r.get("window_s"),
            wall_s=wall,
            pid=pid,
            attrs=dict(attrs or {}),
            ranks=int(r.get("ranks") or 1),
            rank_losses=tuple(tuple(tuple(row) for row in rows) for rows in r.get("rank_losses") or ()),
            applied=tuple(r["applied"]) if r.get("applied") is not None else None,
            load=load_average(),
            run_steps=int(r["run_steps"]) if isinstance(r.get("run_steps"), int) else None,
            run_steps_from=str(r["run_steps_from"]) if r.get("run_steps_from") is not None else None,
            compile_cache_loaded=r.get("compile_cache_loaded"),
            contention=r.get("contention") if r.get("status") == "ok" else None,
            exit_note=exit_note,
        )
        return out

    @staticmethod
    def _wait(
        proc: subprocess.Popen, reported: Callable[[], bool], timeout: float, stop: Callable[[], None],
        watch: Callable[[], None] | None = None,
    ) -> tuple[int | None, bool, bool]:
        """Wait for the trial: (exit status, timed out, stopped after its result was written).

        Once the result is written (under a launcher: every rank's, or one rank's failure) the trial gets
        EXIT_GRACE_S to exit; a hang while exiting (DataLoader workers that do not stop, ranks waiting for a failed
        one in a collective) is then ended without counting as a timeout.
        """
        deadline = time.monotonic() + timeout
        in_grace = False
        while True:
            try:
                return proc.wait(timeout=POLL_S), False, False
            except subprocess.TimeoutExpired:
                pass
            if watch is not None:
                watch()
            now = time.monotonic()
            if not in_grace and deadline > now + EXIT_GRACE_S and reported():
                deadline, in_grace = now + EXIT_GRACE_S, True
            if now >= deadline:
                stop()
                return proc.wait(), not in_grace, in_grace

    def _stop(self, proc: subprocess.Popen, tdir: Path, others: set[int]) -> None:
        """End the trial and everything it started.

        A launcher is asked first (SIGTERM: torchrun then stops its ranks, which it starts in sessions of their
        own), then the trial's process group is killed, then each rank's own group, by the ids the ranks wrote
        (what a launcher that did not stop in time left behind), and then every process below the search but
        ``others`` (its children from before the trial): what left the groups, found as the subreaper's.
        """
        try:
            if self.settings.launcher and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(LAUNCHER_STOP_S)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            _kill_group(proc.pid)
            pids = tdir / "pids"
            for f in pids.iterdir() if pids.is_dir() else ():
                if f.name.isdigit():
                    _kill_group(int(f.name))
            _end_descendants(others, proc.pid)
            if proc.poll() is None:
                proc.wait()

    def resize(self, warmup: int, steps: int) -> None:
        """Run the next trials for ``warmup`` + ``steps`` steps (the lengths fitted to a time budget)."""
        self.settings = replace(self.settings, warmup=warmup, steps=steps)

    def cleanup(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)
        if self.subreaper and not self._was_subreaper:
            _subreaper(False)


def load_average() -> float | None:
    """The machine's 1-minute load average (None where the system does not say)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def stderr_summary(text: str, lines: int = 3) -> str:
    """The last few non-empty lines of a stderr tail, joined for one table cell."""
    kept = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " | ".join(kept[-lines:])


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None
