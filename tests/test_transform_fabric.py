"""fabric: Lightning Fabric's own precision as the knob where the script builds its Fabric (the loop is the script's
own: fabric.backward(loss) runs the loss scaling, so the autocast transform leaves it alone)."""

from __future__ import annotations

from pathlib import Path

import pytest
from framework_readback import readback
from transform_cases import case, losses, sites

from autotune.patch import run, write_outputs
from autotune.project import load_project
from autotune.transform import Status

ARGS = ["--epochs", "1"]


def test_fabrics_precision_becomes_a_knob_unless_the_script_chooses_it():
    (site,) = sites("fabric", "plain")
    assert (site.status, site.reason) == (Status.APPLICABLE, "Fabric: precision becomes a knob")
    found = [s for s in run(load_project(case("autocast", "fabric_backward"))).sites if s.transform == "fabric"]
    assert [(s.status, s.reason) for s in found] == [
        (Status.APPLICABLE, 'precision="32-true" writes out the default, full precision (no choice of the '
                            "script's to keep), which the fabric.precision knob sets")
    ]


def _patched(tmp_path: Path) -> Path:
    result = run(load_project(case("fabric", "plain")))
    write_outputs(result, tmp_path / "patched", "plain.py")
    return tmp_path / "patched" / result.files[0].rel


pytest.importorskip("lightning")


def test_the_patched_script_at_its_defaults_trains_exactly_like_the_original(tmp_path):
    original = losses(tmp_path, "original", case("fabric", "plain").read_text(), args=ARGS)
    assert losses(tmp_path, "patched", _patched(tmp_path).read_text(), args=ARGS) == original


@pytest.mark.parametrize("launcher, resolved", [(None, ["bf16-mixed"]), ("32-true", ["32-true"])])
def test_the_knob_reaches_fabrics_precision_plugin_unless_the_launcher_chose(launcher, resolved, tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("device: cpu\nknobs:\n  fabric.precision: bf16-mixed\n")
    env = {"AUTOTUNE_CONFIG": str(config), "AUTOTUNE_TRIAL": None, "LT_PRECISION": launcher}
    # read back from Fabric's own precision plugin: fabric run --precision sets that variable, and wins
    got = readback(_patched(tmp_path), ARGS, "lightning:Fabric", "_precision.precision", tmp_path / "seen.json",
                   env, tmp_path)
    assert got == resolved


def test_a_model_fabric_set_up_is_compiled_through_its_wrapper(monkeypatch):
    # a training function that gets the model after fabric.setup() compiles what it has: Fabric's wrapper, which
    # hands every attribute to the module it wraps (compiling the wrapper in place recursed without end)
    import sys

    import lightning as L
    import torch
    import torch._dynamo

    from autotune import knob_values
    from autotune.runtime_helpers import compile_model

    class Net(torch.nn.Module):  # a graph break in forward, as torch.nn.Transformer has (its mask check)
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)

        def forward(self, x):
            h = self.a(x)
            if bool((h > 100).all()):
                h = h * 0
            return self.b(torch.nn.functional.gelu(h))

    monkeypatch.setattr(knob_values, "_loaded", lambda: {"compile.mode": "default"})
    limit = sys.getrecursionlimit()  # compiling in this process raises it: put back for the tests after this one
    try:
        fabric = L.Fabric(accelerator="cpu", devices=1)
        torch.manual_seed(0)
        module = Net()
        keys = list(module.state_dict())
        model = fabric.setup_module(module)
        x = torch.randn(4, 8)
        eager = model(x)
        assert compile_model(model) is model
        assert module._compiled_call_impl is not None  # the module Fabric runs, compiled in place
        fabric.backward(model(x).sum())
        torch.testing.assert_close(model(x), eager)
        assert list(module.state_dict()) == keys
    finally:
        torch._dynamo.reset()
        sys.setrecursionlimit(limit)
