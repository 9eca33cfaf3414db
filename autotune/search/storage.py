"""Where a study lives: opening an Optuna storage (SQLite, a journal file, PostgreSQL or MySQL) with one clear line for
each way it can be refused, its password never shown, and database calls retried while the failure is the database's."""

from __future__ import annotations

import errno
import functools
import json
import os
import re
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from autotune.errors import AutotuneError, UsageError


HEARTBEAT_ENV = "AUTOTUNE_HEARTBEAT_S"
HEARTBEAT_S = 10
GRACE_BEATS = 6  # a trial whose worker missed this many heartbeats in a row is taken for dead
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


class StudyDamaged(AutotuneError):
    """A stored trial that cannot be read back (not JSON, or not a result's shape): nothing is run or written."""


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
            except json.JSONDecodeError as exc:  # Optuna reads each stored attribute as JSON
                raise StudyDamaged(
                    f"{self.storage.description}: a trial of study '{self.name}' is stored as something that is not "
                    f"JSON ({exc.msg} at character {exc.pos}): the study is damaged; start another with "
                    "--study-name NAME or --out DIR"
                ) from None
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
    """The storage named by ``--storage``, else by ``AUTOTUNE_STORAGE`` (which ``ps`` does not show), else None;
    an empty one given is refused, not taken for the default."""
    if given is not None and not given.strip():
        raise UsageError("--storage is empty: give a database URL or a file, or leave --storage out for DIR/study.db")
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
