"""Definite assignment: a name is bound at a statement only when every path to it binds the name."""

from __future__ import annotations

import textwrap
from pathlib import Path

import libcst as cst
import pytest

from autotune.analysis import ModuleFacts, _collect, _index
from autotune.source import parse
from autotune.bound import unbound

# (id, code with the statement `probe()` where ``x`` is read, whether it is bound there)
CASES = [
    ("assigned-before", "x = 1\nprobe()\n", True),
    ("never-assigned", "probe()\n", False),
    ("assigned-after", "probe()\nx = 1\n", False),
    ("if-without-else", "if a:\n    x = 1\nprobe()\n", False),
    ("if-else-both", "if a:\n    x = 1\nelse:\n    x = 2\nprobe()\n", True),
    ("elif-without-else", "if a:\n    x = 1\nelif b:\n    x = 2\nprobe()\n", False),
    ("elif-else-all", "if a:\n    x = 1\nelif b:\n    x = 2\nelse:\n    x = 3\nprobe()\n", True),
    ("else-raises", "if a:\n    x = 1\nelse:\n    raise SystemExit\nprobe()\n", True),
    ("loop-body-may-not-run", "for i in y:\n    x = i\nprobe()\n", False),
    ("loop-target-inside", "for x in y:\n    probe()\n", True),
    ("loop-target-after", "for x in y:\n    pass\nprobe()\n", False),
    ("while-body", "while a:\n    x = 1\nprobe()\n", False),
    ("with-as", "with open(f) as x:\n    probe()\n", True),
    ("with-body", "with ctx:\n    x = 1\nprobe()\n", True),
    ("except-as", "try:\n    pass\nexcept E as x:\n    probe()\n", True),
    ("try-handler-misses", "try:\n    x = f()\nexcept E:\n    pass\nprobe()\n", False),
    ("try-handler-binds", "try:\n    x = f()\nexcept E:\n    x = None\nprobe()\n", True),
    ("try-else", "try:\n    x = f()\nexcept E:\n    pass\nelse:\n    probe()\n", True),
    ("deleted", "x = 1\ndel x\nprobe()\n", False),
    # a statement that read the name and went on: it was bound there, or NameError would have stopped the script
    ("elif-then-read", "if a:\n    x = 1\nelif b:\n    x = 2\nx.to(d)\nprobe()\n", True),
    ("read-in-assignment", "if a:\n    x = 1\ny = f(x)[0] + 1\nprobe()\n", True),
    ("read-in-if-test", "if a:\n    x = 1\nif x.training:\n    pass\nprobe()\n", True),
    ("read-right-of-and", "if a:\n    x = 1\ny = a and x\nprobe()\n", False),
    ("read-in-lambda", "if a:\n    x = 1\ny = lambda: x\nprobe()\n", False),
    ("read-in-ifexp-branch", "if a:\n    x = 1\ny = x if a else 0\nprobe()\n", False),
    ("read-in-comprehension", "if a:\n    x = 1\ny = [x for i in z]\nprobe()\n", False),
    ("read-then-handled", "if a:\n    x = 1\ntry:\n    x.to(d)\nexcept NameError:\n    pass\nprobe()\n", False),
    ("tuple-target", "a, (x, *b) = v\nprobe()\n", True),
    ("import-as", "import numpy as x\nprobe()\n", True),
    ("dotted-import", "import x.y\nprobe()\n", True),
    ("main-guard", "if __name__ == '__main__':\n    x = 1\n    probe()\n", True),
    ("parameter", "def f(x):\n    probe()\n", True),
    ("decorated-method-parameter", "class C:\n    @staticmethod\n    @cache\n    def m(x):\n        probe()\n", True),
    ("local-unassigned-yet", "x = 1\ndef f():\n    probe()\n    x = 2\n", False),
    ("global-of-module", "def f():\n    probe()\nx = 1\n", True),
    ("global-conditional", "def f():\n    probe()\nif a:\n    x = 1\n", False),
    ("global-in-main-guard", "def f():\n    probe()\nif __name__ == '__main__':\n    x = 1\n    f()\n", True),
    ("closure-local", "def f():\n    def closure():\n        x = 1\n    probe()\n", False),
    ("free-in-closure", "def f():\n    x = 1\n    def g():\n        probe()\n", True),
]


def _facts(code: str) -> ModuleFacts:
    module, tree = parse(code, "case.py")
    facts = ModuleFacts(Path("case.py"), "case.py", "case", False, code, module, tree)
    _index(facts)
    _collect(facts)
    return facts


def _probe(facts: ModuleFacts) -> cst.BaseStatement:
    (call,) = [c for c in facts.calls if isinstance(c.func, cst.Name) and c.func.value == "probe"]
    return facts.statement_of(call)


@pytest.mark.parametrize(("code", "expected"), [(c, e) for _, c, e in CASES], ids=[i for i, _, _ in CASES])
def test_bound_before(code: str, expected: bool):
    facts = _facts(code)
    assert unbound(facts, _probe(facts), "x") == ([] if expected else ["x"])


def test_builtins_and_self_are_bound():
    facts = _facts("class C:\n    def m(self):\n        probe()\n")
    assert unbound(facts, _probe(facts), "len(self.opt)") == []


def test_after_a_statement_counts_its_own_binding():
    facts = _facts("for b in data:\n    probe()\n    loss = f(b)\n")
    (line,) = [s for s in facts.nodes(cst.SimpleStatementLine) if "loss" in facts.code(s)]
    assert unbound(facts, line, "loss / 2", after=True) == []
    assert unbound(facts, _probe(facts), "loss / 2") == ["loss"]


def test_attributes_and_keywords_are_not_names():
    facts = _facts(textwrap.dedent("self = 1\nprobe()\n"))
    assert unbound(facts, _probe(facts), "self.optimizer.step(closure=fn, set_to_none=True)") == ["fn"]
