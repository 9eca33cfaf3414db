"""bench/bench_search.py keeps running: its phases end to end on the loader fixture, its oracle and its bad input."""

import argparse
import importlib.util
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
from conftest import REPO

spec = importlib.util.spec_from_file_location("bench_search", REPO / "bench" / "bench_search.py")
bench_search = importlib.util.module_from_spec(spec)
sys.modules["bench_search"] = bench_search  # (dataclasses look their module up while the class is made)
spec.loader.exec_module(bench_search)
GridPoint = bench_search.GridPoint


def test_oracle_is_the_fastest_configuration_that_passed_the_gate():
    points = [
        GridPoint({"a": 1}, (1.4, 1.6), True, "ok"),
        GridPoint({"a": 2}, (3.0,), False, "diverged"),  # the fastest, but its losses are off
        GridPoint({"a": 3}, (1.2,), True, "ok"),
    ]
    assert bench_search.oracle_of(points).config == {"a": 1}


def test_no_oracle_when_nothing_beats_the_baseline():
    assert bench_search.oracle_of([GridPoint({"a": 1}, (0.9,), True, "ok"), GridPoint({"a": 2}, (), True, "ok")]) is None


def test_the_rounds_decide_among_the_grids_top_configurations():
    Row = bench_search.Row
    rows = {
        "baseline": Row("baseline", {}, (), (1.0, 1.0), "ok"),
        "oracle": Row("oracle", {"a": 1}, (), (1.2, 1.3), "ok"),
        "grid #2": Row("grid #2", {"a": 2}, (), (1.5, 1.6), "ok"),  # second in the grid pass, first in the rounds
        "grid #3": Row("grid #3", {"a": 3}, (), (2.0, 2.0), "diverged 1/2"),
    }
    got = bench_search.fastest_of_top(rows)
    assert got["oracle"].config == {"a": 2} and got["grid #2"].config == {"a": 1}
    assert got["grid #3"] == rows["grid #3"] and got["baseline"] == rows["baseline"]


def _fake_search(monkeypatch, tmp_path, writes_yaml: bool):
    """A search subprocess that exits 1, after writing its autotune.yaml or not."""

    def fake_run(cmd, **kw):
        out = tmp_path / "loader"
        if writes_yaml:
            out.mkdir()
            (out / "autotune.yaml").write_text("knobs: {gc.freeze: true}\nsearch: {runs: 7, wall_s: 12.0}\n")
        kw["stdout"].write(b"Traceback (most recent call last):\nAttributeError: boom\n")
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(bench_search.subprocess, "run", fake_run)
    bench = SimpleNamespace(script=REPO / "fixtures/search/tiny.py", device="cpu", script_args=(),
                            console=SimpleNamespace(print=lambda *a, **k: None))
    args = argparse.Namespace(steps=3, warmup=1, search_arg=[])
    return bench_search.run_search(bench, tmp_path / "loader", args)


def test_a_search_that_fails_after_choosing_still_counts_with_its_failure_noted(monkeypatch, tmp_path):
    got = _fake_search(monkeypatch, tmp_path, writes_yaml=True)
    assert got.config == {"gc.freeze": True} and got.runs == 7
    assert "exit status 1" in got.problem and "AttributeError: boom" in got.problem


def test_a_search_that_fails_before_choosing_has_no_tuned_configuration(monkeypatch, tmp_path):
    got = _fake_search(monkeypatch, tmp_path, writes_yaml=False)
    assert got.config is None and "exit status 1" in got.verdict


def test_grid_is_every_combination_of_the_declared_choices():
    grid = bench_search.grid_configs({"x": (0, 1, 2), "y": (False, True)})
    assert len(grid) == 6 and {"x": 2, "y": True} in grid and len({json.dumps(c) for c in grid}) == 6


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--skip-search"], "--skip-search needs --out"),
        (["--skip-grid"], "--skip-grid needs --out"),
        (["--rounds", "0"], "--rounds"),
    ],
    ids=["skip-search-without-out", "skip-grid-without-out", "no-rounds"],
)
def test_bad_options_are_one_line_and_exit_2(argv, says, capsys):
    assert bench_search.main(["--scripts", "loader", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1


def test_nothing_saved_to_reuse_is_refused(tmp_path, capsys):
    assert bench_search.main(["--scripts", "loader", "--out", str(tmp_path), "--skip-grid"]) == 2
    assert "no saved grid" in capsys.readouterr().err


def test_a_grid_saved_for_other_trials_is_not_reused(tmp_path):
    path = tmp_path / "loader.grid.json"
    bench_search.save_grid(path, "one", [GridPoint({"a": 1}, (1.5,), True, "ok")])
    assert bench_search.load_grid(path, "one")[0].speedup == 1.5
    with pytest.raises(bench_search.BenchError, match="measure it again"):
        bench_search.load_grid(path, "another")


@pytest.mark.slow
def test_every_phase_runs_on_the_loader_fixture(tmp_path):
    """Grid, search (a small budget here, to stay fast) and one side-by-side round, with the Markdown table."""
    md = tmp_path / "bench.md"
    out = tmp_path / "out"
    argv = ["--scripts", "loader", "--rounds", "1", "--steps", "3", "--warmup", "1", "--out", str(out), "--md", str(md),
            "--search-arg=--trials=2", "--search-arg=--confirm=5", "--search-arg=--whole-runs=0", "--oracle-top", "2"]
    assert bench_search.main(argv) == 0
    text = md.read_text()
    assert "### loader on cpu" in text and "tuned / oracle = " in text
    for name in bench_search.ROLES:
        assert f"\n| {name} | " in text
    grid = json.loads((out / "loader.grid.json").read_text())["points"]
    assert len(grid) == 3  # the 2x2 grid less the baseline itself
    assert all(p["speedups"] for p in grid if p["status"] == "ok")
    assert (out / "loader" / "autotune.yaml").is_file()
    # the saved grid and search are reused, not measured again
    md.unlink()
    assert bench_search.main([*argv, "--skip-grid", "--skip-search"]) == 0
    assert "measured by an earlier run" in md.read_text()
