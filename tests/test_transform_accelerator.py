"""accelerator: Accelerate's own mixed_precision as the knob where the script builds its Accelerator (the loop is the
script's own: accelerator.backward(loss) runs the loss scaling, so the autocast transform leaves it alone)."""

from __future__ import annotations

from pathlib import Path

import pytest
from framework_readback import readback
from transform_cases import case, losses, sites

from autotune.patch import run, write_outputs
from autotune.project import load_project
from autotune.transform import Status

ARGS = ["--epochs", "1"]


def test_the_accelerators_precision_becomes_a_knob_unless_the_script_chooses_it():
    (site,) = sites("accelerator", "plain")
    assert (site.status, site.reason) == (Status.APPLICABLE, "Accelerator: mixed_precision becomes a knob")
    assert [(s.line, s.status, s.reason) for s in sites("accelerator", "user_choice")] == [
        (8, Status.APPLICABLE, 'mixed_precision="no" writes out the default, full precision (no choice of the '
                               "script's to keep), which the accelerator.mixed_precision knob sets"),
        (9, Status.PRESENT, 'the script sets mixed_precision="bf16"'),
        (10, Status.NOT_APPLICABLE, "**settings may give the settings: which, is not known"),
    ]


def _patched(tmp_path: Path) -> Path:
    result = run(load_project(case("accelerator", "plain")))
    write_outputs(result, tmp_path / "patched", "plain.py")
    return tmp_path / "patched" / result.files[0].rel


pytest.importorskip("accelerate")


def test_the_patched_script_at_its_defaults_trains_exactly_like_the_original(tmp_path):
    original = losses(tmp_path, "original", case("accelerator", "plain").read_text(), args=ARGS)
    assert losses(tmp_path, "patched", _patched(tmp_path).read_text(), args=ARGS) == original


@pytest.mark.parametrize("launcher, resolved", [(None, ["bf16"]), ("no", ["no"])])
def test_the_knob_reaches_the_accelerator_unless_the_launcher_chose(launcher, resolved, tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("device: cpu\nknobs:\n  accelerator.mixed_precision: bf16\n")
    env = {"AUTOTUNE_CONFIG": str(config), "AUTOTUNE_TRIAL": None, "ACCELERATE_MIXED_PRECISION": launcher}
    # read back from the Accelerator itself: accelerate launch --mixed_precision no sets that variable, and wins
    got = readback(_patched(tmp_path), ARGS, "accelerate:Accelerator", "mixed_precision", tmp_path / "seen.json",
                   env, tmp_path)
    assert got == resolved


def test_the_scripts_own_precision_option_is_the_switch_the_knob_turns_on_where_it_is_off(tmp_path):
    (site,) = sites("accelerator", "switched")
    assert site.status is Status.APPLICABLE and "the script's own switch" in site.reason
    result = run(load_project(case("accelerator", "switched")))
    write_outputs(result, tmp_path / "patched", "switched.py")
    script = tmp_path / "patched" / result.files[0].rel
    config = tmp_path / "config.yaml"
    config.write_text("device: cpu\nknobs:\n  accelerator.mixed_precision: bf16\n")
    env = {"AUTOTUNE_CONFIG": str(config), "AUTOTUNE_TRIAL": None, "ACCELERATE_MIXED_PRECISION": None}
    seen = tmp_path / "seen.json"
    # the option left at its default (None): the knob's bf16; without the knob, the script's own choices as before
    assert readback(script, ARGS, "accelerate:Accelerator", "mixed_precision", seen, env, tmp_path) == ["bf16"]
    given = [*ARGS, "--mixed_precision", "bf16"]
    env["AUTOTUNE_CONFIG"] = None
    assert readback(script, given, "accelerate:Accelerator", "mixed_precision", seen, env, tmp_path) == ["bf16"]
    assert readback(script, ARGS, "accelerate:Accelerator", "mixed_precision", seen, env, tmp_path) == ["no"]


def test_the_baked_switch_trains_like_the_patched_script_at_that_choice(tmp_path):
    from autotune.bake import bake

    baked = bake(load_project(case("accelerator", "switched")), {"accelerator.mixed_precision": "bf16"}, "cpu")
    result = run(load_project(case("accelerator", "switched")))
    write_outputs(result, tmp_path / "patched", "switched.py")
    knobs = {"accelerator.mixed_precision": "bf16"}
    gated = losses(tmp_path, "gated", (tmp_path / "patched" / result.files[0].rel).read_text(), knobs=knobs, args=ARGS)
    plain = losses(tmp_path, "plain", baked.files[0].new_text, args=ARGS)
    assert plain == gated
    assert gated != losses(tmp_path, "original", case("accelerator", "switched").read_text(), args=ARGS)
