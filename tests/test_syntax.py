"""autotune.syntax: appending arguments to a call keeps the layout the script wrote."""

from __future__ import annotations

import libcst as cst
import pytest

from autotune.syntax import add_args, kwarg


class _Append(cst.CSTTransformer):
    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        return add_args(updated, kwarg("num_workers", "1"))


@pytest.mark.parametrize(
    "before, after",
    [
        ("f(a, b=1)\n", "f(a, b=1, num_workers=1)\n"),
        ("f()\n", "f(num_workers=1)\n"),
        # the arguments on their own line, the closing parenthesis on the next (accelerate's nlp_example)
        ("f(\n    a, b=1\n)\n", "f(\n    a, b=1, num_workers=1\n)\n"),
        ("f(\n    a, b=1  # note\n)\n", "f(\n    a, b=1, num_workers=1  # note\n)\n"),
        ("f(a,\n  b=1)\n", "f(a,\n  b=1, num_workers=1)\n"),
        # one argument per line with a trailing comma: one more line
        ("f(\n    a,\n    b=1,\n)\n", "f(\n    a,\n    b=1,\n    num_workers=1,\n)\n"),
    ],
)
def test_an_appended_argument_keeps_the_calls_layout(before: str, after: str):
    assert cst.parse_module(before).visit(_Append()).code == after
