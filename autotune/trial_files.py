"""A trial's writes kept off the user's files (its working directory a mirror of links, each turned into the trial's
own file before a write goes through it; torch.save by file name checked too), and the compile cache a trial loads
and leaves for the tuned script. Imported by autotune.runtime; standard library only, torch looked up lazily."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


_WRITES = frozenset({"open", "os.mkdir", "os.remove", "os.rmdir", "os.rename", "os.truncate"})
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


# environment variables naming caches that libraries share between runs, with their own locking
SHARED_CACHES = ("HF_HOME", "HF_DATASETS_CACHE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE",
                 "TORCH_HOME", "XDG_CACHE_HOME", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")


def shared_caches() -> list[str]:
    """The folders the environment names as caches libraries share between runs (``SHARED_CACHES``)."""
    return [os.path.abspath(os.path.expanduser(os.environ[v])) for v in SHARED_CACHES if os.environ.get(v)]


def keep_user_files(mirror: str, real: str, own: str, isolated: bool = False) -> None:
    """Under a trial, run in a mirror of the user's working directory made of links to its entries: a write
    through a link first turns that link into the trial's own file or folder, so the user's files are only ever
    read. Where the trial is not ``isolated`` (its folders are no overlays: autotune.isolate), overwriting or
    deleting one of the user's files by its absolute path is refused (a new file may be made), except lock files
    (``*.lock``, which hold nothing) and files under a shared cache (``SHARED_CACHES``); in an overlay such a
    write lands in the trial's own upper layer, so the script goes on as the user's own run would.

    An audit hook, so that every way Python opens or moves a file is covered (open, os.open, numpy, tarfile);
    torch.save writes from C++ by name, so it is wrapped once torch is imported.
    """
    import shutil
    import threading

    inside = threading.local()
    sep = os.sep
    # caches the script's libraries share between runs (a datasets cache under HF_HOME inside the working directory):
    # their files are written and locked by every run as the libraries see fit, a trial's as much as the user's own
    caches = shared_caches()

    def under(path: str, folder: str) -> bool:
        return path == folder or path.startswith(folder + sep)

    def own_copy(path: str, contents: bool) -> None:
        """Replace each link on the way to ``path`` (in the mirror) by a folder of links; ``path`` itself, if a
        link, by nothing (it is about to be written anew) or, with ``contents``, by a copy of what it points to."""
        parts = os.path.relpath(path, mirror).split(sep)
        here = mirror
        for part in parts[:-1]:
            here = os.path.join(here, part)
            if os.path.islink(here) and os.path.isdir(here):
                target = os.path.realpath(here)
                os.unlink(here)
                os.mkdir(here)
                for name in os.listdir(target):
                    os.symlink(os.path.join(target, name), os.path.join(here, name))
        if os.path.islink(path):
            target = os.path.realpath(path)
            os.unlink(path)
            if contents and os.path.isfile(target):
                shutil.copy2(target, path)

    def check(path: Any, contents: bool = False, final: bool = True, made: bool = False) -> None:
        """``final``: ``path`` itself is about to be written; else made (``made``: a folder) or removed."""
        if isinstance(path, int) or getattr(inside, "busy", False):
            return  # an open file descriptor (checked when opened), or own_copy's own work
        path = os.path.abspath(os.fsdecode(path))
        if under(path, mirror):
            inside.busy = True
            try:
                own_copy(path if final else os.path.join(path, "x"), contents and final)  # "x": the folders only
            finally:
                inside.busy = False
        elif (not isolated and under(path, real) and not under(path, own) and os.path.lexists(path) and (final or not made)
              and not path.endswith(".lock") and not any(under(path, cache) for cache in caches)):
            raise PermissionError(f"autotune: a trial does not overwrite or delete your files ({path}): use a path "
                                  "relative to the working directory, which a trial sees as a folder of its own")

    def hook(event: str, args: tuple) -> None:
        if event == "import":
            wrap_torch_save()
            return
        if event not in _WRITES:
            return
        if event == "open":
            path, mode, flags = args
            if path is not None and ((mode and any(c in mode for c in "wax+")) or (mode is None and flags & _WRITE_FLAGS)):
                check(path, contents=bool(mode and ("a" in mode or "+" in mode)) or bool(flags & os.O_APPEND))
        elif event == "os.rename":
            src, dst, src_fd, dst_fd = args
            if src_fd in (None, -1):  # -1, None: no folder descriptor, the path is the cwd's or absolute
                check(src, final=False)
            if dst_fd in (None, -1):
                check(dst)
        elif event == "os.truncate":
            check(args[0], contents=True)
        elif args[-1] in (None, -1):  # mkdir, remove, rmdir: a link itself may go, what it points to stays
            check(args[0], final=False, made=event == "os.mkdir")

    global _write_check
    _write_check = check
    sys.addaudithook(hook)


_write_check: Callable[[Any], None] | None = None  # a trial's check of a path it is about to write
_save_checked = False


def share_mp_tempdir(folder: str) -> None:
    """Make ``folder`` (the search's, removed after the trial) this process's multiprocessing temporary folder, and so
    that of every process it starts: a DataLoader worker passes each batch's tensors through a listening socket in
    that folder, and a worker the search kills as the trial ends never removes its own ``pymp-*`` (about four a run
    of a loader with four workers). Children inherit it by any start method (fork, spawn, forkserver: the process
    object's config travels with it). A folder the script already made is kept."""
    import multiprocessing.process

    multiprocessing.process.current_process()._config.setdefault("tempdir", folder)


def wrap_torch_save() -> None:
    """torch.save by file name writes from C++, unseen by the audit hook: check its path first."""
    global _save_checked
    if _save_checked or _write_check is None:  # (runtime.step calls this after every optimizer step: return at once)
        return
    torch = sys.modules.get("torch")
    save = getattr(torch, "save", None)
    if save is None:
        return
    _save_checked = True
    check = _write_check
    import functools

    @functools.wraps(save)
    def checked_save(obj, f, *args, **kwargs):
        if isinstance(f, (str, bytes, os.PathLike)):
            check(f)
        return save(obj, f, *args, **kwargs)

    torch.save = checked_save


def save_compile_cache(path: str) -> None:
    """What torch.compile compiled in this process (and found in its caches), as one file at ``path``, for the tuned
    script to load (torch.compiler.save_cache_artifacts: the inductor and AOTAutograd caches' entries). Nothing
    where nothing was compiled; a torch that cannot is left alone (the tuned script then compiles as usual)."""
    torch = sys.modules.get("torch")
    save = getattr(getattr(torch, "compiler", None), "save_cache_artifacts", None)
    if save is None:
        return
    try:
        got = save()
        if got:
            tmp = Path(path).with_suffix(".tmp")
            tmp.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(got[0])
            os.replace(tmp, path)
    except Exception:  # (a cache this torch cannot serialize: only the carried cache is lost, never the run)
        pass


def load_compile_cache(path: str) -> bool:
    """Load ``path`` (a file save_compile_cache wrote) into the compiler's caches, as the tuned script's loader
    does (autotune.compile_cache): whether torch took it."""
    try:
        import torch

        with open(path, "rb") as f:
            return torch.compiler.load_cache_artifacts(f.read()) is not None
    except Exception:  # (a missing file, another torch: the run compiles as usual, as the tuned script's would)
        return False
