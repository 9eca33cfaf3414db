"""The loop shapes the step hooks and the batch split both read (autotune/loop_shapes.py): one recogniser."""

from __future__ import annotations

import textwrap

import pytest

from autotune import loop_shapes
from autotune.project import load_project

HEAD = """\
import torch
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(32, 4)
loader = [(x[i:i + 4], x[i:i + 4, :1]) for i in range(0, 32, 4)]
"""


def _loop(tmp_path, body: str):
    path = tmp_path / "train.py"
    path.write_text(HEAD + textwrap.dedent(body))
    project = load_project(path)
    (loop,) = project.loops
    return loop


@pytest.mark.parametrize(("body", "batch"), [
    ("for xb, yb in loader:\n    model(xb).sum().backward()\n    opt.step()\n", "xb"),
    ("for i, (xb, yb) in enumerate(loader):\n    model(xb).sum().backward()\n    opt.step()\n", "xb"),
    ("for batch in loader:\n    model(batch[0]).sum().backward()\n    opt.step()\n", "batch"),
    ("for i, start in enumerate(range(0, 32, 4)):\n    xb = x[start:start + 4]\n    model(xb).sum().backward()\n"
     "    opt.step()\n", "xb"),
    ("for i, start in enumerate(range(0, 32, 4)):\n    model(x[start:start + 4]).sum().backward()\n    opt.step()\n",
     None),  # no slice bound to a name: no batch to hand the hook
    ("for step in range(8):\n    model(x).sum().backward()\n    opt.step()\n", None),  # counts steps
])
def test_the_batch_a_loop_iterates(tmp_path, body, batch):
    assert loop_shapes.batch_of(_loop(tmp_path, body).node) == batch


MICRO = """\
def get_batch():
    return x[:4], x[:4, :1]

it = iter(loader)
for step in range(4):
    for micro in range(accum):
        {draw}
        (model(xb).sum() / accum).backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.parametrize(("draw", "batch"), [
    ("xb, yb = next(it)", "xb"),
    ("xb, yb = get_batch()", "xb"),
    ("xb = x[:4]", None),  # neither next() nor a function of the script's own
])
def test_the_micro_batch_loop_and_what_it_draws(tmp_path, draw, batch):
    loop = _loop(tmp_path, "accum = 2\n" + MICRO.format(draw=draw))
    (scope,) = [s for s in loop.scopes if s.steps]
    inner = loop_shapes.micro_loop(loop.module, loop.node, scope)
    assert inner is not None and loop.module.code(loop_shapes.micro_count(inner)) == "accum"
    assert loop_shapes.micro_batch(loop.module, inner) == batch


def test_a_loop_that_also_steps_is_no_micro_batch_loop(tmp_path):
    loop = _loop(tmp_path, "for epoch in range(2):\n    for xb, yb in loader:\n        model(xb).sum().backward()\n"
                           "        opt.step()\n")
    (scope,) = [s for s in loop.scopes if s.steps]
    assert loop_shapes.micro_loop(loop.module, loop.node, scope) is None
    outer = loop_shapes.micro_loop(loop.module, loop.outer, scope)
    assert outer is None  # the batch loop holds the backward and the step: it is the step, not its micro-batches
