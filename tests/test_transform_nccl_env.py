"""nccl_env: NCCL_ALGO, NCCL_MIN_NCHANNELS and NCCL_BUFFSIZE set before the process group starts, never over a
value the environment or the script already has; only where a process group can use NCCL."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml
from dist_probe import run_dist_probe
from transform_cases import baked, patched, sites, statuses

import autotune.runtime as runtime
from autotune.project import load_project
from autotune.knobs import Numerics
from autotune.patch import run, select, write_outputs
from autotune.transforms.nccl_env import NcclEnv

T = "nccl_env"
REPO = Path(__file__).resolve().parent.parent
DDP_SCRIPT = REPO / "fixtures" / "scripts" / "ddp_accum.py"
VARS = ("NCCL_ALGO", "NCCL_MIN_NCHANNELS", "NCCL_BUFFSIZE")


@pytest.mark.parametrize(
    "name, expected",
    [
        ("runtime_backend", ["applicable"]),
        ("nccl_literal", ["applicable"]),
        ("device_mesh", ["applicable"]),
        ("user_sets_algo", ["kept as written", "applicable"]),
        ("all_set", ["kept as written"] * 3),
        ("gloo_only", ["not applicable"]),
        ("no_process_group", ["not applicable"]),
    ],
)
def test_sites(name, expected):
    assert [str(s) for s in statuses(T, name)] == expected


def test_reasons():
    (site,) = sites(T, "runtime_backend")
    assert site.reason == (
        "NCCL_ALGO, NCCL_MIN_NCHANNELS, NCCL_BUFFSIZE before dist.init_process_group() (line 9, backend gloo or nccl)"
    )
    user, free = sites(T, "user_sets_algo")
    assert user.reason == "the script sets NCCL_ALGO itself"
    assert free.reason.startswith("NCCL_MIN_NCHANNELS, NCCL_BUFFSIZE before")
    (variable,) = sites(T, "gloo_variable")  # BACKEND = "gloo", or dist.Backend.GLOO: never NCCL
    assert str(variable.status) == "not applicable"
    (gloo,) = sites(T, "gloo_only")
    assert gloo.reason == "no process group is started with the NCCL backend"


def test_gated_call_comes_before_the_first_import():
    lines = patched(T, "nccl_literal").splitlines()
    call = lines.index("_autotune.nccl_env()")
    assert lines[call - 1] == "import autotune.runtime as _autotune"
    assert call < lines.index("import os") < lines.index("import torch")
    assert "from __future__ import annotations" in lines[:call]
    user = patched(T, "user_sets_algo")
    assert '_autotune.nccl_env(script_sets=("NCCL_ALGO",))' in user
    result = run(load_project(Path(__file__).parent.parent / "fixtures/transforms/nccl_env/user_sets_algo.in.py"),
                 select([T]), hooks=False)  # fmt: skip
    assert [k.name for k in result.knobs] == ["nccl_env.buffsize_mb", "nccl_env.min_nchannels"]


def test_bake_sets_defaults_before_torch():
    text = baked(T, "nccl_literal", {"nccl_env.algo": "ring", "nccl_env.buffsize_mb": 8}, device="cuda")
    lines = text.splitlines()
    assert lines.index('os.environ.setdefault("NCCL_ALGO", "Ring")') > lines.index("import sys")
    assert lines.index('os.environ.setdefault("NCCL_BUFFSIZE", "8388608")') < lines.index("import torch")
    prelude = baked(T, "runtime_backend", {"nccl_env.algo": "tree"}, device="cuda").splitlines()
    assert prelude[2:4] == ["import os", ""]
    assert 'os.environ.setdefault("NCCL_ALGO", "ring,tree;allreduce:tree")' in prelude


def test_knobs():
    assert all(k.devices == {"cuda"} and k.default == "default" for k in NcclEnv.knobs)
    # the algorithm, channel count and buffer size decide how a buffer is split, hence the order of its sums
    assert all(k.numerics is Numerics.REORDER for k in NcclEnv.knobs)
    assert NcclEnv.entry_only and NcclEnv.devices == {"cuda"}


@pytest.mark.parametrize(
    "name, choice", [(k.name, c) for k in NcclEnv.knobs for c in k.choices if c != "default"], ids=str
)
def test_the_patched_script_sets_what_the_baked_one_writes(name, choice, monkeypatch, tmp_path):
    text = baked(T, "nccl_literal", {name: choice}, device="cuda")
    written = dict(re.findall(r'os\.environ\.setdefault\("(NCCL_\w+)", "([^"]*)"\)', text))
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"knobs": {name: choice}}))
    monkeypatch.setenv("AUTOTUNE_CONFIG", str(path))
    for var in VARS:
        monkeypatch.delenv(var, raising=False)
    runtime.reset()
    runtime.nccl_env()
    assert len(written) == 1
    assert {var: os.environ[var] for var in VARS if var in os.environ} == written
    runtime.reset()


def test_runtime_never_overrides(monkeypatch, tmp_path):
    path = tmp_path / "config.yaml"
    knobs = {"nccl_env.algo": "tree", "nccl_env.min_nchannels": 8, "nccl_env.buffsize_mb": 2}
    path.write_text(yaml.safe_dump({"knobs": knobs}))
    monkeypatch.setenv("AUTOTUNE_CONFIG", str(path))
    for var in VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NCCL_MIN_NCHANNELS", "2")  # the launcher's environment wins
    runtime.reset()
    runtime.nccl_env(script_sets=("NCCL_BUFFSIZE",))  # so does the script
    assert os.environ["NCCL_ALGO"] == "ring,tree;allreduce:tree"
    assert os.environ["NCCL_MIN_NCHANNELS"] == "2"
    assert "NCCL_BUFFSIZE" not in os.environ
    runtime.reset()


def _configs(tmp: Path, device: str, **named: dict) -> list[Path]:
    out = []
    for label, knobs in named.items():
        path = tmp / f"{label}.yaml"
        path.write_text(yaml.safe_dump({"device": device, "knobs": knobs}))
        out.append(path)
    return out


@pytest.mark.slow
def test_knobs_set_the_variables_on_every_rank(tmp_path):
    """gloo ignores NCCL's variables: on CPU this shows the mechanism (set on every rank, training unchanged)."""
    write_outputs(run(load_project(DDP_SCRIPT), select([T])), tmp_path / "patched", "ddp_accum.py")
    knobs = {"nccl_env.algo": "ring", "nccl_env.min_nchannels": 4, "nccl_env.buffsize_mb": 8}
    configs = _configs(tmp_path, "cpu", default={}, tuned=knobs)
    runs = run_dist_probe(
        tmp_path / "patched" / "ddp_accum.py", configs, steps=4, out=tmp_path / "runs", env={v: None for v in VARS}
    )
    for rank in (0, 1):
        default, tuned = runs[rank]
        assert default["env"] == dict.fromkeys(VARS)
        assert tuned["env"] == {"NCCL_ALGO": "Ring", "NCCL_MIN_NCHANNELS": "4", "NCCL_BUFFSIZE": str(8 << 20)}
        assert tuned["losses"] == default["losses"]


@pytest.mark.cuda
def test_nccl_trains_under_the_variables(tmp_path):
    """One GPU, NCCL: the process group starts and trains with each algorithm choice, losses unchanged."""
    write_outputs(run(load_project(DDP_SCRIPT), select([T])), tmp_path / "patched", "ddp_accum.py")
    configs = _configs(
        tmp_path,
        "cuda",
        default={},
        ring={"nccl_env.algo": "ring", "nccl_env.min_nchannels": 4},
        tree={"nccl_env.algo": "tree", "nccl_env.buffsize_mb": 8},
    )
    env = {v: None for v in VARS}
    runs = run_dist_probe(tmp_path / "patched" / "ddp_accum.py", configs, steps=4, out=tmp_path / "runs", nproc=1, env=env)
    default, ring, tree = runs[0]
    assert ring["env"]["NCCL_ALGO"] == "Ring" and tree["env"]["NCCL_ALGO"] == "ring,tree;allreduce:tree"
    assert default["ended"] == ring["ended"] == tree["ended"] == "steps"
    assert ring["losses"] == tree["losses"] == default["losses"]  # one rank: nothing is summed across ranks
