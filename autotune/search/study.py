"""The Optuna side of a search: the study in its storage, asking for configurations and recording trials.

Several workers (processes on one machine, or machines) can share one study. They coordinate through the storage
only: each trial says who runs it, on which machine and, for a search trial, which program it measures (its
claim); the earliest trial of a claim measures it and a later one steps aside. A worker that died leaves a trial
running: it is closed as failed by the process check on its own host, by Optuna's heartbeat on a database, or
once it has run far past its own timeout, so that its configuration is measured again.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import re
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from autotune.errors import AutotuneError, UsageError
from autotune.runtime import pid_alive
from autotune.search.machine import host_name
from autotune.search.space import SearchSpace
from autotune.search.trial import Outcome, TrialResult

ROLE_BASELINE = "baseline"
ROLE_SEARCH = "search"
ROLE_CONFIRM = "confirm"
# the baseline on another number of CPU threads (only the order of floating-point sums changes): how far this
# script's training carries a rounding difference; its losses set the gate's floor, its speed counts nowhere
ROLE_PERTURBED = "perturbed"
# one run of a duel: two configurations whose search runs differ by less than the noise, re-measured in A/B pairs
ROLE_DUEL = "duel"
ROLE_DUPLICATE = "duplicate"  # the sampler proposed a configuration already measured: its result is reused
ROLE_YIELDED = "yielded"  # another worker claimed the same program first: ended FAIL without running

ATTR_ROLE = "role"
ATTR_RESULT = "result"
ATTR_WORKER = "worker"
ATTR_MACHINE = "machine"
ATTR_CLAIM = "claim"
ATTR_PID = "trial_pid"
ATTR_PROCESSES = "processes"  # the worker's boot and pid namespace: where its process id means something
ATTR_TIMEOUT = "timeout_s"
ATTR_FEASIBLE = "feasible"
ATTR_NOTE = "note"

STUDY_FINGERPRINT = "fingerprint"
STUDY_ABOUT = "search"  # what the study was made from: script, arguments, device, space (autotune report reads it)
# the run lengths [warmup, steps] the first worker fitted to its time budget: every run after the first baselines
STUDY_LENGTHS = "lengths"

HEARTBEAT_ENV = "AUTOTUNE_HEARTBEAT_S"
HEARTBEAT_S = 10
GRACE_BEATS = 6  # a trial whose worker missed this many heartbeats in a row is taken for dead
STALE_MARGIN_S = 120.0  # without heartbeats: a trial seen running this long past its own timeout lost its worker
UNSTARTED_S = 600.0  # the timeout assumed for a trial whose worker died before starting its process
SETUP_WAIT_S = 10.0  # how long a claim waits for an earlier trial whose worker is still labelling it
CONNECT_TIMEOUT_S = 10
TABLE_TRIES = 6  # workers that open a new database at once: how often one tries to make Optuna's tables
STORAGE_ENV = "AUTOTUNE_STORAGE"  # the storage URL, where a command line would show its password to `ps`
DRIVER_EXTRAS = {"postgresql": "postgres", "mysql": "mysql"}
# a database call that fails for a moment (a deadlock MySQL resolves by failing one transaction, a dropped
# connection) is made again, this many times in all, waiting 0.5 s, 1 s, 2 s... between
STORAGE_TRIES = 5
STORAGE_WAIT_S = 0.5


class StorageFailed(AutotuneError):
    """The study's database kept failing: the search stops, with every finished trial kept in it."""

    exit_code = 1


def _transient(exc: BaseException) -> bool:
    """Whether a storage error may pass if the call is made again: the database's, not the caller's."""
    import optuna

    if isinstance(exc, optuna.exceptions.StorageInternalError):  # Optuna's wrapper of SQLAlchemy's errors
        return True
    sqlalchemy = sys.modules.get("sqlalchemy")
    return sqlalchemy is not None and isinstance(exc, (sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError))


def retrying(fn):
    """Make a StudyStore call again when the database fails for a moment; after STORAGE_TRIES, one clear error.

    Safe because each Optuna storage call commits or rolls back as a whole, and every call wrapped here may be
    made again: writes of user attributes repeat the same values, and ``record`` knows its own earlier tell.
    """

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        wait = STORAGE_WAIT_S
        for attempt in range(1, STORAGE_TRIES + 1):
            try:
                return fn(self, *args, **kwargs)
            except Exception as exc:
                if not (_transient(exc) or isinstance(exc, OSError)):  # (a journal file's errors are OSErrors)
                    raise
                lost = self.storage.lost(exc)
                if lost:  # no use trying again, and the usual "every finished trial is kept" would be false
                    raise StorageFailed(lost) from None
                if attempt == STORAGE_TRIES:
                    cause = exc.__cause__ or exc
                    first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
                    raise StorageFailed(
                        f"the study's storage failed {STORAGE_TRIES} times in a row ({first}); every finished trial "
                        "is kept in it: run the same command again to resume"
                    ) from None
                time.sleep(wait)
                wait *= 2

    return wrapper


def _feasibility(trial) -> tuple[float]:
    """Optuna constraint: <= 0 is feasible. Failed and diverged trials are infeasible, with their data kept."""
    return (0.0 if trial.user_attrs.get(ATTR_FEASIBLE) else 1.0,)


# --- storages ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Storage:
    """An Optuna storage, how to name it to the user (no password), and the database that keeps heartbeats."""

    optuna: Any
    description: str
    heartbeat: Any = None  # the RDBStorage when trials record heartbeats in it
    file: Path | None = None  # the SQLite database or journal file that holds the study
    identity: tuple[int, int] | None = None  # that file's device and inode when it was opened

    def lost(self, exc: BaseException) -> str | None:
        """Why the study's file cannot keep trials any more (deleted, replaced, not writable), or None."""
        if self.file is None:
            return None
        try:
            st = os.stat(self.file)
            same = (st.st_dev, st.st_ino) == self.identity
        except OSError:
            same = False
        if not same:  # (SQLite reports a database file deleted under it as read-only)
            return (
                f"the study's storage {self.file} was deleted, moved or replaced while autotune used it: the trials "
                "it held are no longer there (the same command again starts a new study)"
            )
        why = _unwritable(exc)
        if why:
            return (
                f"the study's storage {self.file} cannot be written ({why}); the trials finished so far are kept in "
                "it: make it writable and run the same command again to resume"
            )
        return None


def _unwritable(exc: BaseException | None) -> str | None:
    """The reason, when a storage error (or one it wraps) says the file may not be written."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return exc.strerror or str(exc)
        if "readonly database" in str(exc):  # SQLite's SQLITE_READONLY
            return "read-only"
        exc = exc.__cause__ or getattr(exc, "orig", None)
    return None


def _file(path: Path) -> tuple[Path, tuple[int, int] | None]:
    try:
        st = os.stat(path)
    except OSError:
        return path, None
    return path, (st.st_dev, st.st_ino)


def heartbeat_interval() -> int:
    """Seconds between a worker's heartbeats (``AUTOTUNE_HEARTBEAT_S``, the same on every worker of a study)."""
    text = os.environ.get(HEARTBEAT_ENV)
    if not text:
        return HEARTBEAT_S
    if not text.isdigit() or int(text) < 1:
        raise UsageError(f"{HEARTBEAT_ENV} must be a whole number of seconds (at least 1), not {text!r}")
    return int(text)


def storage_url(given: str | None) -> str | None:
    """The storage named by ``--storage``, else by ``AUTOTUNE_STORAGE`` (which ``ps`` does not show), else None."""
    return given or os.environ.get(STORAGE_ENV) or None


def open_storage(url: str | None, default_db: Path | None = None, must_exist: bool = False) -> Storage:
    """SQLite in the output folder by default; a database URL; an SQLite file's path; else a journal file's path.

    ``must_exist`` (autotune report): the study is there already; opened read-only where the database allows it,
    and nothing is created. A file that is neither an Optuna journal nor an SQLite database is never written to.
    """
    if url is None:
        assert default_db is not None
        db = default_db.resolve()
        return _database(f"sqlite:///{db}", shown=str(db))
    if "://" not in url:
        path = Path(url).expanduser().resolve()
        if _is_sqlite(path):  # autotune search's own DIR/study.db given as a path
            return _database(f"sqlite:///{path}", must_exist)
        return _journal(path, must_exist)
    return _database(url, must_exist)


def _head(path: Path, size: int, line: bool = False) -> bytes | None:
    """The first ``size`` bytes (or its first line, up to that) of a regular file (never a FIFO or a device, which
    could block or never end)."""
    try:
        if not path.is_file():
            return None
        with open(path, "rb") as f:
            return f.readline(size) if line else f.read(size)
    except OSError:
        return None


def _is_sqlite(path: Path) -> bool:
    return _head(path, 16) == b"SQLite format 3\x00"


def _is_journal(path: Path) -> bool:
    """Whether ``path`` is an empty file or starts as Optuna's journal files do: a JSON object with an op_code."""
    first = _head(path, 1 << 20, line=True)
    if first == b"":
        return True
    try:
        entry = json.loads(first) if first else None
    except ValueError:  # (or another worker is writing the journal's first line at this moment)
        return not first.endswith(b"\n") and re.match(rb'\{\s*"op_code"\s*:', first) is not None
    return isinstance(entry, dict) and "op_code" in entry


def _journal(path: Path, must_exist: bool) -> Storage:
    """An Optuna journal file: several processes, or machines on a shared file system, append to it."""
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    if must_exist and not path.is_file():
        raise UsageError(f"{path}: no such journal file (--storage takes a database URL or a journal file)")
    if not path.parent.is_dir():
        raise UsageError(f"{path}: the folder of the journal file does not exist")
    if path.exists() and not _is_journal(path):
        raise UsageError(
            f"{path}: not an Optuna journal file or SQLite database, and autotune writes into no other file "
            "(--storage takes a database URL, a study database or a journal file, new or autotune's)"
        )
    try:
        storage = JournalStorage(JournalFileBackend(str(path)))
    except OSError as exc:
        raise UsageError(f"{path}: cannot open the journal file: {exc.strerror or exc}") from None
    except (ValueError, KeyError, TypeError) as exc:  # a line further down that is not a journal entry
        why = f"{type(exc).__name__}: {_first_line(exc)}"
        raise UsageError(f"{path}: not a valid Optuna journal file ({why})") from None
    return Storage(storage, str(path), None, *_file(path))


# query parameters of a database URL whose values are secrets (password, passwd, pwd, sslpassword, token...)
SECRET_QUERY = re.compile(r"([?&;][^=&;#]*(?:pass|pwd|secret|token)[^=&;#]*=)[^&;#]*", re.IGNORECASE)
SECRET_USERINFO = re.compile(r"(://[^:/@]*:)[^@]*@")  # sqlalchemy's own reading: the password runs to the first @


def _hidden(text: str) -> str:
    """``text`` with the passwords a storage URL may hold replaced by ***: in its user part and its query."""
    return SECRET_QUERY.sub(r"\1***", SECRET_USERINFO.sub(r"\1***@", text))


def _database(url: str, must_exist: bool = False, shown: str | None = None) -> Storage:
    """An Optuna RDB storage; a database other than SQLite records heartbeats, for workers on other machines."""
    import optuna
    import sqlalchemy

    try:
        parsed = sqlalchemy.engine.make_url(url)
    except Exception:  # sqlalchemy's ArgumentError, or a ValueError from a bad port
        raise UsageError(
            f"--storage {_hidden(url)!r} is not a database URL (e.g. postgresql://user@host/db) or a file path"
        ) from None
    shown = shown or _hidden(parsed.render_as_string(hide_password=True))
    secrets = [v for v in (parsed.password, *_secret_values(parsed)) if v]

    def failed(exc: BaseException, kind: bool = False) -> UsageError:
        text = f"{type(exc).__name__}: {_first_line(exc)}" if kind else _first_line(exc)
        for secret in secrets:  # a driver may quote what it was given
            text = text.replace(str(secret), "***")
        return UsageError(f"cannot open the study storage {shown}: {text}")

    backend = parsed.get_backend_name()
    parsed = _with_installed_driver(parsed)
    # (a file given as an SQLite URI, file:...?uri=true, is the user's own business: it is not watched)
    plain = backend == "sqlite" and parsed.database not in (None, "", ":memory:") and "uri" not in parsed.query
    file = Path(parsed.database).resolve() if plain else None
    if file is not None and must_exist:
        if not file.is_file():
            raise UsageError(f"{file}: no such study database")
        parsed = parsed.set(database=f"file:{quote(str(file))}", query={**parsed.query, "mode": "ro", "uri": "true"})
    kwargs: dict[str, Any] = {}
    beat = None
    if backend != "sqlite":
        connect = {"connect_timeout": CONNECT_TIMEOUT_S}
        driver = parsed.drivername.partition("+")[2]  # (get_driver_name() would load a dialect it may not know)
        if must_exist and driver in READ_ONLY_SESSION:  # the drivers autotune installs
            connect.update(READ_ONLY_SESSION[driver])
        kwargs["engine_kwargs"] = {"connect_args": connect}
        beat = heartbeat_interval()
        kwargs.update(heartbeat_interval=beat, grace_period=GRACE_BEATS * beat)
    full = parsed.render_as_string(hide_password=False)
    try:
        tables = _tables(full, kwargs.get("engine_kwargs", {}))
    except ImportError as exc:
        raise UsageError(_driver_hint(backend, exc)) from None
    except sqlalchemy.exc.DBAPIError as exc:  # refused, unknown host, bad password, no such database
        raise failed(exc) from None
    except Exception as exc:  # a dialect sqlalchemy does not know, a bad option in the URL
        raise failed(exc, kind=True) from None
    if must_exist and "studies" not in tables:
        raise UsageError(f"{shown} holds no Optuna study")
    if file is not None and tables and "studies" not in tables:
        raise UsageError(
            f"{file}: an SQLite database of something else (tables: {', '.join(sorted(tables)[:5])}); autotune adds "
            "its tables only to a new database or a study's (pass another --storage)"
        )
    wait = 0.2
    for attempt in range(1, TABLE_TRIES + 1):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                storage = optuna.storages.RDBStorage(full, skip_table_creation=must_exist, **kwargs)
            return Storage(storage, shown, storage if beat else None, *(_file(file) if file else (None, None)))
        except (sqlalchemy.exc.DBAPIError, optuna.exceptions.StorageInternalError) as exc:
            # workers started at once on a new database race to create Optuna's tables (MySQL: the table exists
            # already; PostgreSQL: a duplicate key in its catalog; SQLite: locked): the connection works, so the
            # loser makes the tables that are still missing
            if attempt == TABLE_TRIES or must_exist:
                raise failed(exc) from None
            time.sleep(wait)
            wait *= 2
        except Exception as exc:  # Optuna's own checks: a schema of another Optuna version
            raise failed(exc, kind=True) from None
    raise AssertionError("unreachable")


def _secret_values(parsed) -> list[str]:
    values = []
    for key, value in parsed.query.items():
        if SECRET_QUERY.match(f"?{key}="):
            values.extend([value] if isinstance(value, str) else value)
    return values


def _tables(url: str, engine_kwargs: dict[str, Any]) -> set[str]:
    """The tables of the database at ``url``: connecting first tells a database that cannot be reached from one
    whose tables another worker is making at this moment."""
    import sqlalchemy

    engine = sqlalchemy.create_engine(url, **engine_kwargs)
    try:
        with engine.connect() as conn:
            return set(sqlalchemy.inspect(conn).get_table_names())
    finally:
        engine.dispose()


# the drivers autotune's extras install, per database, in order of preference; sqlalchemy's own default for a bare
# postgresql:// or mysql:// differs between its versions (psycopg2 or psycopg; mysqlclient)
DRIVERS = {"postgresql": (("psycopg", "psycopg"), ("psycopg2", "psycopg2")), "mysql": (("MySQLdb", "mysqldb"), ("pymysql", "pymysql"))}
# autotune report reads a study on a database server in read-only sessions, so that nothing it does can write
READ_ONLY_SESSION = {
    **dict.fromkeys(("psycopg", "psycopg2"), {"options": "-c default_transaction_read_only=on"}),
    **dict.fromkeys(("mysqldb", "pymysql"), {"init_command": "SET SESSION TRANSACTION READ ONLY"}),
}


def _with_installed_driver(parsed):
    """A URL without a driver (``postgresql://``) gets the installed one, whichever version of sqlalchemy is here."""
    import importlib.util

    for module, driver in DRIVERS.get(parsed.drivername, ()):
        if importlib.util.find_spec(module) is not None:
            return parsed.set(drivername=f"{parsed.drivername}+{driver}")
    return parsed


def _driver_hint(backend: str, exc: ImportError) -> str:
    cause = exc.__cause__ if isinstance(exc.__cause__, ImportError) else exc  # Optuna wraps the driver's error
    missing = f"{cause.name} is not installed" if cause.name else _first_line(cause)
    extra = DRIVER_EXTRAS.get(backend)
    if extra:
        return f"a {backend} storage needs a database driver ({missing}): pip install 'autotune[{extra}]'"
    return f"a {backend} storage needs a database driver that is not installed ({missing})"


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


# --- the study -----------------------------------------------------------------------------------------------


def _process_space() -> str:
    """This boot of this kernel and this pid namespace: a worker's pid can be checked only from the same one."""
    parts = []
    for path, read in (("/proc/sys/kernel/random/boot_id", Path.read_text), ("/proc/self/ns/pid", os.readlink)):
        try:
            parts.append(str(read(Path(path))).strip())
        except OSError:
            parts.append("")
    return "/".join(parts)


class StudyStore:
    """One Optuna study holding every trial of a search, shared by every worker that runs the same search."""

    def __init__(self, storage: Storage, name: str, create: bool = True, seed: int = 0, machine: str = "") -> None:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        # Optuna 5 reads constraints set on the trial; older versions ask a constraints_func after each trial
        self._set_constraint = hasattr(optuna.trial.Trial, "set_constraint")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            # constant_liar: a worker's sampler treats the trials other workers are running as poor, not as free
            if self._set_constraint:
                sampler = optuna.samplers.TPESampler(seed=seed, constant_liar=True)
            else:
                sampler = optuna.samplers.TPESampler(seed=seed, constant_liar=True, constraints_func=_feasibility)
        try:
            if create:
                self.study = optuna.create_study(
                    storage=storage.optuna, study_name=name, direction="maximize", sampler=sampler, load_if_exists=True
                )
            else:
                self.study = optuna.load_study(study_name=name, storage=storage.optuna, sampler=sampler)
        except KeyError:
            raise UsageError(f"no study named '{name}' in {storage.description}{_known_studies(storage)}") from None
        except Exception as exc:  # drivers raise their own types (sqlalchemy, a journal file that is not one)
            raise UsageError(f"cannot open study '{name}' in {storage.description}: {_first_line(exc)}") from None
        self.storage = storage
        self.name = name
        self.machine = machine
        self.host = host_name()
        self.worker = f"{self.host}:{os.getpid()}"
        self._processes = _process_space()
        self.space: SearchSpace | None = None
        self._distributions: dict[str, Any] = {}
        self._seen_running: dict[int, float] = {}  # trial number -> when this worker first saw it running
        self._waited: set[int] = set()  # unlabelled trials already waited for once
        self._interval = heartbeat_interval() if storage.heartbeat is not None else None
        self._study_id = storage.heartbeat.get_study_id_from_name(name) if storage.heartbeat is not None else None

    # --- what the study is -------------------------------------------------------------------------------------

    @retrying
    def adopt(self, fingerprint: str, space: SearchSpace, about: Mapping[str, Any]) -> None:
        """Make the study this search's, or check that it is: one script, arguments and settings per study."""
        self.space = space
        self._distributions = space.distributions()
        attrs = self.study.user_attrs
        if attrs.get(STUDY_FINGERPRINT) is None:
            self.study.set_user_attr(STUDY_ABOUT, dict(about))
            self.study.set_user_attr(STUDY_FINGERPRINT, fingerprint)  # last: its presence says the rest is there
            attrs = self.study.user_attrs  # read again: another worker may have made the study at the same moment
        if attrs.get(STUDY_FINGERPRINT) != fingerprint:
            raise UsageError(
                f"study '{self.name}' was made for another script, arguments or settings; "
                "pass another --study-name (or --out) to start a new one"
            )
        if STUDY_ABOUT not in attrs:  # made by an autotune that did not record it yet
            self.study.set_user_attr(STUDY_ABOUT, dict(about))

    @retrying
    def about(self) -> dict[str, Any]:
        """What the study was made from (script, arguments, device, steps...), as ``adopt`` stored it."""
        about = self.study.user_attrs.get(STUDY_ABOUT)
        if not isinstance(about, dict) or STUDY_FINGERPRINT not in self.study.user_attrs:
            raise UsageError(
                f"study '{self.name}' in {self.storage.description} was not made by autotune search "
                "(or by a version that did not record what it searched)"
            )
        return about

    @property
    def fingerprint(self) -> str | None:
        return self.study.user_attrs.get(STUDY_FINGERPRINT)

    @retrying
    def lengths(self) -> tuple[int, int] | None:
        """The run lengths (warmup, steps) the study's runs were fitted to, if a worker fitted them."""
        got = self.study.user_attrs.get(STUDY_LENGTHS)
        if isinstance(got, list) and len(got) == 2 and all(type(x) is int and x > 0 for x in got):
            return got[0], got[1]
        return None

    @retrying
    def fit_lengths(self, warmup: int, steps: int) -> tuple[int, int]:
        """Record the run lengths fitted to the budget, unless a worker already did: the lengths in force."""
        if self.lengths() is None:
            self.study.set_user_attr(STUDY_LENGTHS, [warmup, steps])
        return self.lengths() or (warmup, steps)

    # --- reading -----------------------------------------------------------------------------------------------

    @retrying
    def refresh(self) -> tuple[list[TrialResult], set[str]]:
        """Close the trials of dead workers, then: every finished result, and the claims other workers hold now."""
        trials = self.study.get_trials(deepcopy=False)
        if self.recover(trials):
            trials = self.study.get_trials(deepcopy=False)
        return self.results(trials), self._claims(trials)

    @retrying
    def results(self, trials=None) -> list[TrialResult]:
        """Every finished trial's result, in trial order (reused duplicates left out)."""
        from optuna.trial import TrialState

        if trials is None:
            trials = self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        out = []
        for t in trials:
            if t.state is not TrialState.COMPLETE:
                continue
            if t.user_attrs.get(ATTR_ROLE) == ROLE_DUPLICATE or ATTR_RESULT not in t.user_attrs:
                continue
            out.append(TrialResult.from_attrs({**t.user_attrs[ATTR_RESULT], "number": t.number}))
        return out

    @retrying
    def hidden(self) -> int:
        """How many sampler proposals repeated a measured program: told the earlier result, not run, not shown."""
        from optuna.trial import TrialState

        trials = self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        return sum(t.user_attrs.get(ATTR_ROLE) == ROLE_DUPLICATE for t in trials)

    @retrying
    def span_s(self) -> float:
        """Seconds from the first finished trial's start to the last one's end, on whichever machines: how long
        the study took, with workers that ran side by side counted once."""
        from optuna.trial import TrialState

        trials = self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL))
        starts = [t.datetime_start for t in trials if t.datetime_start is not None]
        ends = [t.datetime_complete for t in trials if t.datetime_complete is not None]
        return (max(ends) - min(starts)).total_seconds() if starts and ends else 0.0

    def _claims(self, trials) -> set[str]:
        from optuna.trial import TrialState

        return {
            t.user_attrs[ATTR_CLAIM]
            for t in trials
            if t.state is TrialState.RUNNING and ATTR_CLAIM in t.user_attrs and t.user_attrs.get(ATTR_WORKER) != self.worker
        }

    # --- workers that died ---------------------------------------------------------------------------------------

    def recover(self, trials=None) -> int:
        """Close as failed the running trials whose worker is gone, so that their configurations are run again.

        On this host a worker is gone when its process is; elsewhere when its heartbeats stopped (databases), or
        when its trial has been running far longer than its own timeout allows (journal files keep no heartbeat).
        """
        import optuna
        from optuna.trial import TrialState

        if trials is None:
            trials = self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        now = time.monotonic()
        closed = 0
        for t in trials:
            if t.state is not TrialState.RUNNING:
                continue
            worker = str(t.user_attrs.get(ATTR_WORKER, ""))
            if worker == self.worker:
                continue
            whost, _, wpid = worker.rpartition(":")
            # (containers that share the host name, a reboot: the same pid is another process there)
            here = t.user_attrs.get(ATTR_PROCESSES, self._processes) == self._processes
            if whost == self.host and wpid.isdigit() and here:
                # (the trial process itself is gone too: the runtime ends a trial whose search died)
                dead = not pid_alive(int(wpid))
            else:
                seen = self._seen_running.setdefault(t.number, now)
                limit = float(t.user_attrs.get(ATTR_TIMEOUT, UNSTARTED_S))
                dead = now - seen > limit + STALE_MARGIN_S
            if dead:
                closed += self._close(t.number)
        if self.storage.heartbeat is not None:
            before = sum(t.state is TrialState.RUNNING for t in trials)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                optuna.storages.fail_stale_trials(self.study)
            if before:
                closed += before - len(self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)))
        return max(closed, 0)

    def _close(self, number: int) -> int:
        import optuna
        from optuna.trial import TrialState

        try:
            self.study.tell(number, state=TrialState.FAIL, skip_if_finished=True)
        except (optuna.exceptions.UpdateFinishedTrialError, ValueError):
            return 0  # its worker finished it after all, or another worker closed it first
        return 1

    @contextmanager
    def beating(self, trial) -> Iterator[None]:
        """Record ``trial``'s heartbeat while it runs (database storages), so other workers see if this one dies."""
        hb = self.storage.heartbeat
        if hb is None:
            yield
            return
        trial_id = hb.get_trial_id_from_study_id_trial_number(self._study_id, trial.number)
        stop = threading.Event()

        def beat() -> None:
            while True:
                try:
                    hb.record_heartbeat(trial_id)
                except Exception:  # the database is away for a moment: the next beat tries again
                    pass
                if stop.wait(self._interval):
                    return

        thread = threading.Thread(target=beat, name="autotune-heartbeat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    # --- writing -----------------------------------------------------------------------------------------------

    @retrying
    def ask(self, config: Mapping[str, Any] | None):
        """A new running trial of ``config``, or of the sampler's choice when None."""
        import optuna
        from optuna.trial import TrialState

        while True:
            with warnings.catch_warnings():
                # Optuna warns that its heartbeat is meant for Study.optimize: here beating() records it instead
                warnings.simplefilter("ignore")
                if config is None:
                    trial = self.study.ask(self._distributions)
                else:
                    # A sampler that returns the configuration, not enqueue_trial: a queued trial is taken by
                    # whichever worker asks next, so a baseline or confirmation run meant for this machine could
                    # run on another one.
                    base = self.study.sampler
                    self.study.sampler = optuna.samplers.PartialFixedSampler(dict(config), base)
                    try:
                        trial = self.study.ask(self._distributions)
                    finally:
                        self.study.sampler = base
            if ATTR_ROLE not in trial.user_attrs and (config is None or self.params(trial) == dict(config)):
                return trial
            # a trial queued with enqueue_trial (by an autotune before 0.2, or by hand) came back instead of a new
            # one: its role and machine are unknown here, so it is closed unrun
            trial.set_user_attr(ATTR_NOTE, "a queued trial: autotune runs only the trials it asks for")
            self.study.tell(trial, state=TrialState.FAIL)

    def params(self, trial) -> dict[str, Any]:
        assert self.space is not None
        return {k.name: trial.params.get(k.name, k.default) for k in self.space.knobs}

    @retrying
    def label(self, trial, role: str, claim: str | None = None) -> None:
        """Say who runs ``trial``, where, and what it claims; the role last: a trial with a role is labelled."""
        trial.set_user_attr(ATTR_PROCESSES, self._processes)  # before the worker: a pid is never read without it
        trial.set_user_attr(ATTR_WORKER, self.worker)
        trial.set_user_attr(ATTR_MACHINE, self.machine)
        if claim is not None:
            trial.set_user_attr(ATTR_CLAIM, claim)
        trial.set_user_attr(ATTR_ROLE, role)

    @retrying
    def holds(self, trial, claim: str) -> bool:
        """Whether ``trial`` holds ``claim``: no earlier trial, running or finished, claims the same.

        Trial numbers are handed out by the storage one by one, so of two workers that claim the same program at
        once exactly one holds it. An earlier trial that is not labelled yet may be about to claim it: wait.
        """
        from optuna.trial import TrialState

        deadline = time.monotonic() + SETUP_WAIT_S
        while True:
            unlabelled = []
            for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.COMPLETE)):
                if t.number >= trial.number:
                    continue
                if t.user_attrs.get(ATTR_CLAIM) == claim:
                    return False
                if t.state is TrialState.RUNNING and ATTR_ROLE not in t.user_attrs and t.number not in self._waited:
                    unlabelled.append(t.number)
            if not unlabelled:
                return True
            if time.monotonic() > deadline:  # its worker died while labelling it: it claims nothing
                self._waited.update(unlabelled)
                return True
            time.sleep(0.05)

    @retrying
    def step_aside(self, trial) -> None:
        """Another worker claimed the same program first: end this trial unrun."""
        from optuna.trial import TrialState

        trial.set_user_attr(ATTR_ROLE, ROLE_YIELDED)
        self.study.tell(trial, state=TrialState.FAIL)

    @retrying
    def started(self, trial, pid: int, timeout: float) -> None:
        trial.set_user_attr(ATTR_PID, pid)
        trial.set_user_attr(ATTR_TIMEOUT, timeout)

    @retrying
    def record(self, trial, result: TrialResult, value: float) -> int:
        """Tell Optuna a trial's outcome (``value``, feasible only when it passed); the number it is stored under."""
        import optuna

        try:
            self._tell(trial, result, value)
            return trial.number
        except (optuna.exceptions.UpdateFinishedTrialError, ValueError):
            stored = self.study.get_trials(deepcopy=False)[trial.number]
            if not stored.state.is_finished():
                raise
            mine = json.loads(json.dumps(result.to_attrs()))  # as the storage gives it back: lists, not tuples
            if stored.state.name == "COMPLETE" and stored.user_attrs.get(ATTR_RESULT) == mine:
                return trial.number  # this very tell went through before a failed call was made again
        # another worker took this one for dead (a pause longer than the heartbeat grace) and closed the trial:
        # the measurement is still good, so it is kept in a new trial
        again = self.ask(result.config)
        self.label(again, result.role)
        self._tell(again, result, value)
        return again.number

    def _tell(self, trial, result: TrialResult, value: float) -> None:
        trial.set_user_attr(ATTR_ROLE, result.role)
        trial.set_user_attr(ATTR_RESULT, result.to_attrs())
        self._feasible(trial, result.status is Outcome.OK)
        self.study.tell(trial, value)

    @retrying
    def reuse(self, trial, earlier: TrialResult, value: float) -> None:
        """The sampler proposed a configuration already measured: tell it the earlier result (Optuna's FAQ way)."""
        trial.set_user_attr(ATTR_ROLE, ROLE_DUPLICATE)
        trial.set_user_attr("duplicate_of", earlier.number)
        self._feasible(trial, earlier.status is Outcome.OK)
        self.study.tell(trial, value)

    def _feasible(self, trial, feasible: bool) -> None:
        trial.set_user_attr(ATTR_FEASIBLE, feasible)
        if self._set_constraint:
            trial.set_constraint("feasible", 0.0 if feasible else 1.0)

    @retrying
    def abandon(self, trial) -> None:
        """The search was stopped during this trial: FAIL, so a resumed search measures it again."""
        from optuna.trial import TrialState

        self.study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)


def _known_studies(storage: Storage) -> str:
    import optuna

    try:
        names = optuna.get_all_study_names(storage.optuna)
    except Exception:
        return ""
    return f" (it has: {', '.join(sorted(names))})" if names else " (it has no studies)"
