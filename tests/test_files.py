"""The user's files are never lost or clobbered: output folders autotune owns, atomic writes, all-or-nothing
``--in-place``, and one line (exit 2) for an output path that cannot be written."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from autotune.cli import main
from autotune.files import MARKER, write_file

REPO = Path(__file__).resolve().parent.parent
CNN = REPO / "fixtures/scripts/cnn.py"
PKG = REPO / "fixtures/scripts/pkg_project"
TINY = REPO / "fixtures/search/tiny.py"


def _snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {
        p.relative_to(folder).as_posix(): (p.read_bytes(), p.stat().st_mode)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def _one_line(capsys) -> str:
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


@pytest.fixture
def project(tmp_path) -> Path:
    """A copy of the package project (train.py and mylib/): its entry script."""
    shutil.copytree(PKG, tmp_path / "proj")
    return tmp_path / "proj" / "train.py"


@pytest.fixture
def users_folder(tmp_path) -> Path:
    """A folder of the user's own that holds files with autotune's output names."""
    mine = tmp_path / "mine"
    (mine / ".work").mkdir(parents=True)
    (mine / ".work" / "notes.txt").write_text("my notes\n")
    for name in ("autotune.yaml", "patch.diff", "tuned.diff", "report.md", "throughput.png", "tiny.py", "train.py"):
        (mine / name).write_text(f"# the user's own {name}\n")
    (mine / "autotune.yaml").write_text("script: mine.py\nknobs: {}\n")  # even one that looks like autotune's
    return mine


# --- output folders: new, empty, or made by autotune --------------------------------------------------------------


def _space(tmp_path: Path) -> str:
    space = tmp_path / "space.yaml"
    space.write_text("knobs:\n  gc.freeze: [false, true]\n")
    return str(space)


def _command(kind: str, out: Path, tmp_path: Path) -> list[str]:
    if kind == "patch":
        return ["patch", str(TINY), "--out", str(out)]
    if kind == "bake":
        config = tmp_path / "chosen.yaml"
        config.write_text("knobs:\n  gc.freeze: true\n")
        return ["bake", str(TINY), "--config", str(config), "--out", str(out)]
    return ["search", str(TINY), "--out", str(out), "--space", _space(tmp_path), "--device", "cpu", "--trials", "2",
            "--steps", "2", "--warmup", "1", "--confirm", "5", "--", "--iters", "6"]


@pytest.mark.parametrize("kind", ["patch", "bake", "search"])
def test_a_folder_autotune_did_not_make_is_refused_and_left_alone(kind, users_folder, tmp_path, capsys):
    command = _command(kind, users_folder, tmp_path)
    before = _snapshot(users_folder)
    assert main(command) == 2
    assert "was not made by autotune" in _one_line(capsys)
    assert _snapshot(users_folder) == before and not (users_folder / MARKER).exists()


def test_out_dotdot_never_replaces_a_projects_own_module(tmp_path, capsys, monkeypatch):
    # the project's root holds its own utils.py; the script in scripts/ imports a utils.py of its own
    root = tmp_path / "project"
    (root / "scripts").mkdir(parents=True)
    (root / "utils.py").write_text("ROOT_UTILS = True\n")
    (root / "scripts" / "utils.py").write_text("def batch():\n    return 1\n")
    (root / "scripts" / "train.py").write_text("import utils\n" + CNN.read_text())
    before = _snapshot(root)
    monkeypatch.chdir(root / "scripts")
    assert main(["patch", "train.py", "--out", ".."]) == 2
    assert "was not made by autotune" in _one_line(capsys)
    assert _snapshot(root) == before


@pytest.mark.parametrize("kind", ["patch", "bake"])
def test_a_new_or_empty_folder_is_taken_and_marked_and_written_again(kind, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    for out in (tmp_path / "new" / "deeper", empty):
        assert main(_command(kind, out, tmp_path)) == 0
        assert (out / MARKER).is_file() and (out / "autotune.yaml").is_file()
        (out / "notes.md").write_text("the user's notes in autotune's folder\n")
        assert main(_command(kind, out, tmp_path)) == 0  # autotune's own folder: written again, notes kept
        assert (out / "notes.md").read_text() == "the user's notes in autotune's folder\n"


# --- output paths that cannot be written: one line, exit 2, nothing written ----------------------------------------


def _bad_outs(tmp_path: Path) -> dict[str, Path]:
    a_file = tmp_path / "a_file.txt"
    a_file.write_text("the user's file\n")
    return {"a file": a_file, "below a file": a_file / "sub", "not creatable": Path("/proc/autotune-cannot-be-here")}


@pytest.mark.parametrize("case", ["a file", "below a file", "not creatable"])
@pytest.mark.parametrize("kind", ["patch", "bake", "search"])
def test_an_output_path_that_cannot_be_written_is_one_line(kind, case, tmp_path, capsys):
    out = _bad_outs(tmp_path)[case]
    if case == "not creatable" and not Path("/proc").is_dir():
        pytest.skip("needs Linux /proc: a folder nobody can create a folder in")
    command = _command(kind, out, tmp_path)
    before = _snapshot(tmp_path)
    assert main(command) == 2
    line = _one_line(capsys)
    assert str(out) in line
    assert {"a file": "must be a folder", "below a file": "which is a file", "not creatable": "output folder"}[case] in line
    assert _snapshot(tmp_path) == before


def test_an_unwritable_folder_is_one_line(tmp_path, capsys, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    if os.access(locked, os.W_OK):  # root: the mode does not stop it, so deny it as the kernel would anyone else
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, m, **kw: real(p, m, **kw) and Path(p) != locked)
    try:
        for out in (locked, locked / "out"):
            assert main(["patch", str(TINY), "--out", str(out)]) == 2
            assert "not writable" in _one_line(capsys)
    finally:
        locked.chmod(0o755)
    assert list(locked.iterdir()) == []


@pytest.mark.parametrize("kind, name", [("patch", "autotune.yaml"), ("bake", "tiny.py"), ("search", "report.md")])
def test_a_read_only_output_in_autotunes_folder_is_refused_before_anything_runs(kind, name, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / MARKER).write_text("")
    (out / name).write_text("kept\n")
    (out / name).chmod(0o444)
    command = _command(kind, out, tmp_path)
    before = _snapshot(tmp_path)
    assert main(command) == 2
    line = _one_line(capsys)
    assert f"{out / name}: is read-only" in line
    assert _snapshot(tmp_path) == before


# --- atomic writes --------------------------------------------------------------------------------------------------

# Runs the CLI with every file opened for writing whose name is that of the target, or of a temporary file for it,
# hit right after it was opened: by SIGKILL (a crash mid-write), or by an OSError (a full disk).
_HOOKED_CLI = """
import errno, io, os, signal, sys, builtins
target, action = sys.argv[1], sys.argv[2]
_open = io.open
def hooked(file, mode="r", *args, **kwargs):
    f = _open(file, mode, *args, **kwargs)
    name = os.path.basename(os.readlink(f"/proc/self/fd/{f.fileno()}"))
    if any(c in mode for c in "wax+") and (name == target or name.startswith(f".{target}.")):
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        f.close()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return f
io.open = builtins.open = hooked
from autotune.cli import main
sys.exit(main(sys.argv[3:]))
"""


def _hooked_cli(target: str, action: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs Linux /proc")
    return subprocess.run(
        [sys.executable, "-c", _HOOKED_CLI, target, action, *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_sigkill_while_patching_in_place_never_leaves_a_truncated_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(CNN.read_text())
    run = _hooked_cli("train.py", "kill", ["patch", "train.py", "--in-place"], tmp_path)
    assert run.returncode == -signal.SIGKILL, run.stderr  # killed while writing train.py
    assert script.read_text() == CNN.read_text()


def test_a_failure_halfway_through_in_place_puts_every_file_back(project, capsys):
    before = _snapshot(project.parent)
    # train.py is written first, then the modules of mylib/: the disk is full when engine.py is written
    run = _hooked_cli("engine.py", "fail", ["patch", "train.py", "--in-place"], project.parent)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    err = run.stderr.strip()
    assert len(err.splitlines()) == 1 and "engine.py" in err and "No space left" in err and "put back" in err
    assert _snapshot(project.parent) == before  # train.py restored, no backup left behind


def test_a_read_only_module_stops_in_place_before_anything_is_written(project, capsys):
    (project.parent / "mylib" / "data.py").chmod(0o444)
    before = _snapshot(project.parent)
    assert main(["patch", str(project), "--in-place"]) == 2
    assert "data.py: is read-only" in _one_line(capsys)
    assert _snapshot(project.parent) == before


def test_in_place_keeps_modes_symlinks_and_every_backup(tmp_path):
    real = tmp_path / "src" / "train.py"
    real.parent.mkdir()
    real.write_text(CNN.read_text())
    real.chmod(0o750)
    link = tmp_path / "train.py"
    link.symlink_to(real)
    (real.parent / "autotune.yaml").write_text("# the user's own config\n")
    assert main(["patch", str(link), "--in-place"]) == 0  # the project is where the script really is: src/
    assert link.is_symlink() and "_autotune" in real.read_text()
    assert real.stat().st_mode & 0o777 == 0o750
    assert (real.parent / "train.py.orig").read_text() == CNN.read_text()
    assert (real.parent / "autotune.yaml.orig").read_text() == "# the user's own config\n"
    assert yaml.safe_load((real.parent / "autotune.yaml").read_text())["knobs"]


def test_write_file_replaces_atomically_and_keeps_the_mode(tmp_path):
    path = tmp_path / "a.txt"
    write_file(path, "one\n")
    assert path.stat().st_mode & 0o777 == 0o666 & ~_umask()  # a new file: as open() would make it
    path.chmod(0o640)
    inode = path.stat().st_ino
    write_file(path, b"two\n")
    assert path.read_bytes() == b"two\n" and path.stat().st_mode & 0o777 == 0o640
    assert path.stat().st_ino != inode  # a new file renamed over the old one, not the old one truncated
    assert [p.name for p in tmp_path.iterdir()] == ["a.txt"]  # no temporary file left


def test_an_output_replaces_a_link_in_autotunes_folder_never_the_file_it_points_to(tmp_path):
    mine = tmp_path / "my_train.py"
    mine.write_text("# the user's own script\n")
    out = tmp_path / "out"
    assert main(["patch", str(TINY), "--out", str(out)]) == 0
    (out / "tiny.py").unlink()
    (out / "tiny.py").symlink_to(mine)
    assert main(["patch", str(TINY), "--out", str(out)]) == 0
    assert mine.read_text() == "# the user's own script\n"
    assert not (out / "tiny.py").is_symlink() and "_autotune" in (out / "tiny.py").read_text()


@pytest.mark.parametrize("command", ["patch", "bake", "search"])
def test_an_out_that_is_a_dangling_link_is_refused_and_nothing_made_where_it_points(command, tmp_path, capsys):
    out = tmp_path / "out"
    out.symlink_to(tmp_path / "elsewhere")
    config = tmp_path / "c.yaml"
    config.write_text("knobs: {}\n")
    extra = {"patch": [], "bake": ["--config", str(config)], "search": ["--time-budget", "60"]}[command]
    assert main([command, str(TINY), "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"autotune: error: {out}: --out is a symbolic link to {tmp_path / 'elsewhere'}, which does not "
                   "exist; pass a folder"]
    assert not (tmp_path / "elsewhere").exists() and out.is_symlink()


def test_an_output_that_cannot_be_written_midway_is_one_line(tmp_path):
    run = _hooked_cli("patch.diff", "fail", ["patch", str(TINY), "--out", "out"], tmp_path)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    err = run.stderr.strip()
    assert len(err.splitlines()) == 1 and "patch.diff: cannot write it: No space left on device" in err
    assert not list((tmp_path / "out").glob(".*.tmp"))  # no temporary file left behind


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("case", ["not made by autotune", "a file", "below a file"])
def test_report_checks_its_output_folder_first(case, users_folder, tmp_path, capsys):
    from autotune.search.live import QuietDisplay
    from autotune.search.search import Search, SearchOptions
    from autotune.search.storage import open_storage
    from autotune.search.study import StudyStore

    options = SearchOptions(script=TINY, out=tmp_path / "unused", space=Path(_space(tmp_path)), study_name="s")
    search = Search(options, QuietDisplay())
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    StudyStore(open_storage(url), "s", machine="m (cpu)").adopt(search.fingerprint, search.space, search.ready.about(search.o))
    out = {"not made by autotune": users_folder, **_bad_outs(tmp_path)}[case]
    before = _snapshot(tmp_path)
    assert main(["report", "--storage", url, "--out", str(out)]) == 2
    line = _one_line(capsys)
    assert {"not made by autotune": "was not made by autotune", "a file": "must be a folder",
            "below a file": "which is a file"}[case] in line
    assert _snapshot(tmp_path) == before
