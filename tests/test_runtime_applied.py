"""The trial result lists the knobs whose code ran (``applied``); ``unreached`` names the ones that never did."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from transform_cases import trial

from autotune import runtime
from autotune.project import load_project
from autotune.patch import run, select
from autotune.search.ranks import merge_ranks
from autotune.search.trial import Outcome, TrialResult, unreached
from autotune.transform import all_knobs

BRANCHES = Path(__file__).resolve().parent.parent / "fixtures" / "transforms" / "channels_last" / "arch_branches.in.py"


@pytest.fixture
def knobs(tmp_path, monkeypatch):
    def set_values(**values):
        path = tmp_path / "knobs.yaml"
        path.write_text(yaml.safe_dump({"knobs": {k.replace("__", "."): v for k, v in values.items()}}))
        monkeypatch.setenv(runtime.CONFIG_ENV, str(path))
        runtime.reset()

    yield set_values
    runtime.reset()


def test_defaults_apply_nothing(knobs):
    knobs()
    runtime.channels_last(torch.nn.Conv2d(3, 4, 3))
    runtime.compile_model(torch.nn.Linear(2, 2))
    runtime.dataloader_kwargs(num_workers=2)
    runtime.non_blocking()
    assert runtime.applied() == []


def test_a_knob_counts_where_its_helper_changed_the_program(knobs):
    knobs(channels_last__enabled=True, compile__mode="default", compile__scope="blocks", dataloader__num_workers=2)
    runtime.channels_last(torch.nn.Linear(2, 2))  # no 4-D weight: nothing to convert
    runtime.dataloader_kwargs(num_workers=0)  # the script chose its workers: the knob is not used
    assert runtime.applied() == []
    runtime.channels_last(torch.nn.Conv2d(3, 4, 3))
    runtime.compile_model(torch.nn.Linear(2, 2), blocks=[])  # no blocks to compile: the whole model, not the scope
    assert runtime.applied() == ["channels_last.enabled", "compile.mode"]


def test_bf16_counts_only_where_a_region_runs_in_it(knobs):
    # nanoGPT on a CPU: its autocast is in the arm of a conditional that is not taken, and its GradScaler is turned
    # off (it was on by its own flag, and disabled itself without CUDA): bf16 changed nothing
    knobs(autocast__dtype="bf16")
    assert runtime.scaler_enabled(False) is False and runtime.scaler_enabled(True) is False
    loss = torch.ones(())
    assert runtime.scale(loss) is loss and runtime.unscale_(torch.optim.SGD([torch.zeros(1)], lr=0.1)) is None
    assert runtime.autocast_dtype(torch.bfloat16) is torch.bfloat16  # a region already in bf16: nothing changes
    assert runtime.applied() == []
    assert runtime.autocast_dtype(torch.float16) is torch.bfloat16  # the script's fp16 region, now bf16
    assert runtime.applied() == ["autocast.dtype"]


def test_unreached_names_changed_knobs_that_never_ran():
    table = all_knobs()
    changed = [table["compile.mode"], table["channels_last.enabled"]]
    ran = TrialResult({}, "search", Outcome.OK, step_times=(0.1,), applied=("channels_last.enabled",))
    assert unreached(ran, changed) == ["compile.mode"]
    assert unreached(ran.with_(applied=None), changed) == []  # no record: nothing to say
    assert unreached(ran.with_(status=Outcome.CRASH, step_times=()), changed) == []  # failed anyway
    assert TrialResult.from_attrs(json.loads(json.dumps(ran.to_attrs()))).applied == ("channels_last.enabled",)


def test_ranks_add_up_what_took_effect():
    ranks = [
        {"rank": 0, "world_size": 2, "status": "ok", "losses": [], "applied": ["compile.mode"]},
        {"rank": 1, "world_size": 2, "status": "ok", "losses": [], "applied": ["compile.mode", "no_sync.enabled"]},
    ]
    assert merge_ranks(ranks)["applied"] == ["compile.mode", "no_sync.enabled"]


@pytest.mark.parametrize("arch, reached", [("resnet", True), ("linear", False)])
def test_trial_result_says_whether_channels_last_reached_the_model(tmp_path, arch, reached):
    """The same patched script, one flag apart: the convolutional branch is converted, the linear one has nothing
    that channels_last changes, and the trial result tells the two apart."""
    script = tmp_path / "train.py"
    script.write_text(run(load_project(BRANCHES), select(["channels_last"]), hooks=True).files[0].new_text)
    r = trial(script, ["--arch", arch], tmp_path, knobs={"channels_last.enabled": True}, warmup=1, steps=2)
    assert r["status"] == "ok", r["error"]
    assert r["applied"] == (["channels_last.enabled"] if reached else [])


def test_nccl_variables_count_only_under_an_nccl_process_group(knobs, monkeypatch, tmp_path):
    import torch.distributed as dist

    for var in ("NCCL_ALGO", "NCCL_MIN_NCHANNELS", "NCCL_BUFFSIZE"):
        monkeypatch.delenv(var, raising=False)
    knobs(nccl_env__algo="ring")
    runtime.nccl_env()
    assert os.environ["NCCL_ALGO"] == "Ring"
    assert runtime.applied() == []  # set, but nothing reads it yet
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert runtime.applied() == []  # a gloo group never reads NCCL's variables
    finally:
        dist.destroy_process_group()


def test_a_trainer_precision_counts_where_the_knob_chose_a_mixed_one(knobs):
    from types import SimpleNamespace

    knobs(lightning_trainer__precision="16-mixed")
    # the script's switch is on: its own precision, which the knob had no part in
    assert runtime.lightning_trainer_switch("precision", "bf16-mixed") == "bf16-mixed"
    runtime.lightning_trainer_resolved(SimpleNamespace(precision="bf16-mixed"))
    assert runtime.applied() == []
    runtime.reset()
    # switched off: the knob's choice, which a CPU Trainer resolves to bf16-mixed: the program changed
    assert runtime.lightning_trainer_switch("precision", "32-true") == "16-mixed"
    runtime.lightning_trainer_resolved(SimpleNamespace(precision="bf16-mixed"))
    assert runtime.applied() == ["lightning_trainer.precision"]
    runtime.reset()
    runtime.lightning_trainer_resolved(SimpleNamespace(precision="32-true"))  # a Trainer that kept full precision
    assert runtime.applied() == []
