"""``autotune bake``: knob values written in as plain code, training exactly like the patched script."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from autotune.analysis import load_project
from autotune.bake import bake, read_config
from autotune.cli import main
from autotune.errors import UsageError
from autotune.patch import run, select, write_outputs
from autotune.transform import Mode
from autotune.search.space import read_space
from loss_probe import run_probe

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "fixtures" / "scripts"
TINY = REPO / "fixtures" / "search" / "tiny.py"
PROBE_ENV = {"OMP_NUM_THREADS": "1"}


def _non_default_config(script: Path) -> dict:
    """Every knob this script reads that the CPU space searches, at the last choice the space gives it."""
    knobs = run(load_project(script), select()).knobs
    space = read_space("cpu").choices
    config = {}
    for k in knobs:
        if "cpu" not in k.devices or k.name.startswith("compile."):  # compiling costs minutes on CPU: left out
            continue
        choices = [c for c in space.get(k.name, k.choices) if c != k.default]
        if choices:
            config[k.name] = choices[-1]
    return config


@pytest.mark.parametrize("script", ["cnn.py", "char_gpt.py", "pkg_project/train.py"])
def test_all_defaults_bake_to_the_original_files(script):
    project = load_project(SCRIPTS / script)
    defaults = {k.name: k.default for k in run(project, select()).knobs}
    baked = bake(project, defaults, "cpu")
    assert not baked.changed
    assert all(f.new_text == f.facts.source for f in baked.files)


@pytest.mark.parametrize("script", ["cnn.py", "char_gpt.py", "pkg_project/train.py"])
def test_baked_code_is_plain(script):
    config = _non_default_config(SCRIPTS / script)
    assert config
    baked = bake(load_project(SCRIPTS / script), config, "cpu")
    assert baked.changed
    for f in baked.files:
        compile(f.new_text, str(f.rel), "exec")
        # no runtime import, no knob read, no trial hook (the bundled example's docstring names autotune)
        assert "_autotune" not in f.new_text and "import autotune" not in f.new_text


def test_bake_cli_writes_the_tuned_files_diff_and_config(tmp_path, capsys):
    config = tmp_path / "chosen.yaml"
    config.write_text("device: cpu\nknobs:\n  gc.freeze: true\n  fused_optimizer.impl: default\n")
    out = tmp_path / "out"
    assert main(["bake", str(TINY), "--config", str(config), "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "baked gc.freeze=True" in said
    tuned = (out / "tiny.py").read_text()
    assert "gc.freeze()" in tuned and "autotune" not in tuned
    assert (out / "tuned.diff").read_text().startswith("--- a/tiny.py\n+++ b/tiny.py\n")
    assert "+    gc.freeze()" in (out / "tuned.diff").read_text()
    written = yaml.safe_load((out / "autotune.yaml").read_text())
    assert written["knobs"] == {"gc.freeze": True, "fused_optimizer.impl": "default"}
    # the folder is autotune's now: baking again into it is allowed
    assert main(["bake", str(TINY), "--config", str(config), "--out", str(out)]) == 0


def test_bake_reads_a_search_or_patch_autotune_yaml(tmp_path):
    result = run(load_project(TINY), select())
    write_outputs(result, tmp_path / "patched", "tiny.py")  # knobs: {name: {value, default, choices, ...}}
    values, device = read_config(tmp_path / "patched" / "autotune.yaml")
    assert values == {k.name: k.default for k in result.knobs} and device is None


@pytest.mark.parametrize(
    "text, message",
    [
        ("knobs: [", "not valid YAML"),
        ("gc.freeze: true\n", "expected a mapping with 'knobs:'"),
        ("knobs:\n  gc.froze: true\n", "unknown knob 'gc.froze'"),
        ("knobs:\n  gc.freeze: perhaps\n", "has no choice 'perhaps'"),
        ("device: tpu\nknobs: {}\n", "device must be cpu or cuda"),
        ("knobs:\n  dataloader.num_workers: 2.0\n", "has no choice 2.0 (float;"),
        ("knobs:\n  dataloader.num_workers: true\n", "has no choice True (bool;"),
        ("knobs:\n  compile.dynamic: 1\n", "has no choice 1 (int;"),
        ("knobs:\n  compile.mode: 'default\"); import os; os.system(\"id'\n", "has no choice 'default\")"),
        ("knobs:\n  gc.freeze: " + "x" * 100_000 + "\n", "has no choice 'xxx"),
        (b"knobs: {gc.freeze: \xff}\n", "is not UTF-8 text"),
    ],
    ids=["yaml", "no-knobs", "unknown", "bad-choice", "bad-device", "float-for-int", "bool-for-int", "int-for-bool",
         "code", "huge-value", "not-utf8"],
)
def test_bake_bad_config_is_one_line_exit_2(text, message, tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_bytes(text) if isinstance(text, bytes) else config.write_text(text)
    assert main(["bake", str(TINY), "--config", str(config), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "x" * 200 not in err  # a value from the file is cut short
    assert not (tmp_path / "o").exists()


def test_bake_refuses_to_write_over_the_script(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(TINY.read_text())
    config = tmp_path / "c.yaml"
    config.write_text("knobs:\n  gc.freeze: true\n")
    assert main(["bake", str(script), "--config", str(config), "--out", str(tmp_path)]) == 2
    assert "script's own folder" in capsys.readouterr().err
    assert script.read_text() == TINY.read_text()
    with pytest.raises(UsageError):
        read_config(tmp_path / "missing.yaml")


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, args",
    [
        (SCRIPTS / "cnn.py", ["--num-samples", "96", "--batch-size", "16"]),
        (SCRIPTS / "char_gpt.py", []),
        (SCRIPTS / "pkg_project" / "train.py", []),
        (TINY, ["--iters", "8"]),
    ],
    ids=["cnn", "char_gpt", "pkg_project", "tiny"],
)
def test_baked_script_trains_exactly_like_the_patched_one(script, args, tmp_path):
    project = load_project(script)
    config = _non_default_config(script)
    patched = run(project, select())
    write_outputs(patched, tmp_path / "patched", script.name)
    baked = bake(project, config, "cpu")
    for f in baked.files:
        dest = tmp_path / "baked" / f.rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(f.new_text)
    knobs = tmp_path / "config.yaml"
    knobs.write_text(yaml.safe_dump({"device": "cpu", "knobs": config}))
    entry = patched.files[0].rel
    gated = run_probe(
        tmp_path / "patched" / entry, args, steps=6, out=tmp_path / "p.json",
        env={**PROBE_ENV, "AUTOTUNE_CONFIG": str(knobs)}, cwd=tmp_path, timeout=300,
    )
    plain = run_probe(tmp_path / "baked" / entry, args, steps=6, out=tmp_path / "b.json", env=PROBE_ENV, cwd=tmp_path, timeout=300)
    assert len(gated) == 6
    assert plain == gated, config


class _Sly(str):
    """A string equal to a declared choice that writes itself as code: only the declared choice may be written."""

    def __str__(self) -> str:
        return 'default"); import os; os.system("id'

    __format__ = lambda self, spec: str(self)  # noqa: E731
    __repr__ = __str__


@pytest.mark.parametrize(
    "values",
    [
        {"compile.mode": 'default"); import os; os.system("id'},
        {"compile.mode": _Sly("default")},
        {"dataloader.num_workers": 2.0},
        {"dataloader.num_workers": True},
        {"compile.dynamic": 1},
        {"gc.freeze": "True"},
    ],
    ids=["code", "str-subclass", "float-for-int", "bool-for-int", "int-for-bool", "str-for-bool"],
)
def test_bake_writes_code_only_from_a_declared_choice(values):
    # a study's chosen configuration reaches bake() as it is stored: anyone who can write to the study can edit it
    project = load_project(SCRIPTS / "cnn.py")
    with pytest.raises(UsageError, match="has no choice"):
        bake(project, values, "cpu")
    with pytest.raises(UsageError, match="has no choice"):  # the transforms' own way to a value refuses it too
        run(project, select(), Mode(values=values, device="cpu"), hooks=False)


def test_bake_writes_the_device_only_as_declared():
    project = load_project(SCRIPTS / "cnn.py")
    with pytest.raises(UsageError, match="must be cpu or cuda"):
        bake(project, {"autocast.dtype": "bf16"}, 'cuda"); import os; os.system("id')


def test_bake_writes_the_declared_object_for_an_equal_value():
    project = load_project(SCRIPTS / "cnn.py")
    mode = "max-autotune"
    equal = "".join(["max-", "autotune"])  # equal, not the same object
    assert equal is not mode
    baked = bake(project, {"compile.mode": equal}, "cpu")
    assert 'compile(mode="max-autotune")' in baked.files[0].new_text
