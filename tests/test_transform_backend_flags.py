"""backend_flags: flags the script sets stay out of the knobs; each value runs; baking gives the patched losses."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from loss_probe import run_probe
from transform_cases import assert_same_losses

from autotune import runtime
from autotune.project import load_project
from autotune.knobs import Numerics
from autotune.patch import run, select
from autotune.transform import Mode, Status
from autotune.transforms.backend_flags import BackendFlags

T = "backend_flags"
CASES = Path(__file__).resolve().parent.parent / "fixtures" / "transforms" / T


def _result(name: str, mode: Mode = Mode()):
    return run(load_project(CASES / f"{name}.in.py"), select([T]), mode, hooks=False)


def _text(name: str, mode: Mode = Mode()) -> str:
    (file,) = _result(name, mode).files
    return file.new_text


def _losses(tmp: Path, label: str, text: str, knobs: dict | None = None, steps: int = 6, device: str = "cpu"):
    script = tmp / f"{label}.py"
    script.write_text(text, encoding="utf-8")
    env: dict[str, str | None] = {"AUTOTUNE_CONFIG": None, "AUTOTUNE_TRIAL": None}
    if knobs is not None:
        config = tmp / f"{label}.yaml"
        config.write_text(yaml.safe_dump({"device": device, "knobs": knobs}), encoding="utf-8")
        env["AUTOTUNE_CONFIG"] = str(config)
    out = run_probe(script, steps=steps, out=tmp / f"{label}.json", env=env, cwd=tmp, timeout=240)
    assert len(out) == steps and all(math.isfinite(float.fromhex(v)) for v in out), out
    return out


# --- what it finds -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, expected, knobs",
    [
        ("basic", [Status.APPLICABLE], ["cudnn_benchmark", "matmul_precision", "tf32"]),
        ("benchmark_present", [Status.PRESENT, Status.APPLICABLE], ["matmul_precision", "tf32"]),
        ("all_present", [Status.PRESENT] * 4, []),
        ("user_disables_tf32", [Status.USER, Status.APPLICABLE], ["cudnn_benchmark"]),
        ("fp32_precision_api", [Status.PRESENT, Status.PRESENT, Status.APPLICABLE], ["cudnn_benchmark"]),
        ("lookalike", [Status.APPLICABLE], ["cudnn_benchmark", "matmul_precision", "tf32"]),
        ("no_training_loop", [Status.NOT_APPLICABLE], []),
        # if args.tensorcores: torch.set_float32_matmul_precision("high"), off by default (karpathy/llm.c's shape)
        ("switched", [Status.APPLICABLE, Status.APPLICABLE], ["cudnn_benchmark", "matmul_precision", "tf32"]),
    ],
)
def test_sites_and_the_knobs_left_to_tune(name, expected, knobs):
    result = _result(name)
    assert [s.status for s in result.sites] == expected
    assert [k.name for k in result.knobs] == [f"{T}.{k}" for k in knobs]


def test_flags_the_script_sets_are_not_read_from_the_config():
    assert '_autotune.backend_flags(script_sets=("cudnn_benchmark",))' in _text("benchmark_present")
    assert "_autotune.backend_flags()\n" in _text("basic")
    (kept, _) = _result("user_disables_tf32").sites
    assert kept.reason == "the script sets torch.backends.cuda.matmul.allow_tf32 = False: its choice is kept"


def test_bake_writes_only_the_values_that_differ():
    text = _text("basic", Mode(values={f"{T}.cudnn_benchmark": True}, device="cuda"))
    assert "torch.backends.cudnn.benchmark = True\n" in text
    assert "allow_tf32" not in text and "set_float32_matmul_precision" not in text
    # a flag the script sets itself is never baked over
    text = _text("benchmark_present", Mode(values={f"{T}.cudnn_benchmark": False, f"{T}.tf32": True}, device="cuda"))
    assert "torch.backends.cuda.matmul.allow_tf32 = True" in text and text.count("benchmark = ") == 1


def test_knobs_match_the_runtime_contract():
    knobs = {k.name: k for k in BackendFlags.knobs}
    tf32, precision, benchmark = knobs[f"{T}.tf32"], knobs[f"{T}.matmul_precision"], knobs[f"{T}.cudnn_benchmark"]
    assert (tf32.choices, tf32.default, tf32.numerics, tf32.devices) == (
        (False, True), False, Numerics.LOWP, frozenset({"cuda"}))
    # on CPU, "medium" lets oneDNN run float32 matmuls in bf16 where the CPU has bf16 instructions
    assert (precision.choices, precision.default, precision.numerics, precision.devices) == (
        ("highest", "high", "medium"), "highest", Numerics.LOWP, frozenset({"cpu", "cuda"}))
    assert (benchmark.choices, benchmark.default, benchmark.numerics, benchmark.devices) == (
        (False, True), False, Numerics.REORDER, frozenset({"cuda"}))
    assert BackendFlags.entry_only


# --- the runtime helper, in process ------------------------------------------------------------------------


@pytest.fixture
def flags(tmp_path, monkeypatch):
    """Set knobs for this process's runtime; torch's global flags are put back afterwards."""
    import torch

    saved = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.benchmark,
        torch.get_float32_matmul_precision(),
    )

    def set_knobs(**knobs) -> None:
        config = tmp_path / "config.yaml"
        config.write_text(yaml.safe_dump({"device": "cpu", "knobs": {f"{T}.{k}": v for k, v in knobs.items()}}))
        monkeypatch.setenv("AUTOTUNE_CONFIG", str(config))
        runtime.reset()

    yield set_knobs
    runtime.reset()
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = saved[:3]
    torch.set_float32_matmul_precision(saved[3])


def _state():
    import torch

    return (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.benchmark,
        torch.get_float32_matmul_precision(),
    )


def test_runtime_defaults_touch_nothing(flags):
    flags(tf32=False, matmul_precision="highest", cudnn_benchmark=False)
    before = _state()
    runtime.backend_flags()
    assert _state() == before


def test_runtime_sets_each_flag(flags):
    import torch

    flags(matmul_precision="medium")
    runtime.backend_flags()
    assert torch.get_float32_matmul_precision() == "medium"
    flags(tf32=True, cudnn_benchmark=True)
    runtime.backend_flags()
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32 and torch.backends.cudnn.benchmark


def test_runtime_leaves_the_scripts_own_flags_alone(flags):
    import torch

    flags(tf32=True, cudnn_benchmark=True)
    runtime.backend_flags(script_sets=("tf32",))
    assert torch.backends.cudnn.benchmark
    assert not torch.backends.cuda.matmul.allow_tf32


# --- patched and baked scripts, run ------------------------------------------------------------------------


def test_default_gives_the_original_losses(tmp_path):
    original = _losses(tmp_path, "original", (CASES / "basic.in.py").read_text())
    defaults = {f"{T}.tf32": False, f"{T}.matmul_precision": "highest", f"{T}.cudnn_benchmark": False}
    assert _losses(tmp_path, "patched", _text("basic"), defaults) == original


@pytest.mark.parametrize(
    "knob, flag, expected",
    [("highest", "0", "highest"), ("medium", "0", "medium"), ("medium", "1", "high"), ("highest", "1", "high")],
)
def test_a_switched_off_flag_leaves_the_knob_and_the_switch_turned_on_wins(tmp_path, knob, flag, expected):
    import os

    from loss_probe import run_script

    config = tmp_path / "knobs.yaml"
    config.write_text(yaml.safe_dump({"device": "cpu", "knobs": {f"{T}.matmul_precision": knob}}))
    for form, text in (("patched", _text("switched")),
                       ("baked", _text("switched", Mode(values={f"{T}.matmul_precision": knob}, device="cpu")))):
        script = tmp_path / f"{form}.py"
        script.write_text(text)
        env = {**os.environ, "AUTOTUNE_CONFIG": str(config)} if form == "patched" else dict(os.environ)
        env.pop("AUTOTUNE_TRIAL", None)
        rc, output = run_script(script, ["--tensorcores", flag, "--steps", "1"], env=env, cwd=tmp_path, timeout=120)
        assert rc == 0, output
        assert output.strip().endswith(f"matmul precision: {expected}"), (form, output)


@pytest.mark.parametrize("precision", ["medium", pytest.param("high", marks=pytest.mark.slow)])
def test_cpu_matmul_precision_trains_and_bakes_to_the_same_losses(tmp_path, precision):
    knobs = {f"{T}.matmul_precision": precision}
    patched = _losses(tmp_path, "patched", _text("basic"), knobs)
    baked = _text("basic", Mode(values=knobs, device="cpu"))
    assert f'torch.set_float32_matmul_precision("{precision}")' in baked
    assert _losses(tmp_path, "baked", baked) == patched


@pytest.mark.cuda
@pytest.mark.parametrize(
    "knobs",
    [
        {f"{T}.tf32": True},
        {f"{T}.cudnn_benchmark": True},
        {f"{T}.tf32": True, f"{T}.matmul_precision": "medium", f"{T}.cudnn_benchmark": True},
    ],
)
def test_cuda_values_train_and_bake_to_the_same_losses(tmp_path, knobs):
    patched = _losses(tmp_path, "patched", _text("basic"), knobs, device="cuda")
    baked = _losses(tmp_path, "baked", _text("basic", Mode(values=knobs, device="cuda")))
    if f"{T}.cudnn_benchmark" in knobs:  # cuDNN picks its algorithms by timing them: not bitwise from run to run
        assert [float.fromhex(v) for v in baked] == pytest.approx([float.fromhex(v) for v in patched], rel=1e-3)
    else:
        assert_same_losses(baked, patched, "cuda")
