"""zero_grad: reports the torch default (set_to_none=True) as present, keeps the script's choices, rewrites nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
from transform_cases import FIXTURES, sites, statuses

from autotune.project import load_project
from autotune.patch import run, select
from autotune.transform import Mode, Status
from autotune.transforms.zero_grad import ZeroGrad

T = "zero_grad"
SCRIPTS = Path(__file__).resolve().parent.parent / "fixtures" / "scripts"


@pytest.mark.parametrize(
    "name, expected",
    [
        ("default_already", [Status.PRESENT]),
        ("user_false_kept", [Status.USER, Status.USER]),
        ("positional_false", [Status.USER]),
        ("module_zero_grad", [Status.NOT_APPLICABLE]),  # netD.zero_grad(); the local zero_grad(netG) is not seen
    ],
)
def test_sites(name, expected):
    assert statuses(T, name) == expected


def test_reasons():
    (default,) = sites(T, "default_already")
    assert default.reason == "already default: set_to_none=True"
    kept = [s.reason for s in sites(T, "user_false_kept")]
    assert kept == [
        "opt_body.zero_grad(set_to_none=False) is the script's choice",
        "opt_head.zero_grad(set_to_none=keep_grads_allocated) is the script's choice",
    ]
    (module,) = sites(T, "module_zero_grad")
    assert module.reason.startswith("netD.zero_grad(): not an optimizer")


def test_the_only_choice_is_the_default():
    # set_to_none=False is slower and changes the updates of parameters without gradients: never searched
    (knob,) = ZeroGrad.knobs
    assert knob.name == "zero_grad.set_to_none" and knob.choices == (True,) and knob.default is True


SCRIPT_PATHS = sorted(SCRIPTS.glob("*.py")) + sorted(SCRIPTS.glob("*/train.py"))
CASE_PATHS = sorted((FIXTURES / T).glob("*.in.py"))


@pytest.mark.parametrize("path", SCRIPT_PATHS + CASE_PATHS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_nothing_is_rewritten_and_no_knob_is_injected(path):
    project = load_project(path)
    for mode in (Mode(), Mode(values={"zero_grad.set_to_none": True})):
        result = run(project, select([T]), mode, hooks=False)
        assert not result.changed
        assert result.knobs == ()
    statuses_seen = {s.status for s in run(project, select([T]), hooks=False).sites}
    assert Status.APPLICABLE not in statuses_seen
