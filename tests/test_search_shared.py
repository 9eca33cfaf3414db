"""Two ``autotune search`` workers on one study at once: real PostgreSQL and MariaDB servers on loopback, and a
journal file; workers that open a new database at once; ``autotune report`` on a database without a study.

The servers are Debian's PostgreSQL and MariaDB (``.ci/run`` installs them), each started for these tests on a free
port in a temporary folder and removed afterwards. Where one cannot be started its tests are skipped, and the
reason is printed.
Timings are never asserted.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from procs import wait_gone

REPO = Path(__file__).resolve().parent.parent
# DataLoader workers win clearly on any machine, so each worker's confirmation settles in its first 5 pairs
TINY = REPO / "fixtures" / "search" / "loader.py"
SPACE = {"dataloader.num_workers": [0, 2], "gc.freeze": [False, True]}  # 4 configurations
START = {"dataloader.num_workers": 2, "gc.freeze": True}  # what the search starts from in SPACE
# a long run (--train-steps) ranks by the steps, where the loader's 2x shows; ranked by the fixture's own 12-step
# run, start-up dominates, the win shrinks to a few percent and a loaded machine needed 20+ pairs to settle it
SMALL = ["--steps", "4", "--warmup", "1", "--confirm", "5", "--train-steps", "5000"]
# one intra-op thread (steadier on a shared machine); heartbeats each second, so a dead worker shows in 6 s
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "AUTOTUNE_HEARTBEAT_S": "1"}
ENV.pop("AUTOTUNE_HOST", None)

pytestmark = pytest.mark.slow


# --- a PostgreSQL server of the tests' own ---------------------------------------------------------------------


def _postgres_bin() -> Path | None:
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    return Path(versions[-1]).parent if versions else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(text: str, lines: int = 5) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


@pytest.fixture(scope="module")
def postgres():
    """The URL of a fresh PostgreSQL server on 127.0.0.1, stopped and its folder removed afterwards."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        pytest.skip("no PostgreSQL driver: pip install 'autotune[postgres]'")
    bindir = _postgres_bin()
    if bindir is None:
        pytest.skip("PostgreSQL is not installed (no initdb on PATH or in /usr/lib/postgresql/*/bin)")
    as_user: list[str] = []
    if os.geteuid() == 0:
        # PostgreSQL refuses to run as root: run it as the postgres user the Debian package creates
        try:
            pw = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root, and there is no 'postgres' user to run PostgreSQL as")
        if shutil.which("runuser"):
            as_user = ["runuser", "-u", "postgres", "--"]
        elif shutil.which("setpriv"):
            as_user = ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--init-groups"]
        else:
            pytest.skip("running as root, and neither runuser nor setpriv is there to run PostgreSQL as postgres")
    base = Path(tempfile.mkdtemp(prefix="autotune-pg-"))
    data, log = base / "data", base / "server.log"
    started = False

    def pg(*args: str) -> subprocess.CompletedProcess:
        cmd = [*as_user, str(bindir / args[0]), *args[1:]]
        return subprocess.run(cmd, cwd=base, capture_output=True, text=True, timeout=120)

    try:
        if as_user:
            os.chown(base, pw.pw_uid, pw.pw_gid)
        init = pg("initdb", "-D", str(data), "-U", "autotune", "-A", "trust", "-E", "UTF8", "--no-sync")
        if init.returncode != 0:
            pytest.skip(f"PostgreSQL's initdb failed: {_tail(init.stdout + init.stderr)}")
        port = _free_port()
        # no fsync (a throwaway server); the socket in the server's own folder, not /var/run/postgresql
        opts = f"-h 127.0.0.1 -p {port} -k {base} -F"
        start = pg("pg_ctl", "-D", str(data), "-l", str(log), "-o", opts, "-w", "-t", "60", "start")
        started = True  # (pg_ctl may have started it even when it says it failed)
        if start.returncode != 0:
            server = log.read_text(errors="replace") if log.exists() else ""
            pytest.skip(f"PostgreSQL did not start: {_tail(start.stdout + start.stderr + server)}")
        yield f"postgresql://autotune@127.0.0.1:{port}/postgres"
    finally:
        if started:
            pg("pg_ctl", "-D", str(data), "-m", "immediate", "-w", "-t", "60", "stop")
        shutil.rmtree(base, ignore_errors=True)


# --- a MySQL (MariaDB) server of the tests' own -------------------------------------------------------------------


@pytest.fixture(scope="module")
def mysql():
    """The URL of a fresh MariaDB (or MySQL) server on 127.0.0.1, stopped and its folder removed afterwards."""
    try:
        import pymysql
    except ImportError:
        pytest.skip("no MySQL driver: pip install 'autotune[mysql]'")
    server = shutil.which("mariadbd") or shutil.which("mysqld") or next(
        (p for p in ("/usr/sbin/mariadbd", "/usr/sbin/mysqld") if os.path.exists(p)), None
    )
    install = shutil.which("mariadb-install-db") or shutil.which("mysql_install_db")
    if server is None or install is None:
        pytest.skip("MariaDB/MySQL is not installed (no mariadbd and mariadb-install-db)")
    base = Path(tempfile.mkdtemp(prefix="autotune-mysql-"))
    data, log, sock = base / "data", base / "server.log", base / "mysql.sock"
    # as root the server runs as root when told to (the data folder is its own, thrown away afterwards)
    user = ["--user=root"] if os.geteuid() == 0 else []
    proc = None
    try:
        init = subprocess.run(
            [install, "--no-defaults", f"--datadir={data}", *user, "--auth-root-authentication-method=normal",
             "--skip-test-db"],
            capture_output=True, text=True, timeout=300,
        )
        if init.returncode != 0:
            pytest.skip(f"mariadb-install-db failed: {_tail(init.stdout + init.stderr)}")
        port = _free_port()
        proc = subprocess.Popen(
            [server, "--no-defaults", f"--datadir={data}", *user, "--bind-address=127.0.0.1", f"--port={port}",
             f"--socket={sock}", f"--log-error={log}", "--innodb-flush-log-at-trx-commit=0"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                conn = pymysql.connect(host="127.0.0.1", port=port, user="root", password="", connect_timeout=2)
                with conn.cursor() as cur:
                    cur.execute("CREATE DATABASE autotune")
                conn.close()
                break
            except pymysql.err.OperationalError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    text = log.read_text(errors="replace") if log.exists() else ""
                    pytest.skip(f"MariaDB did not start: {_tail(text)}")
                time.sleep(0.5)
        yield f"mysql://root@127.0.0.1:{port}/autotune"  # as the README writes it: autotune picks the driver
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(base, ignore_errors=True)


# Each storage runs one whole two-worker search, not two (CI time, issue 23.6): MariaDB and the journal file share a
# study between two live workers; PostgreSQL loses one of them midway (below). Opening and reporting run on both
# databases.
@pytest.fixture(params=["mysql"])
def shared(request, tmp_path):
    """(storage, the two workers' host names): two machines on a database. Two workers of one machine on a journal
    file claim and step aside through the same code (tests/test_search_study.py runs it on a journal and sqlite);
    its whole search here cost CI 85-110 s and found nothing the database's does not."""
    return request.getfixturevalue("postgres" if request.param == "postgresql" else "mysql"), ("alpha", "beta")


def _fresh_database(url: str, name: str) -> str:
    """A new empty database ``name`` on the server of ``url``; its URL."""
    import sqlalchemy

    engine = sqlalchemy.create_engine(_driver(url), isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql(f"CREATE DATABASE {name}")
    finally:
        engine.dispose()
    return url.rsplit("/", 1)[0] + f"/{name}"


def _driver(url: str) -> str:
    import sqlalchemy

    from autotune.search.storage import _with_installed_driver

    return _with_installed_driver(sqlalchemy.engine.make_url(url)).render_as_string(hide_password=False)


# --- helpers ---------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _storage(url: str):
    from autotune.search.storage import open_storage

    return open_storage(url).optuna  # one connection pool per storage, however often the tests look


def trials(storage: str, name: str):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.load_study(study_name=name, storage=_storage(storage)).get_trials(deepcopy=False)


def start_worker(tmp_path: Path, storage: str, name: str, index: int, host: str | None):
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump({"knobs": SPACE}))
    out = tmp_path / f"out-{index}"
    cmd = ["search", TINY, "--out", out, "--space", space, "--storage", storage, "--study-name", name, *SMALL]
    env = dict(ENV, **({"AUTOTUNE_HOST": host} if host else {}))
    log = open(tmp_path / f"worker-{index}.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "autotune", *map(str, cmd), "--", "--iters", "12"],
        cwd=tmp_path,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()
    return proc, out, tmp_path / f"worker-{index}.log"


def finish(proc, log: Path, timeout: float = 600) -> str:
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    text = log.read_text()
    assert rc == 0, text
    return text


def printed_trials(text: str) -> list[int]:
    """The trial numbers a worker printed as it finished them (one line per trial it ran)."""
    return [int(m) for m in re.findall(r"^  #\s*(\d+) ", text, flags=re.M)]


def snapshot(storage: str, name: str) -> dict:
    return {
        t.number: (t.params, t.values, t.user_attrs.get("role"), t.user_attrs["result"]["step_times"])
        for t in trials(storage, name)
        if t.state.name == "COMPLETE"
    }


def search_configs(ts) -> list[tuple]:
    return [tuple(sorted(t.params.items())) for t in ts if t.state.name == "COMPLETE" and t.user_attrs.get("role") == "search"]


# --- the tests -------------------------------------------------------------------------------------------------


def test_two_workers_share_one_study(tmp_path, shared):
    storage, hosts = shared
    workers = [start_worker(tmp_path, storage, "two", i, host) for i, host in enumerate(hosts)]
    logs = [finish(proc, log) for proc, _, log in workers]

    ts = trials(storage, "two")
    done = [t for t in ts if t.state.name == "COMPLETE" and t.user_attrs.get("role") != "duplicate"]
    # every finished trial is stored exactly once, by the worker that printed it
    ran = [printed_trials(text) for text in logs]
    assert all(ran), logs  # both workers measured
    assert sorted(ran[0] + ran[1]) == sorted(t.number for t in done)
    assert len({t.user_attrs["result"]["pid"] for t in done}) == len(done)
    # no program measured twice: the start and the descent's steps, each once, by one worker or the other
    assert sorted(search_configs(ts)) == sorted(set(search_configs(ts))) and len(search_configs(ts)) >= 2
    for t in ts:
        if t.user_attrs.get("role") == "yielded":  # stepped aside for the other worker: never ran
            assert t.state.name == "FAIL" and "trial_pid" not in t.user_attrs and "result" not in t.user_attrs
    assert not [t for t in ts if t.state.name == "RUNNING"]

    results = [t.user_attrs["result"] for t in done]
    assert all(r["host"] and r["device_name"] for r in results)
    expected = [h or socket.gethostname() for h in hosts]
    for host in set(expected):
        assert sum(r["role"] == "baseline" and r["host"] == host for r in results) >= 2  # its own baselines
    runs = []
    for (proc, out, _), host in zip(workers, expected):
        doc = yaml.safe_load((out / "autotune.yaml").read_text())
        assert doc["machine"].startswith(f"{host} (")
        assert doc["search"]["configurations_measured"] == 1 + len(set(search_configs(ts)))
        runs.append(sum(doc["search"]["machines"].values()))
    assert max(runs) == len(done)  # the worker that ended last wrote its outputs from every run of the study
    for t in done:  # each confirmation run was measured on the machine whose confirmation it is
        r = t.user_attrs["result"]
        if r["role"] == "confirm":
            assert json.loads(t.user_attrs["claim"])[1] == f"{r['host']} ({r['device_name']})"

    report = autotune_report(tmp_path, storage, "two")
    rows = [line for line in report.splitlines() if re.match(r"\| \d+ \| (baseline|perturbed|search|confirm|duel|whole) \|", line)]
    assert len(rows) == len(done)
    if hosts[0]:
        machines = next(line for line in report.splitlines() if line.startswith("- Machines: "))
        assert "alpha (" in machines and "beta (" in machines


def autotune_report(tmp_path: Path, storage: str, name: str) -> str:
    out = tmp_path / "report"
    run = subprocess.run(
        [sys.executable, "-m", "autotune", "report", "--storage", storage, "--study-name", name, "--out", str(out)],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    for f in ("loader.py", "autotune.yaml", "report.md"):
        assert (out / f).is_file(), f
    tuned = yaml.safe_load((out / "autotune.yaml").read_text())["winner"] == "tuned"
    assert (out / "tuned.diff").is_file() == tuned  # no empty diff when the baseline wins
    compile((out / "loader.py").read_text(), "loader.py", "exec")
    return (out / "report.md").read_text()


@pytest.fixture(params=["postgresql", "mysql"])
def database(request):
    return request.getfixturevalue("postgres" if request.param == "postgresql" else "mysql")


def test_a_killed_worker_loses_nothing_and_its_trial_is_run_again(tmp_path, postgres):
    storage = postgres + "?password=hunter2"  # (the server trusts loopback: the password is never checked, only hidden)
    (alpha, _, alpha_log), (beta, _, _) = [start_worker(tmp_path, storage, "kill", i, h) for i, h in enumerate(("alpha", "beta"))]
    try:
        deadline = time.monotonic() + 300
        victim = None
        while victim is None:
            assert time.monotonic() < deadline, "beta never ran a search trial"
            assert beta.poll() is None and alpha.poll() is None, alpha_log.read_text()
            time.sleep(0.2)
            try:
                ts = trials(storage, "kill")
            except KeyError:  # the study is not made yet
                continue
            alpha_done = [t for t in ts if t.state.name == "COMPLETE" and t.user_attrs["worker"].startswith("alpha:")]
            running = [
                t
                for t in ts
                if t.state.name == "RUNNING"
                and t.user_attrs.get("role") == "search"
                and t.user_attrs["worker"].startswith("beta:")
                and "trial_pid" in t.user_attrs
            ]
            if alpha_done and running:
                victim = running[0]
        before = snapshot(storage, "kill")
        beta.send_signal(signal.SIGKILL)  # no clean-up at all: its trial stays RUNNING in the study
        beta.wait(timeout=30)
        finish(alpha, alpha_log)
    finally:
        for p in (alpha, beta):
            if p.poll() is None:
                p.kill()
                p.wait()

    pid = victim.user_attrs["trial_pid"]
    assert wait_gone([pid], 15) == []  # the trial ended itself with its worker
    after = snapshot(storage, "kill")
    assert {n: after[n] for n in before} == before  # nothing either worker finished was lost or changed
    ts = trials(storage, "kill")
    assert ts[victim.number].state.name == "FAIL"  # its heartbeat stopped: closed by the other worker
    measured = search_configs(ts)
    assert len(measured) == len(set(measured)) >= 2  # no program measured twice
    again = [
        t
        for t in ts
        if t.state.name == "COMPLETE" and t.params == victim.params and t.user_attrs.get("role") == "search"
    ]
    # its configuration is measured again, once, by the other worker, when the search still needs it: always the
    # start configuration; a step of the descent only while it is one from where the descent stands
    assert all(t.number > victim.number and t.user_attrs["worker"].startswith("alpha:") for t in again)
    assert len(again) == 1 if victim.params == START else len(again) <= 1
    # the storage's password is in no log, output or report
    autotune_report(tmp_path, storage, "kill")
    written = [alpha_log.read_text(), (tmp_path / "worker-1.log").read_text()]
    written += [(d / name).read_text() for d in (tmp_path / "out-0", tmp_path / "report") for name in ("autotune.yaml", "report.md")]
    assert not [text for text in written if "hunter2" in text]


# --- opening a study's database ------------------------------------------------------------------------------


OPEN_AT_ONCE = """
import sys, time
from pathlib import Path
from autotune.search.storage import open_storage
ready, go = Path(sys.argv[2]), Path(sys.argv[3])
ready.touch()
while not go.exists():
    time.sleep(0.001)
open_storage(sys.argv[1])
"""


@pytest.mark.parametrize("kind", ["postgresql", "mysql", "sqlite"])
def test_workers_opening_a_new_database_at_once_all_get_it(tmp_path, kind, request):
    # workers started together on a fresh database race to create Optuna's tables: each must end up with them
    if kind == "sqlite":
        url = f"sqlite:///{tmp_path / 'new.db'}"
    else:
        url = _fresh_database(request.getfixturevalue("postgres" if kind == "postgresql" else "mysql"), "at_once")
    go = tmp_path / "go"
    procs = []
    for i in range(4):
        ready = tmp_path / f"ready-{i}"
        cmd = [sys.executable, "-c", OPEN_AT_ONCE, url, str(ready), str(go)]
        procs.append((subprocess.Popen(cmd, env=ENV, stderr=subprocess.PIPE, text=True), ready))
    try:
        deadline = time.monotonic() + 120
        while not all(ready.exists() for _, ready in procs):
            assert time.monotonic() < deadline and all(p.poll() is None for p, _ in procs), "a worker did not start"
            time.sleep(0.05)
        go.touch()
        errors = [p.communicate(timeout=120)[1] for p, _ in procs]
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p, _ in procs] == [0] * 4, errors
    import optuna

    optuna.create_study(storage=_storage(url), study_name="after")  # the tables are all there, and work


def test_report_on_a_database_without_a_study_refuses_it_and_creates_nothing(tmp_path, database):
    import sqlalchemy

    url = _fresh_database(database, "no_study")
    run = subprocess.run(
        [sys.executable, "-m", "autotune", "report", "--storage", url, "--out", str(tmp_path / "r")],
        env=ENV, capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 2 and run.stderr.strip().endswith("holds no Optuna study"), run.stderr
    engine = sqlalchemy.create_engine(_driver(url))
    try:
        assert sqlalchemy.inspect(engine).get_table_names() == []
    finally:
        engine.dispose()
