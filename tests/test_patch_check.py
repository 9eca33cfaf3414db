"""The compile() check of a rewrite: it compiles only what autotune wrote, yet still catches invalid code, at the
line of the new text, including code placed where a ``from __future__`` import must come first."""

from __future__ import annotations

from pathlib import Path

import pytest

from autotune.analysis import ModuleFacts
from autotune.project import load_project
from autotune.patch import _code, _apply, run
from autotune.knobs import Knob, Numerics
from autotune.transform import Edits, Mode, Transform
from autotune.syntax import stmt

SCRIPT = '''"""A script."""
from __future__ import annotations

import torch


def helper(x):
    # a comment
    return x + 1


class Net(torch.nn.Module):
    def forward(self, x):
        return x


def main():
    print(helper(1))


main()
'''


def _transform(where: str, code: str) -> type[Transform]:
    """A transform that inserts ``code`` after the top-level statement whose text starts with ``where``."""

    class Insert(Transform):
        name = "insert"
        knobs = (Knob("insert.x", (False, True), False, Numerics.EXACT),)

        def apply(self, facts: ModuleFacts, edits: Edits) -> None:
            for s in facts.module.body:
                if facts.module.code_for_node(s).lstrip("\n").startswith(where):
                    edits.insert_after(s, stmt(code))

    return Insert


def _load(tmp_path: Path, text: str = SCRIPT):
    path = tmp_path / "train.py"
    path.write_text(text)
    return load_project(path)


def test_check_text_blanks_untouched_statements_and_keeps_line_numbers(tmp_path: Path):
    project = _load(tmp_path)
    facts = project.entry
    edits = Edits()
    transform = _transform("def main", "x = 1\n")(project, Mode())
    transform.apply(facts, edits)
    new_text, check = _code(facts, _apply(facts, edits))
    assert new_text.count("\n") == check.count("\n")
    assert "x = 1" in check and "return x + 1" not in check and "# a comment" not in check
    # the module's head is kept as written: __future__ imports must stay first
    assert check.startswith('"""A script."""\nfrom __future__ import annotations\n')
    compile(check, "train.py", "exec")


def test_invalid_inserted_code_is_caught_at_its_line(tmp_path: Path):
    project = _load(tmp_path)
    # main's def ends on line 18: the break is line 19 of the new text
    with pytest.raises(RuntimeError, match=r"autotune produced invalid code for .*train.py:19: 'break' outside loop"):
        run(project, [_transform("def main", "break\n")], hooks=False)


def test_code_before_a_future_import_is_caught(tmp_path: Path):
    project = _load(tmp_path)
    with pytest.raises(RuntimeError, match="from __future__ imports must occur at the beginning"):
        run(project, [_transform('"""A script."""', "x = 1\n")], hooks=False)


def test_valid_inserted_code_passes(tmp_path: Path):
    result = run(_load(tmp_path), [_transform("def helper", "y = helper(2)\n")], hooks=False)
    (change,) = result.files
    assert "y = helper(2)" in change.new_text
    compile(change.new_text, "train.py", "exec")
