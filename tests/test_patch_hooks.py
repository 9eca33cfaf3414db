"""Where the trial's step hook lands: once per training step on whichever path runs, reading only bound names."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from autotune.analysis import load_project
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
    assert _hooks(tmp_path, body) == ["_autotune.step(loss, batch=x)"]


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
