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
    assert (site.status, site.line) == (Status.APPLICABLE, 40)
    assert site.reason.startswith("micro-batches of args.batch_size x args.accum accumulation steps: the split")
    assert site.reason.endswith("; i only decides when to log (line 46): it counts micro-batches, so at a split of k "
                                "the script logs 1/k as often (x2: half as often), the training the same")
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


def _scan_template(tmp_path: Path, template: str, defaults: dict[str, str], parts: dict[str, str]) -> list:
    """(status, reason) of each batch_split site of ``template`` filled with ``defaults`` updated by ``parts``."""
    script = tmp_path / "train.py"
    script.write_text(template.format(**{**defaults, **parts}))
    return [(s.status, s.reason) for s in run(load_project(script), select(["batch_split"]), hooks=False).sites]


def _scan(tmp_path: Path, **parts: str) -> list[tuple[Status, str]]:
    return _scan_template(tmp_path, LOOP, {"layer": "", "loader": "", "extra": "", "scale": " / args.accum",
                                           "condition": "(i + 1) % args.accum == 0", "inside": "pass"}, parts)


@pytest.mark.parametrize("parts, reason", [
    ({"inside": "if i % 10 == 0: sched.step()", "extra": "sched = torch.optim.lr_scheduler.StepLR(opt, 10)"},
     "i counts micro-batches (line 20): the split changes it"),
    ({"inside": "if i % 10 == 0:\n        last = loss.item()\n        print(last)\n    print(last)"},
     "i counts micro-batches (line 20): the split changes it"),
    ({"scale": ""}, "the loss is not divided by args.accum: the split would change the gradient's scale"),
    ({"extra": "print('global batch', args.bs * args.accum)"}, "args.bs is also read at line 13: the split would "
                                                               "change it"),
    ({"loader": ", drop_last=True"}, "drop_last: a bigger batch would drop another tail of each epoch"),
    ({"condition": "i % args.accum == args.accum - 1"}, "the optimizer step's condition `i % args.accum == args.accum "
                                                        "- 1` is not `(i + 1) % accumulation == 0` (or that, `or i + "
                                                        "1 == len(loader)`)"),
    ({"layer": ", nn.Dropout(0.1)"}, "Dropout(0.1) at {dir}/train.py:10: dropout draws its masks per micro-batch (0 is the "
                                     "only probability known here to be safe)"),
    ({"layer": ", nn.Dropout()"}, "Dropout at {dir}/train.py:10: dropout draws its masks per micro-batch"),
    ({"extra": "sched = torch.optim.lr_scheduler.StepLR(opt, 10)", "inside": "sched.step()"},
     "sched.step() at line 20 runs once per micro-batch: the split would change the learning-rate schedule"),
    ({"inside": "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)"},
     "clip_grad_norm_ at line 20 clips each micro-batch's gradients: the split would change what is clipped"),
    # a schedule sized in micro-batches (Accelerate's by_feature examples: len(train_dataloader) * num_epochs)
    ({"extra": "sched = torch.optim.lr_scheduler.LinearLR(opt, total_iters=len(loader) * 3)"},
     "len(loader) at line 13 counts micro-batches: the split would change it (only math.ceil(len(loader) / "
     "args.accum), an epoch's optimizer steps, stays the same)"),
    ({"scale": " + nn.functional.l1_loss(x.float(), x.float() * 0, reduction='sum') / args.accum"},
     "nn.functional.l1_loss(reduction=\"sum\") at {dir}/train.py:15: a loss summed over samples, which the split "
     "would scale"),
])
def test_where_the_split_would_change_what_is_trained_it_is_not_applicable(tmp_path, parts, reason):
    assert _scan(tmp_path, **parts) == [(Status.NOT_APPLICABLE, reason.replace("{dir}", str(tmp_path)))]


@pytest.mark.parametrize("inside", [
    "if i % 10 == 0: print(loss.item())",
    "if i % 10 == 0:\n        shown = loss.item() * args.accum\n        print(f'{i}: {shown:.4f}')",
    "if i % 10 == 0 and i > 0:\n        logger.info('loss %.4f', loss.item())\n        writer.add_scalar('loss', loss.item(), i)",
])
def test_a_counter_that_only_decides_when_to_log_keeps_the_split_and_the_report_says_what_changes(tmp_path, inside):
    """issue 35: a micro-step counter read only to log (print, logging, a TensorBoard writer) is no reason to
    refuse: the split changes how often the script logs, which the site says, and nothing it trains."""
    extra = "import logging; logger = logging.getLogger(); writer = None"
    ((status, reason),) = _scan(tmp_path, inside=inside, extra=extra)
    assert status is Status.APPLICABLE
    assert reason.endswith("; i only decides when to log (line 20): it counts micro-batches, so at a split of k the "
                           "script logs 1/k as often (x2: half as often), the training the same")


def test_dropout_at_zero_and_a_loop_that_steps_every_batch(tmp_path):
    assert [s for s, _ in _scan(tmp_path, layer=", nn.Dropout(p=0.0)")] == [Status.APPLICABLE]
    # a last, shorter step at each epoch's end: ceil(n / a) steps, and the same samples in each, after the split
    for last in ("i + 1 == len(loader)", "(i + 1) == len(loader)", "i == len(loader) - 1"):
        condition = f"((i + 1) % args.accum == 0) or ({last})"
        assert [s for s, _ in _scan(tmp_path, condition=condition)] == [Status.APPLICABLE]
    assert _scan(tmp_path, condition="(i + 1) % args.accum == 0 or i + 2 == len(loader)") == [(
        Status.NOT_APPLICABLE, "the optimizer step's condition `(i + 1) % args.accum == 0 or i + 2 == len(loader)` is "
        "not `(i + 1) % accumulation == 0` (or that, `or i + 1 == len(loader)`)")]
    # an epoch's optimizer steps, ceil(n / a), are ceil(ceil(n / k) / (a / k)) after the split: the same
    steps = "import math; steps = math.ceil(len(loader) / args.accum) * 3"
    assert [s for s, _ in _scan(tmp_path, extra=steps)] == [Status.APPLICABLE]
    assert _scan(tmp_path, condition="True") == [
        (Status.NOT_APPLICABLE, "the optimizer step's condition `True` is not `(i + 1) % accumulation == 0` "
                                 "(or that, `or i + 1 == len(loader)`)")]


def test_the_runtime_splits_only_where_the_factor_divides_the_accumulation(monkeypatch):
    from autotune import knob_values
    from autotune.runtime_helpers import batch_split

    monkeypatch.setattr(knob_values, "_loaded", lambda: {"batch_split.factor": 4})
    assert batch_split(4, 8) == (16, 2)
    assert batch_split(4, 6) == (4, 6)  # 4 does not divide 6
    assert batch_split(4.0, 8) == (4.0, 8)
    monkeypatch.setattr(knob_values, "_loaded", lambda: {"batch_split.factor": 0.5})  # for memory: half as big
    assert batch_split(4, 8) == (2, 16)
    assert batch_split(3, 8) == (3, 8)  # 2 does not divide a micro-batch of 3


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


EPOCH_END = '''
import torch
from torch import nn
from torch.utils.data import DataLoader
torch.manual_seed(0)
batch_size, accum = 4, 8
model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
loader = DataLoader(torch.randn(88, 8), batch_size=batch_size, shuffle=True)
for epoch in range(3):
    for i, x in enumerate(loader):
        loss = model(x).pow(2).mean() / accum
        loss.backward()
        if ((i + 1) % accum == 0) or (i + 1 == len(loader)):
            opt.step()
            opt.zero_grad()
'''


def test_a_last_shorter_step_at_each_epochs_end_trains_on_the_same_samples(tmp_path):
    # 88 samples: 22 micro-batches of 4, steps after 8, 16 and 22 (the last on 24 samples); split by 2, 11 of 8,
    # steps after 4, 8 and 11: the same samples, the same weights (88 is a multiple of 8), across epochs
    script = tmp_path / "train.py"
    script.write_text(EPOCH_END)
    result = run(load_project(script))
    write_outputs(result, tmp_path / "patched", "train.py")
    patched = tmp_path / "patched" / "train.py"
    assert "_autotune.batch_split(batch_size, accum)" in patched.read_text()
    base = trial(patched, [], tmp_path, warmup=1, steps=7)
    split = trial(patched, [], tmp_path, knobs={"batch_split.factor": 2}, warmup=1, steps=7)
    assert base["status"] == split["status"] == "ok", split["error"]
    assert split["applied"] == ["batch_split.factor"]
    flat = [v for row in split["losses"] for v in row]
    assert len(flat) == 8 and flat == pytest.approx([v for row in base["losses"] for v in row], rel=1e-5)


# --- slices of the script's own tensors: `for i, start in enumerate(range(0, n, batch_size))` ----------------


def test_a_loop_over_slices_of_the_scripts_tensors_gets_the_knob():
    (site,) = sites("batch_split", "sliced")
    assert (site.status, site.line) == (Status.APPLICABLE, 23)
    assert site.reason.startswith("micro-batches of args.batch_size x args.accum accumulation steps")
    # the options object is train()'s parameter, and train() is called once: split on entry
    assert "    args.batch_size, args.accum = _autotune.batch_split(args.batch_size, args.accum)\n" in \
        case("batch_split", "sliced").with_name("sliced.out.py").read_text()


SLICED = '''
import torch
from torch import nn
batch_size = 4
accum = 4
x = torch.randn(256, 8)
model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step, start in enumerate(range(0, {stop}, batch_size)):
    xb = {xb}
    loss = model(xb).pow(2).mean() / accum
    loss.backward()
    {inside}
    if (step + 1) % accum == 0:
        opt.step()
        opt.zero_grad()
'''


@pytest.mark.parametrize("parts, reason", [
    ({}, None),
    ({"xb": "x[start:start + batch_size, :4].repeat(1, 2)"}, None),  # the first dimension sliced, then the second
    ({"xb": "x[:, start:start + batch_size]"}, "start is read at line 10 other than as a slice [start:start + "
                                               "batch_size] of a tensor's first dimension: what a bigger micro-batch "
                                               "would read there is not known"),
    ({"xb": "x[start:start + 4]"}, "start is read at line 10 other than as a slice [start:start + batch_size] of a "
                                   "tensor's first dimension: what a bigger micro-batch would read there is not known"),
    ({"inside": "print(start)"}, "start is read at line 13 other than as a slice [start:start + batch_size] of a "
                                 "tensor's first dimension: what a bigger micro-batch would read there is not known"),
    ({"stop": "len(x) - batch_size + 1"}, "the range's end len(x) - batch_size + 1 reads batch_size: a bigger "
                                          "micro-batch would end an epoch elsewhere"),
    ({"xb": "x[:batch_size]"}, "no slice [start:start + batch_size] in the loop: where its micro-batches come from is "
                               "not known"),
    ({"inside": "print(xb.sum() * batch_size)"}, "batch_size is also read at line 13: the split would change it"),
])
def test_slices_are_split_only_where_they_are_the_micro_batches(tmp_path, parts, reason):
    expected = [(Status.APPLICABLE, None)] if reason is None else [(Status.NOT_APPLICABLE, reason)]
    found = _scan_template(tmp_path, SLICED, {"stop": "len(x)", "xb": "x[start:start + batch_size]", "inside": "pass"},
                           parts)
    assert [(s, None if s is Status.APPLICABLE else r) for s, r in found] == expected


# --- an inner micro-step loop: `for micro in range(accum):` --------------------------------------------------


def test_an_inner_micro_step_loop_gets_the_knob():
    (site,) = sites("batch_split", "sampled")  # nanoGPT's shape: get_batch draws torch.randint indices
    assert (site.status, site.line) == (Status.APPLICABLE, 60)
    assert site.reason.startswith("micro-batches of batch_size x gradient_accumulation_steps accumulation steps")
    (site,) = sites("batch_split", "micro_loop")  # next() of a DataLoader's iterator, sizes as parameters
    assert (site.status, site.line) == (Status.APPLICABLE, 17)
    assert "micro_batch x accumulation" in site.reason


SAMPLED = '''
import torch
from torch import nn
batch_size = 4
accum = 4
data = torch.randn(256, 8)
def get_batch():
    ix = torch.randint(len(data), (batch_size,){device})
    return data[ix]
def evaluate(model):
    return model({eval_batch}).mean()
model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
{extra}
for it in range(20):
    for micro in range(accum):
        loss = model(get_batch()).pow(2).mean() / accum
        loss.backward()
        {inside}
    opt.step()
    opt.zero_grad()
    print(evaluate(model))
'''


def _scan_sampled(tmp_path: Path, **parts: str) -> list[tuple[Status, str]]:
    return _scan_template(tmp_path, SAMPLED, {"device": "", "eval_batch": "data[:32]", "extra": "", "inside": "pass"},
                          parts)


@pytest.mark.parametrize("parts, reason", [
    ({}, None),
    ({"inside": "if micro == accum - 1: pass"}, None),  # the last micro-step stays the last one
    ({"extra": "print(batch_size * accum, 'samples per step')"}, None),  # their product does not change
    # nanoGPT's estimate_loss draws its evaluation batches through get_batch: the split would change them
    ({"eval_batch": "get_batch()"}, "get_batch() is also called at line 10: a bigger batch_size would change what it "
                                    "draws there, and the draws after it"),
    ({"device": ", device='cuda'"}, "torch.randint(device='cuda'): a bigger draw on an accelerator's generator is not "
                                    "the smaller draws it replaces"),
    ({"inside": "print(micro)"}, "micro counts micro-batches (line 19): the split changes it"),
    ({"inside": "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)"},
     "clip_grad_norm_ at line 19 clips each micro-batch's gradients: the split would change what is clipped"),
    ({"extra": "print(batch_size)"}, "batch_size is also read at line 14: the split would change it"),
    # nanoGPT's configurator: exec() rebinds module settings from the command line
    ({"extra": "exec('accum = 8')"}, "exec() at line 14 may rebind batch_size and accum: their values where the split "
                                     "is made are not known"),
])
def test_an_inner_loop_is_split_only_where_its_draws_stay_the_same(tmp_path, parts, reason):
    expected = [(Status.APPLICABLE, None)] if reason is None else [(Status.NOT_APPLICABLE, reason)]
    found = _scan_sampled(tmp_path, **parts)
    assert [(s, None if s is Status.APPLICABLE else r) for s, r in found] == expected


def test_an_inner_loop_over_a_loaders_iterator_is_not_split_where_its_length_is_read(tmp_path):
    text = case("batch_split", "micro_loop").read_text()
    assert [s for s, _ in _scan_template(tmp_path, text.replace("{", "{{").replace("}", "}}"), {}, {})] == [
        Status.APPLICABLE]
    epochs = text.replace("    batches = iter(loader)\n", "    print(len(loader) * steps)\n    batches = iter(loader)\n", 1)
    assert _scan_template(tmp_path, epochs.replace("{", "{{").replace("}", "}}"), {}, {}) == [(
        Status.NOT_APPLICABLE, "len(loader) at line 16 counts micro-batches: the split would change it (only "
        "math.ceil(len(loader) / accumulation), an epoch's optimizer steps, stays the same)")]


INDEXED = '''
import torch
from torch import nn
batch_size = 4
accum = 4
rows = torch.randn(512, 8)
def get_batch(step, micro, size):
    start = {start}
    {inside}
    return rows[start:start + size]
model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
{extra}
for it in range(20):
    for micro in range(accum):
        loss = model(get_batch(it, {index}, batch_size)).pow(2).mean() / accum
        loss.backward()
    opt.step()
    opt.zero_grad()
'''


@pytest.mark.parametrize("parts, reason", [
    ({}, None),  # the rows of the steps before, then the micro-batch's: split, the same rows
    ({"start": "micro * size"}, None),
    ({"start": "size * micro + 7"}, None),  # an offset that reads neither size nor accum
    ({"start": "(step * accum + micro) * size"}, "micro is read at line 8 other than as micro * batch_size: which rows "
                                                 "get_batch() takes at a bigger micro-batch is not known"),
    ({"start": "step * size + micro * size"}, "the offset step * size of the rows' start reads size or accum other than "
                                              "as their product: the split would move it"),
    ({"inside": "print(size)"}, "size is read at line 9 in get_batch() other than in the rows' start and length: the "
                                "split would change it"),
    ({"index": "micro + 1"}, "micro counts micro-batches (line 16): the split changes it"),
    # an evaluation that takes its rows with the same batch size would take other rows after the split
    ({"extra": "print(get_batch(0, 0, batch_size))"}, "batch_size is also read at line 13: the split would change it"),
])
def test_rows_picked_by_the_micro_index_are_split_only_where_the_same_rows_are_taken(tmp_path, parts, reason):
    defaults = {"start": "step * accum * size + micro * size", "inside": "pass", "index": "micro", "extra": ""}
    expected = [(Status.APPLICABLE, None)] if reason is None else [(Status.NOT_APPLICABLE, reason)]
    found = _scan_template(tmp_path, INDEXED, defaults, parts)
    assert [(s, None if s is Status.APPLICABLE else r) for s, r in found] == expected


def test_a_loader_object_of_the_scripts_own_class_gets_the_knob_for_the_training_loader_alone():
    (site,) = sites("batch_split", "loader_object")  # build-nanogpt's and llm.c's shape: train_loader.next_batch()
    assert site.status is Status.APPLICABLE
    assert site.reason.startswith("micro-batches of B x grad_accum_steps accumulation steps: the split")
    assert site.reason.endswith(
        "; the training loader alone is built with the bigger micro-batch (another built with the same size keeps it)"
        "; at the end of its data train_loader moves on as soon as a whole micro-batch no longer fits: a bigger one "
        "moves on up to k - 1 of the original's micro-batches earlier there")


LOADER = '''
import torch
from torch import nn
data = torch.randn(4096)
class Cutter:
    def __init__(self, B, T):
        self.B = B
        self.T = T
        self.pos = 0
    def next_batch(self):
        {cut}
        {inside}
        x = buf.view(self.B, self.T)
        self.pos += self.B * self.T
        return x
B, T = 4, 8
accum = 64 // (B * T)
{before}
loader = Cutter({given})
probe = Cutter(B, T)
model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
{extra}
for it in range(20):
    for micro in range(accum):
        loss = model(loader.next_batch()).pow(2).mean() / accum
        loss.backward()
    opt.step()
    opt.zero_grad()
    print(probe.next_batch().mean(), loader.B * loader.T * accum)
'''


@pytest.mark.parametrize("parts, reason", [
    ({}, None),
    ({"given": "B=B, T=T"}, None),
    ({"before": "print(accum)"}, None),  # read before the split: the script's own count
    ({"extra": "print(B * T, 'tokens a micro-batch')"}, None),  # the other loader's size: B stays
    ({"extra": "loader.next_batch()"},
     "loader.next_batch() is also called at line 23: a bigger micro-batch would change what it cuts there, and what "
     "comes after"),
    ({"extra": "print(loader.B)"}, "loader.B is read at line 23: the split would change it"),
    ({"extra": "print(B * T * accum, 'tokens a step')"}, "accum is also read at line 23: the split would change it"),
    ({"extra": "loader.pos = 128"}, "loader.pos is set at line 23: where loader cuts is not known"),
    ({"inside": "print(self.B)"}, "Cutter reads self.B at line 12 other than as a factor of a product or the leading "
                                  "dimension of a view: one call with a bigger micro-batch may not cut what several "
                                  "smaller ones cut"),
    ({"cut": "buf = data[torch.randint(0, 4000, (self.B * self.T,))]"},
     "next_batch() does not cut data[self.pos : self.pos + B * ...] and advance self.pos by that product: what a "
     "bigger micro-batch cuts is not known"),
    # windows that overlap (or skip): the cuts of a bigger micro-batch would be other tokens
    ({"inside": "self.pos += self.B * self.T * 2"},
     "next_batch() does not cut data[self.pos : self.pos + B * ...] and advance self.pos by that product: what a "
     "bigger micro-batch cuts is not known"),
    ({"inside": "self.pos = 7 if self.pos > 4000 else self.pos"},
     "self.pos is set at line 12 to 7 if self.pos > 4000 else self.pos: not 0 nor a rank's offset of whole "
     "micro-batches, so where a bigger micro-batch is cut is not known"),
    ({"extra": "print(len(loader))"}, "loader is used at line 23 in a way not read here: what the split changes there "
                                      "is not known"),
    ({"extra": "print(loader.pos, loader.T)"}, None),  # where it stands, at a step's start as the original's would
    ({"given": "B + 0, T"}, "Cutter(...) is given B + 0 as B: not a variable or option of the script's own"),
    ({"before": "accum = accum"}, "accum is not a variable bound once before the loader is built, in its block: its "
                                  "value where the split is made is not known"),
])
def test_a_loader_object_is_split_only_where_one_bigger_cut_is_the_smaller_ones(tmp_path, parts, reason):
    defaults = {"cut": "buf = data[self.pos : self.pos + self.B * self.T]", "inside": "pass", "given": "B, T",
                "before": "", "extra": ""}
    expected = [(Status.APPLICABLE, None)] if reason is None else [(Status.NOT_APPLICABLE, reason)]
    found = _scan_template(tmp_path, LOADER, defaults, parts)
    assert [(s, None if s is Status.APPLICABLE else r) for s, r in found] == expected


@pytest.mark.parametrize("name", ["sampled", "micro_loop", "constants", "sliced", "indexed", "loader_object"])
def test_the_other_cases_at_their_defaults_train_exactly_like_the_original(tmp_path, name):
    # constants: the split of two module-level settings goes after the second (it once went between them)
    original = losses(tmp_path, "original", case("batch_split", name).read_text())
    patched = losses(tmp_path, "patched", _patched_script(tmp_path, name).read_text())
    assert patched == original


@pytest.mark.parametrize("name", ["sampled", "micro_loop", "sliced", "indexed", "loader_object"])
def test_other_shapes_bigger_micro_batches_train_each_step_on_the_same_samples(tmp_path, name):
    # sampled: one torch.randint draw of 4 x 4 indices on the CPU generator is the four draws of 4 it replaces;
    # sliced: one slice of 4 x 8 rows is the four slices of 8 it replaces; indexed: the rows from micro' * 4 x 4 on
    # are the rows of the four micro-batches from micro * 4 on; loader_object: one cut of 4 x 4 rows of 16 tokens from
    # the loader's position is the four cuts of 4 rows it replaces
    script = _patched_script(tmp_path, name)
    base = trial(script, [], tmp_path, warmup=1, steps=3)
    split = trial(script, [], tmp_path, knobs={"batch_split.factor": 4}, warmup=1, steps=3)
    assert base["status"] == split["status"] == "ok", split["error"]
    assert split["applied"] == ["batch_split.factor"] and base["applied"] == []
    assert base["batch_size"] == split["batch_size"] == {"sampled": 32, "micro_loop": 32, "sliced": 64,
                                                       "indexed": 32, "loader_object": 16}[name]  # per step
    flat = [v for row in split["losses"] for v in row]
    assert flat == pytest.approx([v for row in base["losses"] for v in row], rel=1e-5)


# --- Lightning: Trainer(accumulate_grad_batches=...) -------------------------------------------------------


def test_lightnings_accumulation_and_its_datamodules_batch_size_become_the_knob():
    (site,) = sites("batch_split", "lightning")
    assert (site.status, site.line) == (Status.APPLICABLE, 59)
    assert site.reason.startswith("micro-batches of args.batch_size x args.accumulate accumulation steps")


LIGHTNING = '''
import lightning as L
import torch
from torch.utils.data import DataLoader
class Data(L.LightningDataModule):
    def __init__(self, batch_size=16):
        super().__init__()
        self.save_hyperparameters()
    def train_dataloader(self):
        return DataLoader(list(range(64)), {loader})
def main(bs, accum):
    model = torch.nn.Linear(1, 1)
    data = Data({data})
    trainer = L.Trainer(accumulate_grad_batches={accum})
    trainer.fit(model, datamodule=data)
'''


@pytest.mark.parametrize("parts, reason", [
    ({}, None),
    ({"accum": "4"}, "accumulate_grad_batches=4 is not a variable or option of the script's own"),
    ({"data": ""}, "the batch size Data's default is not a variable or option of the script's own"),
    ({"loader": "batch_size=32"}, "Data's DataLoader batch size 32 is not self.<name> or self.hparams.<name>: where "
                                  "it comes from is not known"),
    ({"loader": "batch_size=self.hparams.batch_size, drop_last=True"},
     "drop_last: a bigger batch would drop another tail of each epoch"),
])
def test_lightning_is_split_only_where_the_batch_size_is_traced_to_the_script(tmp_path, parts, reason):
    found = _scan_template(tmp_path, LIGHTNING, {"loader": "batch_size=self.hparams.batch_size, shuffle=True",
                                                 "data": "batch_size=bs", "accum": "accum"}, parts)
    assert [(s, None if s is Status.APPLICABLE else r) for s, r in found] == [
        (Status.APPLICABLE, None) if reason is None else (Status.NOT_APPLICABLE, reason)]


def test_lightnings_bigger_micro_batches_train_each_step_on_the_same_samples(tmp_path):
    pytest.importorskip("lightning")
    script = _patched_script(tmp_path, "lightning")
    args = ["--max-steps", "12", "--accumulate", "4", "--batch-size", "8"]
    base = trial(script, args, tmp_path, warmup=1, steps=3)
    split = trial(script, args, tmp_path, knobs={"batch_split.factor": 4}, warmup=1, steps=3)
    assert base["status"] == split["status"] == "ok", split["error"]
    assert split["applied"] == ["batch_split.factor"] and base["batch_size"] == split["batch_size"] == 32
    flat = [v for row in split["losses"] for v in row]
    assert flat == pytest.approx([v for row in base["losses"] for v in row], rel=1e-5)


# --- Accelerate: Accelerator(gradient_accumulation_steps=...) ----------------------------------------------


def test_accelerates_accumulation_and_the_loaders_batch_size_become_the_knob():
    (site,) = sites("batch_split", "accelerate")
    assert (site.status, site.line) == (Status.APPLICABLE, 14)
    # the options object is the training function's parameter, and the function is called once: split on entry
    assert "    args.batch_size, args.accumulate = _autotune.batch_split(args.batch_size, args.accumulate)\n" in \
        case("batch_split", "accelerate").with_name("accelerate.out.py").read_text()


ACCELERATE = '''
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
def train(bs, accum):
    accelerator = Accelerator(gradient_accumulation_steps={accum})
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(torch.randn(64, 1), batch_size=bs, shuffle=True)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    {steps}
    for x in loader:
        {context}
            loss = model(x).pow(2).mean()
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
'''


@pytest.mark.parametrize("parts, reason", [
    ({}, None),
    ({"accum": "4"}, "gradient_accumulation_steps=4 is not a variable or option of the script's own"),
    ({"context": "if True:"}, "no loop runs its micro-batches `with accelerator.accumulate(model):`: Accelerate does "
                              "not accumulate them"),
    ({"steps": "print(len(loader))"}, "len(loader) at line 11 counts micro-batches: the split would change it (only "
                                      "math.ceil(len(loader) / accum), an epoch's optimizer steps, stays the same)"),
])
def test_accelerate_is_split_only_where_it_accumulates_itself(tmp_path, parts, reason):
    found = _scan_template(tmp_path, ACCELERATE, {"accum": "accum", "context": "with accelerator.accumulate(model):",
                                                         "steps": "pass"},
                           parts)
    if reason is None:
        assert [s for s, _ in found] == [Status.APPLICABLE]
    else:
        assert (Status.NOT_APPLICABLE, reason) in found and Status.APPLICABLE not in [s for s, _ in found]


def test_accelerates_bigger_micro_batches_train_each_step_on_the_same_samples(tmp_path):
    pytest.importorskip("accelerate")
    script = _patched_script(tmp_path, "accelerate")
    args = ["--epochs", "1", "--accumulate", "4", "--batch-size", "8"]
    base = trial(script, args, tmp_path, warmup=1, steps=3)
    split = trial(script, args, tmp_path, knobs={"batch_split.factor": 4}, warmup=1, steps=3)
    assert base["status"] == split["status"] == "ok", split["error"]
    # a step is Accelerate's optimizer step (the last of 4 micro-batches), its samples theirs
    assert base["steps_done"] == split["steps_done"] == 4 and base["batch_size"] == split["batch_size"] == 32
    assert split["applied"] == ["batch_split.factor"]
    flat = [v for row in split["losses"] for v in row]
    assert flat == pytest.approx([v for row in base["losses"] for v in row], rel=1e-5)
