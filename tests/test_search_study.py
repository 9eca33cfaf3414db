"""The shared study without running trials: storages, claims between workers, dead workers, machines kept apart."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from autotune.cli import main
from autotune.errors import UsageError
from autotune.search import storage as storage_mod
from autotune.search import study as study_mod
from autotune.search.live import QuietDisplay
from autotune.search.options import SearchOptions
from autotune.search.outcome import local_speedups
from autotune.search.search import Search
from autotune.search.storage import StudyDamaged, open_storage
from autotune.search.study import ROLE_SEARCH, ROLE_YIELDED, StudyStore
from autotune.search.trial import Outcome, TrialResult

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "fixtures" / "search" / "tiny.py"


def _space(tmp_path: Path) -> Path:
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump({"knobs": {"fused_optimizer.impl": ["default", "foreach"], "gc.freeze": [False, True]}}))
    return path


def _search(tmp_path: Path, script: Path = TINY, **kw) -> Search:
    options = SearchOptions(script=script, out=tmp_path / "out", space=_space(tmp_path), study_name="s", **kw)
    return Search(options, QuietDisplay())


def _store(search: Search, storage, worker: str, machine: str = "m (cpu)") -> StudyStore:
    """A worker's view of the study; two in one process are told apart by the worker name they write."""
    store = StudyStore(storage, search.study_name, machine=machine)
    store.adopt(search.fingerprint, search.space, search.ready.about(search.o))
    store.worker = worker
    return store


def _result(config, role="search", host="a", step=0.01, losses=((1.0,), (0.9,)), number=None, status=Outcome.OK, attrs=None):
    return TrialResult(
        config=dict(config),
        role=role,
        status=status,
        step_times=(step, step),
        losses=tuple(losses),
        number=number,
        host=host,
        device_name="cpu",
        attrs=attrs or {},
    )


@pytest.fixture(params=["sqlite", "journal"])
def storage(request, tmp_path):
    if request.param == "sqlite":
        return open_storage(f"sqlite:///{tmp_path / 'study.db'}")
    return open_storage(str(tmp_path / "study.log"))


# --- two workers on one study ----------------------------------------------------------------------------------


def test_the_earlier_claim_holds_and_the_later_worker_steps_aside(tmp_path, storage):
    search = _search(tmp_path)
    one, two = _store(search, storage, "host-a:1"), _store(search, storage, "host-b:2")
    config = {"fused_optimizer.impl": "foreach", "gc.freeze": False}
    first, second = one.ask(config), two.ask(config)
    assert one.params(first) == two.params(second) == config  # fixed without enqueue_trial: nobody else's to take
    claim = '["search", "program"]'
    one.label(first, ROLE_SEARCH, claim)
    two.label(second, ROLE_SEARCH, claim)
    assert second.number > first.number
    assert one.holds(first, claim) and not two.holds(second, claim)
    two.step_aside(second)
    _, claims = two.refresh()
    assert claims == {claim}  # what the other worker is measuring: taken
    assert one.refresh()[1] == set()  # its own claims are not taken from itself
    states = {t.number: (t.state.name, t.user_attrs["role"]) for t in one.study.get_trials()}
    assert states[second.number] == ("FAIL", ROLE_YIELDED)
    one.record(first, _result(config, number=first.number), 1.2)
    assert one.refresh()[1] == set()
    # finished, the claim still holds against a worker that asks for the same program later
    late = two.ask(config)
    two.label(late, ROLE_SEARCH, claim)
    assert not two.holds(late, claim)


def test_a_queued_trial_never_runs_in_place_of_the_configuration_asked_for(tmp_path, storage):
    search = _search(tmp_path)
    one = _store(search, storage, "host-a:1", "a (cpu)")
    # an older autotune queued a confirmation run for its own machine with enqueue_trial: any worker's ask() pops it
    other = {"fused_optimizer.impl": "foreach", "gc.freeze": True}
    one.study.enqueue_trial(other, user_attrs={"role": "confirm", "pair": 0, "arm": "candidate"})
    base = search.space.baseline()
    trial = one.ask(base)
    assert one.params(trial) == base
    queued = one.study.get_trials()[0]
    assert queued.number != trial.number and queued.state.name == "FAIL" and "queued" in queued.user_attrs["note"]


def test_a_dead_workers_trial_on_this_host_is_closed_and_its_claim_freed(tmp_path, storage):
    search = _search(tmp_path)
    one = _store(search, storage, "me:1")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    two = _store(search, storage, f"{one.host}:{dead.pid}")  # a worker of this host whose process is gone
    trial = two.ask({"fused_optimizer.impl": "foreach", "gc.freeze": True})
    two.label(trial, ROLE_SEARCH, '["search", "x"]')
    container = _store(search, storage, f"{one.host}:{dead.pid}")
    container._processes = "another-boot/pid:[1]"  # same host name, other pid namespace: that pid means nothing here
    elsewhere = container.ask({"fused_optimizer.impl": "foreach", "gc.freeze": False})
    container.label(elsewhere, ROLE_SEARCH, '["search", "y"]')
    _, claims = one.refresh()
    assert claims == {'["search", "y"]'}
    states = [t.state.name for t in one.study.get_trials()]
    assert states[trial.number] == "FAIL" and states[elsewhere.number] == "RUNNING"


def test_a_trial_running_far_past_its_timeout_on_another_host_is_closed(tmp_path, storage, monkeypatch):
    search = _search(tmp_path)
    one = _store(search, storage, "me:1")
    two = _store(search, storage, "elsewhere:7")
    trial = two.ask({"fused_optimizer.impl": "foreach", "gc.freeze": True})
    two.label(trial, ROLE_SEARCH, '["search", "x"]')
    two.started(trial, 12345, 0.0)
    monkeypatch.setattr(study_mod, "STALE_MARGIN_S", 0.05)
    assert one.refresh()[1] == {'["search", "x"]'}  # first seen running: its worker may be fine
    import time

    time.sleep(0.1)
    assert one.refresh()[1] == set()
    assert one.study.get_trials()[trial.number].state.name == "FAIL"


def test_a_result_whose_trial_was_closed_meanwhile_is_kept_in_a_new_trial(tmp_path, storage):
    search = _search(tmp_path)
    one = _store(search, storage, "me:1")
    config = {"fused_optimizer.impl": "foreach", "gc.freeze": False}
    trial = one.ask(config)
    one.label(trial, ROLE_SEARCH)
    one.study.tell(trial.number, state=__import__("optuna").trial.TrialState.FAIL)  # another worker took it for dead
    number = one.record(trial, _result(config), 1.1)
    assert number != trial.number
    assert [r.number for r in one.results()] == [number]


# --- machines are never compared with each other -------------------------------------------------------------


def test_local_speedups_use_only_the_same_machines_baselines():
    base = {"k": 0}
    runs = [
        _result(base, role="baseline", host="fast", step=0.01, number=0),
        _result(base, role="baseline", host="slow", step=0.10, number=1),
        _result({"k": 1}, host="fast", step=0.005, number=2),
        _result({"k": 2}, host="slow", step=0.05, number=3),
        _result(base, role="baseline", host="slow", step=0.10, number=4),
        _result(base, role="baseline", host="fast", step=0.01, number=5),
    ]
    assert local_speedups(runs) == {2: pytest.approx(2.0), 3: pytest.approx(2.0)}


def test_each_machines_runs_are_gated_against_its_own_baseline(tmp_path):
    search = _search(tmp_path)
    base = search.space.baseline()
    foreach = {**base, "fused_optimizer.impl": "foreach"}
    gc = {**base, "gc.freeze": True}  # exact numerics: any loss difference fails
    other_cpu = ((1.0,), (0.8,))  # another CPU model rounds differently: its own baseline differs from ours
    search.results = [
        _result(base, role="baseline", host="a", number=0),
        _result(base, role="baseline", host="b", losses=other_cpu, number=1),
        _result(base, role="baseline", host="a", number=2),
        _result(base, role="baseline", host="b", losses=other_cpu, number=3),
        _result(gc, host="b", losses=other_cpu, step=0.005, number=4),
        _result(foreach, host="a", losses=other_cpu, step=0.005, number=5),
        _result(base, role="baseline", host="b", losses=other_cpu, number=6),
        _result(base, role="baseline", host="a", number=7),
    ]
    gated = {r.number: r for r in search.regate(search.results)}
    assert gated[4].status is Outcome.OK and gated[4].deviation == 0.0
    assert gated[5].status is Outcome.DIVERGED
    b = search.results[1].machine
    assert b == "b (cpu)" and search._reference(b).number == 1 and search.noise(b).runs == 3
    assert [c for c, _ in search.candidates()] == [gc]


def test_the_descent_compares_each_run_with_the_baseline_runs_nearest_it_in_time(tmp_path):
    from autotune.search.view import StudyView

    search = _search(tmp_path)
    base = search.space.baseline()
    gc = {**base, "gc.freeze": True}
    foreach = {**base, "fused_optimizer.impl": "foreach"}
    # the machine slows down over the search: 10, 10, 10 ms a baseline step, then 20 ms; gc.freeze runs 10% faster
    # than the baseline around it, foreach as fast as it
    search.results = [
        _result(base, role="baseline", step=0.010, number=0),
        _result(base, role="baseline", step=0.010, number=1),
        _result(base, role="baseline", step=0.010, number=2),
        _result(gc, step=0.0136, number=3),
        _result(base, role="baseline", step=0.020, number=4),
        _result(foreach, step=0.020, number=5),
    ]
    assert search.value_of(search.results[3]) == pytest.approx(0.735, abs=0.001)  # against the 3 before it: slower
    settled = search.settled()
    assert settled[3] == pytest.approx(0.015 / 0.0136)  # against the mean of 10 ms before and 20 ms after: 1.10x
    assert settled[5] == pytest.approx(1.0)  # no baseline run after it yet: the one before
    view = StudyView(search)
    assert view.observed(gc).speedup == pytest.approx(1.103, abs=0.001)
    assert view.observed(foreach).speedup == pytest.approx(1.0)
    assert [c for c, _ in search.candidates()] == [gc]


def test_a_baseline_that_drifts_steadily_asks_a_smaller_margin_than_the_same_runs_in_disorder():
    from autotune.search.view import MIN_MARGIN, margin

    def runs(*steps):
        return [_result({}, role="baseline", step=s, number=i) for i, s in enumerate(steps)]

    drifting = margin(runs(0.010, 0.011, 0.012, 0.013))
    disorder = margin(runs(0.010, 0.013, 0.011, 0.012))
    assert drifting == pytest.approx(0.125, abs=0.002)  # each run against the mean of its neighbours
    assert disorder > 2.5 * drifting
    assert margin(runs(0.010, 0.010, 0.010)) == MIN_MARGIN and margin(runs(0.010)) == MIN_MARGIN


# --- storages and autotune report's bad input --------------------------------------------------------------------


def test_a_search_database_path_opens_as_sqlite_and_other_paths_as_journal_files(tmp_path):
    import sqlite3

    db = tmp_path / "study.db"
    sqlite3.connect(db).executescript("create table t (x); drop table t")  # an SQLite database without tables
    assert open_storage(str(db)).description == f"sqlite:///{db}"
    assert open_storage(str(db)).description == f"sqlite:///{db}"  # and a study's database opens again
    journal = open_storage(str(tmp_path / "j.log"))
    assert type(journal.optuna).__name__ == "JournalStorage" and journal.heartbeat is None
    with pytest.raises(UsageError, match="folder of the journal file does not exist"):
        open_storage(str(tmp_path / "nope" / "j.log"))
    # another worker is writing the journal's first line at this moment: still a journal
    (tmp_path / "new.log").write_text('{"op_code":0,"worker_id":"w-1","study_na')
    assert open_storage(str(tmp_path / "new.log")).file == tmp_path / "new.log"


# --- the user's files are never written to -------------------------------------------------------------------


def _user_files(tmp_path: Path) -> dict[str, bytes]:
    import sqlite3

    (tmp_path / "notes.txt").write_text("my notes\n")
    (tmp_path / "train.py").write_text(TINY.read_text())
    (tmp_path / "data.json").write_text('{"a": 1}\n')  # JSON, but not Optuna's journal
    conn = sqlite3.connect(tmp_path / "plain.db")
    conn.execute("create table users (name)")
    conn.commit()
    conn.close()
    return {name: (tmp_path / name).read_bytes() for name in ("notes.txt", "train.py", "data.json", "plain.db")}


@pytest.mark.parametrize("command", ["search", "report"])
def test_a_storage_file_that_is_not_a_study_is_refused_and_left_as_it_was(command, tmp_path, capsys):
    before = _user_files(tmp_path)
    for name in before:
        if command == "search":
            argv = ["search", TINY, "--out", tmp_path / "out", "--storage", tmp_path / name, "--", "--iters", "12"]
        else:
            argv = ["report", "--storage", tmp_path / name, "--out", tmp_path / "out"]
        rc, err = _cli(argv, capsys)
        assert rc == 2 and len(err.splitlines()) == 1 and name in err, err
        assert "Traceback" not in err and "Error:" not in err  # (no JSONDecodeError from a Python file)
        assert not (tmp_path / "out").exists()  # a refusal writes nothing, not even the output folder's marker
    assert {name: (tmp_path / name).read_bytes() for name in before} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(before)  # no .lock left either


def test_report_opens_a_study_database_read_only_and_refuses_one_without_a_study(tmp_path, capsys):
    import sqlite3

    url = f"sqlite:///{tmp_path / 'empty.db'}"
    sqlite3.connect(tmp_path / "empty.db").executescript("create table t (x); drop table t")
    rc, err = _cli(["report", "--storage", url, "--out", tmp_path / "r"], capsys)
    assert rc == 2 and "holds no Optuna study" in err
    empty = sqlite3.connect(tmp_path / "empty.db")
    assert empty.execute("select name from sqlite_master").fetchall() == []  # no table made in it
    empty.close()
    rc, err = _cli(["report", "--storage", tmp_path / "absent.db", "--out", tmp_path / "r"], capsys)
    assert rc == 2 and not (tmp_path / "absent.db").exists()

    search = _search(tmp_path)
    _store(search, open_storage(f"sqlite:///{tmp_path / 'study.db'}"), "a:1")
    store = StudyStore(open_storage(str(tmp_path / "study.db"), must_exist=True), "s", create=False)
    assert store.about()["script"] == str(TINY)
    with pytest.raises(storage_mod.StorageFailed, match="cannot be written .read-only.; the trials finished so far"):
        store.ask(search.space.baseline())  # the database itself refuses writes


def test_a_study_file_deleted_during_the_search_stops_it_saying_its_trials_are_gone(tmp_path, storage, monkeypatch):
    search = _search(tmp_path)
    store = _store(search, storage, "a:1")
    config = search.space.baseline()
    trial = store.ask(config)
    store.label(trial, "baseline")
    store.record(trial, _result(config, role="baseline", number=trial.number), 1.0)
    storage.file.unlink()
    monkeypatch.setattr(storage_mod, "STORAGE_WAIT_S", 0.0)
    with pytest.raises(storage_mod.StorageFailed) as info:
        store.label(store.ask(config), "baseline")
    message = str(info.value)
    assert "was deleted, moved or replaced" in message and "no longer there" in message
    assert "kept" not in message and "resume" not in message


# --- passwords -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://u:secret@127.0.0.1:1/db",
        "postgresql://u@127.0.0.1:1/db?password=secret",
        "mysql://u@127.0.0.1:1/db?passwd=secret&charset=utf8mb4",
        "mysql://u@127.0.0.1:1/db?PWD=secret",
        "postgresql://u@127.0.0.1:1/db?sslpassword=secret",
        "postgresql://u:secret@host:port/db",  # does not parse
        "postgresql://u@host:port/db?password=secret",
    ],
)
def test_a_storage_password_is_never_shown(url, tmp_path, capsys):
    rc, err = _cli(["report", "--storage", url, "--out", tmp_path / "r"], capsys)
    assert rc == 2 and "secret" not in err and "***" in err and len(err.splitlines()) == 1


def test_a_password_in_the_query_is_not_written_to_the_outputs(tmp_path):
    from autotune.search.storage import _hidden

    # the outputs name the storage by its description: check it hides every form a driver takes
    for url in ("postgresql://u@h/db?password=secret&x=1", "mysql://u@h/db?passwd=secret", "mysql://u:secret@h/db"):
        import sqlalchemy

        shown = _hidden(sqlalchemy.engine.make_url(url).render_as_string(hide_password=True))
        assert "secret" not in shown and "***" in shown and shown.startswith(url.split("://")[0])


def test_the_storage_can_come_from_the_environment(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(storage_mod.STORAGE_ENV, "postgresql://u@127.0.0.1:1/db?password=secret")
    rc, err = _cli(["report", "--out", tmp_path / "r"], capsys)  # no --storage: AUTOTUNE_STORAGE
    assert rc == 2 and "cannot open the study storage postgresql://u@127.0.0.1:1/db?password=***" in err
    rc, err = _cli(["report", "--storage", tmp_path / "missing.log", "--out", tmp_path / "r"], capsys)
    assert rc == 2 and "missing.log" in err  # the command line comes first
    monkeypatch.delenv(storage_mod.STORAGE_ENV)
    rc, err = _cli(["report", "--out", tmp_path / "r"], capsys)
    assert rc == 2 and "--storage" in err and storage_mod.STORAGE_ENV in err


def _cli(argv, capsys):
    rc = main([str(a) for a in argv])
    return rc, capsys.readouterr().err.strip()


@pytest.mark.parametrize(
    "storage, message",
    [
        ("postgresql://u:secret@127.0.0.1:1/db", "cannot open the study storage postgresql://u:***@127.0.0.1:1/db"),
        ("postgresql://u@host:port/db", "is not a database URL"),
        ("nosuch://x", "cannot open the study storage nosuch://x"),
        ("{tmp}/missing.log", "no such journal file"),
        ("", "--storage is empty"),  # not taken for the default
    ],
    ids=["refused", "bad-url", "unknown-dialect", "no-journal", "empty"],
)
@pytest.mark.parametrize("command", ["search", "report"])
def test_bad_storage_is_one_line_and_exit_2_and_writes_nothing(command, storage, message, tmp_path, capsys):
    storage = storage.format(tmp=tmp_path)
    if command == "search":
        message = message.replace("no such journal file", "the folder of the journal file does not exist")
        storage = storage.replace("missing.log", "nowhere/missing.log")
        argv = ["search", TINY, "--out", tmp_path / "r", "--storage", storage, "--", "--iters", "12"]
    else:
        argv = ["report", "--storage", storage, "--out", tmp_path / "r"]
    rc, err = _cli(argv, capsys)
    assert rc == 2 and message in err and len(err.splitlines()) == 1 and "secret" not in err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("url, extra", [("postgresql://u@127.0.0.1:1/db", "postgres"), ("mysql://u@127.0.0.1:1/db", "mysql")])
def test_a_missing_database_driver_says_which_extra_to_install(url, extra, monkeypatch, tmp_path, capsys):
    for module in ("psycopg", "psycopg2", "MySQLdb", "pymysql"):
        monkeypatch.setitem(sys.modules, module, None)  # what `import` sees when it is not installed
    rc, err = _cli(["report", "--storage", url, "--out", tmp_path / "r"], capsys)
    assert rc == 2 and f"pip install 'autotune[{extra}]'" in err and len(err.splitlines()) == 1


def test_report_refuses_unknown_studies_changed_scripts_and_empty_studies(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(TINY.read_text())
    search = _search(tmp_path, script=script, args=("--iters", "12"))
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    _store(search, open_storage(url), "me:1")
    out = tmp_path / "r"

    rc, err = _cli(["report", "--storage", url, "--study-name", "nope", "--out", out], capsys)
    assert rc == 2 and "no study named 'nope'" in err and "(it has: s)" in err

    rc, err = _cli(["report", "--storage", url, "--out", out], capsys)  # its only study
    assert rc == 2 and "study 's' has no finished trials yet" in err

    script.write_text(TINY.read_text().replace("lr=1e-3", "lr=2e-3"))
    rc, err = _cli(["report", "--storage", url, "--study-name", "s", "--out", out], capsys)
    assert rc == 2 and "changed since study 's' was made" in err and len(err.splitlines()) == 1

    rc, err = _cli(["report", "--storage", url, "--script", tmp_path / "gone.py", "--out", out], capsys)
    assert rc == 2 and "gone.py" in err and "--script" in err
    assert not out.exists()


def test_heartbeat_setting_is_checked(monkeypatch):
    monkeypatch.setenv(storage_mod.HEARTBEAT_ENV, "soon")
    with pytest.raises(UsageError, match="whole number of seconds"):
        storage_mod.heartbeat_interval()
    monkeypatch.setenv(storage_mod.HEARTBEAT_ENV, "3")
    assert storage_mod.heartbeat_interval() == 3
    monkeypatch.delenv(storage_mod.HEARTBEAT_ENV)
    assert storage_mod.heartbeat_interval() == storage_mod.HEARTBEAT_S


def test_a_machine_is_named_by_its_host_and_device(monkeypatch):
    from autotune.search.machine import HOST_ENV, this_machine

    monkeypatch.setenv(HOST_ENV, "rack-7")
    m = this_machine("cpu")
    assert m.host == "rack-7" and m.device.endswith(" cores") and m.key == f"rack-7 ({m.device})"
    monkeypatch.delenv(HOST_ENV)
    assert this_machine("cpu").host == os.uname().nodename


def test_report_without_storage_reads_the_study_of_its_output_folder(tmp_path, capsys, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text(TINY.read_text())
    search = _search(tmp_path, script=script, args=("--iters", "12"))
    monkeypatch.delenv("AUTOTUNE_STORAGE", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["report"]) == 2  # no study anywhere: one line that says where it looked
    assert "autotune-out/study.db does not exist" in capsys.readouterr().err
    out = tmp_path / "autotune-out"
    out.mkdir()
    (out / ".autotune-out").write_text("")
    store = _store(search, open_storage(f"sqlite:///{out / 'study.db'}"), "a:1", "a (cpu)")
    for config, role in [(search.space.baseline(), "baseline")] * 2:
        trial = store.ask(config)
        store.label(trial, role)
        store.record(trial, _result(config, role=role, number=trial.number), 1.0)
    assert main(["report"]) == 0, capsys.readouterr().err
    assert yaml.safe_load((out / "autotune.yaml").read_text())["search"]["runs"] == 2


def test_search_help_names_the_device_default(capsys):
    with pytest.raises(SystemExit):
        main(["search", "--help"])
    assert "(default: auto, CUDA where torch sees a GPU, else the CPU)" in " ".join(capsys.readouterr().out.split())


def test_report_writes_a_studys_outputs_and_says_when_nothing_was_confirmed(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(TINY.read_text())
    search = _search(tmp_path, script=script, args=("--iters", "12"))
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    store = _store(search, open_storage(url), "a:1", "a (cpu)")
    base = search.space.baseline()
    fast = {**base, "gc.freeze": True}
    for config, role, step in [(base, "baseline", 0.02), (base, "baseline", 0.02), (fast, "search", 0.01), (base, "baseline", 0.02)]:
        trial = store.ask(config)
        store.label(trial, role)
        store.record(trial, _result(config, role=role, step=step, number=trial.number), 1.0)
    out = tmp_path / "r"
    rc = main(["report", "--storage", url, "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    doc = yaml.safe_load((out / "autotune.yaml").read_text())
    assert doc["winner"] == "baseline" and doc["changed"] == {}
    assert "no candidate was confirmed in A/B pairs yet" in doc["verdict"] and "gc.freeze=true, 2.000x" in doc["verdict"]
    assert doc["machine"] == "a (cpu)" and doc["search"]["runs"] == 4
    # nothing kept: the tuned script is the original, and no (empty) tuned.diff, which `git apply` would refuse
    assert (out / "train.py").read_text() == script.read_text() and not (out / "tuned.diff").exists()
    report = (out / "report.md").read_text()
    assert "no trial run" in report and "(first trial start to last trial end)" in report
    assert "no `tuned.diff`: the tuned script is the original" in report
    printed = capsys.readouterr().out
    assert "the study's runs took" in printed and "your script, unchanged: no tuned.diff" in printed


def test_the_study_span_counts_side_by_side_trials_once(tmp_path, storage):
    import time

    search = _search(tmp_path)
    one, two = _store(search, storage, "host-a:1", "a (cpu)"), _store(search, storage, "host-b:2", "b (cpu)")
    a = one.ask({"fused_optimizer.impl": "foreach", "gc.freeze": False})
    time.sleep(0.02)
    b = two.ask({"fused_optimizer.impl": "foreach", "gc.freeze": True})  # runs beside a
    time.sleep(0.02)
    one.record(a, _result(a.params, host="a", number=a.number), 1.0)
    time.sleep(0.02)
    two.record(b, _result(b.params, host="b", number=b.number), 1.0)
    trials = one.study.get_trials()
    each = [(t.datetime_complete - t.datetime_start).total_seconds() for t in trials]
    span = one.span_s()
    assert span == (max(t.datetime_complete for t in trials) - min(t.datetime_start for t in trials)).total_seconds()
    assert 0 < span < sum(each)  # the sum would count the overlap twice


def test_a_configuration_that_compiles_gets_the_longer_timeout(tmp_path):
    from autotune.search.costs import COMPILE_MIN_TIMEOUT_S, FIRST_TIMEOUT_S

    search = _search(tmp_path)
    search.results = []  # nothing measured yet: the first timeout
    compiling = [k for k in search.patch.knobs if k.compiles]
    assert [k.name for k in compiling] == ["compile.mode"]  # declared by the knob, not known to the search by name
    base = search.space.baseline()
    assert search.costs.timeout(base) == (FIRST_TIMEOUT_S, False)
    assert search.costs.timeout({**base, "compile.mode": "default"}) == (max(FIRST_TIMEOUT_S, COMPILE_MIN_TIMEOUT_S), False)
    assert search.costs.timeout({**base, "compile.scope": "blocks"}) == (FIRST_TIMEOUT_S, False)  # no compile without a mode


# --- a database that fails for a moment ------------------------------------------------------------------------


def _failing(monkeypatch, store: StudyStore, times: int, exc: Exception):
    """``store.study.get_trials`` raises ``exc`` the first ``times`` calls; returns the call counter."""
    real = store.study.get_trials
    calls = {"n": 0}

    def get_trials(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] <= times:
            raise exc
        return real(*args, **kwargs)

    monkeypatch.setattr(store.study, "get_trials", get_trials)
    monkeypatch.setattr(storage_mod, "STORAGE_WAIT_S", 0.0)
    return calls


def test_a_storage_call_that_fails_for_a_moment_is_made_again(tmp_path, storage, monkeypatch):
    import optuna

    search = _search(tmp_path)
    store = _store(search, storage, "a:1")
    calls = _failing(monkeypatch, store, 2, optuna.exceptions.StorageInternalError("deadlock, try again"))
    results, claims = store.refresh()
    assert results == [] and claims == set() and calls["n"] == 3


def test_a_storage_that_keeps_failing_stops_with_one_line(tmp_path, storage, monkeypatch):
    import optuna

    search = _search(tmp_path)
    store = _store(search, storage, "a:1")
    cause = optuna.exceptions.StorageInternalError("An exception is raised during the commit.\nmore")
    calls = _failing(monkeypatch, store, 100, cause)
    with pytest.raises(storage_mod.StorageFailed) as info:
        store.refresh()
    assert calls["n"] == storage_mod.STORAGE_TRIES
    message = str(info.value)
    assert "\n" not in message and "failed 5 times in a row" in message and "run the same command again" in message
    assert info.value.exit_code == 1


def test_an_error_of_the_caller_is_not_made_again(tmp_path, storage, monkeypatch):
    search = _search(tmp_path)
    store = _store(search, storage, "a:1")
    calls = _failing(monkeypatch, store, 100, KeyError("not a storage error"))
    with pytest.raises(KeyError):
        store.refresh()
    assert calls["n"] == 1


def test_a_record_made_again_after_its_tell_went_through_stores_the_result_once(tmp_path, storage):
    search = _search(tmp_path)
    store = _store(search, storage, "a:1")
    config = {"fused_optimizer.impl": "foreach", "gc.freeze": False}
    trial = store.ask(config)
    store.label(trial, ROLE_SEARCH)
    result = _result(config, number=trial.number)
    assert store.record(trial, result, 1.0) == trial.number
    # the database answered with an error after committing: the same record again
    assert store.record(trial, result, 1.0) == trial.number
    assert len(store.study.get_trials()) == 1


@pytest.mark.parametrize("stored, message", [
    ("{not json", r"a trial of study 's' is stored as something that is not JSON \(Expecting property name"),
    ('"just a string"', r"trial 1 of study 's' holds a result autotune cannot read \(TypeError"),
    ('{"status": "ok", "config": 5, "step_times": 3}', r"trial 1 of study 's' holds a result autotune cannot read"),
    ('{"status": "ok", "config": {}, "step_times": ["x"]}', r"holds a result autotune cannot read \(ValueError"),
])
def test_a_damaged_stored_result_is_one_line_exit_2_for_report_and_resume(stored, message, tmp_path, capsys):
    import sqlite3

    script = tmp_path / "train.py"
    script.write_text(TINY.read_text())
    search = _search(tmp_path, script=script, args=("--iters", "12"))
    db = tmp_path / "shared.db"
    store = _store(search, open_storage(f"sqlite:///{db}"), "a:1", "a (cpu)")
    base = search.space.baseline()
    for role in ("baseline", "baseline"):
        trial = store.ask(base)
        store.label(trial, role)
        store.record(trial, _result(base, role=role, number=trial.number), 1.0)
    con = sqlite3.connect(db)
    con.execute("update trial_user_attributes set value_json = ? where key = 'result' and trial_id = "
                "(select trial_id from trials where number = 1)", (stored,))
    con.commit()
    con.close()
    rc = main(["report", "--storage", f"sqlite:///{db}", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and re.search(message, err[0]) and "start another with --study-name" in err[0]
    assert not (tmp_path / "r").exists()
    with pytest.raises(StudyDamaged, match=message):  # a search resuming the study reads its results the same way
        _store(search, open_storage(f"sqlite:///{db}"), "b:1").results()
