"""allocator: expandable_segments for the CUDA caching allocator, set before torch is imported."""

from __future__ import annotations

import sys

import libcst as cst

from autotune.analysis import ModuleFacts
from autotune.knobs import Knob, Numerics
from autotune.transform import Edits, Status, Transform
from autotune.syntax import is_docstring, stmt

ENV_NAMES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # torch reads the first when both are set
SETTERS = ("setdefault", "putenv", "update", "__setitem__")
SETTING_CALLS = {"torch.cuda.memory._set_allocator_settings", "torch._C._accelerator_setAllocatorSettings"}


class Allocator(Transform):
    """Let the CUDA caching allocator grow expandable segments instead of fragmenting fixed ones."""

    name = "allocator"
    entry_only = True
    devices = frozenset({"cuda"})
    knobs = (
        Knob(
            "allocator.expandable_segments",
            (False, True),
            False,
            Numerics.EXACT,
            frozenset({"cuda"}),
            help="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (merged with any allocator settings already set): "
            "less fragmentation, fewer cudaMalloc calls when shapes vary",
        ),
    )

    def apply(self, facts: ModuleFacts, edits: Edits) -> None:
        patched = next((c for c in facts.calls if facts.is_runtime_call(c, "allocator_env")), None)
        if patched is not None:
            self.report(facts, patched, Status.PRESENT, "the allocator setting is already a knob")
            return
        if not self.project.trains:
            self.report(facts, facts.module, Status.NOT_APPLICABLE, "no training loop: no CUDA memory to tune")
            return
        present = False
        for module in self.project.modules:
            for node, text in _script_settings(module):
                present = True
                if "expandable_segments:true" in text.lower():
                    self.report(module, node, Status.PRESENT, "the script turns on expandable_segments itself")
                else:
                    self.report(module, node, Status.USER, "the script sets the allocator configuration itself")
        if present:
            return
        anchor = _first_import(facts)
        self.report(facts, anchor, Status.APPLICABLE, "allocator setting goes before the first import")
        if self.mode.gated:
            edits.prelude(stmt(f"{edits.runtime('allocator_env')}()\n"))
            return
        if not self.mode.value(self.knobs[0]):
            return
        var = _free_name(facts, "_alloc_conf")
        lines = [stmt(c) for c in allocator_statements(var)]
        lines[0] = lines[0].with_changes(
            leading_lines=[
                cst.EmptyLine(),
                cst.EmptyLine(comment=cst.Comment("# merged with any allocator settings the environment has")),
            ]
        )
        early_os = _early_os_import(facts)
        if early_os is not None:
            edits.insert_after(early_os, *lines)
        else:
            edits.prelude(stmt("import os\n"), *lines)


def _script_settings(facts: ModuleFacts):
    """(node, text) for each place the script writes the allocator configuration."""
    for call in facts.calls:
        if facts.qualname(call.func) in SETTING_CALLS:
            yield call, facts.code(call)
    for node in facts.strings:
        if node.evaluated_value not in ENV_NAMES:
            continue
        line = facts.statement_of(node)
        written = False
        for anc in facts.ancestors(node):
            if anc is line:
                break
            if isinstance(anc, cst.AssignTarget):
                written = True
            if isinstance(anc, cst.Call) and isinstance(anc.func, cst.Attribute) and anc.func.attr.value in SETTERS:
                written = True
        if written:
            yield node, facts.code(line)



def _is_import_line(s: cst.BaseStatement) -> bool:
    return isinstance(s, cst.SimpleStatementLine) and all(isinstance(x, (cst.Import, cst.ImportFrom)) for x in s.body)


def _top_imports(facts: ModuleFacts):
    for s in facts.module.body:
        if _is_import_line(s):
            yield s


def _first_import(facts: ModuleFacts) -> cst.CSTNode:
    for line in _top_imports(facts):
        if not any(isinstance(x, cst.ImportFrom) and _imported(x) == ["__future__"] for x in line.body):
            return line.body[0]
    return facts.module


def _early_os_import(facts: ModuleFacts) -> cst.SimpleStatementLine | None:
    """A top-level ``import os`` line that only standard-library imports precede: torch cannot be loaded yet."""
    for s in facts.module.body:
        if not _is_import_line(s):
            if is_docstring(s):
                continue
            return None
        for small in s.body:
            for module in _imported(small):
                if module.split(".")[0] not in sys.stdlib_module_names:
                    return None
        if len(s.body) == 1 and isinstance(s.body[0], cst.Import) and any(
            a.asname is None and _dotted(a.name) == "os" for a in s.body[0].names
        ):
            return s
    return None



def _imported(small: cst.BaseSmallStatement) -> list[str]:
    if isinstance(small, cst.Import):
        return [_dotted(a.name) for a in small.names]
    if isinstance(small, cst.ImportFrom):
        if small.relative or small.module is None:
            return ["."]  # a local module: it may import torch
        return [_dotted(small.module)]
    return []


def _dotted(node: cst.BaseExpression) -> str:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        return f"{_dotted(node.value)}.{node.attr.value}"
    return ""


def _free_name(facts: ModuleFacts, name: str) -> str:
    while name in facts.names:
        name += "_"
    return name


# === runtime: what the patched script runs (python -m autotune.catalog copies it into autotune/runtime_helpers.py) ===

import os

from autotune.knob_values import knob


def allocator_statements(var: str = "current") -> list[str]:
    """The statements that add ``expandable_segments:True`` to the allocator settings, ``var`` holding the ones in
    use: the baked script's, run by the patched one. torch reads PYTORCH_CUDA_ALLOC_CONF in place of
    PYTORCH_ALLOC_CONF when both are set: the setting is merged with the one in use."""
    return [
        f'{var} = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_ALLOC_CONF", ""))\n',
        f'if "expandable_segments" not in {var}:\n'
        f'    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(filter(None, [{var}, "expandable_segments:True"]))\n',
    ]


def allocator_env() -> None:
    """Add ``expandable_segments:True`` to PYTORCH_CUDA_ALLOC_CONF; must run before torch initialises CUDA."""
    if knob("allocator.expandable_segments"):
        exec("".join(allocator_statements()), {"os": os})  # the very statements a baked script runs
