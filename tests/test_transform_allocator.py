"""allocator: expandable_segments reaches PYTORCH_CUDA_ALLOC_CONF before torch loads, merged, and changes no loss."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from loss_probe import probe

from autotune import runtime
from autotune.project import load_project
from autotune.knobs import Numerics
from autotune.patch import run, select
from autotune.transform import Mode, Status
from autotune.transforms.allocator import Allocator

T = "allocator"
KNOB = "allocator.expandable_segments"
CASES = Path(__file__).resolve().parent.parent / "fixtures" / "transforms" / T
ENV_NAMES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def _result(name: str, mode: Mode = Mode()):
    return run(load_project(CASES / f"{name}.in.py"), select([T]), mode, hooks=False)


def _text(name: str, mode: Mode = Mode()) -> str:
    (file,) = _result(name, mode).files
    return file.new_text


def _baked(name: str) -> str:
    return _text(name, Mode(values={KNOB: True}, device="cuda"))


def _run(tmp: Path, label: str, text: str, value: bool | None = None, env: dict | None = None, steps: int = 4):
    """(losses, output) of ``text`` run as a script, with the allocator variables cleared unless ``env`` sets them."""
    script = tmp / f"{label}.py"
    script.write_text(text, encoding="utf-8")
    full_env: dict[str, str | None] = {"AUTOTUNE_CONFIG": None, "AUTOTUNE_TRIAL": None, **dict.fromkeys(ENV_NAMES)}
    full_env.update(env or {})
    if value is not None:
        config = tmp / f"{label}.yaml"
        config.write_text(yaml.safe_dump({"device": "cuda", "knobs": {KNOB: value}}), encoding="utf-8")
        full_env["AUTOTUNE_CONFIG"] = str(config)
    result = probe(script, steps=steps, out=tmp / f"{label}.json", env=full_env, cwd=tmp, timeout=240)
    losses = result["losses"]
    assert len(losses) == steps and all(math.isfinite(float.fromhex(v)) for v in losses), losses
    return losses, result["output"]


# --- what it finds -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, expected",
    [
        ("basic", [Status.APPLICABLE]),
        ("early_os_import", [Status.APPLICABLE]),
        ("reads_env_only", [Status.APPLICABLE]),
        ("already_set", [Status.PRESENT]),
        ("user_alloc_conf", [Status.USER]),
        ("no_training_loop", [Status.NOT_APPLICABLE]),
    ],
)
def test_sites(name, expected):
    result = _result(name)
    assert [s.status for s in result.sites] == expected
    assert [k.name for k in result.knobs] == ([KNOB] if Status.APPLICABLE in expected else [])


def test_knob_matches_the_runtime_contract():
    (knob,) = Allocator.knobs
    assert (knob.name, knob.choices, knob.default) == (KNOB, (False, True), False)
    assert knob.numerics is Numerics.EXACT and knob.devices == frozenset({"cuda"})
    assert Allocator.entry_only and Allocator.devices == frozenset({"cuda"})


def test_the_setting_comes_before_any_import_that_can_load_torch():
    lines = _text("early_os_import").splitlines()
    assert lines.index("_autotune.allocator_env()") < lines.index("import argparse") < lines.index("import torch")
    assert lines.index("from __future__ import annotations") < lines.index("import autotune.runtime as _autotune")
    baked = _baked("early_os_import").splitlines()  # after the script's own `import os`, still before torch
    assert baked.index("import os") < baked.index("import sys") < baked.index("import torch")
    between = baked[baked.index("import os") : baked.index("import sys")]
    assert any("expandable_segments:True" in line for line in between)
    baked = _baked("basic").splitlines()  # no early `import os`: the bake brings its own, first
    assert baked.index("import os") < baked.index("import torch")
    assert "autotune" not in "\n".join(baked)


# --- the runtime helper, in process ------------------------------------------------------------------------


@pytest.fixture
def knob_value(tmp_path, monkeypatch):
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)

    def set_value(value: bool) -> None:
        config = tmp_path / "config.yaml"
        config.write_text(yaml.safe_dump({"knobs": {KNOB: value}}))
        monkeypatch.setenv("AUTOTUNE_CONFIG", str(config))
        runtime.reset()

    yield set_value
    runtime.reset()


def test_runtime_default_leaves_the_environment_alone(knob_value, monkeypatch):
    import os

    knob_value(False)
    runtime.allocator_env()
    assert not any(name in os.environ for name in ENV_NAMES)


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, "expandable_segments:True"),
        ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}, "max_split_size_mb:128,expandable_segments:True"),
        # torch reads PYTORCH_CUDA_ALLOC_CONF first: the generic variable's settings are carried over into it
        ({"PYTORCH_ALLOC_CONF": "garbage_collection_threshold:0.6"},
         "garbage_collection_threshold:0.6,expandable_segments:True"),
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, "expandable_segments:False"),  # the user's
    ],
)
def test_runtime_merges_with_what_the_environment_has(knob_value, monkeypatch, env, expected):
    import os

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    knob_value(True)
    runtime.allocator_env()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == expected


# --- patched and baked scripts, run ------------------------------------------------------------------------

def _needs_settings_reader() -> None:
    import torch

    if not hasattr(torch._C, "_accelerator_getAllocatorSettings"):
        pytest.skip(f"torch {torch.__version__} cannot show its allocator settings (the reader came in a later torch)")


def _show_settings(text: str) -> str:
    """The script, also printing torch's own view of its allocator settings (readable on CPU builds too)."""
    anchor = 'print("allocator config:", os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "<default>"))\n'
    assert anchor in text
    return text.replace(anchor, anchor + 'print("settings:", torch._C._accelerator_getAllocatorSettings())\n')


def test_patched_script_sets_it_before_torch_and_losses_stay_exact(tmp_path):
    _needs_settings_reader()
    # torch's own view of its allocator settings shows the variable reached it (the order is checked above)
    original, _ = _run(tmp_path, "original", _show_settings((CASES / "reads_env_only.in.py").read_text()))
    patched_text = _show_settings(_text("reads_env_only"))
    losses, output = _run(tmp_path, "off", patched_text, value=False)
    assert losses == original and "allocator config: <default>" in output
    losses, output = _run(tmp_path, "on", patched_text, value=True)
    assert losses == original
    assert "allocator config: expandable_segments:True" in output
    assert "settings: expandable_segments:True" in output
    baked_losses, baked_output = _run(tmp_path, "baked", _show_settings(_baked("reads_env_only")))
    assert baked_losses == original and "settings: expandable_segments:True" in baked_output


@pytest.mark.slow
def test_patched_and_baked_scripts_merge_with_the_users_settings(tmp_path):
    _needs_settings_reader()
    env = {"PYTORCH_ALLOC_CONF": "max_split_size_mb:64"}
    merged = "max_split_size_mb:64,expandable_segments:True"
    _, output = _run(tmp_path, "on", _show_settings(_text("reads_env_only")), value=True, env=env)
    assert f"settings: {merged}" in output
    _, output = _run(tmp_path, "baked", _show_settings(_baked("reads_env_only")), env=env)
    assert f"settings: {merged}" in output


@pytest.mark.cuda
def test_cuda_training_with_expandable_segments_gives_the_same_losses(tmp_path):
    original, _ = _run(tmp_path, "original", (CASES / "basic.in.py").read_text())
    patched, _ = _run(tmp_path, "on", _text("basic"), value=True)
    baked, _ = _run(tmp_path, "baked", _baked("basic"))
    assert patched == original and baked == original
