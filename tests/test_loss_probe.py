"""The test harness's runner of training scripts (tests/loss_probe.py): a probe forked from its zygote records what a
fresh ``python`` records, and runs fresh wherever forking could change what the script sees."""

from __future__ import annotations

import os
import textwrap

import pytest
from loss_probe import ProbeError, probe, run_probe, run_script
from procs import wait_gone

SCRIPT = textwrap.dedent(
    """
    import os
    import sys
    print("forked:", "--zygote" in open(f"/proc/{os.getppid()}/cmdline").read())
    import random

    import torch

    print("threads:", torch.get_num_threads())
    print("cwd:", os.getcwd())
    print("variable:", os.environ.get("AUTOTUNE_PROBE_TEST"))
    print("random:", random.random())
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(64, 8)
    for step in range(int(sys.argv[1])):
        loss = (model(x) - 1).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    """
)


def _lines(output: str, key: str) -> list[str]:
    return [line.split(": ", 1)[1] for line in output.splitlines() if line.startswith(key + ":")]


def test_a_forked_probe_records_what_a_fresh_one_records(tmp_path, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    work = tmp_path / "work"
    work.mkdir()
    env = {"AUTOTUNE_PROBE_TEST": "given"}
    forked = [probe(script, ["5"], steps=4, env=env, cwd=work) for _ in range(2)]
    monkeypatch.setenv("LOSS_PROBE_FRESH", "1")
    fresh = probe(script, ["5"], steps=4, env=env, cwd=work)

    assert [_lines(r["output"], "forked") for r in forked] == [["True"]] * 2  # (torch imported in both: the probe uses it)
    assert _lines(fresh["output"], "forked") == ["False"]
    assert forked[0]["losses"] == forked[1]["losses"] == fresh["losses"] and len(fresh["losses"]) == 4
    for r in (*forked, fresh):
        assert _lines(r["output"], "cwd") == [str(work)] and _lines(r["output"], "variable") == ["given"]
    # Python's own generator seeded afresh in each, as in a new interpreter: not the zygote's state twice
    assert _lines(forked[0]["output"], "random") != _lines(forked[1]["output"], "random")


def test_a_script_that_writes_its_environment_runs_fresh(tmp_path):
    """A script may set a variable before it imports torch; forked from a zygote, torch would be imported first."""
    writes = tmp_path / "writes.py"
    writes.write_text('import os\nos.environ["OMP_NUM_THREADS"] = "2"\n' + SCRIPT)
    rc, out = run_script(writes, ["3"])
    assert rc == 0 and _lines(out, "forked") == ["False"] and _lines(out, "threads") == ["2"]
    plain = tmp_path / "plain.py"
    plain.write_text(SCRIPT)
    rc, out = run_script(plain, ["3"])
    assert rc == 0 and _lines(out, "forked") == ["True"] and _lines(out, "threads") == ["1"]


def test_a_variable_read_when_torch_is_imported_reaches_a_forked_probe(tmp_path):
    """OpenMP reads OMP_NUM_THREADS when torch loads it: a probe with another value forks from a zygote that
    imported torch with that value."""
    script = tmp_path / "threads.py"
    script.write_text(SCRIPT)
    for threads in ("2", "1", "2"):
        out = probe(script, ["3"], steps=2, env={"OMP_NUM_THREADS": threads})["output"]
        assert _lines(out, "forked") == ["True"] and _lines(out, "threads") == [threads]


def test_a_probe_past_its_timeout_is_killed_with_its_children(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(
        "import os, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "open('child.pid', 'w').write(str(child.pid))\n"
        "time.sleep(600)\n"
    )
    with pytest.raises(ProbeError, match="timed out"):
        run_probe(script, steps=1, cwd=tmp_path, timeout=5)
    assert wait_gone([int((tmp_path / "child.pid").read_text())], 10) == []


def test_run_script_exits_as_the_interpreter_would(tmp_path):
    script = tmp_path / "exits.py"
    script.write_text(
        "import atexit, sys\n"
        "atexit.register(lambda: print('atexit ran'))\n"
        "if sys.argv[1] == 'raise':\n"
        "    raise ValueError('bad input')\n"
        "sys.exit(int(sys.argv[1]))\n"
    )
    rc, out = run_script(script, ["3"], cwd=tmp_path)
    assert rc == 3 and "atexit ran" in out
    rc, out = run_script(script, ["0"], cwd=tmp_path)
    assert rc == 0
    rc, out = run_script(script, ["raise"], cwd=tmp_path)
    assert rc == 1 and "ValueError: bad input" in out and "Traceback" in out and "atexit ran" in out
    assert os.getcwd() != str(tmp_path)
