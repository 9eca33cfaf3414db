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

Each probe is a process of its own, forked from a *zygote*: a process that imported torch, ``torch._dynamo`` (which
a script's first optimizer imports), and the frameworks the script imports (transformers, lightning, accelerate),
once (about 1 s, 1.3 s and 3-5 s that every probe paid again when each was a fresh ``python``), in the probe's
environment but for the variables read only while a script runs (``AUTOTUNE_*``, pytest's own): a few are kept per
test worker, one per environment and set of frameworks. A forked probe starts as a fresh one would: its own session,
working directory, environment, standard streams and random seeds, nothing run yet. A script that writes
``os.environ`` (which a script may do before it imports torch: the probe imports torch before the script anyway,
``run_script`` does not) runs as a fresh ``python``, as every run does with ``LOSS_PROBE_FRESH=1``.

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
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

__all__ = ["ProbeError", "probe", "run_probe", "read_result", "run_script"]

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
        request = {"mode": "probe", "script": str(script), "args": list(map(str, args)), "steps": int(steps), "out": out}
        rc, timed_out, output = _launch(request, cmd, cwd, full_env, timeout)
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


def run_script(
    script: str | os.PathLike,
    args: list[str] | tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    timeout: float = 300.0,
) -> tuple[int | None, str]:
    """Run ``script`` as ``python SCRIPT ARGS`` would, with exactly ``env`` (default: this process's), forked from a
    zygote where it may be (see the module's docstring); its exit status and its output (stdout and stderr).
    Raises ``ProbeError`` when it runs past ``timeout`` seconds."""
    env = dict(os.environ if env is None else env)
    cmd = [sys.executable, str(script), *map(str, args)]
    request = {"mode": "script", "script": str(script), "args": list(map(str, args))}
    rc, timed_out, output = _launch(request, cmd, cwd, env, timeout)
    if timed_out:
        raise ProbeError(f"{script} timed out after {timeout}s\n{output[-4000:]}", None, output, rc)
    return rc, output


def _launch(request: dict, cmd: list[str], cwd, env: dict[str, str], timeout: float) -> tuple[int | None, bool, str]:
    """Run ``request`` in a process forked from a zygote, or ``cmd`` as a fresh process where it must: the exit
    status, whether it ran past ``timeout`` (and was killed), its output."""
    # Output goes to a file rather than a pipe: a pipe would stay open as long as any orphaned grandchild (a
    # DataLoader worker) holds it.
    with tempfile.NamedTemporaryFile(mode="w+b", prefix="loss_probe_", suffix=".log") as log:
        zygote = _zygote_for(env, os.path.join(cwd or os.getcwd(), request["script"]))
        if zygote is not None:
            request = {**request, "env": env, "cwd": os.path.abspath(cwd or os.getcwd()), "log": log.name}
            rc, timed_out = zygote.run(request, timeout)
        else:
            rc, timed_out = _run_fresh(cmd, cwd, env, log, timeout)
        log.seek(0)
        return rc, timed_out, log.read().decode("utf-8", errors="replace")


def _run_fresh(cmd: list[str], cwd, env: dict, log, timeout: float) -> tuple[int, bool]:
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    timed_out = False
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc.pid)
        rc = proc.wait()
    _kill_group(proc.pid)  # reap anything the script left behind in its session
    return rc, timed_out


# Variables a forked probe may set otherwise than the zygote's environment: read while a script runs, never when
# torch is imported (autotune's config and trial spec, pytest's bookkeeping).
_RUN_TIME_VARS = ("AUTOTUNE_", "PYTEST_")


class _Zygote:
    """A process that imported torch, forking one probe per request (see the module's docstring)."""

    def __init__(self, env: dict[str, str], preload: tuple[str, ...] = ()):
        self.dir = tempfile.mkdtemp(prefix="loss_probe_zygote_")
        self.socket = os.path.join(self.dir, "z.sock")
        self.proc = subprocess.Popen(
            [sys.executable, _THIS_FILE, "--zygote", self.socket, *preload], env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        ready = self.proc.stdout.readline()
        self.proc.stdout.close()
        if ready.strip() != b"ready":
            self.close()
            raise RuntimeError(f"the loss probe's zygote did not start (exit {self.proc.poll()})")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)

    def run(self, request: dict, timeout: float) -> tuple[int | None, bool]:
        """The probe's exit status (as ``Popen.returncode`` gives it; None if it was never known), and whether it
        ran past ``timeout`` and was killed."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(self.socket)
            stream = conn.makefile("rwb")
            stream.write(json.dumps(request).encode() + b"\n")
            stream.flush()
            pid = int(stream.readline())
            conn.settimeout(timeout)
            timed_out = False
            try:
                line = stream.readline()
            except (TimeoutError, socket.timeout):
                timed_out = True
                _kill_group(pid)
                conn.settimeout(60)
                stream = conn.makefile("rwb")
                line = stream.readline()
            _kill_group(pid)  # reap anything the script left behind in its session
            return (int(line) if line.strip() else None), timed_out


# The frameworks a zygote imports besides torch, for the scripts that import them (3-5 s each here): by the name a
# script imports, the modules to import.
_FRAMEWORKS = {
    "transformers": ("transformers", "transformers.trainer"),
    "lightning": ("lightning", "lightning.pytorch", "lightning.fabric"),
    "pytorch_lightning": ("pytorch_lightning",),
    "accelerate": ("accelerate",),
}
_IMPORTS = re.compile(r"^\s*(?:import|from)\s+(" + "|".join(_FRAMEWORKS) + r")\b", re.M)
# A script that writes its environment (before it imports torch or a framework, as some do) runs fresh: in a forked
# probe, what it writes would come after the imports that read it.
_WRITES_ENVIRON = re.compile(r"environ\s*\[[^]]*\]\s*=[^=]|environ\.(?:setdefault|update|pop)\b|putenv")

_zygotes: dict[tuple, _Zygote] = {}  # by what they imported and the environment they imported it in, oldest first
_ZYGOTES_KEPT = 4
_zygote_lock = threading.Lock()


def _zygote_for(env: dict[str, str], script: str) -> _Zygote | None:
    """The zygote to fork a probe of ``script`` with ``env`` from, or None where the probe must run as a fresh
    process. A zygote imported torch (and the script's frameworks) in ``env`` as it would be at a fresh process's
    start: the same but for the variables read only while a script runs."""
    if os.environ.get("LOSS_PROBE_FRESH") or env.get("LOSS_PROBE_FRESH"):
        return None
    try:
        text = open(script, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError):
        return None
    if _WRITES_ENVIRON.search(text):
        return None
    preload = tuple(sorted({m for name in _IMPORTS.findall(text) for m in _FRAMEWORKS[name]}))
    start_env = {k: v for k, v in env.items() if not k.startswith(_RUN_TIME_VARS)}
    key = (preload, tuple(sorted(start_env.items())))
    with _zygote_lock:
        zygote = _zygotes.pop(key, None)
        if zygote is None or not zygote.alive():
            if zygote is not None:
                zygote.close()
            import atexit

            try:
                zygote = _Zygote(start_env, preload)
            except RuntimeError:  # an import failed there: a fresh run shows the script why
                return None
            atexit.register(zygote.close)
        _zygotes[key] = zygote  # the most recently used last
        while len(_zygotes) > _ZYGOTES_KEPT:
            _zygotes.pop(next(iter(_zygotes))).close()
    return zygote


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


def _as_python_would(script: str, args: list[str]) -> None:
    """``sys.argv`` and ``sys.path[0]`` as ``python SCRIPT ARGS`` sets them."""
    sys.argv = [script, *args]
    script_dir = os.path.dirname(os.path.realpath(script))
    if sys.path:
        sys.path[0] = script_dir
    else:
        sys.path.insert(0, script_dir)


def _run_child(script: str, script_args: list[str], steps: int, out: str) -> int:
    import runpy
    import traceback

    losses: list[str] = []
    _install_backward_hook(steps, losses)

    _as_python_would(script, script_args)

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


def _zygote_main(path: str, preload: list[str]) -> int:
    """Import torch and the modules ``preload`` names, then fork a probe for each request on the socket at ``path``
    until the parent is gone."""
    import importlib

    import torch  # noqa: F401 - the point of the zygote: every probe forked from here finds it imported
    # and what a script's first optimizer imports (torch.optim's functions are wrapped to keep dynamo out of them,
    # which imports torch._dynamo on the first call): 1.3-1.7 s of every probe's 1.5 s on this machine
    import torch._dynamo  # noqa: F401

    for name in preload:
        importlib.import_module(name)

    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    server.settimeout(1.0)
    parent = os.getppid()
    print("ready", flush=True)
    while True:
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:  # the waiters that ended
                pass
        except ChildProcessError:
            pass
        if os.getppid() != parent:
            return 0
        try:
            conn, _ = server.accept()
        except (TimeoutError, socket.timeout):
            continue
        _flush_std()
        if os.fork() == 0:  # the waiter: it forks the probe and reports its pid and exit status
            try:
                server.close()
                _waiter(conn)
            finally:
                os._exit(0)
        conn.close()


def _waiter(conn: socket.socket) -> None:
    stream = conn.makefile("rwb")
    request = json.loads(stream.readline())
    pid = os.fork()
    if pid == 0:
        try:
            stream.close()
            conn.close()
            _forked_probe(request)
        finally:
            os._exit(1)
    stream.write(f"{pid}\n".encode())
    stream.flush()
    _, status = os.waitpid(pid, 0)
    stream.write(f"{os.waitstatus_to_exitcode(status)}\n".encode())
    stream.flush()


def _forked_probe(request: dict) -> None:
    """In the forked process: become what a fresh ``python loss_probe.py`` would be, then run the script."""
    import random
    import traceback

    try:
        os.setsid()
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        random.seed()  # seeded from the OS as in a fresh interpreter, not the zygote's state
        if "numpy.random" in sys.modules:
            sys.modules["numpy.random"].seed()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        _flush_std()
        os._exit(1)
    if request["mode"] == "script":
        _run_script(request["script"], request["args"])
    _run_child(request["script"], request["args"], request["steps"], request["out"])


def _run_script(script: str, args: list[str]) -> None:
    """What ``python SCRIPT ARGS`` does, in a forked process: run it as ``__main__``, then exit as the interpreter
    would (its status, non-daemon threads joined, ``atexit`` handlers run)."""
    import atexit
    import runpy
    import traceback

    _as_python_would(script, args)
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - what the interpreter prints for an uncaught exception
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # the interpreter waits for non-daemon threads before atexit
    except BaseException:  # noqa: BLE001
        pass
    atexit._run_exitfuncs()
    _flush_std()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--zygote"]:
        return _zygote_main(argv[1], argv[2:])
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
