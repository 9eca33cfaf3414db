"""gc: collect, freeze and disable Python's cyclic garbage collector around the training loop."""

from __future__ import annotations

from collections.abc import Iterator

import libcst as cst

from autotune.analysis import ModuleFacts
from autotune.project import TrainingLoop
from autotune.transform import Edits, Status, Transform
from autotune.syntax import stmt
from autotune.knobs import Knob, Numerics

# Calls that show the script already manages the collector itself.
_SCRIPT_GC = ("gc.disable", "gc.freeze")


class Gc(Transform):
    """Pause the cyclic garbage collector (collect, freeze, disable) during the training loop and restore it after."""

    name = "gc"
    knobs = (
        Knob(
            "gc.freeze",
            (False, True),
            False,
            Numerics.EXACT,
            help="collect and freeze the heap, then disable the cyclic GC while the loop runs; re-enabled after it",
        ),
    )

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._aliased: set[ModuleFacts] = set()

    def apply(self, facts: ModuleFacts, edits: Edits) -> None:
        done: set[cst.CSTNode] = set()
        for loop in self.project.loops:
            if loop.module is not facts or loop.outer in done:
                continue
            done.add(loop.outer)
            outer = loop.outer
            caller = self._wrapped_by(loop)
            if caller is not None:
                where = caller.module.position(caller.outer)[0]
                self.report(
                    facts,
                    outer,
                    Status.NOT_APPLICABLE,
                    f"runs inside the training loop at {caller.module.display}:{where}, which is wrapped there",
                )
                continue
            found = self._script_gc()
            if found is not None:
                self.report(facts, outer, Status.PRESENT, found)
                continue
            if self._patched(facts, outer):
                self.report(facts, outer, Status.PRESENT, "the collector is already paused by autotune")
                continue
            self.report(facts, outer, Status.APPLICABLE, "the cyclic GC runs during the training loop")
            if self.mode.gated:
                before = [stmt(f"{edits.runtime('gc_pause')}()\n")]
                after = [stmt(f"{edits.runtime('gc_resume')}()\n")]
            elif self.mode.value(self.knobs[0]):
                gc = self._import_gc(facts, edits)
                before = [stmt(f"{gc}.collect()\n"), stmt(f"{gc}.freeze()\n"), stmt(f"{gc}.disable()\n")]
                after = [stmt(f"{gc}.enable()\n"), stmt(f"{gc}.unfreeze()\n")]
            else:
                continue
            # The comments and blank lines above the loop now lead the pause, which belongs to the loop.
            before[0] = before[0].with_changes(leading_lines=outer.leading_lines)
            edits.rewrite(outer, lambda node: node.with_changes(leading_lines=[]))
            edits.insert_before(outer, *before)
            edits.insert_after(outer, *after)
            # A `return` from inside the loop leaves the function without reaching the statement after it.
            for ret in self._returns(facts, outer):
                line = facts.statement_of(ret)
                if isinstance(line, cst.SimpleStatementLine):
                    edits.insert_before(line, *after)

    def _import_gc(self, facts: ModuleFacts, edits: Edits) -> str:
        """The name baked code calls the gc module by: ``gc``, or ``_gc`` where the file uses ``gc`` otherwise."""
        # only a file that says ``gc`` somewhere can bind it: the walk is for those
        if facts.imports.get("gc", "gc") == "gc" and not ("gc" in facts.names and _binds(facts.module, "gc")):
            edits.require_import("gc")
            return "gc"
        if facts.imports.get("_gc") != "gc" and facts not in self._aliased:
            self._aliased.add(facts)
            edits.after_imports(stmt("import gc as _gc\n"))
        return "_gc"

    def _wrapped_by(self, loop: TrainingLoop) -> TrainingLoop | None:
        """The training loop that calls the function holding ``loop`` (``train_one_epoch`` from an epoch loop)."""
        for other in self.project.loops:
            if other.outer is loop.outer:
                continue
            for scope in other.scopes:
                owner = scope.owner
                if scope.module is loop.module and isinstance(owner, cst.FunctionDef):
                    if loop.module.contains(owner, loop.outer):
                        return other
        return None

    def _script_gc(self) -> str | None:
        """Where the script already disables or freezes the collector, as ``gc.disable() at path:line``."""
        for facts in self.project.modules:
            for call in facts.calls:
                qual = _imported_qualname(facts, call.func)
                if qual in _SCRIPT_GC:
                    return f"{qual}() already called at {facts.display}:{facts.position(call)[0]}"
        return None

    @staticmethod
    def _patched(facts: ModuleFacts, outer: cst.CSTNode) -> bool:
        block = facts.block_of(outer)
        body = list(getattr(block, "body", ()))
        i = body.index(outer)
        return i > 0 and any(facts.is_runtime_call(c, "gc_pause") for c in facts.calls_in(body[i - 1]))

    @staticmethod
    def _returns(facts: ModuleFacts, outer: cst.CSTNode) -> Iterator[cst.Return]:
        home = facts.function_of(outer)
        stack = [outer]
        while stack:
            node = stack.pop()
            if isinstance(node, (cst.FunctionDef, cst.ClassDef, cst.Lambda)) and node is not outer:
                continue  # a return in there leaves another function
            if isinstance(node, cst.Return) and facts.function_of(node) is home:
                yield node
            stack.extend(reversed(node.children))


def _imported_qualname(facts: ModuleFacts, func: cst.BaseExpression) -> str | None:
    """The qualified name of ``func`` when its first name was imported (a variable named ``gc`` is not the module)."""
    head = func
    while isinstance(head, cst.Attribute):
        head = head.value
    if not isinstance(head, cst.Name) or head.value not in facts.imports:
        return None
    return facts.qualname(func)


class _Binder(cst.CSTVisitor):
    """Finds whether a name is bound by anything but ``import``: an assignment, a parameter, a def, a loop."""

    def __init__(self, name: str) -> None:
        self.name, self.found = name, False

    def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
        self._target(node.target)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        self._target(node.target)

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        self._target(node.target)

    def visit_For(self, node: cst.For) -> None:
        self._target(node.target)

    def visit_AsName(self, node: cst.AsName) -> None:
        self._target(node.name)

    def visit_NamedExpr(self, node: cst.NamedExpr) -> None:
        self._target(node.target)

    def visit_Param(self, node: cst.Param) -> None:
        self._target(node.name)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self._target(node.name)

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self._target(node.name)

    def _target(self, node: cst.CSTNode) -> None:
        if isinstance(node, cst.Name):
            self.found = self.found or node.value == self.name
        elif isinstance(node, (cst.Tuple, cst.List)):
            for element in node.elements:
                self._target(element.value)
        elif isinstance(node, cst.StarredElement):
            self._target(node.value)


def _binds(module: cst.Module, name: str) -> bool:
    binder = _Binder(name)
    module.visit(binder)
    return binder.found


# === runtime: what the patched script runs (python -m autotune.catalog copies it into autotune/runtime_helpers.py) ===

import gc as _gc
from autotune.knob_values import knob


_gc_paused = False


def gc_pause() -> None:
    """Collect, freeze and disable the garbage collector before the loop, when the knob is on."""
    global _gc_paused
    if knob("gc.freeze") and not _gc_paused:
        _gc.collect()
        _gc.freeze()
        _gc.disable()
        _gc_paused = True


def gc_resume() -> None:
    """Undo ``gc_pause`` after the loop."""
    global _gc_paused
    if _gc_paused:
        _gc.enable()
        _gc.unfreeze()
        _gc_paused = False
