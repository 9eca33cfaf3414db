"""fsdp: FSDP's prefetching, all-gather limit and original parameters, and FSDP2's resharding, as knobs with
torch's defaults; the script's own values kept; two gloo ranks train the FSDP scripts under every knob (FSDP runs
on CPU in torch 2.13 when given device_id=cpu)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from dist_probe import run_dist_probe
from transform_cases import assert_same_losses, baked, case, sites, statuses

import autotune.runtime as runtime
from autotune.project import load_project
from autotune.knobs import Numerics
from autotune.patch import run, select, write_outputs
from autotune.transforms.fsdp import Fsdp

T = "fsdp"
REPO = Path(__file__).resolve().parent.parent
FSDP_SCRIPT = REPO / "fixtures" / "scripts" / "fsdp_train.py"


@pytest.mark.parametrize(
    "name, expected",
    [
        ("fsdp1_wrap", ["applicable"]),
        ("user_prefetch", ["applicable"]),
        ("prefetch_none", ["applicable"]),
        ("fully_shard", ["applicable", "applicable"]),
        ("fully_shard_composable", ["applicable", "kept as written"]),
        ("all_set", ["kept as written"]),
        ("kwargs_splat", ["not applicable", "not applicable"]),
        ("ddp_only", []),
    ],
)
def test_sites(name, expected):
    assert [str(s) for s in statuses(T, name)] == expected


def test_reasons():
    (user,) = sites(T, "user_prefetch")
    assert user.reason == (
        "FSDP: forward_prefetch, limit_all_gathers, use_orig_params become knobs; "
        "backward_prefetch=fsdp.BackwardPrefetch.BACKWARD_POST kept as written"
    )
    inner, root = sites(T, "fully_shard_composable")
    assert inner.reason == "fully_shard: reshard_after_forward becomes a knob"  # the qualified name, not the alias
    assert root.reason == "fully_shard(reshard_after_forward=False) is the script's choice"


def test_knobs_read_are_the_free_settings():
    result = run(load_project(case(T, "user_prefetch")), select([T]), hooks=False)
    assert [k.name for k in result.knobs] == ["fsdp.forward_prefetch", "fsdp.limit_all_gathers", "fsdp.use_orig_params"]
    shard = run(load_project(case(T, "fully_shard")), select([T]), hooks=False)
    assert [k.name for k in shard.knobs] == ["fsdp.reshard_after_forward"]


def test_knobs_keep_torchs_defaults():
    by_name = {k.name: k for k in Fsdp.knobs}
    assert by_name["fsdp.forward_prefetch"].default is False
    assert by_name["fsdp.backward_prefetch"].default == "pre"  # BackwardPrefetch.BACKWARD_PRE
    assert by_name["fsdp.limit_all_gathers"].default is True
    assert by_name["fsdp.use_orig_params"].default is False
    assert by_name["fsdp.reshard_after_forward"].default == "default"  # None in torch 2.13: per-module choice
    assert all(k.numerics is Numerics.EXACT for k in Fsdp.knobs)
    # prefetching and the all-gather limit are about overlap on GPU streams: nothing to gain on CPU
    assert {k.name for k in Fsdp.knobs if k.devices == {"cuda"}} == {
        "fsdp.forward_prefetch", "fsdp.backward_prefetch", "fsdp.limit_all_gathers",
    }  # fmt: skip


def test_bake_spells_backward_prefetch_as_the_script_imports_it():
    text = baked(T, "prefetch_none", {"fsdp.backward_prefetch": "post"}, device="cuda")
    assert "backward_prefetch=BackwardPrefetch.BACKWARD_POST" in text
    none = baked(T, "fsdp1_wrap", {"fsdp.backward_prefetch": "none"}, device="cuda")
    assert "device_id=local_rank, backward_prefetch=None)" in none


def test_runtime_kwargs(monkeypatch, tmp_path):
    from torch.distributed.fsdp import BackwardPrefetch

    def config(knobs):
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump({"knobs": knobs}))
        monkeypatch.setenv("AUTOTUNE_CONFIG", str(path))
        runtime.reset()

    config({})
    assert runtime.fsdp_kwargs() == {} and runtime.fully_shard_kwargs() == {}
    config({"fsdp.backward_prefetch": "post", "fsdp.limit_all_gathers": False, "fsdp.reshard_after_forward": False})
    assert runtime.fsdp_kwargs() == {"backward_prefetch": BackwardPrefetch.BACKWARD_POST, "limit_all_gathers": False}
    assert runtime.fsdp_kwargs(limit_all_gathers=True)["limit_all_gathers"] is True  # the script's value wins
    assert runtime.fully_shard_kwargs() == {"reshard_after_forward": False}
    assert runtime.fully_shard_kwargs(reshard_after_forward=True) == {"reshard_after_forward": True}
    config({"fsdp.backward_prefetch": "none"})
    assert runtime.fsdp_kwargs() == {"backward_prefetch": None}
    runtime.reset()


def _configs(tmp: Path, **named: dict) -> list[Path]:
    out = []
    for label, knobs in named.items():
        path = tmp / f"{label}.yaml"
        path.write_text(yaml.safe_dump({"device": "cpu", "knobs": knobs}))
        out.append(path)
    return out


@pytest.mark.slow
def test_gloo_fsdp1_knobs_keep_the_losses(tmp_path):
    """All-gathers copy, reduce-scatters sum the same buffers: only the timing moves, the losses do not."""
    write_outputs(run(load_project(FSDP_SCRIPT), select([T])), tmp_path / "patched", "fsdp_train.py")
    configs = _configs(
        tmp_path,
        default={},
        prefetch={"fsdp.forward_prefetch": True, "fsdp.backward_prefetch": "post", "fsdp.limit_all_gathers": False},
        orig_params={"fsdp.backward_prefetch": "none", "fsdp.use_orig_params": True},
    )
    runs = run_dist_probe(tmp_path / "patched" / "fsdp_train.py", configs, steps=4, out=tmp_path / "runs")
    for rank in (0, 1):
        default, prefetch, orig = runs[rank]
        assert default["ended"] == prefetch["ended"] == orig["ended"] == "steps"
        assert prefetch["losses"] == default["losses"]
        assert prefetch["grads"] == default["grads"]  # the same flat-parameter shards
        assert orig["losses"] == default["losses"]
    assert runs[0][0]["grads"] != runs[1][0]["grads"]  # each rank holds its own shard


@pytest.mark.slow
def test_gloo_fully_shard_reshard_after_forward(tmp_path):
    script = case(T, "fully_shard")
    write_outputs(run(load_project(script), select([T])), tmp_path / "patched", script.name)
    configs = _configs(
        tmp_path,
        default={},
        reshard={"fsdp.reshard_after_forward": True},
        keep={"fsdp.reshard_after_forward": False},
    )
    runs = run_dist_probe(tmp_path / "patched" / script.name, configs, steps=5, out=tmp_path / "runs")
    for rank in (0, 1):
        default, reshard, keep = runs[rank]
        assert default["ended"] == reshard["ended"] == keep["ended"] == "steps"
        assert reshard["losses"] == keep["losses"] == default["losses"]
        assert reshard["grads"] == keep["grads"] == default["grads"]


@pytest.mark.cuda
def test_fsdp_script_on_gpu(tmp_path):
    """One GPU, NCCL: the FSDP script trains under every FSDP1 knob and gives the default's losses."""
    write_outputs(run(load_project(FSDP_SCRIPT), select([T])), tmp_path / "patched", "fsdp_train.py")
    configs = _configs(
        tmp_path,
        default={},
        tuned={"fsdp.forward_prefetch": True, "fsdp.backward_prefetch": "post", "fsdp.limit_all_gathers": False,
               "fsdp.use_orig_params": True},
    )  # fmt: skip
    runs = run_dist_probe(tmp_path / "patched" / "fsdp_train.py", configs, steps=4, out=tmp_path / "runs", nproc=1)
    default, tuned = runs[0]
    assert default["ended"] == tuned["ended"] == "steps"
    assert_same_losses(tuned["losses"], default["losses"], "cuda")
