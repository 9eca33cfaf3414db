"""Record the per-step losses of an unmodified training script.

Command line (this is what runs inside the subprocess)::

    python tests/loss_probe.py --out OUT.json --steps N -- SCRIPT.py [script args...]

From Python (tests)::

    from loss_probe import run_probe
    losses = run_probe("fixtures/scripts/cnn.py", [], steps=4, out=tmp_path / "l.json")

How it works
------------
``torch.Tensor.backward`` is replaced by a wrapper that records
``float.hex(self.detach().float().item())`` (bit-exact) and then calls the
original. The script is executed with ``runpy.run_path(script,
run_name="__main__")``, with ``sys.argv = [script, *args]`` and ``sys.path[0]``
set to the script's directory, as ``python SCRIPT.py`` would do.

Once N values have been recorded, the call that reached N completes normally
(so its optimizer step still happens) and the *next* ``backward`` call raises
a private ``BaseException`` subclass (not an ``Exception``, so a script's
``except Exception:`` cannot swallow it), which stops the script. The result
file then holds exactly N losses.

Things to keep in mind when comparing runs:

* It counts ``backward`` calls, not iterations. A script with two backward
  passes per iteration (a GAN: D step then G step) records two values per
  iteration; with gradient accumulation there is one value per micro-batch.
* The value recorded is whatever ``backward`` was called on: with a
  ``GradScaler`` that is the *scaled* loss (``scaler.scale(loss)``), with
  gradient accumulation it is ``loss / accum_steps``. A non-scalar tensor
  (``t.backward(gradient)``) is recorded as the hex of its float sum.
* Calls to ``torch.autograd.backward(...)`` / ``torch.autograd.grad(...)``
  that bypass ``Tensor.backward`` are not seen.

Result file (JSON)::

    {"losses": ["0x1.2p+1", ...],
     "ended": "steps" | "script_exit",
     "error": "<ExcType>: <message>",      # only when the script raised
     "steps": N, "elapsed_s": 1.23}

``ended`` is ``"steps"`` when the probe stopped the script after N losses and
``"script_exit"`` when the script finished (or raised) on its own; in that
case ``losses`` may hold fewer than N values. The exit status is 0, or 1 when
the script raised (``SystemExit`` with a zero/None code counts as a normal
exit). After the result is written the process ends with ``os._exit`` so that
DataLoader workers or stray non-daemon threads cannot keep it alive; workers
are shut down first (with a short grace period) and killed if they linger.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

__all__ = ["ProbeError", "probe", "run_probe", "read_result"]

_THIS_FILE = os.path.abspath(__file__)

# Seconds allowed for DataLoader workers etc. to shut down after the result
# has been written, before the probe process hard-exits anyway.
_EXIT_GRACE_S = 10.0


# --------------------------------------------------------------------------
# parent side
# --------------------------------------------------------------------------

class ProbeError(RuntimeError):
    """The probed script failed (or the probe itself did).

    ``result`` is the parsed result file (or None if none was written) and
    ``output`` the combined stdout/stderr of the subprocess.
    """

    def __init__(self, message: str, result: dict | None, output: str, returncode: int | None):
        super().__init__(message)
        self.result = result
        self.output = output
        self.returncode = returncode


def read_result(out: str | os.PathLike) -> dict:
    with open(out, encoding="utf-8") as f:
        return json.load(f)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def probe(
    script: str | os.PathLike,
    args: list[str] | tuple[str, ...] = (),
    steps: int = 8,
    out: str | os.PathLike | None = None,
    env: dict[str, str | None] | None = None,
    cwd: str | os.PathLike | None = None,
    timeout: float = 300.0,
) -> dict:
    """Run ``script`` under the probe in a subprocess and return the result dict.

    ``script`` is resolved like ``python SCRIPT`` would, i.e. relative to
    ``cwd`` (default: the current directory). ``env`` entries are layered on
    top of ``os.environ``; a value of ``None`` removes that variable.
    ``out`` defaults to a temporary file. Raises ``ProbeError`` if the script
    raised, the probe wrote no result, or the run exceeded ``timeout``
    seconds. The returned dict additionally carries ``"output"`` (the
    subprocess's stdout+stderr).
    """
    full_env = dict(os.environ)
    for key, value in (env or {}).items():
        if value is None:
            full_env.pop(key, None)
        else:
            full_env[key] = str(value)

    tmpdir = None
    if out is None:
        tmpdir = tempfile.TemporaryDirectory(prefix="loss_probe_")
        out = os.path.join(tmpdir.name, "losses.json")
    out = os.path.abspath(out)
    if os.path.exists(out):
        os.remove(out)

    cmd = [sys.executable, _THIS_FILE, "--out", out, "--steps", str(int(steps)), "--", str(script), *map(str, args)]
    try:
        # Output goes to a file rather than a pipe: a pipe would stay open as
        # long as any orphaned grandchild (a DataLoader worker) holds it.
        with tempfile.TemporaryFile(mode="w+b") as log:
            proc = subprocess.Popen(
                cmd, cwd=cwd, env=full_env, stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
            timed_out = False
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc.pid)
                rc = proc.wait()
            # Reap anything the script left behind in its session.
            _kill_group(proc.pid)
            log.seek(0)
            output = log.read().decode("utf-8", errors="replace")

        result = read_result(out) if os.path.exists(out) else None
        if timed_out:
            raise ProbeError(f"probe of {script} timed out after {timeout}s\n{output[-4000:]}", result, output, rc)
        if result is None:
            raise ProbeError(f"probe of {script} wrote no result (exit {rc})\n{output[-4000:]}", None, output, rc)
        if rc != 0 or "error" in result:
            msg = result.get("error", f"exit status {rc}")
            raise ProbeError(f"probe of {script} failed: {msg}\n{output[-4000:]}", result, output, rc)
        result["output"] = output
        return result
    finally:
        if tmpdir is not None:
            tmpdir.cleanup()


def run_probe(
    script: str | os.PathLike,
    args: list[str] | tuple[str, ...] = (),
    steps: int = 8,
    out: str | os.PathLike | None = None,
    env: dict[str, str | None] | None = None,
    cwd: str | os.PathLike | None = None,
    timeout: float = 300.0,
) -> list[str]:
    """Like :func:`probe` but return only the recorded losses (hex strings)."""
    return probe(script, args, steps, out, env=env, cwd=cwd, timeout=timeout)["losses"]


# --------------------------------------------------------------------------
# child side
# --------------------------------------------------------------------------

class _ProbeStop(BaseException):
    """Raised from backward() once the requested number of losses is recorded."""


def _install_backward_hook(steps: int, losses: list[str]):
    import torch

    original = torch.Tensor.backward
    main_pid = os.getpid()

    def backward(self, *args, **kwargs):
        if os.getpid() == main_pid:
            if len(losses) >= steps:
                raise _ProbeStop()
            t = self.detach().float()
            value = t.item() if t.numel() == 1 else t.sum().item()
            losses.append(float.hex(value))
        return original(self, *args, **kwargs)

    backward.__wrapped__ = original
    backward.__doc__ = original.__doc__
    torch.Tensor.backward = backward


def _write_json_atomic(path: str, payload: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _flush_std() -> None:
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except Exception:
            pass


def _shutdown_children() -> None:
    """Let DataLoader workers exit cleanly, then kill any that remain."""
    import gc
    import multiprocessing

    # Dropping the script's frames releases DataLoader iterators, whose
    # finalizers stop their workers.
    gc.collect()
    deadline = time.monotonic() + 5.0
    for child in multiprocessing.active_children():
        child.join(timeout=max(0.0, deadline - time.monotonic()))
    for child in multiprocessing.active_children():
        try:
            child.kill()
            child.join(timeout=1.0)
        except Exception:
            pass


def _run_child(script: str, script_args: list[str], steps: int, out: str) -> int:
    import runpy
    import traceback

    losses: list[str] = []
    _install_backward_hook(steps, losses)

    sys.argv = [script, *script_args]
    script_dir = os.path.dirname(os.path.realpath(script))
    if sys.path:
        sys.path[0] = script_dir
    else:
        sys.path.insert(0, script_dir)

    ended = "script_exit"
    error = None
    t0 = time.perf_counter()
    try:
        runpy.run_path(script, run_name="__main__")
    except _ProbeStop:
        ended = "steps"
    except SystemExit as e:
        if e.code not in (None, 0):
            error = f"SystemExit: {e.code}"
    except BaseException as e:  # noqa: BLE001 - report anything the script raised
        traceback.print_exc()
        error = f"{type(e).__name__}: {e}"
    elapsed = time.perf_counter() - t0

    payload = {"losses": list(losses), "ended": ended, "steps": steps, "elapsed_s": round(elapsed, 4)}
    runtime = sys.modules.get("autotune.runtime")  # a patched script: the knobs whose code ran with their value
    payload["applied"] = list(runtime.applied()) if runtime is not None else None
    if error is not None:
        payload["error"] = error
    _write_json_atomic(out, payload)
    code = 1 if error is not None else 0
    print(f"[loss_probe] {len(losses)} losses recorded, ended={ended}"
          + (f", error={error}" if error else ""), file=sys.stderr)
    _flush_std()

    # Never let a hung worker/thread keep the process alive past the grace period.
    watchdog = threading.Timer(_EXIT_GRACE_S, lambda: (_flush_std(), os._exit(code)))
    watchdog.daemon = True
    watchdog.start()
    try:
        _shutdown_children()
    except BaseException:  # noqa: BLE001
        pass
    _flush_std()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        split = argv.index("--")
        own, rest = argv[:split], argv[split + 1:]
    else:
        own, rest = argv, []
    parser = argparse.ArgumentParser(
        prog="loss_probe.py",
        usage="%(prog)s --out OUT.json --steps N -- SCRIPT.py [script args...]",
        description="Record per-step losses of a training script via a Tensor.backward hook.",
    )
    parser.add_argument("--out", required=True, help="where to write the JSON result")
    parser.add_argument("--steps", type=int, required=True, help="number of backward calls to record")
    opts = parser.parse_args(own)
    if not rest:
        parser.error("missing SCRIPT.py after --")
    if opts.steps < 0:
        parser.error("--steps must be >= 0")
    return _run_child(rest[0], rest[1:], opts.steps, os.path.abspath(opts.out))


if __name__ == "__main__":
    sys.exit(main())
