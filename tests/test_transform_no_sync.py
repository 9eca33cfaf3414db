"""no_sync: DDP's gradient all-reduce skipped on the accumulation micro-steps that do not step; detection, the
runtime helper, and two gloo ranks training the DDP fixture script with the knob off and on."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import pytest
import yaml
from dist_probe import run_dist_probe
from transform_cases import baked, case, patched, sites, statuses

import autotune.runtime as runtime
from autotune.project import load_project
from autotune.knobs import Numerics
from autotune.patch import run, select, write_outputs
from autotune.transform import Mode, Status
from autotune.transforms.no_sync import NoSync

T = "no_sync"
REPO = Path(__file__).resolve().parent.parent
DDP_SCRIPT = REPO / "fixtures" / "scripts" / "ddp_accum.py"
ACCUM = 4  # ddp_accum.py's default --accum-steps
MICRO_STEPS = 2 * ACCUM  # two optimizer steps


@pytest.mark.parametrize(
    "name, expected",
    [
        ("accum_if", [Status.APPLICABLE]),
        ("micro_loop", [Status.APPLICABLE]),
        ("continue_form", [Status.APPLICABLE]),
        ("conditional_ddp", [Status.APPLICABLE]),
        ("no_ddp", [Status.NOT_APPLICABLE]),
        ("no_accumulation", [Status.NOT_APPLICABLE]),
        ("already_no_sync", [Status.PRESENT]),
        ("require_grad_sync", [Status.PRESENT]),
        ("counter_changes", [Status.NOT_APPLICABLE]),
        ("condition_calls", [Status.NOT_APPLICABLE]),
        ("forward_in_helper", [Status.NOT_APPLICABLE]),
        ("outside_loop", []),
    ],
)
def test_sites(name, expected):
    assert statuses(T, name) == expected


def test_reasons():
    def reason(name):
        (site,) = sites(T, name)
        return site.reason

    assert reason("accum_if") == "forward and backward() under model.no_sync() unless (i + 1) % accum_steps == 0"
    assert reason("micro_loop").endswith("unless micro_step == gradient_accumulation_steps - 1")
    assert reason("continue_form").endswith("unless (step + 1) % self.accum == 0")  # `!= 0: continue` negated
    assert reason("no_ddp") == "no model is wrapped in DistributedDataParallel"
    assert reason("no_accumulation") == "the optimizer steps after every backward(): no gradient accumulation"
    assert reason("require_grad_sync").startswith("the script sets require_backward_grad_sync itself")
    assert reason("counter_changes").startswith("micro changes between the forward pass and the accumulation condition")
    assert "runs code" in reason("condition_calls")
    assert "forward pass of ddp_model" in reason("forward_in_helper")


def test_forward_runs_inside_no_sync():
    # torch: "the forward pass should be included inside the context manager, or else gradients will still be
    # synchronized" (DDP prepares the all-reduce in forward): the region starts before the model is called
    lines = patched(T, "accum_if").splitlines()
    start = next(i for i, line in enumerate(lines) if "_autotune.no_sync(model" in line)
    assert lines[start + 1].strip() == "out = model(x)"
    assert lines[start + 4].strip() == "loss.backward()"


def test_bake_guards_a_model_that_may_stay_unwrapped():
    text = baked(T, "conditional_ddp", {"no_sync.enabled": True})
    assert 'or not hasattr(model, "no_sync") else model.no_sync():' in text
    plain = baked(T, "accum_if", {"no_sync.enabled": True})
    assert "with contextlib.nullcontext() if (i + 1) % accum_steps == 0 else model.no_sync():" in plain
    assert plain.startswith('"""') and "\nimport contextlib\n" in plain


def test_composes_with_autocast(tmp_path):
    # autocast wraps forward and loss, no_sync wraps forward to backward: the first lies inside the second
    result = run(load_project(case(T, "accum_if")), select(["autocast", T]), hooks=False)
    text = result.files[0].new_text
    lines = text.splitlines()
    outer = next(i for i, line in enumerate(lines) if "_autotune.no_sync(" in line)
    assert lines[outer + 1].strip() == "with _autotune.autocast():"
    assert lines[outer + 1].index("with") > lines[outer].index("with")
    assert text.count("out = model(x)") == 1
    again = tmp_path / "again.py"
    again.write_text(text)
    assert not run(load_project(again), select(["autocast", T]), hooks=False).changed


def test_knob():
    (knob,) = NoSync.knobs
    assert knob.name == "no_sync.enabled" and knob.default is False and knob.choices == (False, True)
    # the all-reduce of the sum of local gradients replaces the sum of all-reduced gradients: last bits move
    assert knob.numerics is Numerics.REORDER and knob.devices == {"cpu", "cuda"}


class _FakeDDP:
    def __init__(self) -> None:
        self.entered = 0

    @contextlib.contextmanager
    def no_sync(self):
        self.entered += 1
        yield


def _config(monkeypatch, tmp_path: Path, knobs: dict) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"knobs": knobs}))
    monkeypatch.setenv("AUTOTUNE_CONFIG", str(path))
    runtime.reset()


def test_runtime_helper(monkeypatch, tmp_path):
    model = _FakeDDP()
    _config(monkeypatch, tmp_path, {"no_sync.enabled": False})
    with runtime.no_sync(model, False):
        pass
    assert model.entered == 0
    _config(monkeypatch, tmp_path, {"no_sync.enabled": True})
    with runtime.no_sync(model, True):  # the final micro-step all-reduces
        pass
    assert model.entered == 0
    with runtime.no_sync(model, False):
        pass
    assert model.entered == 1
    with runtime.no_sync(object(), False):  # the script left the model unwrapped in this run
        pass
    runtime.reset()


# --- two gloo ranks ----------------------------------------------------------------------------------------


def _configs(tmp: Path, **named: dict) -> list[Path]:
    out = []
    for label, knobs in named.items():
        path = tmp / f"{label}.yaml"
        path.write_text(yaml.safe_dump({"device": "cpu", "knobs": knobs}))
        out.append(path)
    return out


@pytest.fixture(scope="module")
def gated_runs(tmp_path_factory):
    """ddp_accum.py patched with no_sync, 2 gloo ranks, 8 micro-steps with the knob off, then on."""
    tmp = tmp_path_factory.mktemp("no_sync_gloo")
    write_outputs(run(load_project(DDP_SCRIPT), select([T])), tmp / "patched", "ddp_accum.py")
    configs = _configs(tmp, off={"no_sync.enabled": False}, on={"no_sync.enabled": True})
    return run_dist_probe(tmp / "patched" / "ddp_accum.py", configs, steps=MICRO_STEPS, out=tmp / "runs")


def _close(a: list[float], b: list[float]) -> tuple[bool, float]:
    worst = max((abs(x - y) for x, y in zip(a, b)), default=0.0)
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-8) for x, y in zip(a, b)), worst


@pytest.mark.slow
def test_gloo_no_sync_skips_the_all_reduce_and_keeps_the_updates(gated_runs):
    for rank in (0, 1):
        off, on = gated_runs[rank]
        assert off["ended"] == on["ended"] == "steps"
        # two optimizer steps: the same losses, bit for bit
        assert on["losses"] == off["losses"]
    (off0, on0), (off1, on1) = gated_runs
    for k in range(MICRO_STEPS):
        final = (k + 1) % ACCUM == 0
        # off: DDP all-reduces after every micro-step, so both ranks hold the same gradients
        assert off0["grads"][k] == off1["grads"][k]
        if final:
            # on: the last micro-step all-reduces the locally accumulated sum
            assert on0["grads"][k] == on1["grads"][k]
            ok, worst = _close(on0["grads"][k], off0["grads"][k])
            assert ok, f"micro-step {k}: gradients differ by up to {worst:.3g}"
        else:
            # on: each rank kept its own gradients; no all-reduce ran
            assert on0["grads"][k] != on1["grads"][k]


@pytest.mark.slow
def test_gloo_baked_script_matches_the_gated_knob(gated_runs, tmp_path):
    result = run(load_project(DDP_SCRIPT), select([T]), Mode(values={"no_sync.enabled": True}, device="cpu"))
    write_outputs(result, tmp_path / "baked", "ddp_accum.py")
    text = (tmp_path / "baked" / "ddp_accum.py").read_text()
    assert "model.no_sync()" in text and "_autotune" not in text
    (config,) = _configs(tmp_path, empty={})
    runs = run_dist_probe(tmp_path / "baked" / "ddp_accum.py", [config], steps=MICRO_STEPS, out=tmp_path / "runs")
    for rank in (0, 1):
        (baked_run,) = runs[rank]
        gated_on = gated_runs[rank][1]
        assert baked_run["losses"] == gated_on["losses"]
        assert baked_run["grads"] == gated_on["grads"]
