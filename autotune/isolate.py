"""Runs a command in a private mount namespace where the user's folders are overlays: it reads them as they are,
and whatever it or anything it starts writes there (a shell, SQLite, C, by any path) lands in a scratch folder.

``python -m autotune.isolate SPEC -- COMMAND...``: SPEC is a JSON file (``Isolation.write``). The command is
exec'd in this very process once the mounts are made, so it keeps this process's id; where any mount fails, it is
not run at all: one line on stderr and exit status ``FAILED``. Standard library only (ctypes for the system calls
Python 3.11 lacks), Linux only: a user namespace where the caller is not root (unprivileged overlayfs: Linux 5.11),
a mount namespace alone where it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import re
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

FAILED = 97  # the exit status of a command that was not run because its folders could not be isolated
# how a search keeps trials off the user's files: overlays made here, or only the runtime's guard of Python's own writes
OVERLAY, PYTHON = "overlay", "python"
ISOLATIONS = (OVERLAY, PYTHON)

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18


class IsolationError(OSError):
    """A mount or namespace the isolation needs could not be made."""


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _call(what: str, result: int) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise IsolationError(err, f"{what}: {os.strerror(err)}")


def _mount(libc: ctypes.CDLL, source: str | None, target: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:
    enc = (lambda s: None if s is None else os.fsencode(s))
    _call(f"mount {fstype or 'bind'} on {target}",
          libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)))


# file systems that hold no files of the user's and cannot be an overlay's lower layer
PSEUDO = frozenset({"proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "mqueue", "debugfs", "tracefs",
                    "securityfs", "pstore", "bpf", "autofs", "hugetlbfs", "fusectl", "configfs", "binfmt_misc",
                    "nsfs", "efivarfs", "rpc_pipefs"})


def _mount_points() -> list[str]:
    """The mount points of file systems that hold files, from /proc/self/mountinfo (its octal escapes undone)."""
    out = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split()
            fstype = fields[fields.index("-") + 1] if "-" in fields else ""
            if fstype not in PSEUDO:
                out.append(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4]))
    return out


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


@dataclass(frozen=True)
class Isolation:
    """What one isolated command sees: ``folders`` as overlays, ``keep`` (paths inside them) as the real thing,
    and ``scratch``, a folder outside them that holds the overlays' upper layers (removed by ``remove``)."""

    folders: tuple[str, ...]
    keep: tuple[str, ...]
    scratch: str

    @classmethod
    def make(cls, folders: Iterable[Path | str], keep: Iterable[Path | str] = ()) -> Isolation:
        """Overlays for ``folders`` (the outermost of nested ones), their mount points inside them included."""
        roots: list[str] = []
        for f in sorted({os.path.realpath(f) for f in folders}, key=len):
            if not any(_under(f, r) for r in roots):
                roots.append(f)
        kept = tuple(sorted({p for k in keep if (p := os.path.realpath(k)) and any(_under(p, r) for r in roots)
                             and os.path.isdir(p)}, key=len))
        if os.sep in roots:
            raise IsolationError(0, "the folder to protect is the file system's root")
        return cls(tuple(roots), kept, _scratch(roots))

    def write(self, path: Path) -> Path:
        path.write_text(json.dumps({"folders": self.folders, "keep": self.keep, "scratch": self.scratch}),
                        encoding="utf-8")
        return path

    def command(self, spec: Path, cmd: Sequence[str]) -> list[str]:
        """``cmd`` run through this module (``-I``: no user site or environment paths decide what it imports)."""
        here = str(Path(__file__).resolve().parent.parent)
        return [sys.executable, "-I", "-c",
                f"import sys; sys.path.insert(0, {here!r}); from autotune.isolate import main; main()",
                str(spec), "--", *cmd]

    def remove(self) -> None:
        """The scratch folder and every upper layer in it (overlayfs leaves its work folders unreadable)."""
        _remove(self.scratch)

    def enter(self) -> None:
        """Make this process's mount namespace private and mount the overlays (raises IsolationError)."""
        libc = _libc()
        uid, gid = os.geteuid(), os.getegid()
        if uid == 0:
            _call("unshare(CLONE_NEWNS)", libc.unshare(CLONE_NEWNS))
        else:  # the caller's own ids mapped to themselves: files keep their owners, the command runs as the user
            _call("unshare(CLONE_NEWUSER | CLONE_NEWNS)", libc.unshare(CLONE_NEWUSER | CLONE_NEWNS))
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
                try:
                    with open(f"/proc/self/{name}", "w", encoding="ascii") as f:
                        f.write(text)
                except OSError as exc:
                    raise IsolationError(exc.errno, f"/proc/self/{name}: {exc.strerror}") from None
        _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here reaches the rest of the machine
        points = _mount_points()
        # every folder and every file system mounted inside one gets its overlay, outermost first
        targets = sorted({p for r in self.folders for p in points if _under(p, r) and p != r} | set(self.folders),
                         key=lambda p: (p.count(os.sep), p))
        stages = []
        for i, target in enumerate(targets):  # each file system as it is, before any overlay hides it
            stage = os.path.join(self.scratch, f"lower{i}")
            os.mkdir(stage)
            _mount(libc, target, stage, None, MS_BIND)
            stages.append(stage)
        kept_stages = []
        for i, path in enumerate(self.keep):
            stage = os.path.join(self.scratch, f"keep{i}")
            os.mkdir(stage)
            _mount(libc, path, stage, None, MS_BIND | MS_REC)
            kept_stages.append(stage)
        for i, (target, stage) in enumerate(zip(targets, stages)):
            upper, work = os.path.join(self.scratch, f"upper{i}"), os.path.join(self.scratch, f"work{i}")
            os.mkdir(upper)
            os.mkdir(work)
            _mount(libc, "overlay", target, "overlay", 0, f"lowerdir={stage},upperdir={upper},workdir={work}")
        for path, stage in zip(self.keep, kept_stages):
            _mount(libc, stage, path, None, MS_BIND | MS_REC)


def _remove(folder: str) -> None:
    """``folder`` and everything in it, the work folders overlayfs leaves unreadable included."""
    for root, dirs, _ in os.walk(folder):  # top down: each folder opened before the walk enters it
        for d in dirs:
            try:
                os.chmod(os.path.join(root, d), stat.S_IRWXU)
            except OSError:
                pass
    shutil.rmtree(folder, ignore_errors=True)


SCRATCH_PREFIX = "autotune-isolate-"


def sweep(base: str, prefix: str = SCRATCH_PREFIX) -> None:
    """Remove the scratch folders in ``base`` that a process of this user made and did not live to remove (a search
    killed by SIGKILL cannot): their names, ``prefix`` then the pid of the process that made them."""
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        pid = name[len(prefix):].split("-", 1)[0] if name.startswith(prefix) else ""
        path = os.path.join(base, name)
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            if os.lstat(path).st_uid != os.geteuid() or not os.path.isdir(path) or os.path.islink(path):
                continue
            os.kill(int(pid), 0)
            continue  # its maker still runs
        except ProcessLookupError:
            _remove(path)
        except OSError:  # (no permission to signal it: another user's process, alive)
            continue


def _scratch(folders: Sequence[str]) -> str:
    """A new folder for the upper layers, outside every overlaid folder (overlayfs refuses overlapping layers);
    those that killed searches left in the same place go first."""
    for base in (tempfile.gettempdir(), "/dev/shm", "/var/tmp", "/tmp"):
        real = os.path.realpath(base)
        if os.path.isdir(real) and not any(_under(real, f) for f in folders):
            sweep(real)
            return tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-", dir=real)
    raise IsolationError(0, "no temporary folder outside the folders to protect for the overlays' upper layers")


def main(argv: Sequence[str] | None = None) -> None:
    """``SPEC -- COMMAND...``: enter the isolation SPEC describes, then exec COMMAND (exit FAILED if it cannot)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3 or args[1] != "--":
        print("usage: python -m autotune.isolate SPEC -- COMMAND...", file=sys.stderr)
        raise SystemExit(2)
    try:
        doc = json.loads(Path(args[0]).read_text(encoding="utf-8"))
        iso = Isolation(tuple(doc["folders"]), tuple(doc["keep"]), doc["scratch"])
        cwd = os.getcwd()
        iso.enter()
        os.chdir(cwd)  # the same path, now seen through the overlays and the folders kept
    except (OSError, ValueError, KeyError, AttributeError) as exc:  # AttributeError: a libc with no unshare (macOS)
        print(f"autotune: the trial's folders could not be isolated: {exc}", file=sys.stderr)
        raise SystemExit(FAILED) from None
    sys.stdout.flush()
    try:
        os.execvp(args[2], args[2:])
    except OSError as exc:
        print(f"autotune: cannot run {args[2]}: {exc.strerror}", file=sys.stderr)
        raise SystemExit(127) from None


if __name__ == "__main__":
    main()
