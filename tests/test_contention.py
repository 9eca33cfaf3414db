"""What else used the machine during a trial's measured steps (autotune.contention), read from /proc."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from autotune import contention
from autotune.contention import Reading, between

TICK = contention._TICK


def _fake_proc(root: Path, stat: str, procs: dict[int, tuple]) -> Path:
    """A /proc with ``stat`` and, for each pid, (command name, session, utime, stime[, parent pid])."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "stat").write_text(stat)
    (root / "self").mkdir(exist_ok=True)  # (not a pid: skipped)
    for pid, (comm, session, utime, stime, *parent) in procs.items():
        (root / str(pid)).mkdir()
        ppid = parent[0] if parent else 1
        # fields 3..: state ppid pgrp session tty_nr tpgid flags minflt cminflt majflt cmajflt utime stime ...
        (root / str(pid) / "stat").write_text(
            f"{pid} ({comm}) R {ppid} {session} {session} 0 -1 4194560 0 0 0 0 {utime} {stime} 0 0 20 0 1 0\n")
    return root


def test_the_machine_and_the_session_are_read_from_proc(tmp_path, monkeypatch):
    stat = "cpu  100 5 50 800 10 1 2 30 7 0\ncpu0 50 2 25 400 5 0 1 15 0 0\n"
    # a command name with spaces and parentheses does not shift the fields; another session's process is not ours
    proc = _fake_proc(tmp_path / "proc", stat, {11: ("python (x) y", 42, 60, 10), 12: ("worker", 42, 5, 5),
                                                13: ("other", 7, 500, 500)})
    monkeypatch.setattr(os, "getsid", lambda pid: 42)
    r = contention.read(str(proc))
    assert (r.busy, r.steal, r.total, r.own) == (100 + 5 + 50 + 1 + 2, 30, 100 + 5 + 50 + 800 + 10 + 1 + 2 + 30, 80)
    assert contention.read(str(tmp_path / "nowhere")) is None


def test_under_a_launcher_every_rank_of_the_trial_is_its_own_work(tmp_path, monkeypatch):
    # torchrun starts each rank in a session of its own: rank 1's processor time is the trial's, not other work
    stat = "cpu  100 5 50 800 10 1 2 30 7 0\n"
    proc = _fake_proc(tmp_path / "proc", stat, {
        10: ("autotune", 5, 1, 1, 4),  # the search, in the user's session
        20: ("torchrun", 20, 3, 1, 10),  # the trial the search started: its own session
        21: ("rank0", 21, 40, 10, 20), 23: ("loader worker", 21, 7, 3, 21),  # this process and its worker
        22: ("rank1", 22, 45, 5, 20),  # the other rank, in a session of its own
        30: ("other", 7, 500, 500, 4),  # other work
    })
    monkeypatch.setattr(os, "getpid", lambda: 21)
    monkeypatch.setattr(os, "getsid", lambda pid: 21)
    monkeypatch.delenv(contention.SEARCH_PID_ENV, raising=False)
    assert contention.read(str(proc)).own == 50 + 10  # outside a search: this session only (rank 0, its worker)
    monkeypatch.setenv(contention.SEARCH_PID_ENV, "10")
    assert contention.read(str(proc)).own == 4 + 50 + 10 + 50  # the trial's tree: the launcher and both ranks
    monkeypatch.setenv(contention.SEARCH_PID_ENV, "99")  # not an ancestor: this session, as outside a search
    assert contention.read(str(proc)).own == 60


def test_read_from_outside_the_trial_its_own_work_is_everything_below_the_search(tmp_path, monkeypatch):
    # the search's look during its first run: the search and its whole tree are its own, whatever the session
    stat = "cpu  100 5 50 800 10 1 2 30 7 0\n"
    proc = _fake_proc(tmp_path / "proc", stat, {
        10: ("autotune", 5, 2, 1, 4), 20: ("python", 20, 30, 5, 10), 21: ("worker", 20, 7, 3, 20),
        30: ("other", 7, 500, 500, 4), 31: ("its child", 7, 9, 1, 30),
    })
    monkeypatch.setattr(os, "getsid", lambda pid: 5)
    assert contention.read(str(proc), root=10).own == 3 + 35 + 10
    assert contention.read(str(proc), root=99).own == 0  # gone: nothing of its own
    assert contention.read(str(proc)).own == 3  # without a root: this session, as before


def test_between_two_readings_in_processors_worth():
    a = Reading(at=10.0, busy=1000, steal=0, total=4000, own=300)
    # 2 s on 2 processors: 4 s of ticks; the session used 2 s (1 processor), the machine 3.5 s busy, 0.2 s stolen
    b = Reading(at=12.0, busy=1000 + int(3.5 * TICK), steal=int(0.2 * TICK), total=4000 + 4 * TICK, own=300 + 2 * TICK)
    got = between(a, b)
    assert got == {"own": 1.0, "others": 0.75, "steal": 0.05, "cores": 2.0, "span_s": 2.0}
    assert between(a, Reading(at=10.1, busy=1001, steal=0, total=4010, own=300)) is None  # too short to say
    assert between(None, b) is None


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads Linux's /proc")
def test_a_trial_records_the_processors_other_work_took_from_its_steps(tmp_path):
    """A busy process beside the trial (in a session of its own) is other work; the trial's own steps are not."""
    from autotune.patch import run
    from autotune.project import load_project
    from autotune.search.trial import Outcome, Runner, TrialSettings

    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent('''
        import time
        import torch

        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(40):
            t = time.perf_counter()
            while time.perf_counter() - t < 0.03:  # a step that keeps one processor busy
                pass
            loss = model(torch.ones(2, 4)).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    ''').lstrip())
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    try:
        settings = TrialSettings((), tmp_path, "cpu", 2, 20, {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"})
        r = Runner(run(load_project(script)), tmp_path / "work", settings).run({}, "baseline", 300)
    finally:
        busy.kill()
        busy.wait()
    assert r.status is Outcome.OK, r.stderr_tail
    c = r.contention
    assert c is not None and c["span_s"] >= 0.5
    # the busy loop's processor (more where other work runs too), and the trial's own busy step: its share of a
    # processor, which other tests running beside this one cut (0.42 with a search and a loss test on 2 cores)
    assert c["others"] >= 0.5 and c["own"] >= 0.2, c


def test_the_noise_warning_names_the_other_work_the_runs_measured():
    from autotune.search.outcome import noise_warning
    from autotune.search.trial import Outcome, TrialResult

    def run(others, load=1.0, step=0.1):
        c = {"own": 2.0, "others": others, "steal": 0.0, "cores": 2.0, "span_s": 3.0} if others is not None else None
        return TrialResult(config={}, role="baseline", status=Outcome.OK, step_times=(step,), load=load, contention=c)

    busy = noise_warning(0.4, [run(0.1), run(1.2, step=0.14), run(0.9)], (2, 1))
    assert busy == ("this machine's timing is noisy: 3 runs of the baseline differ by 40% in step time (one against "
                    "those beside it: 34% rms), so one run's speedup below that is no evidence: the search keeps a "
                    "change only where it beats the noise twice over, and gives a verdict only on interleaved A/B "
                    "pairs; other work on the machine took up to 1.2 processors from the steps of 2 of these 3 runs: "
                    "stop it, or raise --confirm")
    quiet = noise_warning(0.4, [run(0.1), run(0.2)], (2, 1))
    assert "no other work took processors from their steps (at most 0.2)" in quiet
    unread = noise_warning(0.4, [run(None, load=3.5), run(None, load=3.5)], (2, 1))  # (a runtime that did not read)
    assert "load average 3.5" in unread and "other processes compete" in unread


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _readings(others_cores: float, own_cores: float, span: float = 20.0):
    """Two readings ``span`` seconds apart on 2 processors: the search's tree used ``own_cores``, others the rest."""
    a = Reading(at=0.0, busy=1000, steal=0, total=4000, own=300)
    busy = int((own_cores + others_cores) * span * TICK)
    b = Reading(at=span, busy=1000 + busy, steal=0, total=4000 + int(2 * span * TICK), own=300 + int(own_cores * span * TICK))
    return [a, b]


def test_the_first_run_watch_says_other_work_once_twenty_seconds_in():
    from autotune.search.crowd import WATCH_S, FirstRunWatch

    notes, clock, reads = [], _Clock(), _readings(others_cores=1.0, own_cores=1.0)
    asked = []

    def read(root):
        asked.append(root)
        return reads.pop(0)

    watch = FirstRunWatch(notes.append, root=123, read=read, clock=clock)
    watch()  # the first poll: the first reading
    clock.now += WATCH_S - 1
    watch()
    assert notes == [] and asked == [123]  # not yet: one reading only
    clock.now += 1
    watch()
    assert len(notes) == 1 and asked == [123, 123]
    assert notes[0].startswith("warning: other work on this machine is taking 1.0 of its 2 processors while the "
                               "first run goes (20s in)")
    clock.now += 60
    watch()
    assert len(notes) == 1 and len(asked) == 2  # said once; no more reading


def test_the_first_run_watch_is_quiet_on_an_idle_machine_or_without_proc():
    from autotune.search.crowd import WATCH_S, FirstRunWatch

    notes, clock = [], _Clock()
    reads = _readings(others_cores=0.1, own_cores=1.9)
    watch = FirstRunWatch(notes.append, root=1, read=lambda root: reads.pop(0), clock=clock)
    watch()
    clock.now += WATCH_S
    watch()
    assert notes == [] and watch.seen["others"] == 0.1
    watch = FirstRunWatch(notes.append, root=1, read=lambda root: None, clock=clock)  # no /proc
    watch()
    clock.now += WATCH_S
    watch()
    assert notes == [] and watch.seen is None and watch.done


def test_a_trials_wait_calls_its_watch_while_the_run_goes():
    from autotune.search.trial import Runner

    calls = []
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    rc, timed_out, hung = Runner._wait(proc, lambda: False, 30.0, proc.kill, lambda: calls.append(1))
    assert (rc, timed_out, hung) == (0, False, False)
    assert len(calls) >= 2
