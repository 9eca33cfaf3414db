"""batch_split: the same samples per optimizer step in fewer, bigger micro-batches, where a loop accumulates
gradients over its DataLoader's batches; not where the split would change what is trained."""

from __future__ import annotations

from pathlib import Path

import pytest
from loss_probe import run_probe
from transform_cases import case, losses, sites, trial

from autotune.patch import run, select, write_outputs
from autotune.project import load_project
from autotune.transform import Status

ARGS = ["--epochs", "1"]


def _patched_script(tmp_path: Path, name: str) -> Path:
    result = run(load_project(case("batch_split", name)))
    write_outputs(result, tmp_path / "patched", f"{name}.py")
    return tmp_path / "patched" / result.files[0].rel


def test_a_loop_that_accumulates_over_its_loaders_batches_gets_the_knob():
    (site,) = sites("batch_split", "accumulate")
    assert (site.status, site.line) == (Status.APPLICABLE, 39)
    assert site.reason.startswith("micro-batches of args.batch_size x args.accum accumulation steps: the split")
    (site,) = sites("batch_split", "constants")
    assert (site.status, site.line) == (Status.APPLICABLE, 18)
    assert "BATCH_SIZE x GRAD_ACCUM" in site.reason


def test_batchnorm_gets_no_split_with_its_reason():
    (site,) = sites("batch_split", "batchnorm")
    assert site.status is Status.NOT_APPLICABLE
    assert site.reason.endswith("batchnorm.in.py:15: its statistics are per micro-batch")
    assert site.reason.startswith("BatchNorm1d at ")


LOOP = '''
import argparse
import torch
from torch import nn
from torch.utils.data import DataLoader
parser = argparse.ArgumentParser()
parser.add_argument("--bs", type=int, default=4)
parser.add_argument("--accum", type=int, default=4)
args = parser.parse_args()
model = nn.Sequential(nn.Linear(8, 8){layer})
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(list(range(64)), batch_size=args.bs, shuffle=True{loader})
{extra}
for i, x in enumerate(loader):
    loss = model(x.float()[:, None].expand(-1, 8)).pow(2).mean(){scale}
    loss.backward()
    if {condition}:
        opt.step()
        opt.zero_grad()
    {inside}
'''


def _scan(tmp_path: Path, **parts: str) -> list[tuple[Status, str]]:
    fields = {"layer": "", "loader": "", "extra": "", "scale": " / args.accum", "condition": "(i + 1) % args.accum == 0",
              "inside": "pass"}
    fields.update(parts)
    script = tmp_path / "train.py"
    script.write_text(LOOP.format(**fields))
    return [(s.status, s.reason) for s in run(load_project(script), select(["batch_split"]), hooks=False).sites]


@pytest.mark.parametrize("parts, reason", [
    ({"inside": "if i % 10 == 0: print(loss.item())"}, "i counts micro-batches (line 20): the split changes it"),
    ({"scale": ""}, "the loss is not divided by args.accum: the split would change the gradient's scale"),
    ({"extra": "print('global batch', args.bs * args.accum)"}, "args.bs is also read at line 13: the split would "
                                                               "change it"),
    ({"loader": ", drop_last=True"}, "drop_last: a bigger batch would drop another tail of each epoch"),
    ({"condition": "i % args.accum == args.accum - 1"}, "the optimizer step's condition `i % args.accum == args.accum "
                                                        "- 1` is not `(i + 1) % accumulation == 0`"),
    ({"layer": ", nn.Dropout(0.1)"}, "Dropout(0.1) at {dir}/train.py:10: dropout draws its masks per micro-batch (0 is the "
                                     "only probability known here to be safe)"),
    ({"layer": ", nn.Dropout()"}, "Dropout at {dir}/train.py:10: dropout draws its masks per micro-batch"),
    ({"scale": " + nn.functional.l1_loss(x.float(), x.float() * 0, reduction='sum') / args.accum"},
     "nn.functional.l1_loss(reduction=\"sum\") at {dir}/train.py:15: a loss summed over samples, which the split "
     "would scale"),
])
def test_where_the_split_would_change_what_is_trained_it_is_not_applicable(tmp_path, parts, reason):
    assert _scan(tmp_path, **parts) == [(Status.NOT_APPLICABLE, reason.replace("{dir}", str(tmp_path)))]


def test_dropout_at_zero_and_a_loop_that_steps_every_batch(tmp_path):
    assert [s for s, _ in _scan(tmp_path, layer=", nn.Dropout(p=0.0)")] == [Status.APPLICABLE]
    assert _scan(tmp_path, condition="True") == [
        (Status.NOT_APPLICABLE, "the optimizer step's condition `True` is not `(i + 1) % accumulation == 0`")]


def test_the_runtime_splits_only_where_the_factor_divides_the_accumulation(monkeypatch):
    from autotune import knob_values
    from autotune.runtime_helpers import batch_split

    monkeypatch.setattr(knob_values, "_loaded", lambda: {"batch_split.factor": 4})
    assert batch_split(4, 8) == (16, 2)
    assert batch_split(4, 6) == (4, 6)  # 4 does not divide 6
    assert batch_split(4.0, 8) == (4.0, 8)


# --- running them ------------------------------------------------------------------------------------------


def test_the_patched_script_at_its_defaults_trains_exactly_like_the_original(tmp_path):
    original = losses(tmp_path, "original", case("batch_split", "accumulate").read_text(), args=ARGS)
    patched = losses(tmp_path, "patched", _patched_script(tmp_path, "accumulate").read_text(), args=ARGS)
    assert patched == original


def test_bigger_micro_batches_train_each_step_on_the_same_samples(tmp_path):
    import torch

    script = _patched_script(tmp_path, "accumulate")
    original = run_probe(case("batch_split", "accumulate"), ARGS, steps=24, out=tmp_path / "orig.json", cwd=tmp_path)
    base = trial(script, ARGS, tmp_path, warmup=1, steps=2)
    split = trial(script, ARGS, tmp_path, knobs={"batch_split.factor": 4}, warmup=1, steps=2)
    assert base["status"] == split["status"] == "ok", split["error"]
    # a step's loss: the sum of its 8 micro-steps' (each divided by 8), as backward() saw them
    micro = [torch.tensor(float.fromhex(h)) for h in original]
    sums = []
    for group in zip(*[iter(micro)] * 8):
        total = group[0]
        for value in group[1:]:
            total = total + value
        sums.append([total.item()])
    assert base["losses"] == sums
    assert split["applied"] == ["batch_split.factor"] and base["applied"] == []
    assert base["batch_size"] == split["batch_size"] == 32  # samples per optimizer step: 4 x 8 and 16 x 2
    flat = [v for row in split["losses"] for v in row]
    assert flat == pytest.approx([v for row in sums for v in row], rel=1e-5)
    # 16 does not divide 8 accumulation steps: the script runs as written, and the knob is not counted
    odd = trial(script, ARGS, tmp_path, knobs={"batch_split.factor": 16}, warmup=1, steps=1)
    assert odd["status"] == "ok" and odd["applied"] == [] and odd["batch_size"] == 32
