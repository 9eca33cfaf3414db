"""Trials: the patched script run as a subprocess under one knob configuration, and what came of it."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from enum import Enum
from pathlib import Path
from typing import Any

import yaml

from autotune.patch import CONFIG_NAME, PatchResult, knob_table
from autotune.runtime import CONFIG_ENV, TRIAL_ENV
from autotune.search.machine import machine_key

STDERR_TAIL_CHARS = 2000
POLL_S = 0.1
EXIT_GRACE_S = 10.0  # how long a trial may take to exit after writing its result


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
    INTERRUPTED = "interrupted"  # the search was stopped during this trial: not a measurement

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class TrialResult:
    """One run of the patched script under one configuration: its outcome, timings and losses."""

    config: Mapping[str, Any]
    role: str  # "baseline", "search" or "confirm"
    status: Outcome
    device: str = "cpu"
    error: str | None = None
    stderr_tail: str = ""
    step_times: tuple[float, ...] = ()
    losses: tuple[tuple[float, ...], ...] = ()
    steps_done: int = 0
    batch_size: int | None = None
    peak_memory: int | None = None
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
    host: str = ""  # the machine it ran on: timings are compared only between runs of the same machine key
    device_name: str = ""  # CPU model and cores, or GPU name

    @property
    def machine(self) -> str:
        """The key of the machine it ran on (host and device)."""
        return machine_key(self.host, self.device_name)

    @property
    def measured(self) -> bool:
        """Whether the run finished its window, so its time and losses mean something."""
        return self.status in (Outcome.OK, Outcome.DIVERGED) and bool(self.step_times)

    @property
    def step_time(self) -> float | None:
        """Seconds per step: the median of per-step times on CPU; the synchronised window mean on CUDA."""
        if not self.step_times:
            return None
        if self.device == "cuda" and self.window_s:
            return self.window_s / len(self.step_times)
        return statistics.median(self.step_times)

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
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        kw["status"] = Outcome(kw["status"])
        kw["step_times"] = tuple(kw.get("step_times") or ())
        kw["losses"] = tuple(tuple(row) for row in kw.get("losses") or ())
        return cls(**kw)

    def with_(self, **changes: Any) -> TrialResult:
        return replace(self, **changes)


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
    last = next((line for line in reversed(stderr_tail.strip().splitlines()) if line.strip()), "")
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


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _tail(path: Path, chars: int = STDERR_TAIL_CHARS) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - chars))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


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
        # the knob table beside the patched entry: the runtime checks every configured knob against it
        table = {"script": patch.project.entry.display, "knobs": knob_table(patch.knobs)}
        (self.script_dir / CONFIG_NAME).write_text(yaml.safe_dump(table, sort_keys=False), encoding="utf-8")
        self.entry = self.script_dir / patch.files[0].rel
        self.knob_names = {k.name for k in patch.knobs}
        self._count = 0

    def run(
        self,
        config: Mapping[str, Any],
        role: str,
        timeout: float,
        on_start: Callable[[int], None] | None = None,
        attrs: Mapping[str, Any] | None = None,
    ) -> TrialResult:
        """Run one trial; a failure is a typed result, never an exception (KeyboardInterrupt still propagates)."""
        s = self.settings
        self._count += 1
        tdir = self.work / "trials" / f"{self._count:04d}"
        if tdir.exists():
            shutil.rmtree(tdir)
        tdir.mkdir(parents=True)
        knobs = {k: v for k, v in config.items() if k in self.knob_names}
        (tdir / "config.yaml").write_text(yaml.safe_dump({"device": s.device, "knobs": knobs}), encoding="utf-8")
        result_path = tdir / "result.json"
        spec = {"warmup": s.warmup, "steps": s.steps, "result": str(result_path), "parent_pid": os.getpid()}
        (tdir / "spec.json").write_text(json.dumps(spec), encoding="utf-8")
        env = dict(os.environ)
        for key, value in s.env.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        env[CONFIG_ENV] = str(tdir / "config.yaml")
        env[TRIAL_ENV] = str(tdir / "spec.json")
        cmd = [sys.executable, str(self.entry), *s.args]
        started = time.perf_counter()
        timed_out = hung_at_exit = False
        # output goes to files, not pipes: a pipe stays open as long as any orphaned DataLoader worker holds it
        with open(tdir / "stdout.log", "wb") as out, open(tdir / "stderr.log", "wb") as err:
            proc = subprocess.Popen(
                cmd, cwd=s.cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True
            )
            try:
                if on_start is not None:
                    on_start(proc.pid)
                rc, timed_out, hung_at_exit = self._wait(proc, result_path, timeout)
            finally:
                # whatever happened (an interrupt included), nothing the trial started outlives it
                _kill_group(proc.pid)
                if proc.poll() is None:
                    proc.wait()
        wall = time.perf_counter() - started
        try:
            result = json.loads(result_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            result = None
        tail = _tail(tdir / "stderr.log")
        if hung_at_exit and result is not None and result.get("status") == "ok":
            rc = 0  # the measured window completed; only the exit hung, and the group is gone now
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
            pid=proc.pid,
            attrs=dict(attrs or {}),
        )
        shutil.rmtree(tdir, ignore_errors=True)
        return out

    @staticmethod
    def _wait(proc: subprocess.Popen, result_path: Path, timeout: float) -> tuple[int | None, bool, bool]:
        """Wait for the trial: (exit status, timed out, killed after its result was written).

        Once the result is written the trial gets EXIT_GRACE_S to exit; a hang while exiting (DataLoader workers
        that do not stop) is then ended without counting as a timeout.
        """
        deadline = time.monotonic() + timeout
        in_grace = False
        while True:
            try:
                return proc.wait(timeout=POLL_S), False, False
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if not in_grace and result_path.exists() and deadline > now + EXIT_GRACE_S:
                deadline, in_grace = now + EXIT_GRACE_S, True
            if now >= deadline:
                _kill_group(proc.pid)
                return proc.wait(), not in_grace, in_grace

    def cleanup(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)


def stderr_summary(text: str, lines: int = 3) -> str:
    """The last few non-empty lines of a stderr tail, joined for one table cell."""
    kept = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " | ".join(kept[-lines:])


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None
