"""The user's whole run: the loops around the training step tell a trial their lengths as they start."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from transform_cases import trial

from autotune.patch import run
from autotune.project import load_project
from autotune.search.trial import Outcome, Runner, TrialSettings

HEAD = '''
import torch
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm

torch.manual_seed(0)
loader = DataLoader(TensorDataset(torch.randn(96, 4), torch.randn(96, 1)), batch_size=8)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
epochs = 3
'''

NESTED = HEAD + '''
for epoch in range(epochs):
    for step, (x, y) in enumerate(loader):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
'''

ACCUMULATED = HEAD + '''
accum = 4
for epoch in range(1, epochs + 1):
    for i, (x, y) in enumerate(tqdm(loader, desc="train")):
        loss = torch.nn.functional.mse_loss(model(x), y) / accum
        loss.backward()
        if (i + 1) % accum == 0:
            opt.step()
            opt.zero_grad()
'''

TRAINER = HEAD + '''
class Trainer:
    def __init__(self, model, loader):
        self.model, self.loader = model, loader

    def _run_epoch(self):
        for x, y in self.loader:
            loss = torch.nn.functional.mse_loss(self.model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()

    def train(self, max_epochs):
        for epoch in range(max_epochs):
            self._run_epoch()


Trainer(model, loader).train(epochs)
'''

WHILE = HEAD + '''
it = 0
while it < 30:
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        it += 1
'''

# the counted while loops of training scripts: karpathy/makemore's (a plain condition and the bound, checked after
# the count), nanoGPT's (``>``, accumulation inside, a global counter), and ``while step < n``
UNTIL = HEAD + '''
max_steps = 20
batches = iter(loader)
step = 0
while True:
    x, y = next(batches, (torch.randn(8, 4), torch.randn(8, 1)))
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    step += 1
    # termination conditions
    if max_steps >= 0 and step >= max_steps:
        break
'''

NANOGPT_WHILE = HEAD + '''
max_iters, accum, eval_only = 10, 2, False
iter_num = 0
while True:
    if iter_num == 0 and eval_only:
        break
    for micro_step in range(accum):
        loss = torch.nn.functional.mse_loss(model(torch.randn(8, 4)), torch.randn(8, 1)) / accum
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    iter_num += 1
    if iter_num > max_iters:
        break
'''

COUNTED_WHILE = HEAD + '''
def train(max_steps):
    step = 0
    while step < max_steps:
        loss = torch.nn.functional.mse_loss(model(torch.randn(8, 4)), torch.randn(8, 1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1

train(15)
'''

# a counter the loop also sets elsewhere, and a second way out: neither is a bound
RESET_WHILE = UNTIL.replace("    step += 1\n", "    step += 1\n    if loss.item() < 0.01:\n        step = 0\n")
EXIT_WHILE = UNTIL.replace("    step += 1\n", "    step += 1\n    if loss.item() < 1e-9:\n        break\n")

BREAKS = HEAD + '''
max_steps = 20
done = 0
for epoch in range(epochs):
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        done += 1
        if done >= max_steps:
            break
'''

# the bound that ends every loop (the bundled CNN's ``--max-iters``, 0 for none): a cap on the loops' product
CAPPED = HEAD + '''
max_iters = 20
step = 0
for epoch in range(epochs):
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if max_iters and step >= max_iters:
            break
    print("epoch", epoch, "done")
    if max_iters and step >= max_iters:
        break
'''
# the check before the count, in a function: the bound is the count itself, no step past it
CAPPED_FIRST = HEAD + '''
def train(max_steps):
    done = 0
    for epoch in range(epochs):
        if done > max_steps:
            break
        for x, y in loader:
            if done > max_steps:
                break
            done += 1
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()

train(14)
'''
# word_language_model's shape: a setting's way out (``--dry-run``), a range over the data tensor's size, the epoch
# loop in the caller
DRY_RUN = HEAD + '''
data = torch.randn(40, 5)
dry_run = False


def train():
    for batch, i in enumerate(range(0, data.size(0) - 1, 4)):
        x, y = data[i:i + 4, :4], data[i:i + 4, 4:]
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if dry_run:
            break


for epoch in range(1, epochs + 1):
    train()
'''
# a continue that skips the count, a counter reset each epoch: not a bound
CAPPED_SKIP = CAPPED.replace("        opt.zero_grad()\n",
                             "        if loss.item() > 1e6:\n            continue\n        opt.zero_grad()\n")
CAPPED_RESET = CAPPED.replace("    for x, y in loader:\n", "    step = 0\n    for x, y in loader:\n", 1)

GENERATED = HEAD + '''
def batches():
    yield from loader

for x, y in batches():
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
'''


WHILE_WHY = ("the loop at train.py:{} is a while loop that does not end on a counter's bound (`while step < n` or "
             "`if step >= n: break`): its length is known only as it ends")


def _patched(tmp_path: Path, body: str) -> str:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(body))
    return run(load_project(script)).files[0].new_text


def _markers(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if "_autotune.loop_length(" in line]


@pytest.mark.parametrize("body, expected", [
    (NESTED, ["_autotune.loop_length(lambda: range(epochs), 'range(epochs)', 'train.py:13', 2)",
              "_autotune.loop_length(lambda: loader, 'len(loader)', 'train.py:13', 2)"]),
    (ACCUMULATED, ["_autotune.loop_length(lambda: range(1, epochs + 1), 'range(1, epochs + 1)', 'train.py:14', 2)",
                   "_autotune.loop_length(lambda: loader, 'len(loader)', 'train.py:14', 2, counted=True)"]),
    (TRAINER, ["_autotune.loop_length(lambda: self.loader, 'len(self.loader)', 'train.py:17', 2)",  # (file order)
               "_autotune.loop_length(lambda: range(max_epochs), 'range(max_epochs)', 'train.py:17', 2)"]),
], ids=["nested", "accumulated", "trainer"])
def test_each_loop_around_the_step_tells_its_length_before_it_starts(body, expected, tmp_path):
    text = _patched(tmp_path, body)
    assert _markers(text) == expected
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for marker in expected:  # before its loop: only other markers of autotune's (gc_pause()) between them
        following = next(line for line in lines[lines.index(marker) + 1:] if not line.startswith("_autotune."))
        assert following.startswith("for "), following


@pytest.mark.parametrize("body, why", [
    (WHILE, WHILE_WHY.format(13)),
    (RESET_WHILE, WHILE_WHY.format(15)),
    (EXIT_WHILE, WHILE_WHY.format(15)),
    (BREAKS, "the loop at train.py:15 may end before its iterable does (break or return)"),
    (GENERATED, "the loop at train.py:15 iterates over batches(), whose length is not read"),
], ids=["while", "while-reset", "while-exit", "break", "generator"])
def test_where_the_runs_length_cannot_be_read_the_patch_says_why(body, why, tmp_path):
    markers = _markers(_patched(tmp_path, body))
    assert len(markers) == 1 and markers[0].startswith("_autotune.loop_length(None, ") and repr(why) in markers[0]


def test_a_counted_while_loop_tells_its_length_where_the_settings_that_end_it_early_are_off(tmp_path):
    """nanoGPT's ``if iter_num == 0 and eval_only: break``: a way out the run's settings close; the count holds
    where ``eval_only`` is off as the loop starts, and the run's length is unknown where it is on."""
    assert _markers(_patched(tmp_path, NANOGPT_WHILE)) == [
        "_autotune.loop_length(lambda: range(iter_num, max(max_iters + 1, iter_num + 1)) if not eval_only else None, "
        "'iterations until iter_num > max_iters', 'train.py:14', 1)"]


def test_a_bound_that_breaks_every_loop_caps_the_product_of_their_lengths(tmp_path):
    """``if max_iters and step >= max_iters: break`` in the loop over batches and again in the epoch loop: a marker
    before the loops gives the counts left until the bound (None where ``max_iters`` is 0: no bound)."""
    assert _markers(_patched(tmp_path, CAPPED)) == [
        "_autotune.loop_length(lambda: range(step, max(max_iters, step + 1)) if max_iters else None, "
        "'until step >= max_iters', 'train.py:15', 2, cap=True)",
        "_autotune.loop_length(lambda: range(epochs), 'range(epochs)', 'train.py:15', 2)",
        "_autotune.loop_length(lambda: loader, 'len(loader)', 'train.py:15', 2)"]


def test_a_way_out_a_setting_closes_is_counted_where_the_setting_is_off(tmp_path):
    assert _markers(_patched(tmp_path, DRY_RUN)) == [
        "_autotune.loop_length(lambda: range(0, data.size(0) - 1, 4) if not dry_run else None, "
        "'range(0, data.size(0) - 1, 4)', 'train.py:17', 2)",
        "_autotune.loop_length(lambda: range(1, epochs + 1), 'range(1, epochs + 1)', 'train.py:17', 2)"]


def test_a_way_out_inside_an_if_is_counted_where_its_setting_is_off_not_on_a_value_the_run_changes(tmp_path):
    """mnist's ``if args.dry_run: break`` inside its logging ``if``: the setting, not the epoch (the caller's loop
    assigns it, so where it is first read says nothing of later epochs)."""
    body = DRY_RUN.replace("        if dry_run:\n            break\n",
                           "        if epoch % 2 == 0 and batch % 4 == 0:\n            print(loss.item())\n"
                           "            if dry_run:\n                break\n")
    assert _markers(_patched(tmp_path, body))[0].startswith(
        "_autotune.loop_length(lambda: range(0, data.size(0) - 1, 4) if not dry_run else None, ")
    unset = body.replace("            if dry_run:\n", "            if loss.item() < 1.0:\n")
    assert _markers(_patched(tmp_path, unset))[0].startswith("_autotune.loop_length(None, ")


@pytest.mark.parametrize("body, line", [(CAPPED_SKIP, 15), (CAPPED_RESET, 16)], ids=["skip", "reset"])
def test_a_bound_a_continue_or_a_reset_defeats_is_no_cap_the_loops_are_counted_where_it_is_off(body, line, tmp_path):
    assert _markers(_patched(tmp_path, body)) == [
        f"_autotune.loop_length(lambda: range(epochs) if not max_iters else None, 'range(epochs)', "
        f"'train.py:{line}', 2)",
        f"_autotune.loop_length(lambda: loader if not max_iters else None, 'len(loader)', 'train.py:{line}', 2)"]


READ = "read as the loops started"


def _trial(tmp_path: Path, body: str):
    script = tmp_path / "code" / "train.py"
    script.parent.mkdir()
    script.write_text(textwrap.dedent(body))
    settings = TrialSettings((), tmp_path, "cpu", 1, 2, {"CUDA_VISIBLE_DEVICES": ""})
    return Runner(run(load_project(script)), tmp_path / "work", settings).run({}, "baseline", timeout=120)


@pytest.mark.parametrize("body, steps, said", [
    (NESTED, 36, "range(epochs) 3 x len(loader) 12, read as the loops started"),
    (ACCUMULATED, 9, "range(1, epochs + 1) 3 x len(loader) 12, 4 iterations a step, read as the loops started"),
    (TRAINER, 36, "range(max_epochs) 3 x len(self.loader) 12, read as the loops started"),
    (WHILE, None, WHILE_WHY.format(13)),
    (UNTIL, 20, "iterations until step >= max_steps 20, read as the loops started"),
    (UNTIL.replace("max_steps = 20", "max_steps = -1"), None, "iterations until step >= max_steps has no length"),
    (NANOGPT_WHILE, 11, "iterations until iter_num > max_iters 11, read as the loops started"),
    (COUNTED_WHILE, 15, "iterations while step < max_steps 15, read as the loops started"),
    (CAPPED, 20, "20 iterations until step >= max_iters (of range(epochs) 3 x len(loader) 12), " + READ),
    (CAPPED.replace("max_iters = 20", "max_iters = 0"), 36, "range(epochs) 3 x len(loader) 12, " + READ),
    (CAPPED.replace("max_iters = 20", "max_iters = 50"), 36, "range(epochs) 3 x len(loader) 12, " + READ),
    (CAPPED_FIRST, 15, "15 iterations until done > max_steps (of range(epochs) 3 x len(loader) 12), " + READ),
    (DRY_RUN, 30, "range(1, epochs + 1) 3 x range(0, data.size(0) - 1, 4) 10, " + READ),
    (DRY_RUN.replace("dry_run = False", "dry_run = True"), None, "range(0, data.size(0) - 1, 4) has no length"),
    # the settings in one dict, read by their keys
    (NESTED.replace("epochs = 3", 'config = {"epochs": 3, "loaders": {"train": loader}}').replace(
        "range(epochs)", 'range(config["epochs"])').replace("enumerate(loader)", 'enumerate(config["loaders"]["train"])'),
     36, 'range(config["epochs"]) 3 x len(config["loaders"]["train"]) 12, ' + READ),
    (CAPPED.replace("max_iters = 20", 'config = dict(max_iters=20)').replace("max_iters and step >= max_iters",
                                                                           'step >= config["max_iters"]'),
     20, '20 iterations until step >= config["max_iters"] (of range(epochs) 3 x len(loader) 12), ' + READ),
], ids=["nested", "accumulated", "trainer", "while", "until", "until-unbounded", "nanogpt", "while-counted",
        "capped", "capped-off", "capped-past", "capped-first", "dry-run-off", "dry-run", "config-dict", "config-cap"])
def test_a_trial_reads_the_runs_optimizer_steps_as_its_loops_start(body, steps, said, tmp_path):
    # what the patched script's runtime reads, in a trial forked from the probes' zygote (a fresh process imports
    # torch for 3 s here); the search's runner carries it into its result, below
    patched = tmp_path / "patched" / "train.py"
    patched.parent.mkdir()
    patched.write_text(_patched(tmp_path, body))
    result = trial(patched, (), tmp_path, warmup=1, steps=2)
    assert result["status"] == "ok", result["error"]
    assert (result["run_steps"], result["run_steps_from"]) == (steps, said)


def test_the_runners_result_carries_the_runs_length_as_the_trial_read_it(tmp_path):
    result = _trial(tmp_path, ACCUMULATED)
    assert result.status is Outcome.OK, result.stderr_tail
    assert (result.run_steps, result.run_steps_from) == (
        9, "range(1, epochs + 1) 3 x len(loader) 12, 4 iterations a step, read as the loops started")


AFTER = NESTED + '''
import os
import sys

with torch.no_grad():  # the script's own evaluation, after training: a whole run gets here, a timed window does not
    print("eval loss", torch.nn.functional.mse_loss(model(torch.randn(8, 4)), torch.randn(8, 1)).item())
with open(os.environ["EVALUATED"], "w") as f:
    f.write("evaluated")
sys.exit(int(os.environ.get("EXIT", "0")))
'''


@pytest.mark.parametrize("whole, exit_status", [(False, 0), (True, 0), (True, 3)], ids=["window", "whole", "whole-fails"])
def test_a_whole_run_goes_on_past_its_window_to_the_scripts_own_end(whole, exit_status, tmp_path, tmp_path_factory):
    side = tmp_path_factory.mktemp("side") / "evaluated"  # outside the trial's overlay: what the run did is seen here
    script = tmp_path / "code" / "train.py"
    script.parent.mkdir()
    script.write_text(textwrap.dedent(AFTER))
    env = {"CUDA_VISIBLE_DEVICES": "", "EVALUATED": str(side), "EXIT": str(exit_status)}
    runner = Runner(run(load_project(script)), tmp_path / "work", TrialSettings((), tmp_path, "cpu", 1, 2, env))
    result = runner.run({}, "whole" if whole else "baseline", timeout=120, **({"whole": True} if whole else {}))
    assert side.exists() is whole
    # the window is measured the same either way: its steps and losses, and the run's length
    assert (result.steps_done, len(result.losses), len(result.step_times)) == (3, 3, 2)
    assert result.run_steps == 36
    if exit_status:
        assert result.status is Outcome.CRASH and result.error == "exit status 3 after the measured steps", result.error
    else:
        assert result.status is Outcome.OK, result.stderr_tail


# A script with code that runs as it ends, however it ends: a try/finally around its loop and an atexit handler, each
# leaving a mark outside the trial's overlay.
CLEANUP = HEAD + '''
import atexit
import os

atexit.register(lambda: open(os.environ["MARKS"] + ".atexit", "w").close())
try:
''' + textwrap.indent(NESTED.removeprefix(HEAD).strip("\n"), "    ") + '''
finally:
    open(os.environ["MARKS"] + ".finally", "w").close()
'''


@pytest.mark.parametrize("whole", [False, True], ids=["window", "whole"])
def test_a_trial_ends_as_its_window_does_and_a_whole_run_as_the_script_does(whole, tmp_path, tmp_path_factory):
    # Nothing after the window is measured or kept, while an interpreter's teardown after importing torch took
    # 0.8-0.9 s here: the trial's process exits at once (its result written), a whole run ends as the script does
    marks = tmp_path_factory.mktemp("side") / "ended"
    script = tmp_path / "code" / "train.py"
    script.parent.mkdir()
    script.write_text(textwrap.dedent(CLEANUP))
    settings = TrialSettings((), tmp_path, "cpu", 1, 2, {"CUDA_VISIBLE_DEVICES": "", "MARKS": str(marks)})
    runner = Runner(run(load_project(script)), tmp_path / "work", settings)
    result = runner.run({}, "whole" if whole else "baseline", timeout=120, **({"whole": True} if whole else {}))
    assert result.status is Outcome.OK, (result.error, result.stderr_tail)
    assert (result.steps_done, len(result.losses), len(result.step_times)) == (3, 3, 2)
    ran = {end for end in ("finally", "atexit") if marks.with_name(f"ended.{end}").exists()}
    assert ran == ({"finally", "atexit"} if whole else set())


# What torch's gloo group does to a rank now and then as the interpreter tears down, after the script's end
# ("terminate called without an active exception", SIGABRT): here an object that aborts as it is finalised.
TEARDOWN = NESTED + '''
import os

RANK = int(os.environ.get("RANK", "0"))
HOW = os.environ["HOW"]


class Group:
    def __del__(self, abort=os.abort):  # (the module's globals may be gone by then)
        abort()


if HOW == "teardown" and RANK == 0:
    group = Group()  # finalised with the module, after the script's end
elif HOW == "before-end" and RANK == int(os.environ.get("WORLD_SIZE", "1")) - 1:  # the last rank
    os.abort()
elif HOW == "raises":
    group = Group()
    raise RuntimeError("evaluation failed")
'''


@pytest.mark.parametrize("launcher", [False, True], ids=["one-process", "two-ranks"])
@pytest.mark.parametrize("how", ["teardown", "before-end", "raises"])
def test_a_whole_run_aborted_in_the_interpreters_teardown_counts_and_says_so(launcher, how, tmp_path):
    script = tmp_path / "code" / "train.py"
    script.parent.mkdir()
    script.write_text(textwrap.dedent(TEARDOWN))
    fake = (sys.executable, str(Path(__file__).parent / "fake_launcher.py"), "--nproc", "2") if launcher else ()
    settings = TrialSettings((), tmp_path, "cpu", 1, 2, {"CUDA_VISIBLE_DEVICES": "", "HOW": how}, fake)
    result = Runner(run(load_project(script)), tmp_path / "work", settings).run({}, "whole", timeout=120, whole=True)
    assert (result.steps_done, len(result.step_times)) == (3, 2)  # the window was measured either way
    if how == "teardown":  # the script ran to its end: the run's time counts, with what ended it
        assert result.status is Outcome.OK, (result.error, result.stderr_tail)
        assert result.exit_note and "after the script ended (Fatal Python error: Aborted)" in result.exit_note
    else:  # it died before its end, or an exception ended it: the run failed
        assert result.status is Outcome.CRASH and result.exit_note is None, result
