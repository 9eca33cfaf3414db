"""Writing files without ever losing the user's: folders autotune owns, atomic replacement, all-or-nothing edits."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from autotune.errors import UsageError

MARKER = ".autotune-out"  # in every output folder autotune made: the only folders it writes into, besides new ones
REPORT_NAME = "report.md"  # what a search writes beside the tuned script: its report
PLOT_NAME = "throughput.png"  # and the report's plot
MARKER_TEXT = "autotune made this folder and writes its outputs here; delete the folder when you no longer need them\n"


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def read_only(path: Path) -> bool:
    """Whether ``path`` is a file the user may not, or chose not to, write (no write bit: even root leaves it)."""
    return not os.access(path, os.W_OK) or not os.stat(path).st_mode & 0o222


def refuse_dangling(out: Path) -> None:
    """Refuse an --out that is a symbolic link to nothing: autotune would make the folder wherever it points."""
    if out.is_symlink() and not out.exists():
        raise UsageError(f"{out}: --out is a symbolic link to {os.readlink(out)}, which does not exist; pass a folder")


def check_out_dir(out: Path, names: Iterable[str | Path] = ()) -> Path:
    """The resolved output folder, refused (UsageError) unless it is new, empty or made by autotune, and unless
    each of ``names`` can be written in it; nothing is written."""
    refuse_dangling(out)
    out = out.resolve()
    if out.exists():
        if not out.is_dir():
            raise UsageError(f"{out}: --out must be a folder, not a file")
        try:
            foreign = not (out / MARKER).is_file() and any(out.iterdir())
        except OSError as exc:
            raise UsageError(f"{out}: cannot read the output folder: {exc.strerror or exc}") from None
        if foreign:
            raise UsageError(
                f"{out}: this folder exists and was not made by autotune, which writes only into a new folder or "
                f"one it made; pass another --out DIR (or, if autotune made it, add an empty {MARKER} file to it)"
            )
        if not os.access(out, os.W_OK | os.X_OK):
            raise UsageError(f"{out}: the output folder is not writable")
    else:
        base = _nearest_existing(out.parent)
        if not base.is_dir():
            raise UsageError(f"{out}: --out is below {base}, which is a file, not a folder")
        if not os.access(base, os.W_OK | os.X_OK):
            raise UsageError(f"{out}: cannot create the output folder: {base} is not writable")
        return out
    for name in names:
        dest = out / name
        if dest.is_dir():
            raise UsageError(f"{dest}: is a folder where autotune writes a file; pass another --out DIR")
        if dest.is_file() and read_only(dest):
            raise UsageError(f"{dest}: is read-only, and autotune does not replace it; pass another --out DIR")
    return out


def claim_out_dir(out: Path) -> Path:
    """Create ``out`` (checked by check_out_dir) where it does not exist and mark it as autotune's."""
    marker = out / MARKER
    if not marker.is_file():
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"{out}: cannot create the output folder: {exc.strerror or exc}") from None
        write_file(marker, MARKER_TEXT)
    return out


_UMASK: int | None = None


def _new_file_mode() -> int:
    """The mode open() gives a new file (0o666 less the umask): a temporary file starts at 0o600."""
    global _UMASK
    if _UMASK is None:
        _UMASK = os.umask(0o022)
        os.umask(_UMASK)
    return 0o666 & ~_UMASK


def write_file(path: Path, data: str | bytes, users_file: bool = False) -> Path:
    """Replace ``path`` atomically (a temporary file in its folder, then os.replace), keeping an existing file's
    mode; a killed process leaves the old file or the new one, never a part of either.

    An output replaces a symbolic link at ``path`` rather than write where it points. A ``users_file`` (--in-place)
    is written where its link points, so the link stays, and is flushed to disk before the rename, so that a
    power cut cannot leave an empty file either (not for outputs: 10 ms a file).
    """
    target = Path(os.path.realpath(path)) if users_file else path
    raw = data.encode("utf-8") if isinstance(data, str) else data
    try:
        try:
            st = os.lstat(target)
            mode = _new_file_mode() if stat.S_ISLNK(st.st_mode) else stat.S_IMODE(st.st_mode)
        except FileNotFoundError:
            mode = _new_file_mode()
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as exc:
        raise UsageError(f"{path}: cannot write it: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            if users_file:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise UsageError(f"{path}: cannot write it: {exc.strerror or exc}") from None
        raise
    return path


def backup_path(path: Path) -> Path:
    """``<file>.orig``, or ``<file>.orig.N`` when an earlier backup exists: the first original is never lost."""
    backup = path.with_name(path.name + ".orig")
    n = 1
    while backup.exists():
        backup = path.with_name(f"{path.name}.orig.{n}")
        n += 1
    return backup


def replace_all(changes: Sequence[tuple[Path, str]]) -> list[Path]:
    """Write each (path, text), keeping a backup of each existing file, all or nothing: every file is checked
    first, and a failure halfway puts back every file already written (and removes its backup)."""
    for path, _ in changes:
        if path.exists() and (not path.is_file() or read_only(path)):
            raise UsageError(f"{path}: is read-only (or not a file), and autotune does not replace it; nothing changed")
        if not os.access(path.parent, os.W_OK | os.X_OK):
            raise UsageError(f"{path.parent}: the folder is not writable; nothing changed")
    done: list[tuple[Path, Path | None]] = []
    try:
        for path, text in changes:
            backup = None
            if path.exists():
                backup = backup_path(path)
                try:
                    shutil.copy2(path, backup)
                except OSError as exc:
                    with contextlib.suppress(OSError):
                        backup.unlink()
                    raise UsageError(f"{backup}: cannot write the backup: {exc.strerror or exc}") from None
            try:
                write_file(path, text, users_file=True)
            except BaseException:
                if backup is not None:  # this file was not replaced: its copy is no backup of anything
                    backup.unlink(missing_ok=True)
                raise
            done.append((path, backup))
    except BaseException as exc:
        stuck = _roll_back(done)
        if stuck:
            raise UsageError(f"{exc}; could not put back {', '.join(stuck)} (from its .orig backup by hand)") from None
        if isinstance(exc, UsageError):
            raise UsageError(f"{exc}; every file was put back as it was") from None
        raise
    return [path for path, _ in changes]


def _roll_back(done: list[tuple[Path, Path | None]]) -> list[str]:
    """Put back each written file from its backup (a new file is removed); the files that could not be."""
    stuck = []
    for path, backup in reversed(done):
        try:
            if backup is None:
                path.unlink(missing_ok=True)
            else:
                write_file(path, backup.read_bytes(), users_file=True)
                backup.unlink()
        except (OSError, UsageError):
            stuck.append(str(path))
    return stuck


class OutDirLock:
    """An exclusive lock on an output folder (the file ``name`` in it); the OS drops it when the process dies, so
    none goes stale."""

    def __init__(self, out: Path, name: str) -> None:
        self.path = out / name
        self.file = open(self.path, "w")
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows: no advisory locks, run one search per folder
            return
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.close()
            raise UsageError(f"{out}: another autotune search is using this output folder") from None

    def release(self) -> None:
        try:
            self.path.unlink()
        except OSError:
            pass
        self.file.close()
