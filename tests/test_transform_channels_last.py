"""channels_last: convolutional models and their 4-D batches switch to NHWC behind a knob."""

from __future__ import annotations

import pytest
import torch
import yaml
from transform_cases import assert_same_losses, baked, losses, original, patched, sites, statuses

from autotune import runtime
from autotune.transform import Status

T = "channels_last"
A, P, N, U = Status.APPLICABLE, Status.PRESENT, Status.NOT_APPLICABLE, Status.USER


@pytest.mark.parametrize(
    "name, expected",
    [
        ("cnn_to_device", [A, A]),  # the model, then its input
        ("sequential_loop_input", [A, A]),
        ("train_step_param", [A, A]),
        ("torchvision_model", [A, A]),
        ("already_channels_last", [P, P]),
        ("no_conv", [N]),
        ("inference_only", [N]),
        ("arch_branches", [A, A]),  # one model whichever branch builds it, then its input
        ("weights_init", [A, A, A, N, N, N]),  # netD, netG, netD's real batch; generated inputs are not batches
        ("dropout_mnist", [N]),
        ("memory_format_flag", [U, U]),
        ("trainer_attribute", [A, A]),
        ("lightning_module", [A]),  # a LightningModule that Lightning's Trainer fits: its batches are Lightning's
        ("diffusers_unet", [A, N]),  # a diffusers UNet2DModel; its input is no batch copied to a device (CPU)
        ("imagenet_arch", [A, A]),  # models.__dict__[args.arch](...) in both branches, DataParallel on the GPU  # self.model of a trainer class, after its init_weights  # a flag in a variable, applied to the model and in the collate function
    ],
)
def test_sites(name, expected):
    assert statuses(T, name) == expected


def test_reasons():
    assert [s.reason for s in sites(T, "train_step_param")] == [
        "create_model() has 2-D convolutions",  # a factory returning a local module with conv layers in blocks
        "input images of model (converted when 4-D)",
    ]
    assert [s.reason for s in sites(T, "no_conv")] == ["MLP has no 2-D convolutions"]
    assert [s.reason for s in sites(T, "inference_only")] == ["model is not trained in a training loop"]
    assert sites(T, "arch_branches")[0].reason == "SmallResNet or TinyVGG has 2-D convolutions"
    model, batches = sites(T, "memory_format_flag")
    assert model.reason == "model: memory_format=memory_format is the script's choice"
    assert batches.reason.startswith("input images: the script sets the batches' memory format (")
    assert batches.reason.endswith("memory_format_flag.in.py:21)")
    (dropout,) = sites(T, "dropout_mnist")
    assert dropout.reason.startswith("Net has dropout: in train mode dropout draws its mask in memory order")


def test_model_chosen_in_branches_is_converted_once_after_all_of_them():
    text = patched(T, "arch_branches")
    assert text.count("model = _autotune.channels_last(model)") == 1
    assert "    model = model.to(device)\n    model = _autotune.channels_last(model)\n" in text


def test_conversion_follows_the_scripts_own_weight_initialisation():
    text = patched(T, "weights_init")
    assert "    netG.apply(weights_init)\n    netG = _autotune.channels_last(netG)\n" in text
    assert "    netD.apply(weights_init)\n    netD = _autotune.channels_last(netD)\n" in text


def test_a_trainer_class_converts_its_own_model_after_initialising_it():
    text = patched(T, "trainer_attribute")
    assert (
        "        self.model.apply(init_weights)\n        self.model = _autotune.channels_last(self.model)\n"
        "        self.optimizer = " in text
    )


def test_dropout_after_the_flatten_does_not_count():
    from autotune.project import load_project
    from autotune.patch import run, select
    from pathlib import Path

    cnn = Path(__file__).resolve().parent.parent / "fixtures" / "scripts" / "cnn.py"  # Dropout in its linear head
    model = next(s for s in run(load_project(cnn), select([T]), hooks=False).sites if "convolutions" in s.reason)
    assert model.status is A


def test_conversion_follows_the_device_move_and_the_batch_copy():
    text = patched(T, "train_step_param")
    assert "    model.to(device)\n    model = _autotune.channels_last(model)\n" in text
    assert '"""One optimisation step on one batch."""\n    images = _autotune.channels_last(images)\n' in text
    text = patched(T, "cnn_to_device")
    assert (
        "images, labels = images.to(device), labels.to(device)\n"
        "            images = _autotune.channels_last(images)\n" in text
    )


@pytest.fixture
def knob(tmp_path, monkeypatch):
    def set_value(value):
        path = tmp_path / "knobs.yaml"
        path.write_text(yaml.safe_dump({"knobs": {"channels_last.enabled": value}}))
        monkeypatch.setenv(runtime.CONFIG_ENV, str(path))
        runtime.reset()

    yield set_value
    runtime.reset()


def test_runtime_converts_modules_and_4d_tensors_only(knob):
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Linear(4, 2))
    x4, x3 = torch.randn(2, 3, 8, 8), torch.randn(3, 8, 8)
    knob(False)
    assert runtime.channels_last(model) is model
    assert runtime.channels_last(x4) is x4
    knob(True)
    assert runtime.channels_last(model)[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert not model[0].weight.is_contiguous()
    y = runtime.channels_last(x4)
    assert y.is_contiguous(memory_format=torch.channels_last) and torch.equal(y, x4)
    assert runtime.channels_last(x3) is x3
    assert runtime.channels_last("not a tensor") == "not a tensor"


CPU_CASES = ["cnn_to_device", "sequential_loop_input", "train_step_param", "arch_branches", "weights_init", "trainer_attribute",
             "lightning_module", "diffusers_unet"]  # imagenet_arch needs torchvision


@pytest.mark.slow
@pytest.mark.parametrize("name", CPU_CASES)
def test_losses(tmp_path, name):
    base = original(tmp_path, T, name)
    gated = patched(T, name)
    assert losses(tmp_path, "default", gated) == base
    knobs = {"channels_last.enabled": True}
    on = losses(tmp_path, "on", gated, knobs)  # reorder numerics: finite, not necessarily equal to the original
    assert losses(tmp_path, "baked", baked(T, name, knobs)) == on


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.parametrize("name", CPU_CASES)
def test_losses_on_cuda(tmp_path, name):
    gated = patched(T, name)
    knobs = {"channels_last.enabled": True}
    on = losses(tmp_path, "on", gated, knobs, device="cuda")
    assert_same_losses(losses(tmp_path, "baked", baked(T, name, knobs, device="cuda")), on, "cuda")


@pytest.mark.slow
def test_knob_on_keeps_the_weights_the_script_initialised(tmp_path):
    """Converted before ``apply(weights_init)``, ``normal_()`` would fill the NHWC weights in memory order: other
    weights, losses apart from the first step. Converted after it, only floating-point reordering is left."""
    base = [float.fromhex(v) for v in original(tmp_path, T, "weights_init")]
    on = losses(tmp_path, "on", patched(T, "weights_init"), {"channels_last.enabled": True})
    assert [float.fromhex(v) for v in on] == pytest.approx(base, rel=1e-4)


def test_model_zoo_converts_the_trained_network_not_the_test_functions():
    """``from models import *`` re-exports ResNet18 from models/resnet.py; each model file has a ``test()`` that
    builds a net of its own: only the network train.py trains is converted and compiled."""
    from pathlib import Path

    from autotune.project import load_project
    from autotune.patch import run, select

    zoo = Path(__file__).resolve().parent.parent / "fixtures" / "scripts" / "cifar_zoo" / "train.py"
    result = run(load_project(zoo), select([T, "compile"]), hooks=False)
    changed = {f.rel.as_posix(): f.new_text for f in result.files if f.changed}
    assert list(changed) == ["train.py"]
    assert "    start_epoch = checkpoint['epoch']\nnet = _autotune.channels_last(net)\n_autotune.compile_model(net)\n" in changed["train.py"]
    assert [s.reason for s in result.sites if s.transform == T][0] == "ResNet18() has 2-D convolutions"


@pytest.mark.slow
def test_the_knob_reaches_a_lightningmodule_the_trainer_fits(tmp_path):
    from transform_cases import case, trial

    from autotune.patch import run, select, write_outputs
    from autotune.project import load_project

    result = run(load_project(case(T, "lightning_module")), select())  # every transform, the trial's hooks too
    write_outputs(result, tmp_path / "patched", "train.py")
    got = trial(tmp_path / "patched" / result.files[0].rel, ["--max-steps", "4"], tmp_path,
                knobs={"channels_last.enabled": True}, warmup=1, steps=2)
    assert got["status"] == "ok", got["error"]
    assert got["applied"] == ["channels_last.enabled"]


@pytest.mark.parametrize("built, reason", [
    ("UNet2DModel(sample_size=8, norm_num_groups=8)", "UNet2DModel has 2-D convolutions"),
    ("UNet2DModel(sample_size=8, dropout=0.0)", "UNet2DModel has 2-D convolutions"),
    ("UNet2DModel(sample_size=8, dropout=0.1)", "UNet2DModel has dropout: in train mode dropout draws its mask in "
                                                "memory order"),
    ("UNet2DModel.from_config(UNet2DModel.load_config(path))", "UNet2DModel.from_config(...) takes its dropout from a "
                                                               "saved config, which is not read here; where it is on, "
                                                               "in train mode dropout"),
    ("UNet2DModel(**config)", "UNet2DModel(...) takes its dropout from a saved config"),
    ("AutoencoderKL.from_pretrained(path)", "AutoencoderKL.from_pretrained(...) takes its dropout from a saved config"),
    ("UNet1DModel()", "UNet1DModel has no 2-D convolutions"),
])
def test_a_diffusers_model_is_converted_where_its_dropout_is_known_to_be_off(tmp_path, built, reason):
    from autotune.patch import run, select
    from autotune.project import load_project

    script = tmp_path / "train.py"
    script.write_text(
        "import torch\nfrom diffusers import AutoencoderKL, UNet1DModel, UNet2DModel\npath, config = 'unet', {}\n"
        f"model = {built}\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for x in range(3):\n"
        "    loss = model(torch.randn(2, 3, 8, 8), 0).sample.mean()\n"
        "    loss.backward()\n"
        "    opt.step()\n"
    )
    (site,) = [s for s in run(load_project(script), select([T]), hooks=False).sites if s.line == 4]
    assert site.status is (A if reason.endswith("2-D convolutions") and "no 2-D" not in reason else N)
    assert site.reason.startswith(reason)
