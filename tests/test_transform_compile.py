"""compile: the model is compiled in place, so checkpoints move between the original and the compiled model."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import autotune.runtime as runtime
from autotune.project import load_project
from autotune.patch import run, select, write_outputs
from autotune.transform import Status
from loss_probe import probe

REPO = Path(__file__).resolve().parent.parent
CASES = REPO / "fixtures" / "transforms" / "compile"
PROJECT = REPO / "fixtures" / "projects" / "minigpt"
ENV = {"OMP_NUM_THREADS": "1"}
_count = itertools.count()


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"compile_case_{next(_count)}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def knobs(tmp_path, monkeypatch):
    def set_values(**values) -> None:
        config = tmp_path / f"config{next(_count)}.yaml"
        device = values.pop("device", None)
        lines = [f"device: {device}"] if device else []
        lines.append("knobs:")
        lines += [f"  compile.{k}: {v}" for k, v in values.items()]
        config.write_text("\n".join(lines) + "\n")
        monkeypatch.setenv(runtime.CONFIG_ENV, str(config))
        runtime.reset()

    yield set_values
    runtime.reset()


def _gpt(module):
    torch.manual_seed(0)
    return module.GPT(vocab_size=11, block_size=8, n_layer=3, n_embd=16, n_head=2)


def _compiled(module: torch.nn.Module) -> bool:
    return module._compiled_call_impl is not None


def test_default_compiles_nothing(knobs):
    gated = _load(CASES / "script_gpt.out.py")
    knobs()
    model = gated._autotune.compile_model(_gpt(gated), blocks=["blocks"])
    assert not any(_compiled(m) for m in model.modules())


@pytest.mark.parametrize("scope", ["model", "blocks"])
def test_in_place_compile_keeps_state_dict_keys(scope, knobs):
    """Compiling is lazy, so this checks the keys without paying for a compilation (the slow test below trains)."""
    original = _gpt(_load(CASES / "script_gpt.in.py"))
    saved = original.state_dict()
    gated = _load(CASES / "script_gpt.out.py")
    knobs(mode="default", scope=scope)
    model = _gpt(gated)
    assert gated._autotune.compile_model(model, blocks=["blocks"]) is model
    if scope == "model":
        assert _compiled(model) and not any(_compiled(b) for b in model.blocks)
    else:
        assert not _compiled(model) and all(_compiled(b) for b in model.blocks)
    assert list(model.state_dict()) == list(saved)
    model.load_state_dict(saved)  # strict: the original checkpoint loads into the compiled model
    original.load_state_dict(model.state_dict())  # and back
    # what the transform avoids: the wrapper torch.compile returns renames every key
    assert all(k.startswith("_orig_mod.") for k in torch.compile(_gpt(gated)).state_dict())


def test_blocks_scope_without_blocks_compiles_the_model(knobs):
    gated = _load(CASES / "script_gpt.out.py")
    knobs(mode="max-autotune-no-cudagraphs", scope="blocks", dynamic="false")
    model = gated._autotune.compile_model(_gpt(gated))
    assert _compiled(model)
    assert model._compiled_call_impl is not None
    # a second call (a script that builds its optimizer twice) does not compile again
    first = model._compiled_call_impl
    gated._autotune.compile_model(model)
    assert model._compiled_call_impl is first


class _Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


def test_compiled_for_the_training_steps_only():
    """What makemore's whole run needed (docs/benchmarks.md): evaluation under no_grad/inference_mode, and sampling
    with its growing shapes, run as written instead of compiling again; a step with gradients runs what compiled.
    Counted with a backend that records the graphs it is given (no inductor compile)."""
    import copy
    import io

    from autotune.runtime_helpers import compile_for_training

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.manual_seed(0)
    model = _Mlp()  # not a bare nn.Sequential: Module.compile() of one compiles nothing on torch 2.13
    keys = list(model.state_dict())
    expected = [model(torch.ones(n, 4)).detach() for n in (3, 5)]
    compile_for_training(model, backend=backend)
    model(torch.ones(3, 4)).sum().backward()
    assert len(graphs) == 1  # the training step compiled
    with torch.no_grad():
        assert torch.equal(model(torch.ones(5, 4)), expected[1])
    with torch.inference_mode():
        model(torch.ones(7, 4))
    model.eval()
    with torch.no_grad():
        model(torch.ones(3, 4))
    model.train()
    assert torch.equal(model(torch.ones(3, 4)).detach(), expected[0])
    assert len(graphs) == 1  # evaluation compiled nothing; the next training step ran the first graph
    assert list(model.state_dict()) == keys
    twin = copy.deepcopy(model)  # an EMA copy: its own weights, uncompiled (as a copy of Module.compile's)
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    assert torch.equal(twin(torch.ones(3, 4)), torch.zeros(3, 1))
    assert torch.equal(model(torch.ones(3, 4)).detach(), expected[0])
    saved = io.BytesIO()
    torch.save(model, saved)  # the whole module pickles, as an uncompiled one
    saved.seek(0)
    assert torch.equal(torch.load(saved, weights_only=False)(torch.ones(3, 4)).detach(), expected[0])
    assert len(graphs) == 1


@pytest.mark.parametrize(
    ("values", "marks"),
    [
        (dict(mode="reduce-overhead", device="cuda"), 1),
        (dict(mode="max-autotune", device="cuda"), 1),
        (dict(mode="max-autotune-no-cudagraphs", device="cuda"), 0),
        (dict(mode="default", device="cuda"), 0),
        (dict(mode="reduce-overhead", device="cpu"), 0),
        (dict(), 0),
    ],
)
def test_cudagraph_step_marker_only_with_cuda_graphs(values, marks, knobs, monkeypatch):
    seen = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: seen.append(1))
    knobs(**values)
    runtime.compile_step_begin()
    assert len(seen) == marks


def _sites(case: str) -> list:
    return list(run(load_project(CASES / f"{case}.in.py"), select(["compile"]), hooks=False).sites)


def test_torch_compile_in_the_script_is_present_with_the_orig_mod_hazard():
    (site,) = _sites("orig_mod_present")
    assert site.status is Status.PRESENT
    assert "_orig_mod." in site.reason and "model.compile()" in site.reason


def test_model_sites_across_files():
    result = run(load_project(PROJECT / "train.py"), select(["compile"]), hooks=False)
    (site,) = result.sites
    assert site.status is Status.APPLICABLE and site.path.endswith("train.py") and "(GPT)" in site.reason
    texts = {f.rel.as_posix(): f.new_text for f in result.files}
    # after the checkpoint is loaded, before the optimizer is built over the model
    assert (
        'map_location=device))\n    _autotune.compile_model(model, blocks=["blocks"])\n    optimizer = build_optimizer('
        in texts["train.py"]
    )
    assert "for step in range(steps):\n            _autotune.compile_step_begin()\n" in texts["mingpt/trainer.py"]
    assert texts["mingpt/model.py"] == (PROJECT / "mingpt" / "model.py").read_text()


@pytest.mark.slow
def test_checkpoints_round_trip_through_the_compiled_project(tmp_path):
    """The original project saves a checkpoint; the patched project, compiled (inductor on CPU), resumes from it,
    trains and saves; the original loads that back. Losses stay close; compile time is reported apart."""
    out = tmp_path / "patched"
    write_outputs(run(load_project(PROJECT / "train.py"), select(["compile"])), out, "train.py")
    config = tmp_path / "compile.yaml"
    config.write_text("knobs:\n  compile.mode: default\n  compile.scope: blocks\n")
    spec = tmp_path / "trial.json"
    result = tmp_path / "result.json"
    spec.write_text(json.dumps({"warmup": 1, "steps": 100, "result": str(result)}))
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    common = ["--dropout", "0", "--n-layer", "2", "--n-embd", "32"]

    probe(PROJECT / "train.py", [*common, "--steps", "1", "--save", str(a)], steps=1, env=ENV, timeout=300)
    eager = probe(PROJECT / "train.py", [*common, "--steps", "3", "--load", str(a)], steps=3, env=ENV, timeout=300)
    # run as `python train.py` (the trial writes its result when the script exits: 3 steps of the 1 + 100 asked)
    env = {**os.environ, **ENV, runtime.CONFIG_ENV: str(config), runtime.TRIAL_ENV: str(spec)}
    cmd = [sys.executable, str(out / "train.py"), *common, "--steps", "3", "--load", str(a), "--save", str(b)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    back = probe(PROJECT / "train.py", [*common, "--steps", "1", "--load", str(b)], steps=1, env=ENV, timeout=300)

    saved_a, saved_b = torch.load(a), torch.load(b)
    assert list(saved_b) == list(saved_a)
    assert len(back["losses"]) == 1
    trial = json.loads(result.read_text())
    assert trial["status"] == "short" and trial["steps_done"] == 3
    want = [float.fromhex(v) for v in eager["losses"]]
    got = [row[0] for row in trial["losses"]]
    assert got == pytest.approx(want, rel=1e-4)
    assert trial["compile_s"] > 0
    assert trial["warmup_s"] >= trial["compile_s"] - (trial["window_compile_s"] or 0)


def test_the_scripts_own_compile_switch_is_the_knob_where_it_is_off():
    (site,) = _sites("switch")
    assert site.status is Status.APPLICABLE and "the script's own switch" in site.reason
    assert "_autotune.compile_model(model, switch=args.compile)" in (CASES / "switch.out.py").read_text()
    assert "if not args.compile:\n    compile_for_training(model)" in (CASES / "switch.bake.py").read_text()


def test_a_switch_in_a_config_dict_is_the_knob_too(tmp_path):
    from autotune.patch import run, select
    from autotune.project import load_project

    script = tmp_path / "train.py"
    script.write_text(
        "import torch\nfrom torch import nn\nconfig = {'compile': False}\nmodel = nn.Linear(4, 1)\n"
        "if config['compile']:\n    model = torch.compile(model)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for x in torch.randn(8, 2, 4):\n    loss = model(x).sum()\n    loss.backward()\n    opt.step()\n")
    result = run(load_project(script), select(["compile"]), hooks=False)
    (site,) = result.sites
    assert site.status is Status.APPLICABLE and site.reason.startswith(
        "if config['compile']: torch.compile(model): the script's own switch (present, switched off where "
        "config['compile'] is false)")
    assert "_autotune.compile_model(model, switch=config['compile'])" in result.files[0].new_text


@pytest.mark.parametrize("switch, compiled", [(False, True), (True, False)])
def test_compile_model_leaves_a_model_the_scripts_switch_compiled(switch, compiled, knobs):
    knobs(mode="default")
    model = torch.nn.Linear(4, 2)
    runtime.compile_model(model, switch=switch)
    assert _compiled(model) is compiled  # Module.compile is lazy: nothing is compiled until the first call


def test_a_model_a_factory_returns_with_its_optimizer_compiles_before_the_trainer_wraps_it(tmp_path):
    """pytorch/examples' minGPT-ddp: ``model, optimizer = get_train_objs(...)`` (the optimizer built from parameter
    groups by a helper), then a trainer class that wraps ``self.model`` in DDP. The model is compiled right after the
    factory returns it, whole-model or block by block; at default knobs the losses are the original's, bit for bit,
    and compiled the evaluation (gradients off, another shape) runs as written."""
    from transform_cases import assert_same_losses, losses, original, patched, sites

    (site,) = sites("compile", "factory_ddp_trainer")
    assert site.status is Status.APPLICABLE and site.reason.startswith("model (TinyGPT): Module.compile in place")
    assert "repeated blocks: blocks" in site.reason
    text = patched("compile", "factory_ddp_trainer")
    assert "    model, optimizer = get_train_objs(32, 1e-3)\n    _autotune.compile_model(model, blocks=[\"blocks\"])\n" in text
    want = original(tmp_path, "compile", "factory_ddp_trainer")
    assert_same_losses(losses(tmp_path, "default", text), want, "cpu")
    compiled = losses(tmp_path, "compiled", text, knobs={"compile.mode": "default", "compile.scope": "blocks"})
    assert [float.fromhex(v) for v in compiled] == pytest.approx([float.fromhex(v) for v in want], rel=1e-4)
