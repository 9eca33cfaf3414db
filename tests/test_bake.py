"""``autotune bake``: knob values written in as plain code, training exactly like the patched script."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from autotune.project import load_project
from autotune.bake import bake, read_config
from autotune.cli import main
from autotune.errors import UsageError
from autotune.patch import run, select, write_outputs
from autotune.transform import Mode
from autotune.search.space import read_space

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
    rel = TINY.relative_to(REPO).as_posix() if (REPO / ".git").exists() else TINY.name  # from the repository's root
    assert (out / "tuned.diff").read_text().startswith(f"--- a/{rel}\n+++ b/{rel}\n")
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


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_tuned_diff_applies_with_git_apply_from_the_repository_root(tmp_path):
    repo = tmp_path / "repo"
    (repo / "experiments" / "mlp").mkdir(parents=True)
    script = repo / "experiments" / "mlp" / "train.py"
    script.write_text(TINY.read_text())
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True, timeout=60)
    config = tmp_path / "chosen.yaml"
    config.write_text("knobs:\n  gc.freeze: true\n")
    out = tmp_path / "out"
    assert main(["bake", str(script), "--config", str(config), "--out", str(out)]) == 0
    assert (out / "tuned.diff").read_text().startswith("--- a/experiments/mlp/train.py\n")
    done = subprocess.run(["git", "apply", str(out / "tuned.diff")], cwd=repo, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert script.read_text() == (out / "train.py").read_text()


SDPA_CASE = REPO / "fixtures" / "transforms" / "sdpa" / "gpt_causal.in.py"


def _baked_sdpa(tmp_path: Path, text: str) -> str:
    script = tmp_path / "attn.py"
    script.write_text(text)
    (baked,) = bake(load_project(script), {"sdpa.attention": "sdpa"}, "cpu").files
    compile(baked.new_text, "attn.py", "exec")
    return baked.new_text


def test_bake_drops_an_import_only_the_replaced_code_used(tmp_path):
    # the hand-written attention was math's only user: SDPA leaves `import math` behind otherwise
    baked = _baked_sdpa(tmp_path, SDPA_CASE.read_text())
    assert "import math" not in baked and "scaled_dot_product_attention" in baked
    assert baked.startswith('''"""minGPT-style causal self-attention: a registered lower-triangular buffer and attention dropout."""

import torch
''')


@pytest.mark.parametrize(
    "imports, kept",
    [
        ("import math\n", "import math\n"),  # still read by the line the test adds below
        ("import math, os  # math: the attention scale\n", "import math, os  # math: the attention scale\n"),
        ("import os, math\n", "import os, math\n"),
    ],
    ids=["used-elsewhere", "first-of-two", "second-of-two"],
)
def test_bake_keeps_an_import_something_else_reads(tmp_path, imports, kept):
    text = SDPA_CASE.read_text().replace("import math\n", imports, 1) + "print(math.pi, os.sep if False else '')\n"
    text = text if "os" in imports else text.replace(", os.sep if False else ''", "")
    assert kept in _baked_sdpa(tmp_path, text)


@pytest.mark.parametrize(
    "imports, left",
    [
        ("import os, math\n", "import os\n"),
        ("import math, os  # paths\n", "import os  # paths\n"),
        ("from math import sqrt, pi\n", "from math import pi\n"),
        ("import os; import math\n", "import os\n"),
    ],
    ids=["second-of-two", "first-of-two", "from-import", "semicolon"],
)
def test_bake_drops_just_the_unused_name_of_a_shared_import(tmp_path, imports, left):
    text = SDPA_CASE.read_text().replace("import math\n", imports, 1).replace("math.sqrt", "sqrt" if "sqrt" in imports else "math.sqrt")
    text += "print(os.sep, pi)\n" if "pi" in imports else "print(os.sep)\n"
    baked = _baked_sdpa(tmp_path, text)
    head = baked.split("\n\n")[1]  # the docstring, then the block of standard-library imports
    assert head + "\n" == left


def test_baked_imports_go_among_the_scripts_own():
    (baked,) = bake(load_project(TINY), {"gc.freeze": True}, "cpu").files
    docstring, imports = baked.new_text.split("\n\n")[:2]
    assert docstring.startswith('"""A tiny regression MLP') and imports == "import argparse\nimport gc"


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
    assert 'compile_for_training(model, mode="max-autotune")' in baked.files[0].new_text
