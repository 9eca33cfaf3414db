"""Imported by patched scripts as ``_autotune``: knob values, the transforms' runtime helpers and the trial protocol.

Standard library and PyYAML only; torch is imported lazily, inside the helpers that need it, so importing this
module costs nothing measurable and never initialises CUDA. Knob values come from ``autotune.knob_values``; the
helpers each transform's gated edits call are its runtime section, gathered in ``autotune.runtime_helpers``.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autotune import contention, trial_files
from autotune.knob_values import (  # noqa: F401 - the names patched scripts and the search use
    CONFIG_ENV,
    CONFIG_NAME,
    applied,
    device_type,
    knob,
    load_config,
    reset,
    took_effect,
)
from autotune.runtime_helpers import *  # noqa: F403 - every helper a gated edit calls, as _autotune.<helper>
from autotune.runtime_helpers import compile_seconds

TRIAL_ENV = "AUTOTUNE_TRIAL"


# --- trial protocol ----------------------------------------------------------------------------------------

def _end_trial(compile_cache: str | None) -> None:
    """End a trial's process as its window's result is written: save what it compiled where the search asked, then
    exit at once, without the interpreter's teardown.

    Nothing after the window is measured or kept (the process runs in the trial's own folder, its files thrown
    away), while the teardown of an interpreter that imported torch took 0.8-0.9 s here, a quarter of a small
    script's run (``python -c 'import torch; ...; raise SystemExit'`` against ``os._exit``: 2.9 s and 2.1 s). A
    distributed rank first waits for the others: every rank leaves after this step's last collective, and leaving
    the group to the interpreter's exit aborted a rank ("terminate called without an active exception", SIGABRT)
    in 4 of 24 runs of a 2-rank DDP script under torchrun (destroying it first in 2 of 24). DataLoader workers and
    other processes the script started are the search's to end: it kills the trial's process group as it ends.
    """
    if compile_cache:
        trial_files.save_compile_cache(compile_cache)
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.barrier()  # no rank leaves while another still needs it for this step's last collective
    except Exception:  # a group already broken: the result is written, the exit is all that is left
        pass
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


# (rank, local rank, world size) variables, by launcher: torchrun (and anything built on torch.distributed.run),
# Open MPI's mpirun, MPICH / Intel MPI (PMI), Slurm's srun. The first set whose rank variable is present wins.
RANK_VARS = (
    ("RANK", "LOCAL_RANK", "WORLD_SIZE"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE"),
    ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS"),
)


def rank_info(env: Any = None) -> tuple[int, int, int]:
    """This process's (rank, local rank, world size) as its launcher set them; (0, 0, 1) without a launcher."""
    env = os.environ if env is None else env

    def number(name: str, default: int) -> int:
        value = env.get(name, "").strip()
        return int(value) if value.isdigit() else default

    for rank, local, world in RANK_VARS:
        r = number(rank, -1)
        if r >= 0:
            return r, number(local, r), number(world, r + 1)
    return 0, 0, 1


class _Trial:
    """Times steps after a warm-up, keeps per-step losses on device and writes one JSON result (one per rank under
    a launcher: every rank times and records its own losses; the search merges them)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.warmup = int(spec.get("warmup", 2))
        self.steps = int(spec.get("steps", 10))
        self.rank, self.local_rank, self.world_size = rank_info()
        self.result_path = Path(spec["result"])
        if spec.get("per_rank"):
            self.result_path = self.result_path.with_name(f"{self.result_path.stem}.rank{self.rank}.json")
        self.search_pid: int | None = spec.get("search_pid")
        # a whole run: the window's result is written as usual, then the script runs on to its own end (the search
        # times the process from start to exit: start-up, compile, evaluation passes and their recompiles)
        self.whole = bool(spec.get("whole"))
        # where to leave what torch.compile compiled (rank 0 saves it): as the window ends, or at a whole run's exit
        self.compile_cache: str | None = spec.get("compile_cache") if self.rank == 0 else None
        self.cache_loaded: bool | None = None  # whether a carried compile cache loaded (None: none was given)
        # what else ran on the machine's processors during the measured window (autotune.contention)
        self.cpu_start: contention.Reading | None = None
        self.contention: dict[str, float] | None = None
        self.started = time.perf_counter()
        self.count = 0
        self.stamps: list[float] = []
        self.losses: list[Any] = []
        self.pending: list[tuple] = []  # the losses of this optimizer step's micro-steps (gradient accumulation)
        self.pending_samples: list[int | None] = []  # and the samples of their micro-batches, where known
        self.batch: int | None = None
        self.written = False
        self.uncaught = False  # an exception ended the script (its excepthook ran)
        self.first_step_at: float | None = None
        self.window_start: float | None = None
        # the run's length, read as it starts: each loop around the step (group -> text -> length), how many loops
        # each group has, iterations of the innermost loop per optimizer step, or the framework's own count
        self.loops: dict[str, dict[str, int | None]] = {}
        self.loops_of: dict[str, int] = {}
        self.caps: dict[str, tuple[str, int | None]] = {}  # group: (text, the bound's count or None where none holds)
        self.per_step: list[int] = []
        self.counted = False  # the innermost loop steps every few iterations (accumulation): per_step counts them
        self.length: tuple[int | None, str] | None = None  # (optimizer steps, where from) once known or refused
        if self.warmup <= 0:  # no warm-up: the window opens now
            self.window_start = self.started
            self.stamps.append(self.started)

    def _sync(self) -> None:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def accumulate(self, losses: tuple, batch: Any = None) -> None:
        if self.written:
            return  # a whole run, past its window
        self.pending.append(_copies(losses))
        shape = getattr(batch, "shape", None)
        self.pending_samples.append(int(shape[0]) if shape is not None and len(shape) > 0 else None)

    def step(self, losses: tuple, batch: Any, samples: int | None = None) -> None:
        """``samples``: how many the optimizer step trained on, where a framework hook counted its micro-batches
        (else the first dimension of ``batch``, the step's last micro-batch)."""
        if self.written:
            return  # a whole run, past its window: the script's own steps, untouched
        self.count += 1
        if self.counted:
            self.per_step.append(max(len(self.pending), 1))
        if samples is None and self.pending_samples and None not in self.pending_samples:
            samples = sum(self.pending_samples)  # a loop of the script's own: each micro-batch counted
        self.pending_samples = []
        if self.batch is None and samples:
            self.batch = int(samples)
        if losses:
            self.losses.append(_copies(losses))
        elif self.pending:  # the step's loss is the sum of its micro-steps' (each scaled by 1/accumulation, as a rule)
            self.losses.append(tuple(sum(column[1:], column[0]) for column in zip(*self.pending)))
        self.pending = []
        if self.batch is None and batch is not None and hasattr(batch, "shape") and len(batch.shape) > 0:
            self.batch = int(batch.shape[0])
        if self.count == 1:
            self.first_step_at = time.perf_counter()
        if self.count == self.warmup:
            self.cpu_start = contention.read()  # (before the window opens: reading /proc is not a step's time)
            self._sync()
            self.window_start = time.perf_counter()
            self.stamps.append(self.window_start)
        elif self.count > self.warmup:
            self.stamps.append(time.perf_counter())
        if self.count >= self.warmup + self.steps:
            self._sync()
            self.stamps[-1] = time.perf_counter()
            self.contention = contention.between(self.cpu_start, contention.read())
            self.write("ok")
            if self.whole:
                # registered now, after whatever the script's imports registered: runs first at the exit
                atexit.register(self.mark_exit)
                return
            _end_trial(self.compile_cache)

    def mark_exit(self) -> None:
        """A whole run's program has ended (an atexit handler): say so in ``result*.exit``, and where it ended without
        an uncaught exception, have a fatal signal in the interpreter's teardown written there too.

        torch's gloo group can abort a rank as the interpreter tears down ("terminate called without an active
        exception", SIGABRT), after the script ended, destroy_process_group called or not: 4 of 24 torchrun runs
        of a 2-rank DDP script here. The run's work is done by then; the search counts its time, and says so
        (``teardown_fatal`` in autotune.search.ranks).
        """
        uncaught = self.uncaught or getattr(sys, "last_value", None) is not None
        try:
            f = open(self.result_path.with_suffix(".exit"), "w", encoding="utf-8")
            f.write("uncaught\n" if uncaught else "ended\n")
            f.flush()
            if not uncaught:  # faulthandler holds the file until the interpreter is gone
                faulthandler.enable(file=f, all_threads=False)
            else:
                f.close()
        except OSError:  # (the trial's folder is gone: the search has stopped it)
            pass

    def run_length(self) -> tuple[int | None, str]:
        """The optimizer steps the user's whole run takes and where that comes from (None and why, where unknown):
        the framework's own count, else the lengths of the loops around the step as they started."""
        if self.length is not None:
            return self.length
        for group, lengths in self.loops.items():
            if len(lengths) < self.loops_of.get(group, 0):
                continue  # a loop around the step did not start (yet): its length is not known
            unknown = [text for text, n in lengths.items() if n is None]
            if unknown:
                return None, f"{unknown[0]} has no length"
            *outer, (inner_text, inner) = lengths.items()
            micro = round(sorted(self.per_step)[len(self.per_step) // 2]) if self.counted and self.per_step else 1
            steps = -(-inner // micro)  # a last, shorter step at each pass's end (ceil)
            for _, n in outer:
                steps *= n
            parts = [f"{text} {n}" for text, n in outer] + [f"{inner_text} {inner}"]
            how = " x ".join(parts) + (f", {micro} iterations a step" if micro > 1 else "")
            cap_text, cap = self.caps.get(group, ("", None))
            if cap is not None and -(-cap // micro) < steps:  # the count's bound ends the loops first
                steps, how = -(-cap // micro), f"{cap} iterations {cap_text} (of {how})"
            return steps, f"{how}, read as the loops started"
        return None, "no loop around the step said its length"

    def _loss_values(self) -> list[list[float]]:
        out = []
        for row in self.losses:
            out.append([float(v) for v in row])  # one host sync per value, after the window
        return out

    def _peak_memory(self) -> tuple[int | None, str]:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            return int(torch.cuda.max_memory_allocated()), "cuda_max_allocated"
        own = _own_peak_rss()
        if own is not None:
            return own, "cpu_max_rss"
        try:
            import resource

            rss = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
            return (rss if sys.platform == "darwin" else rss * 1024), "cpu_max_rss"  # bytes on macOS, KiB elsewhere
        except ImportError:  # pragma: no cover - not on Linux/macOS
            return None, "unknown"

    def write(
        self, status: str, error: str | None = None, error_type: str | None = None, error_types: tuple[str, ...] = ()
    ) -> None:
        if self.written:
            return
        self.written = True
        step_times = [b - a for a, b in zip(self.stamps, self.stamps[1:])]
        window = self.stamps[-1] - self.stamps[0] if len(self.stamps) > 1 else None
        try:
            losses = self._loss_values()
        except Exception as exc:  # a failed device (OOM, illegal access) can make losses unreadable
            losses, error = [], error or f"losses unreadable: {exc}"
        peak, peak_kind = self._peak_memory()
        run_steps, run_steps_from = self.run_length()
        result = {
            "status": status,
            "steps_done": self.count,
            "warmup": self.warmup,
            "steps": self.steps,
            "warmup_s": (self.window_start - self.started) if self.window_start else None,
            "first_step_s": (self.first_step_at - self.started) if self.first_step_at else None,
            # time torch.compile spent (in the warm-up, and the part that fell in the timed window: recompiles)
            "compile_s": compile_seconds(),
            "window_compile_s": compile_seconds(self.window_start) if self.window_start else None,
            "window_s": window,
            "step_times": step_times,
            "losses": losses,
            "batch_size": self.batch,
            "peak_memory": peak,
            "peak_memory_kind": peak_kind,
            "error": error,
            "error_type": error_type,
            "error_types": list(error_types),  # qualified names along the exception's MRO: oom, compile errors
            "run_steps": run_steps,  # the optimizer steps of the user's whole run, where they were read
            "run_steps_from": run_steps_from,
            "compile_cache_loaded": self.cache_loaded,
            "contention": self.contention,
            "applied": applied(),  # knobs that took effect: see took_effect
            "rank": self.rank,
            "local_rank": self.local_rank,
            "world_size": self.world_size,
            "pid": os.getpid(),
            "ended": time.time(),  # wall clock, comparable across ranks: which rank failed first
        }
        tmp = self.result_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result), encoding="utf-8")
        os.replace(tmp, self.result_path)


def _start_trial() -> _Trial | None:
    spec_path = os.environ.get(TRIAL_ENV)
    if not spec_path:
        return None
    spec = json.loads(Path(spec_path).read_text(encoding="utf-8"))
    if spec.get("mirror"):
        trial_files.keep_user_files(spec["mirror"], spec["cwd"], spec["own"], bool(spec.get("isolated")))
    if spec.get("mp_tempdir"):
        trial_files.share_mp_tempdir(spec["mp_tempdir"])
    trial = _Trial(spec)
    if spec.get("load_compile_cache"):  # first thing, as the tuned script's loader at its top
        trial.cache_loaded = trial_files.load_compile_cache(spec["load_compile_cache"])
    previous_hook = sys.excepthook

    def hook(exc_type, exc, tb):
        names = tuple(f"{t.__module__}.{t.__qualname__}" for t in exc_type.__mro__)
        trial.uncaught = True
        trial.write("error", error=f"{exc_type.__name__}: {exc}", error_type=exc_type.__name__, error_types=names)
        previous_hook(exc_type, exc, tb)

    sys.excepthook = hook
    atexit.register(lambda: trial.write("short", error=f"script ended after {trial.count} steps"))
    if trial.compile_cache:  # a run that ends before its window does (registered last: runs first at exit)
        atexit.register(trial_files.save_compile_cache, trial.compile_cache)
    pids = spec.get("pids")
    if pids:  # a launcher may start its ranks in sessions of their own: the search kills them by these ids
        Path(pids).mkdir(parents=True, exist_ok=True)
        # "rank world_size": which ranks started, should none of them live to write a result
        Path(pids, str(os.getpid())).write_text(f"{trial.rank} {trial.world_size}", encoding="utf-8")
        logs = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if logs:  # in the folder torchrun made for this launch's logs (autotune.search.ranks.launcher_logs)
            Path(pids, f"logs.{trial.rank}").write_text(logs, encoding="utf-8")
    if trial.search_pid is not None:
        _watch_search(trial.search_pid)
    return trial


WATCH_S = 0.5


def _own_peak_rss() -> int | None:
    """This process's peak resident memory in bytes, from Linux's VmHWM; None where there is no /proc.

    Not getrusage's ru_maxrss: Linux keeps that figure across exec, so a trial started by the search (a process
    of a few hundred MiB with libcst and Optuna loaded) would report at least the search's own size.
    """
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user's counts: it cannot be signalled, but it is there)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _watch_search(pid: int) -> None:
    """End this trial, and whatever it started, as soon as the search that launched it is gone (even SIGKILLed),
    or the launcher between them is.

    Without a launcher the search is this process's parent. Under one (torchrun's agent, mpirun) the parent is the
    launcher: its death also ends the trial, as a rank whose agent is gone has nobody left to stop it; and the
    search, which is no parent, is watched by its process id (a pidfd where the OS has them, so a search that died
    but was not reaped yet counts as gone).
    """
    import select
    import threading

    parent = os.getppid()
    fd: int | None = None
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(1)  # the search ended before this trial got this far
    except (AttributeError, OSError):  # no pidfds (not Linux 5.3+): poll the process id instead
        pass

    def search_alive() -> bool:
        if fd is not None:
            return not select.select([fd], [], [], WATCH_S)[0]  # readable once the process has ended
        time.sleep(WATCH_S)
        return pid_alive(pid)

    def watch() -> None:
        while os.getppid() == parent and search_alive():
            pass
        # the trial (or, under a launcher, this rank) runs in its own process group: take its workers along
        if hasattr(os, "killpg") and os.getpgrp() == os.getpid():
            os.killpg(os.getpgrp(), 9)
        os._exit(1)

    threading.Thread(target=watch, name="autotune-search-watch", daemon=True).start()


_trial = _start_trial()


def _copies(losses: tuple) -> tuple:
    # a copy, not a view: under CUDA graphs (compile's reduce-overhead) the loss lives in the graph's static output
    # buffer, which the next replay overwrites; clone() is queued on the device, no host sync
    return tuple(l.detach().clone() if hasattr(l, "detach") else l for l in losses)


def accumulate(*losses: Any, batch: Any = None) -> None:
    """Called by patched scripts after each micro-step's backward where the step hook cannot see the loss (it is
    bound only inside a gradient-accumulation loop, or the optimizer steps every few batches); ``batch``: the
    micro-batch, whose samples count into the step's. Does nothing outside a trial."""
    if _trial is not None:
        _trial.accumulate(losses, batch)


def step(*losses: Any, batch: Any = None, samples: int | None = None) -> None:
    """Called by patched scripts after each optimizer step; does nothing outside a trial.

    Under Accelerate's own gradient accumulation (``Accelerator(gradient_accumulation_steps=n)`` with ``with
    accelerator.accumulate(model):``) the script calls ``optimizer.step()`` on every micro-batch and Accelerate skips
    all but the last of each n: only that one ends a step, whose loss is the mean of its micro-batches' (Accelerate
    divides each by n in ``accelerator.backward``) and whose samples are theirs."""
    if _trial is not None:
        trial_files.wrap_torch_save()  # torch imported without an import after it (the audit hook's other chance)
        accumulating = _accelerate_accumulation()
        if accumulating is None:
            _trial.step(losses, batch, samples)
            return
        count, sync = accumulating
        _trial.counted = True  # the loop's iterations per optimizer step are Accelerate's micro-batches
        _trial.accumulate(tuple(loss / count for loss in losses), batch)
        if sync:
            _trial.step((), None, samples)


def _accelerate_accumulation() -> tuple[int, bool] | None:
    """(micro-batches per step, whether this one ends the step) where Accelerate accumulates gradients itself."""
    state_module = sys.modules.get("accelerate.state")
    state = getattr(state_module, "GradientState", None)
    if state is None or not state._shared_state:
        return None
    gradient_state = state()
    count = gradient_state.num_steps
    return (count, bool(gradient_state.sync_gradients)) if isinstance(count, int) and count > 1 else None


def loop_length(length: Callable[[], Any] | None, text: str, group: str, of: int, counted: bool = False,
                cap: bool = False) -> None:
    """Called by patched scripts just before each loop around a training step starts: ``length()`` gives what the
    loop iterates over (``range(epochs)``, the DataLoader), whose len() the trial records the first time; ``of``: how
    many loops ``group`` has; ``counted``: this innermost loop steps every few iterations. ``length`` None: the run's
    length cannot be read, ``text`` says why. ``cap``: ``length()`` is the range of counts until a bound that breaks
    every loop of the group (None where the bound's condition is off). Does nothing outside a trial (``length`` is
    never called there)."""
    if _trial is None or _trial.length is not None or text in _trial.loops.get(group, {}):
        return
    if cap and group in _trial.caps:
        return
    if length is None:
        _trial.length = (None, text)
        return
    if cap:
        try:
            bound = length()
            _trial.caps[group] = (text, None if bound is None else len(bound))
        except Exception:  # (a name the bound reads not bound as the loops start)
            _trial.length = (None, f"{text}: not read as the loops started")
        return
    try:
        n = len(length())
    except Exception:  # an iterable of no known length (a generator, an IterableDataset's loader)
        n = None
    _trial.loops.setdefault(group, {})[text] = n
    _trial.loops_of[group] = of
    _trial.counted = _trial.counted or counted


def framework_trial(trainer: Any) -> None:
    """Called by patched scripts just before a framework's Trainer trains (``trainer.train()``); does nothing outside
    a trial. In a trial, the framework's own hooks hand each micro-step's loss and each optimizer step's end to the
    trial, as ``accumulate`` and ``step`` do in a loop of the script's own, and the knobs its resolved settings
    hold are recorded as applied."""
    if _trial is None or getattr(trainer, "_autotune_trial", False):
        return  # a trainer trained again (resumed) keeps the hooks it has
    trainer._autotune_trial = True
    names = {f"{c.__module__}.{c.__qualname__}" for c in type(trainer).__mro__}
    if "transformers.trainer.Trainer" in names:
        _hf_trial(trainer)
    elif names & {"lightning.pytorch.trainer.trainer.Trainer", "pytorch_lightning.trainer.trainer.Trainer"}:
        _lightning_trial(trainer)


def _hf_trial(trainer: Any) -> None:
    """The Hugging Face Trainer: its ``training_step`` (one micro-step: forward, backward, the loss returned) is
    wrapped on this instance, and a callback's ``on_step_end`` (after the optimizer step) ends the step."""
    from transformers import TrainerCallback

    hf_trainer_resolved(trainer.args)  # noqa: F405 - the transform's helper: which knobs the settings hold
    own = trainer.training_step
    sizes: list[int | None] = []  # each micro-batch's samples in this optimizer step

    def training_step(*args: Any, **kwargs: Any) -> Any:
        loss = own(*args, **kwargs)
        accumulate(loss)
        sizes.append(_batch_size(args[1] if len(args) > 1 else kwargs.get("inputs")))
        return loss

    class StepEnd(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if _trial is not None and isinstance(state.max_steps, int) and state.max_steps > 0:
                how = (f"max_steps={args.max_steps}" if args.max_steps and args.max_steps > 0
                       else f"{args.num_train_epochs:g} epochs")
                _trial.length = (state.max_steps, f"the Trainer's state.max_steps ({how})")

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            samples = sum(sizes) if sizes and None not in sizes else None
            sizes.clear()
            step(samples=samples)

    trainer.training_step = training_step
    trainer.add_callback(StepEnd())


def _lightning_trial(trainer: Any) -> None:
    """The Lightning Trainer: a callback's ``on_train_batch_end`` sees each batch's loss (``training_step``'s,
    divided by the accumulation count as Lightning divides it); a batch after which ``trainer.global_step`` moved on
    ended an optimizer step."""
    if type(trainer).__module__.startswith("pytorch_lightning"):
        from pytorch_lightning.callbacks import Callback
    else:
        from lightning.pytorch.callbacks import Callback

    class StepEnd(Callback):
        def __init__(self) -> None:
            self.steps: int | None = None
            self.sizes: list[int | None] = []  # each micro-batch's samples in this optimizer step

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            lightning_trainer_resolved(trainer)  # noqa: F405 - the transform's helper
            self.steps = trainer.global_step
            try:
                total = trainer.estimated_stepping_batches
            except Exception:  # a loader of no known length
                total = None
            if _trial is not None and isinstance(total, (int, float)) and 0 < total < float("inf"):
                _trial.length = (int(total), f"Lightning's estimated_stepping_batches (max_epochs={trainer.max_epochs}, "
                                             f"max_steps={trainer.max_steps})")

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            if hasattr(loss, "detach"):
                accumulate(loss)
            self.sizes.append(_batch_size(batch))
            if trainer.global_step != self.steps:
                self.steps = trainer.global_step
                samples = sum(self.sizes) if None not in self.sizes else None
                self.sizes = []
                step(samples=samples)

    trainer.callbacks.append(StepEnd())


def _batch_size(batch: Any) -> int | None:
    """The samples in a batch: the first dimension of its first tensor."""
    first = _first_tensor(batch)
    shape = getattr(first, "shape", None)
    return int(shape[0]) if shape is not None and len(shape) > 0 else None


def _first_tensor(batch: Any) -> Any:
    """The first tensor of a batch (a tensor, or a tuple, list or dict of them): its first dimension is the batch."""
    if hasattr(batch, "shape"):
        return batch
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (tuple, list)) else ()
    return next((v for v in items if hasattr(v, "shape")), None)
