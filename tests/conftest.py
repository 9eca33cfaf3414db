import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# The suite runs on two workers (pytest -n 2) on a two-core machine: each test's processes (the scripts it runs, and
# torch in the worker itself) compute on one intra-op thread unless a test says otherwise. Two workers of two
# threads each on two cores keep OpenMP's threads waiting for whichever one is descheduled: measured on
# tests/test_transform_autocast.py, 107 s on two threads, 93 s on one.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _unsynced_sqlite_commits() -> None:
    """The searches this process runs itself (fake runners) commit to SQLite without waiting for the disk.

    A search commits 20-30 times a trial (Optuna writes each parameter and attribute in its own transaction), and
    SQLite's default waits for two fsyncs each: a third of tests/test_search_strategy.py's time here. Unsynced
    commits are still safe if the process dies (SQLite's documentation: only an OS crash can lose or corrupt them),
    and the searches run as commands, whose interruption and resumption the tests check, keep SQLite's defaults.
    """
    import sqlite3

    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    @event.listens_for(Engine, "connect")
    def _no_sync(connection, _record):
        if isinstance(connection, sqlite3.Connection):
            connection.execute("PRAGMA synchronous=OFF")


_unsynced_sqlite_commits()

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
sys.path.insert(0, str(TESTS))


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


WHOLE_SEARCHES = {"test_search.py", "test_search_shared.py", "test_search_launcher.py", "test_bench_search.py"}


def pytest_collection_modifyitems(config, items):
    # the slow tests (whole searches) first: with several workers (pytest -n), a long test that starts last keeps
    # one worker busy while the others have nothing left to do
    items.sort(key=lambda item: ("slow" not in item.keywords, item.path.name not in WHOLE_SEARCHES))
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _cpu_unless_marked_cuda(request, monkeypatch):
    """Scripts a test runs see no GPU unless the test is marked cuda.

    The fixture scripts pick CUDA when they see it, and CUDA kernels (cuDNN's algorithm choice, atomics in
    backward) are not bitwise reproducible run to run, while the CPU tests assert bit-identical losses.
    """
    if "cuda" not in request.keywords:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture
def temp(monkeypatch):
    """The temporary folder of the search and of its trials (give the trials ``TMPDIR``), this test's own and short,
    as a socket's path in it must be: what they leave there is seen."""
    folder = tempfile.mkdtemp(prefix="t")
    monkeypatch.setattr(tempfile, "tempdir", folder)
    yield Path(folder)
    shutil.rmtree(folder, ignore_errors=True)
