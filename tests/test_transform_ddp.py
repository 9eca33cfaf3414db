"""ddp: bucket size, gradients as bucket views and static graph as knobs of the DDP constructor; the script's own
values kept; two gloo ranks train the DDP fixture script under every knob."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from dist_probe import run_dist_probe
from transform_cases import case, sites, statuses

import autotune.runtime as runtime
from autotune.project import load_project
from autotune.knobs import Numerics
from autotune.patch import run, select, write_outputs
from autotune.transforms.ddp import Ddp

T = "ddp"
REPO = Path(__file__).resolve().parent.parent
DDP_SCRIPT = REPO / "fixtures" / "scripts" / "ddp_accum.py"
MICRO_STEPS = 8  # two optimizer steps of ddp_accum.py's 4 micro-steps


@pytest.mark.parametrize(
    "name, expected",
    [
        ("plain", ["applicable"]),
        ("user_bucket", ["applicable"]),
        ("all_set", ["kept as written"]),
        ("kwargs_splat", ["not applicable"]),
        ("data_parallel", []),
        ("no_ddp", []),
    ],
)
def test_sites(name, expected):
    assert [str(s) for s in statuses(T, name)] == expected


def test_reasons():
    (plain,) = sites(T, "plain")
    assert plain.reason == "DDP: bucket_cap_mb, gradient_as_bucket_view, static_graph become knobs"
    (user,) = sites(T, "user_bucket")
    assert user.reason == (
        "DDP: gradient_as_bucket_view, static_graph become knobs; bucket_cap_mb=args.bucket_mb kept as written"
    )
    (splat,) = sites(T, "kwargs_splat")
    assert splat.reason == "**ddp_opts may set the DDP settings"


def test_only_free_settings_become_knobs():
    result = run(load_project(case(T, "user_bucket")), select([T]), hooks=False)
    assert [k.name for k in result.knobs] == ["ddp.gradient_as_bucket_view", "ddp.static_graph"]
    # the script's value moves, as written, into the helper, which passes it through
    assert "**_autotune.ddp_kwargs(bucket_cap_mb=args.bucket_mb),  # tuned for 100 Gb/s links" in result.files[0].new_text


def test_knobs():
    by_name = {k.name: k for k in Ddp.knobs}
    assert by_name["ddp.bucket_cap_mb"].default == 25  # torch's own default bucket size
    assert by_name["ddp.gradient_as_bucket_view"].default is False and by_name["ddp.static_graph"].default is False
    # with 3+ ranks the bucket layout decides the order of each element's sum (measured: 1e-8 with gloo)
    assert all(k.numerics is Numerics.REORDER and k.devices == {"cpu", "cuda"} for k in Ddp.knobs)


def _config(monkeypatch, tmp_path: Path, knobs: dict) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"knobs": knobs}))
    monkeypatch.setenv("AUTOTUNE_CONFIG", str(path))
    runtime.reset()


def test_runtime_kwargs(monkeypatch, tmp_path):
    _config(monkeypatch, tmp_path, {})
    assert runtime.ddp_kwargs() == {}
    _config(monkeypatch, tmp_path, {"ddp.bucket_cap_mb": 25, "ddp.static_graph": False})
    assert runtime.ddp_kwargs() == {}  # defaults are left to torch
    _config(monkeypatch, tmp_path, {"ddp.bucket_cap_mb": 100, "ddp.gradient_as_bucket_view": True})
    assert runtime.ddp_kwargs() == {"bucket_cap_mb": 100, "gradient_as_bucket_view": True}
    assert runtime.ddp_kwargs(bucket_cap_mb=5) == {"bucket_cap_mb": 5, "gradient_as_bucket_view": True}
    runtime.reset()


def test_static_graph_is_left_out_where_gradients_accumulate_under_no_sync():
    # DDP(static_graph=True) with no_sync() asserts in the reducer on the first backward (torch 2.13)
    result = run(load_project(DDP_SCRIPT), select([T]), hooks=False)
    assert [k.name for k in result.knobs] == ["ddp.bucket_cap_mb", "ddp.gradient_as_bucket_view"]
    (site,) = result.sites
    assert site.reason.endswith("static_graph left out: it breaks no_sync() gradient accumulation (pytorch/pytorch#187732)")
    every_step = run(load_project(case(T, "every_step")), select([T]), hooks=False)
    assert [k.name for k in every_step.knobs] == [k.name for k in Ddp.knobs]


def _configs(tmp: Path, **named: dict) -> list[Path]:
    out = []
    for label, knobs in named.items():
        path = tmp / f"{label}.yaml"
        path.write_text(yaml.safe_dump({"device": "cpu", "knobs": knobs}))
        out.append(path)
    return out


# With two ranks each all-reduced element is the sum of two numbers, whose order cannot matter: every bucket
# setting must give the default's losses and gradients bit for bit (with 3+ ranks they differ in the last bits).


@pytest.mark.slow
def test_gloo_bucket_knobs_with_accumulation(tmp_path):
    write_outputs(run(load_project(DDP_SCRIPT), select([T, "no_sync"])), tmp_path / "patched", "ddp_accum.py")
    tuned = {"ddp.bucket_cap_mb": 10, "ddp.gradient_as_bucket_view": True}
    configs = _configs(tmp_path, default={}, tuned=tuned, tuned_no_sync={**tuned, "no_sync.enabled": True})
    runs = run_dist_probe(tmp_path / "patched" / "ddp_accum.py", configs, steps=MICRO_STEPS, out=tmp_path / "runs")
    for rank in (0, 1):
        default, tuned_run, with_no_sync = runs[rank]
        assert default["ended"] == tuned_run["ended"] == with_no_sync["ended"] == "steps"
        assert tuned_run["losses"] == default["losses"]
        assert tuned_run["grads"] == default["grads"]
        assert with_no_sync["losses"] == default["losses"]
    final = MICRO_STEPS - 1
    assert runs[0][2]["grads"][final] == runs[1][2]["grads"][final]  # the step's gradients were all-reduced


@pytest.mark.slow
def test_gloo_static_graph_without_accumulation(tmp_path):
    script = case(T, "every_step")
    write_outputs(run(load_project(script), select([T])), tmp_path / "patched", script.name)
    tuned = {"ddp.bucket_cap_mb": 10, "ddp.gradient_as_bucket_view": True, "ddp.static_graph": True}
    configs = _configs(tmp_path, default={}, tuned=tuned)
    runs = run_dist_probe(tmp_path / "patched" / script.name, configs, steps=6, out=tmp_path / "runs")
    for rank in (0, 1):
        default, tuned_run = runs[rank]
        assert default["ended"] == tuned_run["ended"] == "steps"
        assert tuned_run["losses"] == default["losses"]
        assert tuned_run["grads"] == default["grads"]
    assert runs[0][1]["grads"] == runs[1][1]["grads"]  # all-reduced on both ranks alike
