"""autocast: what it finds, that each knob value trains on CPU, and that baking gives the patched script's losses."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import yaml
from loss_probe import run_probe, run_script

from autotune import runtime, runtime_helpers
from autotune.project import load_project
from autotune.knobs import Numerics
from autotune.patch import run, select
from autotune.transform import Mode, Status
from autotune.transforms.autocast import Autocast

T = "autocast"
CASES = Path(__file__).resolve().parent.parent / "fixtures" / "transforms" / T


def _case(name: str) -> Path:
    return CASES / f"{name}.in.py"


def _result(name: str, mode: Mode = Mode()):
    return run(load_project(_case(name)), select([T]), mode, hooks=False)


def _text(name: str, dtype: str | None = None) -> str:
    mode = Mode() if dtype is None else Mode(values={"autocast.dtype": dtype}, device="cpu")
    (file,) = _result(name, mode).files
    return file.new_text


def _losses(tmp: Path, label: str, text: str, steps: int, dtype: str | None = None) -> list[str]:
    """Hex of each backward()'s loss when ``text`` runs as a script, under ``autocast.dtype: dtype`` if given."""
    script = tmp / f"{label}.py"
    script.write_text(text, encoding="utf-8")
    env: dict[str, str | None] = {"AUTOTUNE_CONFIG": None, "AUTOTUNE_TRIAL": None}
    if dtype is not None:
        config = tmp / f"{label}.yaml"
        config.write_text(yaml.safe_dump({"device": "cpu", "knobs": {"autocast.dtype": dtype}}), encoding="utf-8")
        env["AUTOTUNE_CONFIG"] = str(config)
    out = run_probe(script, steps=steps, out=tmp / f"{label}.json", env=env, cwd=tmp, timeout=240)
    assert len(out) == steps, f"{label}: {len(out)} losses, expected {steps}"
    assert all(math.isfinite(float.fromhex(v)) for v in out), f"{label}: non-finite loss in {out}"
    return out


# --- what it finds -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, expected",
    [
        ("basic", [Status.APPLICABLE]),
        ("gan", [Status.APPLICABLE, Status.APPLICABLE]),
        ("amp_scaler", [Status.PRESENT, Status.PRESENT, Status.PRESENT]),
        ("amp_switch", [Status.PRESENT, Status.PRESENT]),
        ("bf16_no_scaler", [Status.PRESENT, Status.PRESENT]),
        ("dtype_variable", [Status.PRESENT, Status.PRESENT]),
        ("disabled_region", [Status.USER, Status.APPLICABLE]),
        ("user_autocast_lookalike", [Status.APPLICABLE]),
        ("zero_grad_after_forward", [Status.APPLICABLE]),
        ("loss_in_backward", [Status.NOT_APPLICABLE]),
        ("saliency_outside_loop", [Status.NOT_APPLICABLE]),
        ("lbfgs_closure", [Status.NOT_APPLICABLE]),
        ("optimizer_on_one_path", [Status.APPLICABLE]),  # bf16 only
    ],
)
def test_sites(name, expected):
    assert [s.status for s in _result(name).sites] == expected


def test_reasons_name_what_the_script_uses():
    reasons = [s.reason for s in _result("amp_scaler").sites]
    assert reasons[0] == "the script autocasts (dtype=torch.float16); its dtype becomes the knob"
    assert reasons[1] == "the script has torch.amp.GradScaler(...); it is turned off under bf16"
    assert reasons[2].startswith("the loop already autocasts (") and reasons[2].endswith("amp_scaler.in.py:18)")
    (inline,) = _result("loss_in_backward").sites
    assert inline.reason == "the loss is computed in the backward() statement itself"
    (outside,) = _result("saliency_outside_loop").sites
    assert outside.reason == "backward() outside any training loop"


@pytest.mark.parametrize("dtype", [None, "bf16", "fp16"])
def test_bf16_autocast_without_a_scaler_is_left_alone(dtype):
    # already the optimization: fp16 would need a GradScaler added, for at best a small gain
    result = _result("bf16_no_scaler", Mode() if dtype is None else Mode(values={"autocast.dtype": dtype}))
    assert not result.changed and result.knobs == ()
    assert result.sites[0].reason == "the script already autocasts in bf16, which needs no GradScaler"


def test_knob_matches_the_runtime_contract():
    (knob,) = Autocast.knobs
    assert knob.name == "autocast.dtype"
    assert knob.choices == ("default", "bf16", "fp16") and knob.default == "default"
    assert knob.numerics is Numerics.LOWP and knob.devices == frozenset({"cpu", "cuda"})


def test_a_present_autocast_still_puts_its_knob_in_the_table():
    # the script's own autocast is reported as present, yet its dtype now reads the knob: autotune.yaml lists it
    result = _result("amp_scaler")
    assert Status.APPLICABLE not in {s.status for s in result.sites}
    assert [k.name for k in result.knobs] == ["autocast.dtype"]
    assert _result("loss_in_backward").knobs == ()


def test_fp16_bake_updates_the_scaler_once_after_several_steps(tmp_path):
    # one loss, two optimizers: both steps must unscale with the same scale, so one update() after them
    source = _case("basic").read_text()
    source = source.replace("        optimizer.step()\n", "        optimizer.step()\n        optimizer2.step()\n")
    second = "optimizer2 = torch.optim.SGD(model.parameters(), lr=0.1)\n"
    source = source.replace("criterion = nn.MSELoss()\n", "criterion = nn.MSELoss()\n" + second)
    path = tmp_path / "two_optimizers.py"
    path.write_text(source)
    (file,) = run(load_project(path), select([T]), Mode(values={"autocast.dtype": "fp16"}), hooks=False).files
    assert "scaler.step(optimizer)\n        scaler.step(optimizer2)\n        scaler.update()\n" in file.new_text


def test_a_module_using_the_name_scaler_gets_another(tmp_path):
    source = _case("basic").read_text().replace("criterion = nn.MSELoss()", "criterion = nn.MSELoss()\nscaler = 2.0")
    path = tmp_path / "named.py"
    path.write_text(source)
    (file,) = run(load_project(path), select([T]), Mode(values={"autocast.dtype": "fp16"}), hooks=False).files
    assert 'grad_scaler = torch.amp.GradScaler("cpu")' in file.new_text
    assert "grad_scaler.scale(loss).backward()" in file.new_text


# --- the runtime helpers, in process -----------------------------------------------------------------------


@pytest.fixture
def knob_value(tmp_path, monkeypatch):
    """Set autocast.dtype for the runtime of this process; the runtime's scaler starts fresh."""

    def set_value(value: str) -> None:
        config = tmp_path / "config.yaml"
        config.write_text(yaml.safe_dump({"device": "cpu", "knobs": {"autocast.dtype": value}}))
        monkeypatch.setenv("AUTOTUNE_CONFIG", str(config))
        runtime.reset()

    monkeypatch.setattr(runtime_helpers, "_scaler_obj", None)
    monkeypatch.setattr(runtime_helpers, "_update_pending", False)
    yield set_value
    runtime.reset()


def test_runtime_default_changes_nothing(knob_value):
    import torch

    knob_value("default")
    loss = torch.tensor(2.0, requires_grad=True)
    assert runtime.scale(loss) is loss
    assert runtime.autocast_dtype(torch.float16) is torch.float16
    assert runtime.scaler_enabled(True) is True and runtime.scaler_enabled(False) is False
    with runtime.autocast():
        assert not torch.is_autocast_enabled("cpu")
    assert runtime_helpers._scaler_obj is None  # no GradScaler is ever built by default


@pytest.mark.parametrize("value, dtype_name", [("bf16", "bfloat16"), ("fp16", "float16")])
def test_runtime_autocast_runs_in_the_chosen_dtype(knob_value, value, dtype_name):
    import torch

    knob_value(value)
    layer = torch.nn.Linear(4, 4)
    with runtime.autocast():
        out = layer(torch.randn(2, 4))
    assert out.dtype is getattr(torch, dtype_name)
    assert runtime.autocast_dtype(torch.float32) is getattr(torch, dtype_name)
    assert runtime.scaler_enabled(True) is (value == "fp16")


def test_runtime_fp16_unscales_before_clipping(knob_value):
    import torch

    knob_value("fp16")
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=1.0)
    runtime.scale((w * torch.tensor([1.0, 2.0, 3.0])).sum()).backward()
    assert w.grad.tolist() == [65536.0, 131072.0, 196608.0]  # scaled by the GradScaler's initial scale
    runtime.unscale_(opt)
    assert w.grad.tolist() == [1.0, 2.0, 3.0]
    runtime.optimizer_step(opt)
    assert w.detach().tolist() == [0.0, -1.0, -2.0]


def test_runtime_fp16_steps_several_optimizers_with_one_scale(knob_value):
    # the first optimizer's gradients overflow: its step is skipped and the scale halves, but only at the next
    # scale(): the second optimizer, stepped after the same backward, must still be unscaled with 65536
    import torch

    knob_value("fp16")
    a, b = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
    opt_a, opt_b = torch.optim.SGD([a], lr=1.0), torch.optim.SGD([b], lr=1.0)
    runtime.scale((a * 1e38).sum() + b.sum()).backward()
    runtime.optimizer_step(opt_a)
    runtime.optimizer_step(opt_b)
    assert a.item() == 1.0  # skipped: inf gradient
    assert b.item() == 0.0  # 1.0 - lr * (65536 / 65536)
    assert runtime_helpers._scaler().get_scale() == 65536.0
    opt_a.zero_grad()
    opt_b.zero_grad()
    runtime.scale(b.sum()).backward()
    assert runtime_helpers._scaler().get_scale() == 32768.0  # the update came with the next scale()
    assert b.grad.item() == 32768.0


# --- patched and baked scripts, run ------------------------------------------------------------------------

# case -> number of backward() calls to record (a GAN records two per iteration)
STEPS = {
    "basic": 6,
    "gan": 6,
    "amp_scaler": 6,
    "clip_fp16": 6,
    "train_step_fn": 6,
    "grad_accum": 8,
    "disabled_region": 6,
    "zero_grad_after_forward": 6,
    "user_autocast_lookalike": 6,
    "step_one_line": 6,
    "optimizer_on_one_path": 6,
    "amp_switch": 6,
}
BF16_ONLY = {"optimizer_on_one_path"}  # fp16 not offered: no safe place for its gradient scaling
SCRIPT_DTYPE = {"amp_scaler": "fp16"}  # cases that autocast already
SWITCHED_OFF = {"amp_switch"}  # its own region, off: fp16 keeps it off (no scaler goes with it), bf16 turns it on
# every script run costs seconds: the quick suite runs these, the rest are marked slow
FAST_DEFAULT = {"basic", "amp_scaler", "amp_switch"}
FAST_VALUES = {("basic", "fp16"), ("amp_scaler", "bf16"), ("amp_switch", "bf16")}


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    """The unpatched case's losses, run once per case for all the tests of this module."""
    seen: dict[str, list[str]] = {}

    def losses(name: str) -> list[str]:
        if name not in seen:
            tmp = tmp_path_factory.mktemp(f"original_{name}")
            seen[name] = _losses(tmp, "original", _case(name).read_text(), STEPS[name])
        return seen[name]

    return losses


@pytest.mark.parametrize(
    "name", [n if n in FAST_DEFAULT else pytest.param(n, marks=pytest.mark.slow) for n in STEPS]
)
def test_default_gives_the_original_losses(tmp_path, original, name):
    assert _losses(tmp_path, "patched", _text(name), STEPS[name], dtype="default") == original(name)
    if name == "basic":  # no config at all: the knob table's defaults
        assert _losses(tmp_path, "no_config", _text(name), STEPS[name]) == original(name)


@pytest.mark.parametrize(
    "name, dtype",
    [
        p if p in FAST_VALUES else pytest.param(*p, marks=pytest.mark.slow)
        for p in [(n, d) for n in STEPS for d in ("bf16", "fp16") if not (n in BF16_ONLY and d == "fp16")]
    ],
)
def test_each_dtype_trains_and_bakes_to_the_same_losses(tmp_path, original, name, dtype):
    steps = STEPS[name]
    patched = _losses(tmp_path, "patched", _text(name), steps, dtype=dtype)
    if SCRIPT_DTYPE.get(name) == dtype:
        assert patched == original(name)  # the script's own precision
    elif name in SWITCHED_OFF and dtype == "fp16":  # its region left off: fp32, the loss scaled by 2**16 for backward
        assert [float.fromhex(v) / 2**16 for v in patched] == [float.fromhex(v) for v in original(name)]
    else:
        assert patched != original(name), "the knob changed nothing"
    baked_text = _text(name, dtype)
    assert "autotune" not in baked_text
    assert _losses(tmp_path, "baked", baked_text, steps) == patched


def test_a_with_ctx_that_is_the_scripts_autocast_is_not_wrapped_again(tmp_path):
    """nanoGPT: ``ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(...)``, then ``with ctx:``
    around the forward: the loop already autocasts, and a second region around it is a false site."""
    sites = list(_result("ctx_variable").sites)
    assert [s.status for s in sites] == [Status.PRESENT] * 3
    assert sites[-1].reason == f"the loop already autocasts ({_case('ctx_variable')}:13)"
    text = _text("ctx_variable")
    assert "_autotune.autocast()" not in text
    original = _losses(tmp_path, "original", _case("ctx_variable").read_text(), steps=4)
    assert _losses(tmp_path, "default", text, steps=4) == original


def test_a_scaler_without_an_autocast_region_is_not_put_under_the_knob():
    """bf16 would only have switched the script's GradScaler off: nothing autocasts where the training runs."""
    scaler, loss = _result("scaler_no_region").sites
    assert scaler.status is Status.NOT_APPLICABLE
    assert scaler.reason == "torch.cuda.amp.GradScaler(...): no autocast region the knob could switch to bf16, so it stays"
    assert loss.status is Status.NOT_APPLICABLE
    assert not _result("scaler_no_region").knobs
    assert _text("scaler_no_region") == _case("scaler_no_region").read_text()


@pytest.mark.parametrize("name", ["basic", "train_step_fn"])  # the batch copied to the device; the optimizer's
def test_baked_autocast_follows_the_scripts_device_not_the_searchs(tmp_path, name):
    # a search on a GPU once baked device_type="cuda": run where the script computes on the CPU, that autocast
    # did nothing (and a CPU search's "cpu" does nothing on a GPU)
    text = _result(name, Mode(values={"autocast.dtype": "bf16"}, device="cuda")).files[0].new_text
    assert 'device_type="cuda"' not in text
    patched = _losses(tmp_path, "patched", _text(name), STEPS[name], dtype="bf16")  # its trial: autocast on CPU
    assert _losses(tmp_path, "baked", text, STEPS[name]) == patched


def test_where_fp16_scaling_has_no_safe_place_bf16_alone_is_offered(tmp_path):
    """A word-language-model shape: the optimizer exists under a flag only, a hand-written update otherwise, and the
    gradients are clipped on every path. fp16 would have to unscale the optimizer's gradients before the clip, and
    the optimizer may not exist there; bf16 needs no scaling, so it is offered, and fp16 is refused at run time."""
    result = _result("optimizer_on_one_path")
    (site,) = [s for s in result.sites if s.status is Status.APPLICABLE]
    text = _case("optimizer_on_one_path").read_text()
    clip = text[: text.index("torch.nn.utils.clip_grad_norm_")].count("\n") + 1
    assert site.reason.endswith(
        f"bf16 only: optimizer is not bound on every path to the clipping at {_case('optimizer_on_one_path')}:{clip}, "
        "where fp16 would unscale its gradients"
    )
    (knob,) = result.knobs
    assert knob.choices == ("default", "bf16") and "fp16 not offered here" in knob.help
    (tmp_path / "train.py").write_text(_text("optimizer_on_one_path"))
    (tmp_path / "fp16.yaml").write_text(yaml.safe_dump({"device": "cpu", "knobs": {"autocast.dtype": "fp16"}}))
    env = {**os.environ, "AUTOTUNE_CONFIG": str(tmp_path / "fp16.yaml"), "OMP_NUM_THREADS": "1"}
    env.pop("AUTOTUNE_TRIAL", None)
    rc, output = run_script(tmp_path / "train.py", ["--epochs", "1"], env=env, cwd=tmp_path, timeout=240)
    assert rc == 1 and "Traceback" not in output
    assert "autocast.dtype=fp16 is not offered for this script (bf16 only" in output
    assert _text("optimizer_on_one_path", "fp16") == _case("optimizer_on_one_path").read_text()  # bake: no change


def test_a_region_the_script_switches_off_is_a_knob_that_bf16_switches_on(knob_value):
    """``autocast(dtype=torch.bfloat16, enabled=use_amp)`` with use_amp False: present, switched off. It was left
    as "already autocasts in bf16", with no knob (issue 21.3)."""
    (region, _) = _result("amp_switch").sites
    assert region.reason == (
        "the script autocasts (dtype=torch.bfloat16) behind its own switch, enabled=args.amp (present, switched off "
        "where that is false): its dtype becomes the knob, and bf16 switches the region on"
    )
    assert [k.name for k in _result("amp_switch").knobs] == ["autocast.dtype"]
    import torch

    for value, switch, on, effect in [("default", False, False, False), ("default", True, True, False),
                                      ("bf16", False, True, True), ("fp16", False, False, False),
                                      ("fp16", True, True, True)]:
        knob_value(value)
        dtype = runtime_helpers.autocast_dtype(torch.bfloat16, enabled=switch)
        assert runtime_helpers.autocast_enabled(switch) is on, (value, switch)
        assert ("autocast.dtype" in runtime.applied()) is effect, (value, switch)
        assert dtype == {"default": torch.bfloat16, "bf16": torch.bfloat16, "fp16": torch.float16}[value]


def test_a_switch_that_calls_something_is_not_read_twice(tmp_path):
    source = _case("amp_switch").read_text().replace("enabled=args.amp", "enabled=use_amp()")
    script = tmp_path / "switch_call.py"
    script.write_text(source.replace("torch.manual_seed(0)", "use_amp = lambda: args.amp\ntorch.manual_seed(0)"))
    result = run(load_project(script), select([T]), Mode(), hooks=False)
    assert "autocast_enabled" not in result.files[0].new_text and "enabled=use_amp())" in result.files[0].new_text
