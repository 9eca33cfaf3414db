"""A trial's processes: every one it starts ends with it, however it left the trial's process group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procs import alive, wait_gone

from autotune.project import load_project
from autotune.patch import run, select
from autotune.search.trial import Outcome, Runner, TrialSettings, _subreaper

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
