"""A trial's processes: every one it starts ends with it, however it left the trial's process group."""

from __future__ import annotations

import getpass
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from procs import alive, wait_gone

from autotune.project import load_project
from autotune.patch import run, select
from autotune.search.trial import Outcome, Runner, TrialSettings, _mp_tempdir, _subreaper

REPO = Path(__file__).resolve().parent.parent
ORPHANS = REPO / "fixtures" / "search" / "orphans.py"

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fixture forks; /proc is Linux's")


@pytest.fixture
def pids(tmp_path):
    """The folder the fixture's left-behind processes write their ids into; any still running are killed after."""
    folder = tmp_path / "pids"
    folder.mkdir()
    yield folder
    for pid in _pids(folder):
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def _pids(folder: Path) -> list[int]:
    return [int(p.name) for p in folder.iterdir()]


def _runner(tmp_path: Path, pids: Path, *extra: str) -> Runner:
    # the trial works in a folder of its own: what it writes under its working directory never leaves its overlay
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    settings = TrialSettings(("--pids", str(pids), *extra), run_dir, "cpu", 1, 2, {"CUDA_VISIBLE_DEVICES": ""})
    return Runner(run(load_project(ORPHANS), select()), tmp_path / "work", settings)


def _when_started(pids: Path, then: BaseException | None = None):
    """An on_start that waits until the trial's two left-behind processes run (the trial's timeout starts after it),
    then raises ``then``, as an interrupt during the trial would."""

    def on_start(pid: int) -> None:
        deadline = time.monotonic() + 60
        while len(_pids(pids)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        if then is not None:
            raise then

    return on_start


@pytest.mark.parametrize("how", ["finished", "timeout", "interrupted"])
def test_nothing_a_trial_started_outlives_it(how, tmp_path, pids):
    runner = _runner(tmp_path, pids, *(["--hang"] if how == "timeout" else []))
    try:
        if how == "interrupted":
            with pytest.raises(KeyboardInterrupt):
                runner.run({}, "baseline", 60, on_start=_when_started(pids, KeyboardInterrupt()))
        else:
            result = runner.run({}, "baseline", 2 if how == "timeout" else 60, on_start=_when_started(pids))
            assert result.status is (Outcome.TIMEOUT if how == "timeout" else Outcome.OK), result.error
    finally:
        runner.cleanup()
    left = _pids(pids)
    assert len(left) == 2  # the child in a session of its own that ignores SIGTERM, and its daemon
    assert wait_gone(left, 5) == []


def test_the_search_is_a_subreaper_only_while_it_runs_trials(tmp_path, pids):
    before = _subreaper()
    runner = _runner(tmp_path, pids)
    assert runner.subreaper  # Linux: a trial's orphans are re-parented to the search
    runner.cleanup()
    assert _subreaper() == before


@pytest.mark.slow
def test_a_search_leaves_no_process_of_its_trials_behind(tmp_path, pids):
    space = tmp_path / "space.yaml"
    space.write_text("knobs:\n  gc.freeze: [false, true]\n")
    cmd = ["search", ORPHANS, "--out", tmp_path / "out", "--space", space, "--device", "cpu", "--steps", "4",
           "--warmup", "1", "--confirm", "5", "--", "--pids", pids]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    (tmp_path / "run").mkdir()  # the search's working directory, whose trials see it as an overlay (not pids)
    done = subprocess.run([sys.executable, "-m", "autotune", *map(str, cmd)], cwd=tmp_path / "run", env=env,
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    left = _pids(pids)
    assert len(left) >= 2 * 4  # two baselines, the candidate and a confirmation pair, each leaving two
    assert wait_gone(left, 5) == []


# A loop over a DataLoader with worker processes: each worker passes its batches' tensors through a listening socket
# in multiprocessing's temporary folder, which it removes only as it exits by itself, never when the search kills it.
WORKERS = '''
import torch
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
loader = DataLoader(TensorDataset(torch.randn(256, 4), torch.randn(256, 1)), batch_size=8, num_workers=2)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for x, y in loader:
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
'''


def _trial_in(temp: Path, tmp_path: Path, body: str, run_dir: Path | None = None, whole: bool = False):
    """One trial of ``body`` run from ``run_dir`` (the folder its overlay covers) with ``temp`` as its temporary
    folder."""
    script = tmp_path / "code" / "train.py"
    script.parent.mkdir()
    script.write_text(body)
    settings = TrialSettings((), run_dir or tmp_path, "cpu", 1, 2, {"CUDA_VISIBLE_DEVICES": "", "TMPDIR": str(temp)})
    runner = Runner(run(load_project(script)), tmp_path / "work", settings)
    try:
        return runner.run({}, "whole" if whole else "baseline", timeout=120, **({"whole": True} if whole else {}))
    finally:
        runner.cleanup()


@pytest.mark.parametrize("whole", [False, True], ids=["window", "whole"])
def test_a_trials_multiprocessing_files_go_with_it(whole, tmp_path, temp):
    result = _trial_in(temp, tmp_path, WORKERS, whole=whole)
    assert result.status is Outcome.OK, (result.error, result.stderr_tail)
    assert [name for name in os.listdir(temp) if name.startswith(("pymp-", "atmp-"))] == []


def test_where_a_socket_would_not_fit_in_the_search_s_folder_the_trial_makes_its_own(tmp_path, monkeypatch):
    # 75 characters: multiprocessing's own /pymp-12345678/listener-12345678 fits in 107, the search's folder does not
    long = tmp_path / ("t" * (75 - len(str(tmp_path)) - 1))
    long.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long))
    result = _trial_in(long, tmp_path, WORKERS)
    assert result.status is Outcome.OK, (result.error, result.stderr_tail)  # (a worker's socket too long: it hung)
    assert not [name for name in os.listdir(long) if name.startswith("atmp-")]


def test_the_folder_a_killed_search_left_is_swept_by_the_next(temp):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = temp / f"atmp-{int(dead.stdout)}-abcdefgh"  # a search killed by SIGKILL, its pid now gone
    (left / "pymp-x").mkdir(parents=True)
    alive_one = temp / f"atmp-{os.getppid()}-abcdefgh"  # a search still running (this test's parent process)
    alive_one.mkdir()
    made = Path(_mp_tempdir())
    assert made.parent == temp and made.name.startswith(f"atmp-{os.getpid()}-")
    assert sorted(p.name for p in temp.iterdir()) == sorted([made.name, alive_one.name])


# A run that writes into torch.compile's default cache (as compiling does) and elsewhere in the temporary folder.
CACHES = '''
import getpass
import os
import tempfile

import torch

open(os.path.join(tempfile.gettempdir(), "torchinductor_" + getpass.getuser(), "compiled"), "w").close()
open(os.path.join(tempfile.gettempdir(), "scratch"), "w").close()
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(5):
    loss = model(torch.ones(2, 4)).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
'''


def test_torch_compiles_cache_stays_real_where_the_temporary_folder_is_inside_an_overlay(tmp_path, monkeypatch):
    # a search run from /tmp: its trials see /tmp as an overlay, so what compiling leaves there would be lost
    run_dir = tmp_path / "run"
    temp = run_dir / "tmp"
    temp.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    result = _trial_in(temp, tmp_path, CACHES, run_dir)
    assert result.status is Outcome.OK, (result.error, result.stderr_tail)
    assert sorted(p.relative_to(temp).as_posix() for p in temp.rglob("*")) == [
        f"torchinductor_{getpass.getuser()}", f"torchinductor_{getpass.getuser()}/compiled"]
