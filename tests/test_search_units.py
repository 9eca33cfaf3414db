"""The search's parts without running trials: space files, the gate, failure types, speedups, the CLI's errors."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from autotune.cli import main
from autotune.errors import UsageError
from autotune.knobs import Knob, Numerics
from autotune.search.gate import NOISE_FACTOR, Noise, gated, judge, measure_noise, step_deviations, tolerances
from autotune.search.outcome import local_speedups
from autotune.search.space import SpaceFile, build_space, bundled_space_text, config_key, parse_space, read_space
from autotune.search.trial import Outcome, TrialResult, classify
from autotune.transform import all_knobs

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "fixtures" / "search" / "tiny.py"


# --- search spaces -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", "cuda"], ids=["cpu-space", "cuda-space"])  # a bare "cuda" id reads as the marker
def test_bundled_space_is_found_and_valid(device):
    text = bundled_space_text(device)
    assert "knobs:" in text
    space = parse_space(text, f"{device}.yaml", strict=True)  # every knob it names exists
    assert space == read_space(device)
    assert space.others == "all"  # knobs of transforms added later are searched without editing the file
    for name, choices in space.choices.items():
        assert set(choices) <= set(all_knobs()[name].choices)


def test_bundled_cpu_space_leaves_out_cuda_only_knobs():
    space = build_space(all_knobs().values(), "cpu", read_space("cpu"))
    searched = {k.name for k in space.knobs}
    cuda_only = {k.name for k in all_knobs().values() if "cpu" not in k.devices}
    assert cuda_only and not searched & cuda_only
    assert all(space.left_out[name] == "does not apply on cpu" for name in cuda_only)


@pytest.mark.parametrize(
    "text, message",
    [
        ("knobs: [", "not valid YAML"),
        ("- a\n- b\n", "expected 'knobs:'"),
        ("knobs:\n  no_such.knob: [1, 2]\n", "unknown knob 'no_such.knob'"),
        ("knobs:\n  gc.freeze: []\n", "non-empty list of choices"),
        ("knobs:\n  gc.freeze: true\n", "non-empty list of choices"),
        ("knobs:\n  gc.freeze: [false, maybe]\n", "has no choice 'maybe'"),
        ("knobs:\n  gc.freeze: [false, true]\nothers: some\n", "'others' must be"),
        ("knobs:\n  gc.freeze: [false, true]\nextra: 1\n", "expected 'knobs:'"),
        ("knobs:\n  dataloader.num_workers: [0, 2.0]\n", "has no choice 2.0 (float;"),
        ("knobs:\n  dataloader.num_workers: [0, true]\n", "has no choice True (bool;"),
        ("knobs:\n  compile.dynamic: [default, 1]\n", "has no choice 1 (int;"),
        ("knobs:\n  gc.freeze: [false, true]\nothers: [all]\n", "'others' must be"),
    ],
    ids=["yaml", "not-a-mapping", "unknown-knob", "empty", "not-a-list", "bad-choice", "bad-others", "extra-key",
         "float-for-int", "bool-for-int", "int-for-bool", "others-not-a-string"],
)
def test_bad_space_file_is_one_line_usage_error(text, message):
    with pytest.raises(UsageError) as err:
        parse_space(text, "space.yaml")
    assert message in str(err.value)
    assert "\n" not in str(err.value)
    assert str(err.value).startswith("space.yaml")


def _knob(name, choices, default, numerics=Numerics.EXACT, devices=("cpu", "cuda")):
    return Knob(name, tuple(choices), default, numerics, frozenset(devices))


def test_build_space_filters_devices_and_adds_the_default():
    knobs = [
        _knob("gc.freeze", (False, True), False),
        _knob("non_blocking.enabled", (False, True), False, devices=("cuda",)),
        _knob("fused_optimizer.impl", ("default", "foreach", "fused"), "default", Numerics.REORDER),
        _knob("autocast.dtype", ("default", "bf16", "fp16"), "default", Numerics.LOWP),
    ]
    wanted = SpaceFile({"fused_optimizer.impl": ("fused",), "non_blocking.enabled": (False, True)}, "default")
    space = build_space(knobs, "cpu", wanted)
    assert [k.name for k in space.knobs] == ["fused_optimizer.impl"]
    assert space.choices["fused_optimizer.impl"] == ("default", "fused")  # the baseline is always in the space
    assert space.left_out["non_blocking.enabled"] == "does not apply on cpu"
    assert space.left_out["gc.freeze"] == "not in the search space"
    everything = build_space(knobs, "cpu", SpaceFile({"autocast.dtype": ("default",)}, "all"))
    assert [k.name for k in everything.knobs] == ["fused_optimizer.impl", "gc.freeze"]
    assert everything.left_out["autocast.dtype"] == "pinned to its default"
    assert everything.size == 6


def test_configs_baseline_first_then_each_knob_alone_then_combinations():
    knobs = [_knob("a.x", (0, 1, 2), 0), _knob("b.y", (False, True), False)]
    space = build_space(knobs, "cpu", SpaceFile({}, "all"))
    configs = list(space.configs())
    assert configs[0] == {"a.x": 0, "b.y": False}
    assert configs[1:4] == [{"a.x": 1, "b.y": False}, {"a.x": 2, "b.y": False}, {"a.x": 0, "b.y": True}]
    assert len(configs) == space.size == 6
    assert len({config_key(c) for c in configs}) == 6
    assert [k.name for k in space.changed({"a.x": 2, "b.y": False})] == ["a.x"]


# --- the gate ----------------------------------------------------------------------------------------------


def _result(losses, role="search", status=Outcome.OK, step_times=(0.01, 0.01), config=None, number=None, attrs=None):
    return TrialResult(
        config=config or {},
        role=role,
        status=status,
        losses=tuple(tuple(row) for row in losses),
        step_times=tuple(step_times),
        number=number,
        attrs=attrs or {},
    )


def test_step_deviations_relative_and_inf_on_shape_mismatch():
    ref = [[2.0], [1.0], [0.5]]
    assert step_deviations([[2.0], [1.001], [0.5]], ref) == pytest.approx([0.0, 1e-3, 0.0])
    assert step_deviations([[2.0], [1.0]], ref)[2] == math.inf
    assert step_deviations([[2.0], [math.nan], [0.5]], ref)[1] == math.inf


def test_tolerance_by_numerics_class_grows_and_never_below_noise():
    quiet = Noise(2, (0.0,) * 30, 0.1)
    assert tolerances(None, 3, quiet) == [0.0, 0.0, 0.0]
    assert tolerances(Numerics.EXACT, 3, quiet) == [0.0, 0.0, 0.0]
    reorder = tolerances(Numerics.REORDER, 30, quiet)
    lowp = tolerances(Numerics.LOWP, 30, quiet)
    assert reorder[0] < reorder[-1] <= 1e-3  # reordering differences grow as training amplifies them
    assert all(r < l for r, l in zip(reorder, lowp))
    assert tolerances(Numerics.LOWP, 3, quiet, rtol=0.5) == [0.5] * 3
    noisy = Noise(3, (0.0, 0.0, 0.0, 0.2, 0.2), 0.1)
    # noise that showed at a step could have shown NOISE_LEAD steps earlier: the runs drift apart from a chance step
    assert tolerances(Numerics.EXACT, 5, noisy) == [0.0] + [NOISE_FACTOR * 0.2] * 4
    assert tolerances(Numerics.REORDER, 5, noisy, rtol=1e-9)[2] == NOISE_FACTOR * 0.2


def test_a_thread_change_that_moves_the_losses_widens_reordering_and_lowp_tolerances_never_exact_ones():
    from autotune.search.gate import NOISE_LEAD

    assert NOISE_LEAD == 2
    steps = [[2.0], [1.5], [1.2], [1.0], [0.9]]
    ref = _result(steps, role="baseline")
    shaken = _result([[2.0], [1.5], [1.2], [1.02], [0.9]], role="perturbed")  # 2% at the fourth step, then back
    noise = measure_noise([ref, ref], [shaken])
    assert noise.deterministic and noise.perturbed == 1
    assert noise.reorder == pytest.approx((0.0, 0.0, 0.0, 0.02, 0.02))  # what showed up can show up later
    fused = _knob("fused_optimizer.impl", ("default", "fused"), "default", Numerics.REORDER)
    gc_knob = _knob("gc.freeze", (False, True), False)

    def off(at):  # 2.5% off at step ``at`` (0-based): within twice what the thread change moved, by then
        return _result([[v * (1.025 if i == at else 1.0)] for i, (v,) in enumerate(steps)])

    assert judge(off(4), ref, [fused], noise).passed
    # a knob's own rounding differences are larger, so training carries them as far a little earlier
    assert judge(off(1), ref, [fused], noise).passed
    assert not judge(off(0), ref, [fused], noise).passed  # more than NOISE_LEAD steps before: too early
    assert not judge(off(4), ref, [fused], measure_noise([ref, ref])).passed  # the class's 1e-4 otherwise
    assert not judge(off(4), ref, [gc_knob], noise).passed  # exact knobs answer to run-to-run noise only
    assert tolerances(Numerics.LOWP, 5, noise)[4] == pytest.approx(NOISE_FACTOR * 0.02)


def test_judge_exact_needs_identical_losses_lowp_allows_small_deviations():
    ref = _result([[2.0], [1.5], [1.2]], role="baseline")
    noise = measure_noise([ref, ref])
    assert noise.deterministic and noise.runs == 2
    gc_knob = _knob("gc.freeze", (False, True), False)
    bf16 = _knob("autocast.dtype", ("default", "bf16"), "default", Numerics.LOWP)
    same = judge(_result([[2.0], [1.5], [1.2]]), ref, [gc_knob], noise)
    assert same.passed and same.deviation == 0.0
    tiny_change = _result([[2.0], [1.5], [1.2000001]])
    assert not judge(tiny_change, ref, [gc_knob], noise).passed
    verdict = judge(tiny_change, ref, [bf16], noise)
    assert verdict.passed and 0 < verdict.deviation < 1e-6
    far = judge(_result([[2.0], [1.5], [1.5]]), ref, [bf16], noise)  # judged on its last 2 steps (round(3 / 2))
    assert not far.passed and far.window == (2, 3) and far.step == 2 and far.deviation == pytest.approx(0.125)


def test_reduced_precision_is_judged_on_where_training_got_to_not_on_an_early_spike():
    # bf16 on a 6-layer GPT on an H100 (docs/data/h100_gpt_lr6e-4.json): 17% off at step 10, then back within 1%
    base = [3.86, 3.17, 5.22, 4.03, 3.40, 2.97, 2.93, 2.88, 2.83, 3.89, 2.72, 2.67, 2.62, 2.58, 2.53, 2.51]
    ref = _result([[v] for v in base], role="baseline")
    noise = measure_noise([ref, ref])
    bf16 = _knob("autocast.dtype", ("default", "bf16"), "default", Numerics.LOWP)
    fused = _knob("fused_optimizer.impl", ("default", "fused"), "default", Numerics.REORDER)

    def run(at_spike, later):
        return _result([[v * (at_spike if i == 9 else 1 + later if i >= 10 else 1)] for i, v in enumerate(base)])

    spike = judge(run(1.17, 0.008), ref, [bf16], noise)
    assert spike.passed and spike.window == (9, 16) and spike.deviation == pytest.approx((0.17 + 6 * 0.008) / 8)
    assert not judge(run(1.17, 0.008), ref, [fused], noise).passed  # a reordering knob is held at every step
    lasting = judge(run(1.0, 0.08), ref, [bf16], noise)  # training that ends 8% worse is not the same training
    assert not lasting.passed and lasting.step == 9 and lasting.deviation == pytest.approx(6 * 0.08 / 8)
    nan_once = _result([[math.nan if i == 2 else v] for i, v in enumerate(base)])
    broken = judge(nan_once, ref, [bf16], noise)  # a loss that is not finite where the baseline's is: refused
    assert not broken.passed and broken.step == 3 and broken.deviation == math.inf and broken.window is None


def test_measured_noise_widens_the_gate():
    a = _result([[2.0], [1.5], [1.2]], role="baseline")
    b = _result([[2.0], [1.5], [1.23]], role="baseline")
    noise = measure_noise([a, b])
    assert not noise.deterministic and noise.max_loss == pytest.approx(0.025)
    gc_knob = _knob("gc.freeze", (False, True), False)
    assert judge(_result([[2.0], [1.5], [1.25]]), a, [gc_knob], noise).passed  # 0.042 < 2 x 0.025


def test_a_run_that_trains_on_other_samples_per_step_is_refused_whatever_its_losses():
    # a batch split that reached the accumulation steps and not the micro-batch: half the samples per step, which
    # steps/s would credit as twice as fast
    from dataclasses import replace

    ref = replace(_result([[2.0], [1.5], [1.2]], role="baseline"), batch_size=64)
    split = _knob("batch_split.factor", (1, 2, 4), 1, Numerics.REORDER)
    noise = measure_noise([ref])
    same = gated(replace(_result([[2.0], [1.5], [1.2]]), batch_size=64), ref, [split], noise, None)
    assert same.status is Outcome.OK
    fewer = gated(replace(_result([[2.0], [1.5], [1.2]]), batch_size=32), ref, [split], noise, None)
    assert fewer.status is Outcome.DIVERGED
    assert fewer.error == "32 samples per optimizer step, the baseline's 64: the knobs changed what a step trains on"


def test_no_visible_loss_admits_only_exact_knobs():
    ref = _result([], role="baseline")
    gc_knob = _knob("gc.freeze", (False, True), False)
    bf16 = _knob("autocast.dtype", ("default", "bf16"), "default", Numerics.LOWP)
    noise = measure_noise([ref])
    assert judge(_result([]), ref, [gc_knob], noise).passed
    assert not judge(_result([]), ref, [bf16], noise).passed


# --- failure types -----------------------------------------------------------------------------------------


def _error(kind, types, message="boom"):
    return {"status": "error", "error": f"{kind}: {message}", "error_type": kind, "error_types": types, "losses": []}


@pytest.mark.parametrize(
    "rc, timed_out, result, expected",
    [
        (0, False, {"status": "ok", "losses": [[1.0], [0.9]]}, Outcome.OK),
        (None, True, None, Outcome.TIMEOUT),
        (1, False, _error("OutOfMemoryError", ["torch.OutOfMemoryError", "builtins.RuntimeError"]), Outcome.OOM),
        (1, False, _error("RuntimeError", ["builtins.RuntimeError"], "DefaultCPUAllocator: not enough memory"), Outcome.OOM),
        (
            1,
            False,
            _error("BackendCompilerFailed", ["torch._dynamo.exc.BackendCompilerFailed", "builtins.Exception"]),
            Outcome.COMPILE_ERROR,
        ),
        (1, False, _error("InductorError", ["torch._inductor.exc.InductorError"]), Outcome.COMPILE_ERROR),
        (0, False, {"status": "ok", "losses": [[1.0], [math.nan]]}, Outcome.NAN),
        (1, False, {**_error("ValueError", ["builtins.ValueError"]), "losses": [[math.inf]]}, Outcome.NAN),
        (0, False, {"status": "short", "steps_done": 3, "losses": [[1.0]]}, Outcome.SHORT),
        (1, False, {"status": "short", "steps_done": 3, "losses": [[1.0]]}, Outcome.CRASH),
        (1, False, _error("ValueError", ["builtins.ValueError"]), Outcome.CRASH),
        (-9, False, None, Outcome.CRASH),
        (1, False, None, Outcome.CRASH),
    ],
    ids=["ok", "timeout", "oom", "cpu-oom", "dynamo", "inductor", "nan", "inf-then-error", "short", "short-rc1",
         "error", "sigkill", "no-result"],
)
def test_classify(rc, timed_out, result, expected):
    status, error = classify(rc, timed_out, result, "Traceback...\nValueError: boom\n", wanted_steps=7)
    assert status is expected
    if expected is Outcome.SHORT:
        assert "ended after 3 training steps" in error and "needs 7" in error and "after --" in error
    if expected is Outcome.CRASH and rc == -9:
        assert "SIGKILL" in error


def test_trial_result_round_trips_through_study_attrs():
    r = _result([[1.0, 2.0], [math.nan, 3.0]], config={"gc.freeze": True}, number=4, attrs={"pair": 1})
    back = TrialResult.from_attrs({**r.to_attrs(), "number": 4})
    assert back.config == r.config and back.status is Outcome.OK and back.attrs == {"pair": 1}
    assert back.losses[0] == (1.0, 2.0) and math.isnan(back.losses[1][0])
    assert back.throughput == pytest.approx(100.0)


def test_local_speedup_uses_the_baseline_runs_around_each_trial():
    base = {"k": 0}
    runs = [
        _result([], role="baseline", step_times=(0.02, 0.02), config=base, number=0),
        _result([], step_times=(0.01, 0.01), config={"k": 1}, number=1),
        _result([], role="baseline", step_times=(0.04, 0.04), config=base, number=2),
        _result([], step_times=(0.02, 0.02), config={"k": 2}, number=3),
        _result([], role="confirm", step_times=(0.02, 0.02), config=base, number=4, attrs={"arm": "baseline"}),
        _result([], status=Outcome.CRASH, step_times=(), config={"k": 3}, number=5),
    ]
    speed = local_speedups(runs)
    assert speed == {1: pytest.approx(3.0), 3: pytest.approx(1.5)}


# --- the command line: every mistake is one line and exit code 2 -----------------------------------------------


def _cli(argv, capsys):
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    return rc, err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--trials", "0"], "--trials must be at least 1"),
        (["--warmup", "0"], "--warmup must be at least 1"),
        (["--steps", "1"], "--steps at least 2"),
        (["--time-budget", "-5"], "--time-budget must be a positive"),
        (["--rtol", "2"], "--rtol must be"),
        (["--confirm", "0"], "--confirm 0 can never confirm a candidate"),
        (["--confirm", "4"], "needs at least 5 A/B pairs to say faster with p <= 0.05 (all 5 faster gives p = 0.031); "
         "give --confirm 5 or more"),
        (["--trials", "many"], "invalid int value"),
        (["--device", "tpu"], "invalid choice"),
        (["--batch-size", "4"], "arguments for the script go after --"),
    ],
)
def test_search_bad_arguments(extra, message, capsys, tmp_path):
    rc, err = _cli(["search", str(TINY), "--out", str(tmp_path / "out"), *extra], capsys)
    assert rc == 2
    assert message in err and err.startswith("autotune: error:")
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_search_bad_space_file(capsys, tmp_path):
    space = tmp_path / "space.yaml"
    space.write_text("knobs:\n  gc.freeze: [false, sometimes]\n")
    rc, err = _cli(["search", str(TINY), "--out", str(tmp_path / "out"), "--space", str(space)], capsys)
    assert rc == 2 and len(err.splitlines()) == 1
    assert f"{space}: knob 'gc.freeze' has no choice 'sometimes'" in err
    rc, err = _cli(["search", str(TINY), "--out", str(tmp_path / "out"), "--space", str(tmp_path / "nope.yaml")], capsys)
    assert rc == 2 and "nope.yaml: no such file" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_search_refuses_a_script_without_training_loop(capsys, tmp_path):
    rc, err = _cli(["search", str(REPO / "fixtures/scripts/no_loop.py"), "--out", str(tmp_path / "o")], capsys)
    assert rc == 2 and "no training loop found" in err and "nothing to search" in err
    assert len(err.splitlines()) == 1


def test_search_never_writes_over_the_users_files(capsys, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TINY.read_text())
    rc, err = _cli(["search", str(script), "--out", str(tmp_path)], capsys)
    assert rc == 2 and "must not be the script's own folder" in err
    other = tmp_path / "mine"
    other.mkdir()
    (other / "train.py").write_text("# my own file\n")
    rc, err = _cli(["search", str(script), "--out", str(other)], capsys)
    assert rc == 2 and "was not made by autotune" in err
    assert (other / "train.py").read_text() == "# my own file\n"


def test_search_with_nothing_to_search(capsys, tmp_path):
    space = tmp_path / "space.yaml"
    space.write_text("knobs:\n  gc.freeze: [false]\n")
    rc, err = _cli(["search", str(TINY), "--out", str(tmp_path / "o"), "--space", str(space), "--device", "cpu"], capsys)
    assert rc == 2 and "nothing to search on cpu" in err


# --- the runtime's trial protocol (plain Python scripts: no torch, so these run in a fraction of a second) -------


def _run_trial_script(tmp_path, body, warmup=2, steps=3, extra_env=None):
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / "script.py"
    script.write_text("import autotune.runtime as _autotune\n" + body)
    spec = tmp_path / "spec.json"
    result = tmp_path / "result.json"
    spec.write_text(json.dumps({"warmup": warmup, "steps": steps, "result": str(result)}))
    env = {**os.environ, "AUTOTUNE_TRIAL": str(spec), **(extra_env or {})}
    env.pop("AUTOTUNE_CONFIG", None)
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
    return proc, json.loads(result.read_text())


def test_trial_protocol_times_the_window_and_ends_the_run(tmp_path):
    body = "for i in range(100):\n    _autotune.step(1.0 / (i + 1))\nprint('never reached')\n"
    proc, r = _run_trial_script(tmp_path, body, warmup=2, steps=3)
    assert proc.returncode == 0 and "never reached" not in proc.stdout
    assert r["status"] == "ok" and r["steps_done"] == 5
    assert len(r["step_times"]) == 3  # the measured window only
    assert r["losses"] == [[1.0], [0.5], [1 / 3], [0.25], [0.2]]  # every step's loss, warm-up included
    assert r["warmup_s"] > 0 and r["first_step_s"] > 0 and r["peak_memory"] > 0


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="VmHWM is Linux's")
def test_a_trials_peak_memory_is_its_own_not_the_searchs(tmp_path):
    # Linux keeps getrusage's ru_maxrss across exec: a trial started by a 300 MiB search reported >= 300 MiB
    held = bytearray(300 * 1024 * 1024)
    held[:: 4096] = b"\x01" * len(held[:: 4096])  # touch every page: resident in this (the parent) process
    body = "x = bytearray(40 * 1024 * 1024)\nx[::4096] = b'\\x01' * len(x[::4096])\nfor i in range(10):\n    _autotune.step(1.0)\n"
    proc, r = _run_trial_script(tmp_path, body, warmup=1, steps=2)
    del held
    assert proc.returncode == 0, proc.stderr
    assert r["peak_memory_kind"] == "cpu_max_rss"
    assert 40 * 2**20 < r["peak_memory"] < 250 * 2**20  # its own 40 MiB and Python's, not the parent's 300 MiB


def test_trial_protocol_keeps_each_loss_when_the_script_reuses_its_output_buffer(tmp_path):
    # CUDA graphs (compile's reduce-overhead) return the loss in a static buffer that every replay overwrites;
    # seen on an H100 as a 2x faster trial whose recorded losses were garbage. The same reuse, on CPU:
    body = (
        "import torch\nbuf = torch.zeros(())\n"
        "for i in range(100):\n    buf.copy_(torch.tensor(1.0 / (i + 1)))\n    _autotune.step(buf)\n"
    )
    proc, r = _run_trial_script(tmp_path, body, warmup=2, steps=3)
    assert proc.returncode == 0, proc.stderr
    assert [v for (v,) in r["losses"]] == pytest.approx([1.0, 0.5, 1 / 3, 0.25, 0.2])  # float32 values


def test_trial_protocol_reports_what_the_script_raised(tmp_path):
    body = "_autotune.step(1.0)\nclass Boom(MemoryError):\n    pass\nraise Boom('no room')\n"
    proc, r = _run_trial_script(tmp_path, body)
    assert proc.returncode == 1 and "Boom: no room" in proc.stderr  # the traceback is still printed
    assert r["status"] == "error" and r["error"] == "Boom: no room" and r["steps_done"] == 1
    assert r["error_types"][:2] == ["__main__.Boom", "builtins.MemoryError"]
    assert classify(1, False, r, proc.stderr, 5)[0] is Outcome.OOM


def test_trial_protocol_short_script(tmp_path):
    proc, r = _run_trial_script(tmp_path, "for i in range(2):\n    _autotune.step(1.0)\n", warmup=2, steps=3)
    assert proc.returncode == 0 and r["status"] == "short" and r["steps_done"] == 2
    assert classify(0, False, r, "", 5)[0] is Outcome.SHORT


def test_plot_is_skipped_with_a_reason_without_matplotlib(monkeypatch, tmp_path):
    from autotune.search.plot import write_plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what `import matplotlib` sees when it is not installed
    plot, why = write_plot(None, tmp_path / "throughput.png")
    assert plot is None and "pip install matplotlib" in why
    assert not (tmp_path / "throughput.png").exists()


def test_the_plot_compares_each_run_with_its_own_machines_baseline():
    from types import SimpleNamespace

    from autotune.search.plot import plot_data

    def run(n, host, step, role="search", status=Outcome.OK):
        return TrialResult(config={}, role=role, status=status, step_times=(step,), number=n, host=host, device_name="cpu")

    fast_box = [run(0, "fast", 0.01, "baseline"), run(2, "fast", 0.005)]  # 100 steps/s baseline, a 2x trial
    slow_box = [run(1, "slow", 0.1, "baseline"), run(3, "slow", 0.08), run(4, "slow", 0.1, status=Outcome.DIVERGED)]
    results = (*fast_box, *slow_box)
    study = {"space": SimpleNamespace(baseline=dict), "confirmations": (), "winner": None, "speedups": {}}
    one = SimpleNamespace(results=tuple(fast_box), machines=(fast_box[0].machine,), machine=fast_box[0].machine, **study)
    data = plot_data(one)
    assert data.points["ok"] == [(2, pytest.approx(200.0))] and data.level == pytest.approx(100.0)  # steps/s
    two = SimpleNamespace(
        results=results, machines=tuple(dict.fromkeys(r.machine for r in results)), machine=one.machine, **study
    )
    data = plot_data(two)
    assert data.level == 1.0 and "same machine" in data.ylabel
    assert data.points["baseline"] == [(0, pytest.approx(1.0)), (1, pytest.approx(1.0))]
    assert data.points["ok"] == [(2, pytest.approx(2.0)), (3, pytest.approx(1.25))]
    assert data.points["diverged"] == [(4, pytest.approx(1.0))]


def test_a_trial_of_an_entry_in_scripts_imports_the_package_at_the_project_root(tmp_path):
    from autotune.project import load_project
    from autotune.patch import run
    from autotune.search.trial import Runner, TrialSettings

    root = Path(__file__).resolve().parent.parent / "fixtures/realistic/pkg_scripts"
    patch = run(load_project(root / "scripts/train.py"))
    settings = TrialSettings((), tmp_path, "cpu", 1, 2, {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"})
    runner = Runner(patch, tmp_path / "work", settings)
    result = runner.run({}, "baseline", timeout=240)
    assert result.status is Outcome.OK, result.stderr_tail
    assert result.steps_done == 3 and all(len(step) == 1 for step in result.losses)
    assert (runner.entry.parent / "autotune.yaml").is_file()  # beside the entry, where the runtime looks


def _plotted_search(winner: bool = True):
    """A search as the report sees it: baselines at 10 steps/s, four configurations, one confirmed or not."""
    from types import SimpleNamespace

    from autotune.search.outcome import Confirmation

    defaults = {"gc.freeze": False, "autocast.dtype": "default", "fused_optimizer.impl": "default",
                "dataloader.persistent_workers": False}

    def run(n, role, steps_per_s, status=Outcome.OK, **changed):
        return TrialResult(config={**defaults, **changed}, role=role, status=status, step_times=(1 / steps_per_s,) if steps_per_s else (),
                           number=n, host="box", device_name="cpu")

    bf16 = {"autocast.dtype": "bf16"}
    results = (
        run(0, "baseline", 10.0), run(1, "baseline", 10.0),
        # persistent workers without workers bake to the same code: bf16 alone is confirmed, standing for this run
        run(2, "search", 15.0, **bf16, **{"dataloader.persistent_workers": True}),
        run(3, "search", 0.3, **{"fused_optimizer.impl": "fused"}),  # compiling-style crawl: 0.03x
        run(4, "search", 400.0, status=Outcome.DIVERGED, **{"gc.freeze": True}),  # 40x, but wrong losses
        run(5, "search", 0.0, status=Outcome.OOM, **{"gc.freeze": True, **bf16}),
        run(6, "search", 11.0, **{"fused_optimizer.impl": "foreach"}),
    )
    pairs = Confirmation({**defaults, **bf16}, (1.4, 1.5, 1.45, 0.98, 1.6), winner, "faster in 4 of 5 A/B pairs",
                         search_speedup=1.5)
    return SimpleNamespace(
        results=results, machines=("box",), machine=results[0].machine, device="cpu",
        space=SimpleNamespace(baseline=lambda: dict(defaults)), project=SimpleNamespace(entry=SimpleNamespace(display="train.py")),
        confirmations=(pairs,), winner=pairs if winner else None,
        speedups={2: 1.5, 3: 0.03, 4: 40.0, 6: 1.1},
    )


def test_the_plot_shows_each_configurations_speedup_with_its_pairs_and_the_winner():
    from autotune.search.plot import plot_data

    rows = plot_data(_plotted_search()).rows
    # the winner, the others that trained the same by speedup, then the one whose losses differ, then failures
    assert [r.label for r in rows] == [
        "autocast.dtype=bf16", "fused_optimizer.impl=foreach", "fused_optimizer.impl=fused", "gc.freeze=true",
        "autocast.dtype=bf16, gc.freeze=true",
    ]
    first = rows[0]
    assert first.label == "autocast.dtype=bf16" and first.winner and first.accepted
    assert first.search == (1.5,) and first.pairs == (1.4, 1.5, 1.45, 0.98, 1.6) and first.value == 1.45
    by_label = {r.label: r for r in rows}
    assert by_label["gc.freeze=true"].status == "diverged" and by_label["gc.freeze=true"].search == (40.0,)
    assert by_label["autocast.dtype=bf16, gc.freeze=true"].status == "oom" and rows[-1].value is None
    assert not any(r.winner for r in plot_data(_plotted_search(winner=False)).rows)


def test_the_plots_axis_is_not_squashed_by_a_diverged_or_crawling_run():
    from autotune.search.plot import plot_data

    lo, hi = plot_data(_plotted_search()).limits
    assert lo < 0.98 and 1.6 < hi  # 1x and every pair of the winner
    assert hi < 40.0 / 4 and lo > 0.03 * 4  # the 40x run whose losses differ and the 0.03x crawl sit at the edges


def test_the_plot_is_written(tmp_path):
    from autotune.search.plot import write_plot

    for winner in (True, False):
        path, why = write_plot(_plotted_search(winner), tmp_path / f"plot{winner}.png")
        assert why is None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_matplotlib_is_a_dependency_so_the_first_search_draws_its_plot():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert any(d.startswith("matplotlib") for d in project["dependencies"])
    assert "plot" in project["optional-dependencies"]  # `pip install -e ".[plot]"` of older instructions still works


def test_space_choices_are_the_declared_objects():
    space = parse_space("knobs:\n  compile.dynamic: [default, true, true]\n", "space.yaml")
    declared = all_knobs()["compile.dynamic"].choices
    assert space.choices["compile.dynamic"] == ("default", True)
    assert all(any(c is d for d in declared) for c in space.choices["compile.dynamic"])


@pytest.mark.parametrize(
    "choices",
    [["none", 'default"); import os; os.system("id'], ["none", 1.0], "none"],
    ids=["code", "wrong-type", "not-a-list"],
)
def test_a_study_space_is_checked_like_a_space_file(choices):
    # the search space a study stores is read back by autotune report: anyone who can write to the study can edit it
    from autotune.search.space import restore_space

    knobs = [all_knobs()["compile.mode"]]
    with pytest.raises(UsageError, match="the study's search space"):
        restore_space(knobs, "cpu", {"compile.mode": choices}, {})


@pytest.mark.parametrize("option", ["--timeout", "--time-budget", "--rtol"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_number_that_is_not_finite_is_refused(option, value, tmp_path, capsys):
    tiny = Path(__file__).resolve().parent.parent / "fixtures/search/tiny.py"
    assert main(["search", str(tiny), f"{option}={value}", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"autotune: error: argument {option}: expected a finite number, not '{value}'"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("field", ["timeout", "time_budget"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_search_refuses_a_time_that_is_not_finite(field, value, tmp_path):
    from autotune.search.search import Search, SearchOptions

    tiny = Path(__file__).resolve().parent.parent / "fixtures/search/tiny.py"
    options = SearchOptions(script=tiny, out=tmp_path / "out", **{field: value})
    with pytest.raises(UsageError, match="must be a positive number of seconds"):
        Search(options, display=None)


def test_report_refuses_a_study_whose_space_was_edited_to_hold_code(tmp_path, capsys):
    # anyone who can write to a shared study's storage can edit what it says was searched
    from autotune.search.live import QuietDisplay
    from autotune.search.identity import fingerprint
    from autotune.search.search import Search, SearchOptions
    from autotune.search.space import SearchSpace
    from autotune.search.storage import open_storage
    from autotune.search.study import STUDY_ABOUT, STUDY_FINGERPRINT, StudyStore

    script = tmp_path / "train.py"
    script.write_text((Path(__file__).resolve().parent.parent / "fixtures/search/tiny.py").read_text())
    space = tmp_path / "space.yaml"
    space.write_text("knobs: {compile.mode: [none, default]}\n")
    search = Search(SearchOptions(script=script, out=tmp_path / "out", space=space, study_name="s"), QuietDisplay())
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    store = StudyStore(open_storage(url), "s", machine="m (cpu)")
    store.adopt(search.fingerprint, search.space, search.ready.about(search.o))
    evil = ("none", 'default"); import os; os.system("id')
    about = {**store.study.user_attrs[STUDY_ABOUT], "space": {"compile.mode": list(evil)}}
    store.study.set_user_attr(STUDY_ABOUT, about)
    # and the fingerprint made to match, so the edit is not taken for a changed script
    edited = SearchSpace("cpu", search.space.knobs, {"compile.mode": evil}, search.space.left_out)
    store.study.set_user_attr(STUDY_FINGERPRINT, fingerprint(search.patch, search.o, "cpu", edited))
    assert main(["report", "--storage", url, "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("autotune: error: the study's search space: knob 'compile.mode' has no choice 'default\")")
    assert len(err.splitlines()) == 1 and not (tmp_path / "r").exists()


def test_the_perturbed_baseline_runs_on_one_thread_fewer_or_two_where_runs_get_one(monkeypatch):
    import torch

    from autotune.search.identity import thread_counts

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert thread_counts({"OMP_NUM_THREADS": "4"}, False) == (4, 3)
    assert thread_counts({"OMP_NUM_THREADS": "1"}, False) == (1, 2)
    assert thread_counts({}, True) == (1, 2)  # torchrun gives each process one thread unless told otherwise
    base = torch.get_num_threads()
    assert thread_counts({"OMP_NUM_THREADS": "many"}, False) == (base, base - 1 if base > 1 else 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert thread_counts({}, False) == (3, 2)


def test_thread_counts_a_run_gets_anyway_or_that_oversubscribe_the_cores_are_not_searched():
    from autotune.search.space import SearchSpace, fit_threads
    from autotune.transforms.threads import Threads

    (knob,) = Threads.knobs
    space = SearchSpace("cpu", (knob,), {knob.name: ("default", 1, 2, 4)})
    assert fit_threads(space, 2, 2).choices[knob.name] == ("default", 1)  # 2 is what a run gets: the baseline again
    assert fit_threads(space, 4, 8).choices[knob.name] == ("default", 1, 2)
    assert fit_threads(space, 1, 16).choices[knob.name] == ("default", 2, 4)
    alone = fit_threads(SearchSpace("cpu", (knob,), {knob.name: ("default", 1)}), 1, 1)
    assert not alone.knobs and "fits its 1 core" in alone.left_out[knob.name]


def test_a_compiling_winners_one_time_cost_says_what_it_could_not_count_where_the_runs_length_is_unknown():
    from autotune.search.credit import startup
    from autotune.search.outcome import Confirmation

    def run(step, warmup_s):
        return TrialResult(config={}, role="confirm", status=Outcome.OK, step_times=(step,) * 20, warmup_s=warmup_s,
                           steps_done=25)

    # 5 warm-up steps: the baseline's start-up 1 s, the candidate's 4 s (compilation), 10 ms a step saved
    won = Confirmation({"compile.mode": "default"}, (1.5,), True, "", baseline=(run(0.03, 1.15),),
                       candidate=(run(0.02, 4.1),))
    assert startup(won, True, 5, 1000) == ("start-up 3s longer than the baseline's (compilation): it pays for itself "
                                           "after 300 steps (your run: 1000)")
    unknown = startup(won, True, 5, None)
    assert unknown.startswith("start-up 3s longer than the baseline's (compilation): it pays for itself after 300 "
                              "steps, counted on runs of 25 steps: what they did not reach (a training step of a "
                              "new shape, an evaluation with gradients on)")
    assert "--train-steps N" in unknown
    assert startup(won, False, 5, None) is None  # nothing compiles: no one-time cost to speak of
