"""hf_trainer: the Hugging Face Trainer's own settings as knobs, set where the script builds TrainingArguments or as
its HfArgumentParser's defaults; trials time the Trainer's steps through its own callbacks.

The fixtures in fixtures/transforms/hf_trainer train a small GPT-2 built from a config on random tokens (no
download). Running them needs transformers (a test dependency); the tests that only parse do not."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from loss_probe import run_probe
from transform_cases import case, losses, sites, trial

from autotune.cli import main
from autotune.patch import run, select, write_outputs
from autotune.project import load_project
from autotune.transform import Status

PLAIN_ARGS = ["--steps", "40"]
PARSED_ARGS = ["--output_dir", "out", "--max_steps", "40", "--report_to", "none", "--do_train", "--save_strategy", "no",
               "--use_cpu"]
ARGS = {"plain": PLAIN_ARGS, "parsed": PARSED_ARGS, "switched": PLAIN_ARGS}


def _patched_script(tmp_path: Path, name: str) -> Path:
    """The whole patch of a case (every transform, trial hooks included), written to ``tmp_path/patched``."""
    result = run(load_project(case("hf_trainer", name)))
    write_outputs(result, tmp_path / "patched", f"{name}.py")
    return tmp_path / "patched" / result.files[0].rel


# --- what scan and patch find (parsed only) --------------------------------------------------------------------


def test_settings_the_script_leaves_out_become_knobs_where_it_builds_training_arguments():
    site, _ = sites("hf_trainer", "plain")
    assert site.status is Status.APPLICABLE
    assert ("precision, tf32, torch_compile, optim, dataloader_num_workers, dataloader_prefetch_factor, "
            "dataloader_persistent_workers, gradient_checkpointing become knobs") in site.reason


def test_a_parsed_trainers_knobs_are_the_parsers_defaults_and_the_command_line_wins():
    site, _ = sites("hf_trainer", "parsed")
    assert site.status is Status.APPLICABLE and "a value given on the command line wins" in site.reason


@pytest.mark.parametrize("installed", ["adamw_torch", "adamw_torch_fused"])
def test_the_tuned_script_writes_the_fused_optimizer_only_where_the_trainer_does_not_use_it_already(installed,
                                                                                                     monkeypatch):
    # transformers 5 trains with adamw_torch_fused by default, older ones with adamw_torch: a trial reads which is
    # installed (and credits nothing where fused is the default already), and so does the tuned script
    from autotune.bake import bake
    from autotune.transforms import hf_trainer

    monkeypatch.setattr(hf_trainer, "_installed_optim", lambda: installed)
    baked = bake(load_project(case("hf_trainer", "plain")), {"hf_trainer.optim": "adamw_torch_fused"}, "cpu")
    assert ('optim="adamw_torch_fused"' in baked.files[0].new_text) is (installed != "adamw_torch_fused")
    assert baked.changed is (installed != "adamw_torch_fused")


def _scan(tmp_path: Path, body: str) -> list:
    script = tmp_path / "train.py"
    script.write_text(
        "from transformers import HfArgumentParser, Trainer, TrainingArguments\n" + body
    )
    found = run(load_project(script), select(["hf_trainer"]), hooks=False).sites
    return [s for s in found if "per_device_train_batch_size" not in s.reason]  # the batch split: tested below


def test_settings_the_script_writes_are_its_choice(tmp_path):
    found = _scan(tmp_path, (
        "args = TrainingArguments(output_dir='out', bf16=True, optim='adamw_torch', torch_compile_mode='max-autotune')\n"
        "trainer = Trainer(model=None, args=args)\n"
        "trainer.train()\n"
    ))
    assert [(s.status, s.reason) for s in found] == [
        (Status.PRESENT, "the script sets bf16=True"),
        (Status.PRESENT, "the script sets torch_compile_mode='max-autotune'"),
        (Status.USER, "the script sets optim='adamw_torch': its choice is kept"),
        (Status.APPLICABLE, "TrainingArguments: tf32, dataloader_num_workers, dataloader_prefetch_factor, "
                            "dataloader_persistent_workers, gradient_checkpointing become knobs"),
    ]
    text = run(load_project(tmp_path / "train.py"), select(["hf_trainer"]), hooks=False).files[0].new_text
    assert '**_autotune.hf_trainer_args(script_sets=("precision", "torch_compile", "optim"))' in text


def test_arguments_from_a_dict_and_arguments_without_a_trainer_are_left_alone(tmp_path):
    found = _scan(tmp_path, (
        "config = {'output_dir': 'out'}\n"
        "args = TrainingArguments(**config)\n"
        "trainer = Trainer(model=None, args=args)\n"
        "trainer.train()\n"
    ))
    assert [(s.status, s.reason) for s in found] == [
        (Status.NOT_APPLICABLE, "**config may give the settings: which, is not known")
    ]
    found = _scan(tmp_path, "args = TrainingArguments(output_dir='out')\nprint(args)\n")
    assert [(s.status, s.reason) for s in found] == [
        (Status.NOT_APPLICABLE, "no Hugging Face Trainer trains in this script")
    ]


def test_a_local_subclass_of_training_arguments_and_a_parser_of_the_scripts_own_dataclasses(tmp_path):
    found = _scan(tmp_path, (
        "from dataclasses import dataclass\n"
        "@dataclass\n"
        "class MyArguments(TrainingArguments):\n"
        "    lora_rank: int = 8\n"
        "@dataclass\n"
        "class DataArguments:\n"
        "    path: str = 'data'\n"
        "data_parser = HfArgumentParser(DataArguments)\n"  # no TrainingArguments: not the Trainer's settings
        "(data,) = data_parser.parse_args_into_dataclasses()\n"
        "args = MyArguments(output_dir='out')\n"
        "trainer = Trainer(model=None, args=args)\n"
        "trainer.train()\n"
    ))
    assert [s.status for s in found] == [Status.APPLICABLE]
    assert found[0].line == 11


def test_the_loader_settings_that_need_workers_are_set_only_with_the_knobs_workers():
    from autotune.runtime_helpers import hf_settings

    with_workers = {"dataloader_num_workers": 2, "dataloader_prefetch_factor": 4, "dataloader_persistent_workers": True}
    assert hf_settings(with_workers, default_optim=None) == with_workers
    # TrainingArguments refuses a prefetch factor without workers, DataLoader persistent workers without them; the
    # script's own worker count is not known where the arguments are built
    assert hf_settings({**with_workers, "dataloader_num_workers": 0}, default_optim=None) == {}
    assert hf_settings({"dataloader_prefetch_factor": 4}, default_optim=None) == {}
    assert hf_settings({"dataloader_num_workers": 2, "dataloader_prefetch_factor": 2, "gradient_checkpointing": True},
                       default_optim=None) == {"dataloader_num_workers": 2, "gradient_checkpointing": True}


def test_patch_is_idempotent_on_the_whole_script(tmp_path):
    first = _patched_script(tmp_path, "parsed")
    again = run(load_project(first))
    assert not again.changed


# --- running them (transformers needed) ------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("name", ["plain", "parsed", "switched"])
def test_the_patched_script_at_its_defaults_trains_exactly_like_the_original(name, tmp_path):
    original = losses(tmp_path, "original", case("hf_trainer", name).read_text(), args=ARGS[name])
    patched = losses(tmp_path, "patched", _patched_script(tmp_path, name).read_text(), args=ARGS[name])
    assert patched == original


def test_a_trial_times_the_trainers_steps_and_keeps_each_steps_loss(tmp_path):
    original = run_probe(case("hf_trainer", "plain"), PLAIN_ARGS, steps=20, out=tmp_path / "orig.json", cwd=tmp_path)
    result = trial(_patched_script(tmp_path, "plain"), PLAIN_ARGS, tmp_path, warmup=2, steps=3)
    assert result["status"] == "ok" and result["steps_done"] == 5, result["error"]  # ended after 5 of 40 steps
    assert len(result["step_times"]) == 3
    import torch

    # the loss of each step: the sum of the losses backward() saw in its 4 micro-steps (float32, as the trial sums)
    micro = [torch.tensor(float.fromhex(h)) for h in original]
    assert result["losses"] == [[(a + b + c + d).item()] for a, b, c, d in zip(*[iter(micro)] * 4)]
    assert result["batch_size"] == 8  # samples per optimizer step: 4 micro-batches of 2
    assert result["run_steps"] == 40 and result["run_steps_from"].startswith("the Trainer's state.max_steps (")


def test_a_step_of_gradient_accumulation_records_the_sum_of_its_micro_steps(tmp_path):
    args = [*PARSED_ARGS, "--gradient_accumulation_steps", "2"]
    original = run_probe(case("hf_trainer", "parsed"), args, steps=6, out=tmp_path / "orig.json", cwd=tmp_path)
    result = trial(_patched_script(tmp_path, "parsed"), args, tmp_path, warmup=1, steps=2)
    assert result["status"] == "ok" and result["steps_done"] == 3, result["error"]
    import torch

    micro = [torch.tensor(float.fromhex(h)) for h in original]  # float32, as the trial sums them
    assert result["losses"] == [[(a + b).item()] for a, b in zip(micro[::2], micro[1::2])]


def _installed_optim() -> str:
    from autotune.runtime_helpers import _installed_optim

    return _installed_optim()


def test_each_knob_reaches_the_setting_the_trainer_resolves(tmp_path):
    knobs = {"hf_trainer.precision": "bf16", "hf_trainer.dataloader_num_workers": 2,
             "hf_trainer.optim": "adamw_torch_fused", "hf_trainer.dataloader_prefetch_factor": 4,
             "hf_trainer.dataloader_persistent_workers": True, "hf_trainer.gradient_checkpointing": True}
    result = trial(_patched_script(tmp_path, "plain"), PLAIN_ARGS, tmp_path, knobs=knobs, warmup=1, steps=1)
    assert result["status"] == "ok", result["error"]
    # read back from the Trainer's own TrainingArguments; optim counts only where it is not already the default
    fused_default = _installed_optim() == "adamw_torch_fused"
    expected = [k for k in knobs if k != "hf_trainer.optim" or not fused_default]
    assert sorted(result["applied"]) == sorted(expected)


def test_a_value_given_on_the_command_line_wins_over_the_knob(tmp_path):
    knobs = {"hf_trainer.precision": "bf16", "hf_trainer.dataloader_num_workers": 2}
    script = _patched_script(tmp_path, "parsed")
    result = trial(script, PARSED_ARGS, tmp_path, knobs=knobs, warmup=1, steps=1)
    assert sorted(result["applied"]) == ["hf_trainer.dataloader_num_workers", "hf_trainer.precision"]
    # the user's own --fp16 decides the precision (bf16 is not added beside it), their worker count stands
    given = [*PARSED_ARGS, "--dataloader_num_workers", "1", "--bf16", "false"]
    result = trial(script, given, tmp_path, knobs=knobs, warmup=1, steps=1)
    assert result["status"] == "ok", result["error"]
    assert result["applied"] == []


def test_the_scripts_own_switches_into_training_arguments_become_the_knobs():
    # bf16=args.bf16, fp16=args.fp16, tf32=args.tf32, torch_compile=args.compile: present, switched off
    reasons = [s.reason for s in sites("hf_trainer", "switched") if s.status is Status.APPLICABLE]
    assert reasons[0].startswith("bf16=args.bf16, fp16=args.fp16: the script's own switch (present, switched off ")
    assert reasons[1].startswith("tf32=args.tf32: the script's own switch")
    assert reasons[2].startswith("torch_compile=args.compile: the script's own switch")
    assert reasons[3] == ("TrainingArguments: optim, dataloader_num_workers, dataloader_prefetch_factor, "
                          "dataloader_persistent_workers, gradient_checkpointing become knobs")


def test_a_switched_off_flag_is_turned_on_by_the_knob_and_a_flag_the_user_turns_on_wins(tmp_path):
    knobs = {"hf_trainer.precision": "bf16"}
    script = _patched_script(tmp_path, "switched")
    result = trial(script, PLAIN_ARGS, tmp_path, knobs=knobs, warmup=1, steps=1)
    assert result["status"] == "ok" and result["applied"] == ["hf_trainer.precision"], result["error"]
    # read back from the Trainer's resolved arguments: the user's own --bf16 is their choice, not the knob's
    result = trial(script, [*PLAIN_ARGS, "--bf16"], tmp_path, knobs=knobs, warmup=1, steps=1)
    assert result["status"] == "ok" and result["applied"] == [], result["error"]


def test_the_batch_split_becomes_a_knob_where_the_trainer_is_built():
    trainer = [s for s in sites("hf_trainer", "plain") if s.line == 48]
    assert [s.status for s in trainer] == [Status.APPLICABLE]
    assert trainer[0].reason.startswith("training_args.per_device_train_batch_size x gradient_accumulation_steps: the "
                                        "split of each optimizer step's samples becomes a knob")


def test_the_batch_split_needs_the_arguments_as_a_name_bound_before_the_trainer(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "from transformers import Trainer, TrainingArguments\n"
        "def build(args):\n"
        "    return Trainer(model=None, args=args) if args else None\n"
        "trainer = Trainer(model=None, args=TrainingArguments(output_dir='out'))\n"
        "trainer.train()\n"
    )
    found = [s for s in run(load_project(script), select(["hf_trainer"]), hooks=False).sites if s.line in (3, 4)
             and "batch split" in s.reason]
    assert [(s.line, s.status) for s in found] == [(3, Status.NOT_APPLICABLE), (4, Status.NOT_APPLICABLE)]
    assert found[1].reason == ("args=TrainingArguments(output_dir='out'): the batch split needs the TrainingArguments "
                               "as a name bound before the Trainer is built")


def test_a_bigger_micro_batch_trains_each_step_on_the_same_samples(tmp_path):
    script = _patched_script(tmp_path, "plain")
    base = trial(script, PLAIN_ARGS, tmp_path, warmup=1, steps=3)
    split = trial(script, PLAIN_ARGS, tmp_path, knobs={"hf_trainer.batch_split": 4}, warmup=1, steps=3)
    assert base["status"] == split["status"] == "ok", split["error"]
    assert split["applied"] == ["hf_trainer.batch_split"]
    assert base["batch_size"] == split["batch_size"] == 8  # samples per optimizer step: 2 x 4 and 8 x 1
    # the same samples in each step, the loss the mean over them: equal to float rounding
    assert [v for row in split["losses"] for v in row] == pytest.approx([v for row in base["losses"] for v in row],
                                                                        rel=1e-5)
    # 8 does not divide 4 accumulation steps: nothing changes, and the knob is not counted
    odd = trial(script, PLAIN_ARGS, tmp_path, knobs={"hf_trainer.batch_split": 8}, warmup=1, steps=1)
    assert odd["status"] == "ok" and odd["applied"] == []


def test_the_batch_split_leaves_a_model_with_dropout_as_it_is(tmp_path):
    args = [*PARSED_ARGS, "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2"]
    script = _patched_script(tmp_path, "parsed")
    result = trial(script, args, tmp_path, knobs={"hf_trainer.batch_split": 2}, warmup=1, steps=1)
    assert result["status"] == "ok" and result["applied"] == [], result["error"]  # dropout 0.1: masks per micro-batch
    result = trial(script, [*args, "--dropout", "0"], tmp_path, knobs={"hf_trainer.batch_split": 2}, warmup=1, steps=1)
    assert result["status"] == "ok" and result["applied"] == ["hf_trainer.batch_split"], result["error"]


def test_search_on_a_trainer_script_ends_with_a_verdict(tmp_path, capsys):
    out = tmp_path / "search"
    # no whole runs: each run imports transformers (4-5 s here), and tests/test_search.py measures whole runs
    code = main(["search", str(case("hf_trainer", "plain")), "--out", str(out), "--trials", "2", "--steps", "4",
                 "--warmup", "2", "--confirm", "5", "--whole-runs", "0", "--", "--steps", "40"])
    assert code == 0, capsys.readouterr().err
    doc = yaml.safe_load((out / "autotune.yaml").read_text())
    assert doc["throughput"]["baseline"]["steps_per_s"] > 0 and doc["verdict"]
    assert any(name.startswith("hf_trainer.") for name in doc["knobs"])
