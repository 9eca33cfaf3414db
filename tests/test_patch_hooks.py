"""Where the trial's step hook lands: once per training step on whichever path runs, reading only bound names."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from autotune.project import load_project
from autotune.patch import run, select

REPO = Path(__file__).resolve().parent.parent
HEAD = "import torch\nimport torch.nn as nn\n\nmodel = nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"


def _hooks(tmp_path: Path, body: str) -> list[str]:
    """The step hooks of the patched script."""
    script = tmp_path / "train.py"
    script.write_text(HEAD + textwrap.dedent(body))
    (file,) = run(load_project(script), select(["gc"])).files
    return [line.strip() for line in file.new_text.splitlines() if "_autotune.step(" in line]


def _hook_after(tmp_path: Path, body: str) -> list[str]:
    """For each step hook, the line just before it (what the hook follows)."""
    script = tmp_path / "train.py"
    script.write_text(HEAD + textwrap.dedent(body))
    (file,) = run(load_project(script), select(["gc"])).files
    lines = file.new_text.splitlines()
    return [lines[i - 1].strip() for i, line in enumerate(lines) if "_autotune.step(" in line]


def test_elif_without_else_hooks_each_stepping_branch(tmp_path):
    # with no else, a path may skip both steps: one hook in each branch, none after the if
    body = """
    for x, y in data:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if mode == "a":
            opt.step()
        elif mode == "b":
            opt.step()
            opt.zero_grad()
    """
    assert _hook_after(tmp_path, body) == ["opt.step()", "opt.step()"]


def test_gradient_accumulation_hook_stays_under_its_condition(tmp_path):
    body = """
    for i, (x, y) in enumerate(data):
        loss = nn.functional.mse_loss(model(x), y) / 4
        loss.backward()
        if (i + 1) % 4 == 0:
            opt.step()
            opt.zero_grad()
    """
    assert _hook_after(tmp_path, body) == ["opt.step()"]
    # the step's loss is the sum of its micro-steps' (whose loss the step hook would see only the last of), its
    # samples those of all four micro-batches
    assert _hooks(tmp_path, body) == ["_autotune.step(batch=x)"]


def test_loss_bound_on_one_path_only_is_left_out(tmp_path):
    body = """
    for x, y in data:
        if use_l1:
            loss = (model(x) - y).abs().mean()
            loss.backward()
        else:
            nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    """
    assert _hooks(tmp_path, body) == ["_autotune.step(batch=x)"]


@pytest.mark.parametrize("case", ["accelerate_backward", "fabric_backward"])
def test_the_loss_given_to_a_librarys_backward_is_the_loss(case):
    (file,) = run(load_project(REPO / "fixtures/transforms/autocast" / f"{case}.in.py")).files
    (hook,) = [line.strip() for line in file.new_text.splitlines() if "_autotune.step(" in line]
    assert hook.startswith("_autotune.step(loss")


def test_an_epoch_loop_that_calls_the_batch_loops_method_is_not_a_training_loop():
    # Trainer.train() loops over epochs calling self._run_epoch(), whose loop over batches calls self._run_batch()
    project = load_project(REPO / "fixtures/scripts/trainer_class.py")
    (loop,) = project.loops
    assert loop.module.function_of(loop.node).name.value == "_run_epoch"
    text = run(project).files[0].new_text
    assert text.count("_autotune.step(") == 1 and text.count("_autotune.gc_pause()") == 1


def test_a_loop_that_calls_a_step_method_of_the_scripts_own_trainer_object_is_a_training_loop():
    # `loss = learner.train_step(x, y)` with `learner = Learner(...)`: the method runs backward() and the step
    project = load_project(REPO / "fixtures/scripts/trainer_step.py")
    (loop,) = project.loops
    assert loop.module.function_of(loop.node).name.value == "main"
    assert {s.owner.name.value for s in loop.scopes if s.backward} == {"train_step"}
    text = run(project).files[0].new_text
    assert text.count("_autotune.step(") == 1


LEARNER = """
import torch


class Base:
    def train_step(self, x):
        loss = self.model(x).sum()
        loss.backward()
        self.opt.step()


class Learner(Base):
    def __init__(self, model):
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=0.1)


class Other:
    def train_step(self, x):
        return 0.0

"""


@pytest.mark.parametrize(
    "body, found",
    [
        # inherited from a local base class
        ("def main(model, data):\n    learner = Learner(model)\n    for x in data:\n        learner.train_step(x)\n", True),
        # bound at module level, called in a loop there
        ("learner = Learner(torch.nn.Linear(2, 1))\nfor x in []:\n    learner.train_step(x)\n", True),
        # a parameter: what it holds is not known without running the script
        ("def main(learner, data):\n    for x in data:\n        learner.train_step(x)\n", False),
        # bound to two different classes
        ("def main(model, data, fast):\n    learner = Learner(model)\n    if fast:\n        learner = Other()\n"
         "    for x in data:\n        learner.train_step(x)\n", False),
        # bound by a loop target as well
        ("def main(model, data):\n    learner = Learner(model)\n    for learner in [learner]:\n"
         "        for x in data:\n            learner.train_step(x)\n", False),
    ],
    ids=["inherited", "module_level", "parameter", "two_classes", "loop_target"],
)
def test_a_method_call_on_an_object_resolves_only_where_one_local_class_binds_it(tmp_path, body, found):
    script = tmp_path / "train.py"
    script.write_text(LEARNER + body)
    assert bool(load_project(script).loops) is found


def test_a_loss_bound_only_inside_a_micro_step_loop_is_accumulated(tmp_path):
    # the nanoGPT shape: backward inside `for micro_step in range(accum)`, one optimizer step after it
    body = """
    for it in range(iters):
        for micro_step in range(accum):
            with ctx:
                loss = nn.functional.mse_loss(model(x), y)
                loss = loss / accum
            scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    """
    script = tmp_path / "train.py"
    script.write_text(HEAD + "scaler = torch.amp.GradScaler(enabled=False)\n" + textwrap.dedent(body))
    (file,) = run(load_project(script), select(["gc"])).files
    lines = [line.strip() for line in file.new_text.splitlines()]
    assert lines[lines.index("_autotune.accumulate(loss)") - 1] == "scaler.scale(loss).backward()"
    assert lines[lines.index("_autotune.step()") - 1] == "scaler.step(opt)"  # it records the micro-steps' sum


def test_a_loss_the_step_hook_sees_is_not_also_accumulated(tmp_path):
    body = """
    for x, y in data:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if not torch.isfinite(loss):
            continue
        opt.step()
    """
    script = tmp_path / "train.py"
    script.write_text(HEAD + textwrap.dedent(body))
    (file,) = run(load_project(script), select(["gc"])).files
    assert "_autotune.accumulate(" not in file.new_text
    assert "_autotune.step(loss, batch=x)" in file.new_text


def test_a_step_every_few_batches_records_the_sum_of_its_micro_steps(tmp_path):
    body = """
    for i, (x, y) in enumerate(data):
        loss = nn.functional.mse_loss(model(x), y) / 4
        loss.backward()
        if (i + 1) % 4 == 0:
            opt.step()
    """
    script = tmp_path / "train.py"
    script.write_text(HEAD + textwrap.dedent(body))
    (file,) = run(load_project(script), select(["gc"])).files
    lines = [line.strip() for line in file.new_text.splitlines()]
    assert lines[lines.index("_autotune.accumulate(loss, batch=x)") - 1] == "loss.backward()"
    assert lines[lines.index("_autotune.step(batch=x)") - 1] == "opt.step()"


def test_a_trial_records_the_sum_of_the_micro_steps_losses_per_optimizer_step(tmp_path):
    """Each optimizer step's loss is the sum of its micro-steps' (each divided by the accumulation count): the loss
    of the step's whole batch, which the gate compares like any other."""
    import torch

    from autotune.search.trial import Outcome, Runner, TrialSettings

    script = REPO / "fixtures/scripts/accum_micro.py"
    settings = TrialSettings(("--iters", "8", "--grad-accum", "3"), tmp_path, "cpu", 2, 4, {"OMP_NUM_THREADS": "1"})
    result = Runner(run(load_project(script)), tmp_path / "work", settings).run({}, "baseline", timeout=120)
    assert result.status is Outcome.OK, result.error or result.stderr_tail
    assert len(result.losses) == 6 and all(len(row) == 1 for row in result.losses)
    # the same sums, by hand: the script's model, data and micro-batches, one optimizer step at a time
    import importlib.util

    spec = importlib.util.spec_from_file_location("accum_micro", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(1337)
    torch.set_num_threads(1)
    data = torch.randint(65, (20_000,))
    gen = torch.Generator().manual_seed(0)
    model = mod.TinyLM(65, 32, 4, 2, 16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    X, Y = mod.get_batch(data, 4, 16, gen)
    expected = []
    for _ in range(6):
        total = 0.0
        for _ in range(3):
            _, loss = model(X, Y)
            loss = loss / 3
            X, Y = mod.get_batch(data, 4, 16, gen)
            loss.backward()
            total = total + loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        expected.append(float(total))
    assert [row[0] for row in result.losses] == pytest.approx(expected, rel=1e-6)
