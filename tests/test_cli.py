"""The command line as a user meets it: bad input, outputs, and never touching the user's files uninvited."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.cli import main

REPO = Path(__file__).resolve().parent.parent
CNN = REPO / "fixtures/scripts/cnn.py"
NO_LOOP = REPO / "fixtures/scripts/no_loop.py"


def _files(folder: Path) -> set[Path]:
    return {p for p in folder.rglob("*") if p.is_file()}


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


BAD_INPUTS = {
    "missing": (None, "no such file"),
    "directory": ("DIR", "is a directory"),
    "syntax": ("import torch\nfor x in range(3)\n    pass\n", "bad.py:2:"),
    # parsed, but refused by Python's compiler
    "return_outside": ("import torch\nreturn 5\n", "bad.py:2:1: 'return' outside function"),
    "await_outside": ("import torch\nawait torch.load('x')\n", "bad.py:2:1: 'await' outside function"),
    "not_utf8": (b"x = '\xff\xfe'\n", "not UTF-8"),
    "empty": ("", "is empty"),
    "binary": (b"\x7fELF\x02\x01\x01\x00\x00\x00", "binary"),
    "unknown_coding": ("# -*- coding: foobar -*-\nimport torch\n", "unknown encoding: foobar"),
    "latin1_coding": (b"# coding: latin-1\nname = '\xe9t\xe9'\n", "declares iso-8859-1"),
    # codecs Python looks up but will not read a script with: no ASCII-compatible text encoding
    "rot13_coding": ("# coding: rot13\nimport torch\n", "declares the encoding rot13, which Python cannot read it"),
    "hex_coding": ("# coding: hex\nimport torch\n", "declares the encoding hex, which Python cannot read it"),
    "utf16_coding": ("# coding: utf-16\nimport torch\n", "declares the encoding utf-16, which Python cannot read"),
    "undefined_coding": ("# coding: undefined\nimport torch\n", "declares the encoding undefined, which Python"),
    "notebook_as_py": ('{"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}', "Jupyter notebook"),
}


@pytest.mark.parametrize("command", ["scan", "patch"])
@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_line_exit_2_nothing_written(case, command, in_tmp, capsys):
    content, expected = BAD_INPUTS[case]
    path = in_tmp / "bad.py"
    if content == "DIR":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    before = _files(in_tmp)
    code = main([command, "bad.py"])
    captured = capsys.readouterr()
    assert code == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], captured.err
    assert "Traceback" not in captured.err + captured.out
    assert _files(in_tmp) == before


def test_notebook_is_refused_with_how_to_export(in_tmp, capsys):
    nb = {"cells": [{"cell_type": "code", "source": ["loss.backward()"]}], "metadata": {}, "nbformat": 4}
    (in_tmp / "train.ipynb").write_text(json.dumps(nb))
    assert main(["scan", "train.ipynb"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "jupyter nbconvert --to script train.ipynb" in err[0]


def test_ascii_script_with_a_legacy_coding_line_is_read(in_tmp, capsys):
    """Python runs it as the same text UTF-8 gives, so autotune reads it (and keeps the line)."""
    (in_tmp / "train.py").write_text("# -*- coding: latin-1 -*-\n" + CNN.read_text(encoding="utf-8"))
    assert main(["patch", "train.py", "--out", "out"]) == 0
    assert (in_tmp / "out/train.py").read_text().startswith("# -*- coding: latin-1 -*-\n")


def test_syntax_error_reports_path_line_col(in_tmp, capsys):
    (in_tmp / "bad.py").write_text("import torch\nx = (1,\ny = 2\n")
    assert main(["scan", "bad.py"]) == 2
    err = capsys.readouterr().err.strip()
    path, line, col, msg = err.removeprefix("autotune: error: ").split(":", 3)
    assert path == "bad.py" and line.isdigit() and col.isdigit() and msg.strip()


def test_scan_without_training_loop_says_what_it_looked_for(capsys):
    assert main(["scan", str(NO_LOOP)]) == 0
    out = capsys.readouterr().out
    assert "no training loop found" in out and ".backward()" in out and ".step()" in out


def test_patch_without_training_loop_refuses_and_writes_nothing(in_tmp, capsys):
    code = main(["patch", str(NO_LOOP), "--out", "out"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "no training loop" in err[0]
    assert not (in_tmp / "out").exists()


def test_unknown_transform_is_a_usage_error(capsys):
    assert main(["scan", str(CNN), "--only", "warp_drive"]) == 2
    assert "unknown transform 'warp_drive'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["scan", "patch"])
@pytest.mark.parametrize("option", [("--only", ","), ("--only", ""), ("--skip", "EVERY")], ids=["comma", "empty", "skip-all"])
def test_an_empty_selection_of_transforms_is_an_error(command, option, in_tmp, capsys):
    from autotune.transform import all_transforms

    flag, value = option
    value = ",".join(t.name for t in all_transforms()) if value == "EVERY" else value
    assert main([command, str(CNN), flag, value, "--out", "out"][: 4 if command == "scan" else 6]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no transform" in err[0] and "known: " in err[0]
    assert not (in_tmp / "out").exists()


def test_bad_arguments_exit_2_one_line(capsys):
    assert main(["patch"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "path" in err[0]


def test_patch_writes_outputs_and_leaves_original_alone(in_tmp, capsys):
    script = in_tmp / "train.py"
    script.write_text(CNN.read_text())
    original = script.read_text()
    assert main(["patch", "train.py"]) == 0
    out = in_tmp / "autotune-out"
    assert {p.name for p in out.iterdir()} == {"train.py", "autotune.yaml", "patch.diff", ".autotune-out"}
    assert script.read_text() == original
    diff = (out / "patch.diff").read_text()
    assert diff.startswith("--- a/train.py\n+++ b/train.py\n")
    assert "+import autotune.runtime as _autotune" in diff
    assert "+import autotune.runtime as _autotune" in capsys.readouterr().out


def test_patch_of_an_entry_in_scripts_lays_out_the_project_and_says_how_to_run_it(in_tmp, capsys):
    import shutil

    shutil.copytree(REPO / "fixtures/realistic/pkg_scripts", in_tmp / "proj")
    assert main(["patch", "proj/scripts/train.py", "--out", "out"]) == 0
    out = in_tmp / "out"
    files = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert files == {"scripts/__init__.py", "scripts/train.py", "scripts/autotune.yaml", "mypkg/__init__.py",
                     "mypkg/model.py", "mypkg/data.py", "patch.diff", ".autotune-out"}
    assert "run it with: cd out && python -m scripts.train" in " ".join(capsys.readouterr().out.split())


def test_patch_diff_writes_nothing(in_tmp, capsys):
    (in_tmp / "train.py").write_text(CNN.read_text())
    before = _files(in_tmp)
    assert main(["patch", "train.py", "--diff"]) == 0
    assert "_autotune" in capsys.readouterr().out
    assert _files(in_tmp) == before


def test_patch_in_place_keeps_backups(in_tmp):
    script = in_tmp / "train.py"
    script.write_text(CNN.read_text())
    assert main(["patch", "train.py", "--in-place"]) == 0
    assert (in_tmp / "train.py.orig").read_text() == CNN.read_text()
    assert "_autotune" in script.read_text()
    assert (in_tmp / "autotune.yaml").exists()
    # a second in-place patch has nothing to do and keeps the first backup
    assert main(["patch", "train.py", "--in-place"]) == 0
    assert (in_tmp / "train.py.orig").read_text() == CNN.read_text()


def test_patch_copies_local_modules_so_the_output_runs(in_tmp):
    project = REPO / "fixtures/scripts/pkg_project"
    assert main(["patch", str(project / "train.py"), "--out", "out"]) == 0
    out = in_tmp / "out"
    expected = {p.relative_to(project) for p in project.rglob("*.py")}
    assert expected <= {p.relative_to(out) for p in out.rglob("*.py")}


def test_scan_json_schema(capsys):
    assert main(["scan", str(CNN), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == 1
    assert doc["training_loops"] and doc["training_loops"][0]["path"].endswith("cnn.py")
    statuses = {"applicable", "present", "user", "not_applicable"}
    for site in doc["sites"]:
        assert set(site) == {"transform", "path", "line", "col", "status", "reason"}
        assert site["status"] in statuses and site["line"] >= 1
    assert any(s["transform"] == "fused_optimizer" and s["status"] == "applicable" for s in doc["sites"])
    for t in doc["transforms"]:
        assert t["numerics"] in ("exact", "reorder", "lowp") and t["knobs"]


def test_scan_lines_point_at_the_code(capsys):
    assert main(["scan", str(CNN), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    lines = CNN.read_text().splitlines()
    site = next(s for s in doc["sites"] if s["transform"] == "fused_optimizer")
    assert "AdamW" in lines[site["line"] - 1]


def test_console_script_and_python_m(tmp_path):
    env = {**os.environ, "COLUMNS": "200"}
    for cmd in (["autotune"], [sys.executable, "-m", "autotune"]):
        proc = subprocess.run([*cmd, "scan", str(NO_LOOP)], capture_output=True, text=True, env=env, timeout=60)
        assert proc.returncode == 0 and "no training loop found" in proc.stdout
        proc = subprocess.run([*cmd, "scan", str(tmp_path / "nope.py")], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


# A form feed and a U+2028 in comments: str.splitlines() breaks lines at both, Python and patch do not.
ODD_BREAKS = (
    "import torch\n"
    "# page \x0c break, and a line separator \u2028 in a comment\n"
    "model = torch.nn.Linear(2, 2)\n"
    "opt = torch.optim.AdamW(model.parameters())\n"
    "for i in range(3):\n"
    "    loss = model(torch.ones(2)).sum()\n"
    '    t = "\u00e9\u00e9"; loss.backward()\n'
    "    opt.step()\n"
    "    opt.zero_grad()\n"
)


def test_columns_and_diff_count_lines_as_python_does(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(ODD_BREAKS, encoding="utf-8")
    assert main(["scan", str(script), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    backward = [s for s in doc["sites"] if s["line"] == 7]
    assert backward and all(s["col"] == 15 for s in backward)  # characters, not UTF-8 bytes: "    t = "éé"; " is 14
    out = tmp_path / "out"
    assert main(["patch", str(script), "--out", str(out)]) == 0
    # the diff applies to the original with git apply (a plain patch tool), giving the patched file
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text(ODD_BREAKS, encoding="utf-8")
    proc = subprocess.run(["git", "apply", "-p1", str(out / "patch.diff")], cwd=work, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (work / "train.py").read_text(encoding="utf-8") == (out / "train.py").read_text(encoding="utf-8")


def test_bare_autotune_prints_usage_and_exits_2(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: autotune")
    assert all(c in err for c in ("scan", "patch", "bake", "search", "report"))


@pytest.mark.parametrize("command", ["scan", "patch", "bake", "search", "report"])
def test_each_subcommand_help_has_an_example_and_says_what_path_is(command, capsys):
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert f"examples:\n  autotune {command} " in out
    if command != "report":  # report takes a study, not a script
        assert "path " in out and "the training script" in out


def test_a_closed_pipe_ends_quietly(tmp_path):
    # `autotune scan --json x.py | head`: the reader is gone before autotune writes
    proc = subprocess.Popen(
        [sys.executable, "-m", "autotune", "scan", "--json", str(CNN)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert err == b"" and proc.returncode == 141


def test_printed_hints_quote_paths(in_tmp, capsys):
    (in_tmp / "my train.py").write_text(CNN.read_text())
    assert main(["patch", "my train.py", "--out", "out dir"]) == 0
    assert "run it with: python 'out dir/my train.py'" in capsys.readouterr().out


def test_the_documented_knob_table_is_what_autotune_knobs_prints(capsys):
    assert main(["knobs", "--markdown"]) == 0
    table = capsys.readouterr().out
    readme = (REPO / "docs" / "knobs.md").read_text(encoding="utf-8")
    start = readme.index("<!-- generated by `autotune knobs --markdown`")
    end = readme.index("<!-- end of the generated table -->")
    assert readme[start:end].split("\n", 1)[1] == table  # regenerate: autotune knobs --markdown


def test_knobs_json_lists_every_knob_with_its_default_first(capsys):
    from autotune.transform import all_knobs

    assert main(["knobs", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [k["name"] for k in doc["knobs"]] == list(all_knobs())
    for k in doc["knobs"]:
        declared = all_knobs()[k["name"]]
        assert k["choices"][0] == declared.default and sorted(map(str, k["choices"])) == sorted(map(str, declared.choices))
        assert k["numerics"] in ("exact", "reorder", "lowp") and k["devices"] and k["help"]


def test_knobs_piped_prints_each_knob_whole_on_one_line():
    """`autotune knobs | grep compile` finds whole names: no table wrapping them at 80 columns."""
    import subprocess
    import sys

    from autotune.transform import all_knobs

    done = subprocess.run([sys.executable, "-m", "autotune", "knobs"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "80"})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split("\t")[0] for line in lines] == list(all_knobs())
    compile_mode = next(line for line in lines if line.startswith("compile.mode\t")).split("\t")
    assert compile_mode[1].startswith("none,default,") and compile_mode[2] == "reorder" and compile_mode[4]


class _Asked(Exception):
    pass


@pytest.mark.parametrize("given, lengthen, lengths", [
    ((), True, (5, 20)),
    (("--steps", "20"), False, (5, 20)),
    (("--warmup", "3"), False, (3, 20)),
])
def test_search_lengthens_cheap_runs_only_where_the_user_left_the_run_lengths_to_it(
    tmp_path, monkeypatch, given, lengthen, lengths
):
    asked = []

    def fake_run_search(options, display):
        asked.append(options)
        raise _Asked

    monkeypatch.setattr("autotune.search.search.run_search", fake_run_search)
    with pytest.raises(_Asked):
        main(["search", str(CNN), "--out", str(tmp_path / "out"), *given])
    assert asked[0].lengthen is lengthen and (asked[0].warmup, asked[0].steps) == lengths


def test_scan_prints_the_scripts_own_text_in_a_reason_as_written(tmp_path, capsys, monkeypatch):
    # a reason that quotes code with brackets (``[start:start + batch_size]``) is the script's text, not rich markup
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\nfrom torch import nn\nbatch_size, accum = 4, 2\nx = torch.randn(32, 8)\n"
        "model = nn.Linear(8, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for i, start in enumerate(range(0, 32, batch_size)):\n"
        "    loss = model(x[start:start + batch_size]).mean() / accum\n    loss.backward()\n    print(start)\n"
        "    if (i + 1) % accum == 0:\n        opt.step()\n        opt.zero_grad()\n")
    monkeypatch.setenv("COLUMNS", "400")
    assert main(["scan", str(script), "--only", "batch_split"]) == 0
    out = capsys.readouterr().out
    assert "[start:start + batch_size]" in out, out
