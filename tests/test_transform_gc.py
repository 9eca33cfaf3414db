"""gc: the collector is paused around the outermost training loop, restored after it, and never changes losses."""

from __future__ import annotations

import gc

import pytest
import yaml
from transform_cases import baked, losses, original, patched, sites, statuses

from autotune import runtime
from autotune.transform import Status

T = "gc"


@pytest.mark.parametrize(
    "name, expected",
    [
        ("epoch_loop", [Status.APPLICABLE]),
        ("early_return", [Status.APPLICABLE]),
        ("module_level", [Status.APPLICABLE]),
        ("lookalikes", [Status.APPLICABLE]),  # a function named freeze and a variable named gc are not the module
        ("nested_epoch", [Status.APPLICABLE]),
        ("already_frozen", [Status.PRESENT]),
        ("no_training_loop", []),
    ],
)
def test_sites(name, expected):
    assert statuses(T, name) == expected


def test_present_names_the_call():
    (site,) = sites(T, "already_frozen")
    assert site.reason.startswith("gc.disable() already called at") and site.reason.endswith(":14")


def test_return_inside_the_loop_restores_the_collector():
    text = patched(T, "early_return")
    body = text[text.index("def fit") : text.index('if __name__')]
    assert body.count("_autotune.gc_pause()") == 1
    assert body.count("_autotune.gc_resume()") == 2  # after the loop, and before the `return` inside it
    assert "_autotune.gc_resume()\n            return step" in body


def test_bake_avoids_a_variable_named_gc():
    text = baked(T, "lookalikes", {"gc.freeze": True})
    assert "import gc as _gc\n" in text and "\n_gc.disable()\n" in text and "\n_gc.unfreeze()\n" in text
    assert "\ngc = GradClipper(1.0)\n" in text  # the script's own gc is untouched


@pytest.fixture
def knobs(tmp_path, monkeypatch):
    """Set knob values for in-process runtime calls."""

    def set_knobs(**values):
        path = tmp_path / "knobs.yaml"
        path.write_text(yaml.safe_dump({"knobs": {k.replace("__", "."): v for k, v in values.items()}}))
        monkeypatch.setenv(runtime.CONFIG_ENV, str(path))
        runtime.reset()

    yield set_knobs
    runtime.gc_resume()
    runtime.reset()


def test_runtime_pause_and_resume(knobs):
    assert gc.isenabled()
    knobs(gc__freeze=True)
    runtime.gc_pause()
    try:
        assert not gc.isenabled()
        assert gc.get_freeze_count() > 0
        runtime.gc_pause()  # a second pause (a nested loop) changes nothing
        assert not gc.isenabled()
    finally:
        runtime.gc_resume()
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0


def test_runtime_default_touches_nothing(knobs):
    knobs()
    before = gc.get_freeze_count()
    runtime.gc_pause()
    assert gc.isenabled() and gc.get_freeze_count() == before
    runtime.gc_resume()
    assert gc.isenabled()


@pytest.mark.slow
@pytest.mark.parametrize("name, args", [("epoch_loop", ["--epochs", "2"]), ("early_return", ["40"]), ("lookalikes", [])])
def test_losses(tmp_path, name, args):
    base = original(tmp_path, T, name, args)
    gated = patched(T, name)
    assert losses(tmp_path, "default", gated, args=args) == base
    if name == "epoch_loop":  # a config that names the knob at its default is no config
        assert losses(tmp_path, "default_config", gated, {"gc.freeze": False}, args=args) == base
    on = losses(tmp_path, "freeze", gated, {"gc.freeze": True}, args=args)
    assert losses(tmp_path, "baked", baked(T, name, {"gc.freeze": True}), args=args) == on
    assert on == base  # exact: the collector never touches tensor values
