"""checkpointing: checkpointed blocks give the same losses and gradients, bit for bit, and really are checkpointed."""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path

import pytest
import torch
import torch.utils.checkpoint

import autotune.runtime as runtime
from autotune.project import load_project
from autotune.patch import run, select
from autotune.transform import Mode, Status

CASES = Path(__file__).resolve().parent.parent / "fixtures" / "transforms" / "checkpointing"
_count = itertools.count()


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"ckpt_case_{next(_count)}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def knob(tmp_path, monkeypatch):
    def set_value(value: str) -> None:
        config = tmp_path / f"{value}.yaml"
        config.write_text(f"knobs:\n  checkpointing.blocks: {value}\n")
        monkeypatch.setenv(runtime.CONFIG_ENV, str(config))
        runtime.reset()

    yield set_value
    runtime.reset()


@pytest.fixture
def calls(monkeypatch):
    """Counts the calls of torch.utils.checkpoint.checkpoint (the runtime and baked code both look it up there)."""
    seen = []
    real = torch.utils.checkpoint.checkpoint

    def counting(fn, *args, **kwargs):
        seen.append(kwargs.get("use_reentrant"))
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", counting)
    return seen


def _gpt_loss(model, g):
    idx = torch.randint(0, 65, (3, 16), generator=g)
    return model(idx, torch.roll(idx, -1, dims=1))[1]


def _nanogpt_loss(model, g):
    idx = torch.randint(0, 65, (3, 16), generator=g)
    return model(idx, torch.roll(idx, -1, dims=1))


def _image_loss(model, g):
    x = torch.randn(2, 3, 8, 8, generator=g)
    return torch.nn.functional.cross_entropy(model(x), torch.tensor([1, 7]))


def _llama_loss(model, g):
    return model(torch.randint(0, 64, (2, 6), generator=g))


def _tokens_loss(model, g):
    return model(torch.randn(2, 5, 32, generator=g)).logsumexp(dim=-1).mean()


# case: (class, constructor kwargs, loss, checkpointed blocks per forward for "all", for "every_2nd")
CASE_SPECS = {
    "gpt_blocks": ("GPT", dict(block_size=16, n_layer=4, n_embd=32, n_head=4, dropout=0.1), _gpt_loss, 4, 2),
    "nanogpt_moduledict": ("GPT", dict(block_size=16, n_layer=5, n_embd=32, dropout=0.2), _nanogpt_loss, 5, 3),
    "sequential_stack": ("ResNet", dict(channels=16, depth=4), _image_loss, 4, 2),
    # stages of depths 2, 2, 4: only the 8 inner blocks are checkpointed, never the stages around them
    "nested_blocks": ("Net", dict(dim=32, depths=(2, 2, 4)), _tokens_loss, 8, 4),
    # an empty ModuleList filled by append(), each block called with a second argument
    "llama_append": ("Transformer", dict(n_layers=4), _llama_loss, 4, 2),
}


def _train(cls, kwargs, loss_fn, steps=2):
    """Losses and final gradients of two SGD steps from a fixed seed, dropout on."""
    torch.manual_seed(0)
    model = cls(**kwargs)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(model, g)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses, [p.grad.clone() for p in model.parameters()], model


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("case", sorted(CASE_SPECS))
@pytest.mark.parametrize("value", ["all", "every_2nd"])
def test_checkpointed_training_is_bitwise_identical(case, value, knob, calls):
    cls_name, kwargs, loss_fn, n_all, n_half = CASE_SPECS[case]
    want_losses, want_grads, _ = _train(getattr(_load(CASES / f"{case}.in.py"), cls_name), kwargs, loss_fn)
    gated = getattr(_load(CASES / f"{case}.out.py"), cls_name)

    knob("none")
    losses, grads, _ = _train(gated, kwargs, loss_fn)
    assert calls == []
    assert _same(losses, want_losses) and _same(grads, want_grads)

    knob(value)
    losses, grads, model = _train(gated, kwargs, loss_fn)
    per_step = n_all if value == "all" else n_half
    assert len(calls) == 2 * per_step and set(calls) == {False}, "each chosen block runs under checkpoint, non-reentrant"
    assert _same(losses, want_losses), "losses differ"
    assert _same(grads, want_grads), "gradients differ"

    # outside training (eval, or no grad) nothing is checkpointed
    calls.clear()
    model.eval()
    with torch.no_grad():
        loss_fn(model, torch.Generator().manual_seed(2))
    model.train()
    with torch.no_grad():
        loss_fn(model, torch.Generator().manual_seed(2))
    assert calls == []


@pytest.mark.parametrize("case", sorted(CASE_SPECS))
def test_baked_checkpointing_is_bitwise_identical(case, calls):
    cls_name, kwargs, loss_fn, n_all, n_half = CASE_SPECS[case]
    spec = (CASES / f"{case}.bake.yaml").read_text()
    value = "every_2nd" if "every_2nd" in spec else "all"
    want_losses, want_grads, _ = _train(getattr(_load(CASES / f"{case}.in.py"), cls_name), kwargs, loss_fn)
    losses, grads, _ = _train(getattr(_load(CASES / f"{case}.bake.py"), cls_name), kwargs, loss_fn)
    assert len(calls) == 2 * (n_all if value == "all" else n_half)
    assert _same(losses, want_losses) and _same(grads, want_grads)


@pytest.mark.parametrize("value", ["all", "every_2nd"])
def test_bake_of_every_choice_compiles_and_matches(value, tmp_path, calls):
    """Both choices baked into the GPT fixture (the yaml of the fixture covers only one)."""
    result = run(load_project(CASES / "gpt_blocks.in.py"), select(["checkpointing"]), Mode(values={"checkpointing.blocks": value}), hooks=False)
    baked = tmp_path / "baked.py"
    baked.write_text(result.files[0].new_text)
    cls_name, kwargs, loss_fn, n_all, n_half = CASE_SPECS["gpt_blocks"]
    want_losses, want_grads, _ = _train(getattr(_load(CASES / "gpt_blocks.in.py"), cls_name), kwargs, loss_fn)
    losses, grads, _ = _train(getattr(_load(baked), cls_name), kwargs, loss_fn)
    assert len(calls) == 2 * (n_all if value == "all" else n_half)
    assert _same(losses, want_losses) and _same(grads, want_grads)


def _sites(case: str) -> list:
    return list(run(load_project(CASES / f"{case}.in.py"), select(["checkpointing"]), hooks=False).sites)


def test_what_is_not_checkpointed_says_why():
    reasons = [(s.line, s.status, s.reason) for s in _sites("not_blocks")]
    assert [r[:2] for r in reasons] == [(26, Status.NOT_APPLICABLE), (40, Status.NOT_APPLICABLE), (54, Status.NOT_APPLICABLE)]
    assert "Linear layers, not blocks" in reasons[0][2]
    assert "also uses `block` itself" in reasons[1][2]
    assert "differ" in reasons[2][2]
    (bn,) = _sites("batchnorm_blocks")
    assert bn.status is Status.NOT_APPLICABLE and "BatchNorm2d" in bn.reason
    nested = _sites("nested_blocks")
    assert [s.status for s in nested] == [Status.APPLICABLE, Status.NOT_APPLICABLE]
    assert "Stage runs repeated blocks of its own" in nested[1].reason


def test_batchnorm_really_is_updated_twice_under_checkpoint():
    """Why BatchNorm blocks are refused: the recomputation in backward updates the running statistics again."""
    bn = torch.nn.BatchNorm1d(3)
    x = torch.randn(4, 3, requires_grad=True)
    torch.utils.checkpoint.checkpoint(bn, x, use_reentrant=False).sum().backward()
    assert int(bn.num_batches_tracked) == 2


PROJECT = Path(__file__).resolve().parent.parent / "fixtures" / "projects" / "minigpt"


@pytest.mark.slow
def test_package_project_trains_bitwise_the_same_with_checkpointing(tmp_path):
    """The minGPT-style project (blocks looped in mingpt/model.py, the loop in mingpt/trainer.py): with every block
    checkpointed, dropout on, the losses are the original's bit for bit."""
    from loss_probe import run_probe

    from autotune.patch import write_outputs

    result = run(load_project(PROJECT / "train.py"), select(["checkpointing"]))
    assert "mingpt/model.py" in [f.rel.as_posix() for f in result.files if f.changed]
    out = tmp_path / "patched"
    write_outputs(result, out, "train.py")
    config = tmp_path / "all.yaml"
    config.write_text("knobs:\n  checkpointing.blocks: all\n")
    args = ["--steps", "4", "--dropout", "0.1", "--n-layer", "3"]
    env = {"OMP_NUM_THREADS": "1"}
    want = run_probe(PROJECT / "train.py", args, steps=4, env=env, timeout=300)
    assert run_probe(out / "train.py", args, steps=4, env={**env, runtime.CONFIG_ENV: str(config)}, timeout=300) == want


# --- the model library's own switch (transformers, timm) -----------------------------------------------------

# A stand-in for timm, written beside the script: its model checkpoints its blocks once switched, and says so.
FAKE_TIMM = '''
import pathlib

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        return x + self.drop(torch.tanh(self.fc(x)))


class _Net(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.head = nn.Linear(16, num_classes)
        self.grad_checkpointing = False

    def set_grad_checkpointing(self, enable=True):
        self.grad_checkpointing = enable
        pathlib.Path("switched").write_text("yes")

    def forward(self, x):
        x = x.flatten(1)[:, :16]
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.grad_checkpointing and self.training else block(x)
        return self.head(x)


def create_model(name, num_classes):
    return _Net(num_classes)
'''


def _patch(name: str):
    return run(load_project(CASES / f"{name}.in.py"), select(["checkpointing"]), hooks=False)


def test_library_models_offer_their_own_switch():
    hf, timm, user = (_patch(n) for n in ("framework_hf", "framework_timm", "framework_user_switch"))
    assert [(s.status, s.reason) for s in hf.sites] == [(
        Status.APPLICABLE,
        'model = AutoModelForCausalLM.from_pretrained(... is a transformers model: its own switch, '
        'model.gradient_checkpointing_enable(), becomes a knob',
    )]  # the tokenizer is no model
    assert [s.status for s in timm.sites] == [Status.APPLICABLE]
    assert [(s.status, s.reason) for s in user.sites] == [
        (Status.USER, "the script calls model.set_grad_checkpointing() itself")
    ]
    assert [k.name for k in hf.knobs] == [k.name for k in timm.knobs] == ["checkpointing.framework"]
    assert not user.knobs
    assert [k.name for k in _patch("gpt_blocks").knobs] == ["checkpointing.blocks"]


def test_switch_helper_calls_the_library_only_when_the_knob_is_on(tmp_path, monkeypatch):
    called = []

    class NewHF:
        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            called.append(("new", gradient_checkpointing_kwargs))

    class OldHF:
        def gradient_checkpointing_enable(self):
            called.append(("old", None))

    class Timm:
        def set_grad_checkpointing(self, enable=True):
            called.append(("timm", enable))

    class UNet:  # diffusers' ModelMixin: no arguments, non-reentrant checkpointing of its own
        _supports_gradient_checkpointing = True

        def enable_gradient_checkpointing(self):
            called.append(("diffusers", None))

    class OldUNet(UNet):  # UNet2DModel before diffusers 0.32: enable_gradient_checkpointing() raises
        _supports_gradient_checkpointing = False

        def enable_gradient_checkpointing(self):
            raise ValueError("OldUNet does not support gradient checkpointing.")

    runtime.reset()
    for model, method in ((NewHF(), "gradient_checkpointing_enable"), (Timm(), "set_grad_checkpointing")):
        runtime.checkpoint_switch(model, method)
    assert called == []  # default: the script as written
    config = tmp_path / "on.yaml"
    config.write_text("knobs:\n  checkpointing.framework: true\n")
    monkeypatch.setenv(runtime.CONFIG_ENV, str(config))
    runtime.reset()
    try:
        runtime.checkpoint_switch(OldUNet(), "enable_gradient_checkpointing")
        assert runtime.applied() == []  # a class without the switch: nothing changed, not credited to the knob
        runtime.checkpoint_switch(NewHF(), "gradient_checkpointing_enable")
        runtime.checkpoint_switch(OldHF(), "gradient_checkpointing_enable")
        runtime.checkpoint_switch(Timm(), "set_grad_checkpointing")
        runtime.checkpoint_switch(UNet(), "enable_gradient_checkpointing")
        assert runtime.applied() == ["checkpointing.framework"]
    finally:
        runtime.reset()
    assert called == [("new", {"use_reentrant": False}), ("old", None), ("timm", True), ("diffusers", None)]


@pytest.mark.slow
def test_timm_switch_keeps_losses_and_reaches_the_model(tmp_path):
    from transform_cases import baked, losses, original, patched

    (tmp_path / "timm.py").write_text(FAKE_TIMM)
    base = original(tmp_path, "checkpointing", "framework_timm")
    assert not (tmp_path / "switched").exists()
    gated = patched("checkpointing", "framework_timm")
    assert losses(tmp_path, "default", gated) == base
    assert not (tmp_path / "switched").exists()
    knobs = {"checkpointing.framework": True}
    assert losses(tmp_path, "on", gated, knobs) == base
    assert (tmp_path / "switched").exists()
    (tmp_path / "switched").unlink()
    assert losses(tmp_path, "baked", baked("checkpointing", "framework_timm", knobs)) == base
    assert (tmp_path / "switched").exists()


@pytest.mark.parametrize("built, applies", [
    ("GPT2LMHeadModel(config)", True),
    ("BertForSequenceClassification(config)", True),
    ("LlamaModel(config)", True),
    ("GPT2Config(n_layer=2)", False),  # a config, not a model
    ("PreTrainedTokenizerFast(tokenizer_file='t.json')", False),
    ("AutoModelForCausalLM.from_config(config)", True),
])
def test_a_transformers_model_built_from_its_config_has_the_librarys_switch(tmp_path, built, applies):
    name = built.split("(")[0].split(".")[0]
    script = tmp_path / "train.py"
    script.write_text(
        f"import torch\nfrom transformers import {name}\n"
        f"model = {built}\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for batch in range(3):\n"
        "    loss = model(batch).loss\n"
        "    loss.backward()\n"
        "    opt.step()\n"
    )
    found = [s for s in run(load_project(script), select(["checkpointing"]), hooks=False).sites
             if "own switch" in s.reason]
    assert bool(found) is applies, [s.reason for s in run(load_project(script), select(["checkpointing"])).sites]


def _gpt2_site(tmp_path, function: str, call: str):
    """The checkpointing site of the GPT2LMHeadModel that ``function`` (a def, with its decorators) builds as ``hf``,
    in a script whose own small model trains and that calls ``call`` once."""
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\nfrom transformers import GPT2LMHeadModel\n"
        "model = torch.nn.Linear(4, 4)\n" + function + call + "\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for batch in range(3):\n"
        "    loss = model(torch.ones(2, 4)).sum()\n"
        "    loss.backward()\n"
        "    opt.step()\n"
    )
    (site,) = [s for s in run(load_project(script), select(["checkpointing"]), hooks=False).sites
               if "GPT2LMHeadModel" in s.reason]
    return site


@pytest.mark.parametrize("uses, applies", [
    ("sd_hf = hf.state_dict()\nprint(hf.config.n_layer)\n", False),  # nanoGPT's from_pretrained: its weights copied
    ("sd_hf = hf.state_dict()\nout = hf(torch.zeros(1, 4, dtype=torch.long))\n", True),  # also run
    ("model.load_state_dict(hf.state_dict())\nhf.train()\n", True),  # put in training mode: it may train
    # diffusers' load_model_hook: the weights copied, then the copy deleted
    ("model.load_state_dict(hf.state_dict())\ndel hf\n", False),
])
def test_a_library_model_only_read_for_its_weights_gets_no_switch(tmp_path, uses, applies):
    site = _gpt2_site(tmp_path, "def load():\n    hf = GPT2LMHeadModel.from_pretrained('gpt2')\n"
                      + "".join(f"    {line}\n" for line in uses.splitlines()), "load()")
    if applies:
        assert site.status is Status.APPLICABLE and "own switch" in site.reason
    else:
        assert site.status is Status.NOT_APPLICABLE
        assert site.reason.endswith("is only read (hf.state_dict): the script never runs it, so nothing of it trains")


@pytest.mark.parametrize("decorator, applies", [
    ("@torch.no_grad()", False),  # build-nanogpt's HellaSwag evaluate(): a model of its own, never trained
    ("@torch.inference_mode()", False),
    ("@torch.enable_grad()", True),
    ("", True),
])
def test_a_library_model_an_evaluator_builds_under_no_grad_gets_no_switch(tmp_path, decorator, applies):
    site = _gpt2_site(tmp_path, f"{decorator}\ndef evaluate(model_type):\n    hf = GPT2LMHeadModel.from_pretrained("
                      "model_type)\n    return hf(torch.zeros(1, 4, dtype=torch.long)).logits.mean()\n",
                      "print(evaluate('gpt2'))")
    if applies:
        assert site.status is Status.APPLICABLE and "own switch" in site.reason
    else:
        assert site.status is Status.NOT_APPLICABLE
        assert site.reason == (f"hf = GPT2LMHeadModel.from_pretrained(model... is built and run in evaluate(), which "
                               f"runs under {decorator}: nothing of it trains")


def test_a_diffusers_unet_built_in_either_branch_gets_its_switch_once_after_the_if_else():
    # diffusers' train_unconditional.py: UNet2DModel(...) from the arguments, else UNet2DModel.from_config(config)
    (site,) = [s for s in run(load_project(CASES / "diffusers_unet.in.py"), select(["checkpointing"]),
                              hooks=False).sites]
    assert (site.status, site.line) == (Status.APPLICABLE, 21)
    assert site.reason.endswith("(or the else branch's, switched after the if/else) is a diffusers model: its own "
                                "switch, model.enable_gradient_checkpointing(), becomes a knob")
    from transform_cases import patched

    text = patched("checkpointing", "diffusers_unet")
    assert text.count("checkpoint_switch(") == 1
    assert '    model = UNet2DModel.from_config(config)\n_autotune.checkpoint_switch(model, "enable_gradient_' \
           'checkpointing")\n' in text


@pytest.mark.parametrize("branches, applies", [
    ("if a:\n    model = UNet2DModel()\nelse:\n    model = UNet2DModel.from_pretrained(p)\n", True),
    # three ways to bind it: not the if/else shape, which model trains is not read
    ("if a:\n    model = UNet2DModel()\nelif b:\n    model = UNet2DModel.from_pretrained(p)\nelse:\n"
     "    model = UNet2DModel.from_config(c)\n", False),
    ("model = UNet2DModel()\nif a:\n    model = UNet2DModel.from_pretrained(p)\n", False),
    # a pipeline, a scheduler and a config are no models
    ("model = UNet2DModel()\npipe = DDPMPipeline(unet=model, scheduler=s)\nc = UNet2DModel.load_config(p)\n", True),
    # the weights' moving average (diffusers.training_utils.EMAModel) is a helper, not a model with a switch
    ("model = UNet2DModel()\nfrom diffusers.training_utils import EMAModel\nema = EMAModel(model.parameters())\n", True),
])
def test_a_diffusers_model_bound_once_on_each_path_gets_the_switch(tmp_path, branches, applies):
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\nfrom diffusers import DDPMPipeline, UNet2DModel\na, b, p, c, s = 1, 0, 'unet', {}, None\n"
        + branches +
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for x in range(3):\n"
        "    loss = model(x, 0).sample.mean()\n"
        "    loss.backward()\n"
        "    opt.step()\n"
    )
    found = run(load_project(script), select(["checkpointing"]), hooks=False).sites
    if applies:
        assert [s.status for s in found] == [Status.APPLICABLE]  # one site, whichever branch binds it
    else:  # each binding says why
        assert len(found) == branches.count("UNet2DModel(") + branches.count("UNet2DModel.from_")
        assert {(s.status, s.reason) for s in found} == {
            (Status.NOT_APPLICABLE, "`model` is bound more than once: which model trains is unclear")}


def test_a_diffusers_unet_trains_bitwise_the_same_with_its_own_checkpointing(tmp_path):
    pytest.importorskip("diffusers")
    from transform_cases import baked, losses, original, patched

    base = original(tmp_path, "checkpointing", "diffusers_unet", steps=4)
    gated = patched("checkpointing", "diffusers_unet")
    knobs = {"checkpointing.framework": True}
    assert losses(tmp_path, "default", gated, steps=4) == base
    assert losses(tmp_path, "on", gated, knobs, steps=4) == base  # EXACT: recomputed, not changed
    assert losses(tmp_path, "baked", baked("checkpointing", "diffusers_unet", knobs), steps=4) == base
