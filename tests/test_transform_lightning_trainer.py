"""lightning_trainer: the Lightning Trainer's precision= and benchmark= as knobs where the script builds the Trainer;
trials time its optimizer steps through a callback (the DataLoader and fused-optimizer knobs apply inside the
LightningModule and LightningDataModule as in any script).

Running the fixture needs lightning (a test dependency); the tests that only parse do not."""

from __future__ import annotations

from pathlib import Path

import pytest
from loss_probe import run_probe
from transform_cases import case, losses, sites, trial

from autotune.patch import run, write_outputs
from autotune.project import load_project
from autotune.transform import Status

ARGS = ["--max-steps", "12"]


def test_precision_and_benchmark_become_knobs_where_the_script_builds_the_trainer():
    (site,) = sites("lightning_trainer", "plain")
    assert (site.status, site.reason) == (Status.APPLICABLE, "Trainer: precision, benchmark become knobs")


def test_a_precision_the_script_writes_is_its_choice_and_its_own_option_is_a_switch():
    assert [(s.line, s.status, s.reason) for s in sites("lightning_trainer", "user_precision")] == [
        (14, Status.APPLICABLE, 'precision=args.precision: the script\'s own switch (present, switched off where it '
                                'is None or "32-true" or "32" or 32), which the lightning_trainer.precision knob '
                                'turns on there'),
        (14, Status.APPLICABLE, "Trainer: benchmark becomes a knob"),
        (17, Status.PRESENT, 'the script sets precision="bf16-mixed"'),
        (17, Status.APPLICABLE, "Trainer: benchmark becomes a knob"),
    ]


def test_the_whole_patch_reaches_the_modules_optimizer_and_the_datamodules_loader(tmp_path):
    result = run(load_project(case("lightning_trainer", "plain")))
    text = result.files[0].new_text
    assert "**_autotune.optimizer_impl()" in text and "**_autotune.dataloader_kwargs()" in text
    assert "_autotune.framework_trial(trainer)\n    trainer.fit(model, datamodule=data)" in text


def _patched_script(tmp_path: Path) -> Path:
    result = run(load_project(case("lightning_trainer", "plain")))
    write_outputs(result, tmp_path / "patched", "plain.py")
    return tmp_path / "patched" / result.files[0].rel


pytest.importorskip("lightning")


def test_the_patched_script_at_its_defaults_trains_exactly_like_the_original(tmp_path):
    original = losses(tmp_path, "original", case("lightning_trainer", "plain").read_text(), args=ARGS)
    patched = losses(tmp_path, "patched", _patched_script(tmp_path).read_text(), args=ARGS)
    assert patched == original


def test_a_trial_counts_optimizer_steps_and_sums_the_losses_of_their_micro_batches(tmp_path):
    import torch

    args = [*ARGS, "--accumulate", "2"]
    original = run_probe(case("lightning_trainer", "plain"), args, steps=6, out=tmp_path / "orig.json", cwd=tmp_path)
    result = trial(_patched_script(tmp_path), args, tmp_path, warmup=1, steps=2)
    assert result["status"] == "ok" and result["steps_done"] == 3, result["error"]
    assert result["batch_size"] == 64  # the samples of an optimizer step: 2 micro-batches of 32
    # --max-steps 12 bounds the run: Lightning's own count of its optimizer steps
    assert result["run_steps"] == 12 and result["run_steps_from"].startswith("Lightning's estimated_stepping_batches (")
    # backward() saw each micro-batch's loss divided by 2, as Lightning divides it; a step's loss is their sum
    micro = [torch.tensor(float.fromhex(h)) for h in original]
    assert result["losses"] == [[(a + b).item()] for a, b in zip(micro[::2], micro[1::2])]


@pytest.mark.parametrize("precision, applied", [("bf16-mixed", ["lightning_trainer.precision"]),
                                                ("16-mixed", ["lightning_trainer.precision"])])
def test_the_precision_counts_as_applied_where_the_trainer_resolved_it(precision, applied, tmp_path):
    # on a CPU Lightning turns 16-mixed into bf16-mixed: the run is not the original program, and the tuned script,
    # which writes precision="16-mixed", runs what the trial measured (test_bake_every_choice checks both agree)
    result = trial(_patched_script(tmp_path), ARGS, tmp_path, knobs={"lightning_trainer.precision": precision},
                    warmup=1, steps=1)
    assert result["status"] == "ok", result["error"]
    assert result["applied"] == applied


def test_a_precision_written_out_at_its_default_is_no_choice_and_the_knob_sets_it(tmp_path):
    """``precision="32-true"`` is full precision written out, the same as leaving it out: bf16 is offered there, the
    patched script at its defaults trains as the original did, and the knob reaches the Trainer."""
    source = case("lightning_trainer", "written_default")
    result = run(load_project(source))
    write_outputs(result, tmp_path / "patched", "written_default.py")
    script = tmp_path / "patched" / result.files[0].rel
    assert losses(tmp_path, "patched", script.read_text(), args=ARGS) == \
        losses(tmp_path, "original", source.read_text(), args=ARGS)
    on = trial(script, ARGS, tmp_path, knobs={"lightning_trainer.precision": "bf16-mixed"}, warmup=1, steps=1)
    assert on["status"] == "ok" and on["applied"] == ["lightning_trainer.precision"], on["error"]


def test_the_lightningmodule_fit_trains_is_compiled_in_place_and_its_checkpoint_keeps_its_keys(tmp_path):
    import os
    import subprocess
    import sys

    import yaml

    script = _patched_script(tmp_path)
    assert "    model = Classifier()\n    _autotune.compile_model(model)\n" in script.read_text()
    result = trial(script, ARGS, tmp_path, knobs={"compile.mode": "default"}, warmup=1, steps=2)
    assert result["status"] == "ok", result["error"]
    assert "compile.mode" in result["applied"]
    # outside trials: the checkpoint Lightning saves after fit() has the module's own keys, no "_orig_mod."
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import runpy, sys, torch\nimport lightning as L\nfit = L.Trainer.fit\n"
        "def saving_fit(self, model, *a, **k):\n"
        "    fit(self, model, *a, **k)\n"
        "    self.save_checkpoint('last.ckpt')\n"
        "    keys = sorted(torch.load('last.ckpt', weights_only=False)['state_dict'])\n"
        "    print('KEYS', keys, getattr(model, '_compiled_call_impl', None) is not None)\n"
        f"L.Trainer.fit = saving_fit\nsys.argv = [{str(script)!r}, '--max-steps', '2']\n"
        f"runpy.run_path({str(script)!r}, run_name='__main__')\n")
    config = tmp_path / "compile.yaml"
    config.write_text(yaml.safe_dump({"device": "cpu", "knobs": {"compile.mode": "default"}}))
    proc = subprocess.run([sys.executable, str(probe)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "AUTOTUNE_CONFIG": str(config)})
    line = next((l for l in proc.stdout.splitlines() if l.startswith("KEYS")), None)
    assert line == "KEYS ['net.0.bias', 'net.0.weight', 'net.2.bias', 'net.2.weight'] True", proc.stderr[-2000:]


def test_a_fused_optimizer_is_left_as_written_where_lightning_clips_under_mixed_precision(tmp_path):
    # Lightning's precision plugin refuses to clip the gradients of an optimizer that unscales them itself
    # ("does not allow for gradient clipping because it performs unscaling of gradients internally"): with
    # gradient_clip_val, the fused knob applies at full precision only, instead of crashing the trial
    source = case("lightning_trainer", "plain").read_text().replace(
        "        logger=False,\n", "        logger=False,\n        gradient_clip_val=1.0,\n")
    (tmp_path / "clipped.py").write_text(source)
    result = run(load_project(tmp_path / "clipped.py"))
    (site,) = [s for s in result.sites if s.transform == "fused_optimizer"]
    assert site.reason.endswith("fused only at full precision: Lightning refuses to clip a fused optimizer's "
                                f"gradients under mixed precision (Trainer(gradient_clip_val=1.0) at "
                                f"{tmp_path / 'clipped.py'}:59)")
    write_outputs(result, tmp_path / "patched", "clipped.py")
    script = tmp_path / "patched" / result.files[0].rel
    assert '**_autotune.optimizer_impl(lightning_clipping="knob")' in script.read_text()
    both = {"fused_optimizer.impl": "fused", "lightning_trainer.precision": "bf16-mixed"}
    mixed = trial(script, ARGS, tmp_path, knobs=both, warmup=1, steps=1)
    assert mixed["status"] == "ok" and mixed["applied"] == ["lightning_trainer.precision"], mixed["error"]
    full = trial(script, ARGS, tmp_path, knobs={"fused_optimizer.impl": "fused"}, warmup=1, steps=1)
    assert full["status"] == "ok" and full["applied"] == ["fused_optimizer.impl"], full["error"]
    # the tuned script says what the trial did: fused at full precision, as written under mixed precision
    from autotune.bake import bake

    project = load_project(tmp_path / "clipped.py")
    assert "fused=True" in bake(project, {"fused_optimizer.impl": "fused"}, "cpu").files[0].new_text
    assert "fused=True" not in bake(project, both, "cpu").files[0].new_text
