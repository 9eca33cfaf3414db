"""no_sync: skip DDP's gradient all-reduce on the accumulation micro-steps that do not step the optimizer."""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from autotune.analysis import ModuleFacts
from autotune.project import StepScope
from autotune.bound import unbound
from autotune.knobs import Knob, Numerics
from autotune.transform import Edits, Status, Transform
from autotune.syntax import expr, is_docstring, walk
from autotune.transforms._dist import Wrapped, assigned_chains, chains, conflicts, ddp_models

# Expressions that may run code or bind names: the accumulation condition is evaluated once more, before the
# forward pass, so it must be a plain expression over values that do not change in between.
_IMPURE = (
    cst.NamedExpr, cst.Await, cst.Yield, cst.Lambda, cst.ListComp, cst.SetComp, cst.DictComp, cst.GeneratorExp,
)  # fmt: skip


@dataclass
class _Region:
    """The statements to run under no_sync() and the condition that marks the micro-step that steps."""

    stmts: list[cst.BaseStatement]
    final: cst.BaseExpression  # True on the micro-step whose backward must all-reduce
    final_code: str
    model: str
    conditional: bool  # the model may stay unwrapped (DDP only under an if)


class NoSync(Transform):
    """Run forward and backward of the non-final gradient-accumulation micro-steps inside DDP's no_sync()."""

    name = "no_sync"
    knobs = (
        Knob(
            "no_sync.enabled",
            (False, True),
            False,
            Numerics.REORDER,
            help="accumulate gradients locally and all-reduce once per optimizer step instead of once per "
            "micro-step; the sum of local sums replaces the sum of all-reduced sums (last-bit differences)",
        ),
    )

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._done: set[cst.CSTNode] = set()  # backward() calls already looked at (a scope shared by two loops)
        self._skips: list[str | None] | None = None

    def apply(self, facts: ModuleFacts, edits: Edits) -> None:
        models = ddp_models(self.project)
        regions: dict[cst.BaseStatement, _Region] = {}
        for loop in self.project.loops:
            for scope in loop.scopes:
                if scope.module is not facts:
                    continue
                for call in scope.backward:
                    if call in self._done:
                        continue
                    self._done.add(call)
                    self._site(facts, edits, scope, call, models, regions)

    def _site(
        self,
        facts: ModuleFacts,
        edits: Edits,
        scope: StepScope,
        call: cst.Call,
        models: list[Wrapped],
        regions: dict[cst.BaseStatement, _Region],
    ) -> None:
        wrapped = self._already_wrapped(facts, call)
        if wrapped:
            self.report(facts, call, Status.PRESENT, wrapped)
            return
        if not models:
            self.report(facts, call, Status.NOT_APPLICABLE, "no model is wrapped in DistributedDataParallel")
            return
        present = self._script_skips_sync()
        if present:
            self.report(facts, call, Status.PRESENT, present)
            return
        region = self._region(facts, scope, call, models)
        if isinstance(region, str):
            self.report(facts, call, Status.NOT_APPLICABLE, region)
            return
        missing = unbound(facts, region.stmts[0], f"({region.model}, {region.final_code})")
        if missing:
            reason = f"{', '.join(missing)} not bound on every path to the forward, where no_sync() would read it"
            self.report(facts, call, Status.NOT_APPLICABLE, reason)
            return
        self.report(
            facts, call, Status.APPLICABLE, f"forward and backward() under {region.model}.no_sync() unless {region.final_code}"
        )
        anchor = region.stmts[-1]
        if anchor in regions:
            return  # two backward() calls in one statement: one region serves both
        regions[anchor] = region
        if self.mode.gated:
            head = f"{edits.runtime('no_sync')}({region.model}, {region.final_code})"
        elif self.mode.value(self.knobs[0]):
            edits.require_import("contextlib")
            final = region.final_code
            if isinstance(region.final, (cst.IfExp, cst.Lambda)):
                final = f"({final})"
            if region.conditional:
                final = f'{final} or not hasattr({region.model}, "no_sync")'
            head = f"contextlib.nullcontext() if {final} else {region.model}.no_sync()"
        else:
            return
        edits.wrap(region.stmts, lambda body, head=head: _with(head, body))

    # --- detection -------------------------------------------------------------------------------------------

    def _already_wrapped(self, facts: ModuleFacts, call: cst.Call) -> str | None:
        for anc in facts.ancestors(call):
            if not isinstance(anc, cst.With):
                continue
            for item in anc.items:
                for inner in _calls(item.item):
                    if facts.is_runtime_call(inner, "no_sync"):
                        return "backward() already runs under the no_sync knob"
                    if isinstance(inner.func, cst.Attribute) and inner.func.attr.value == "no_sync":
                        return f"backward() already runs under {facts.code(inner.func)}()"
        return None

    def _script_skips_sync(self) -> str | None:
        """Where the script already skips DDP's synchronisation: no_sync() or require_backward_grad_sync."""
        if self._skips is None:
            self._skips = [self._find_skips()]
        return self._skips[0]

    def _find_skips(self) -> str | None:
        for module in self.project.modules:
            for c in module.calls:
                if isinstance(c.func, cst.Attribute) and c.func.attr.value == "no_sync" and not c.args:
                    return f"the script calls {module.code(c.func)}() itself ({module.display}:{module.position(c)[0]})"
            for node in module.nodes(cst.AssignTarget):
                if isinstance(node.target, cst.Attribute):
                    if node.target.attr.value == "require_backward_grad_sync":
                        line = module.position(module.statement_of(node))[0]
                        return f"the script sets require_backward_grad_sync itself ({module.display}:{line})"
        return None

    def _region(self, facts: ModuleFacts, scope: StepScope, call: cst.Call, models: list[Wrapped]) -> _Region | str:
        found = self._accumulation(facts, scope, call)
        if isinstance(found, str):
            return found
        body, end, final, between = found
        start = _forward_start(self.project, facts, body, end)
        stmts = body[start : end + 1]
        targets = {m.target for m in models if m.target is not None}
        reads = set().union(*(chains(facts, s) for s in stmts))
        used = sorted(t for t in targets if t in reads)
        if not used:
            names = ", ".join(sorted(targets)) or "the DDP model"
            return f"the forward pass of {names} is not among the statements before backward() in its block"
        if len(used) > 1:
            return f"{' and '.join(used)} both run before backward(): no_sync() of one would not stop the other"
        bad = [n for n in walk(final, itself=True) if isinstance(n, _IMPURE) or (isinstance(n, cst.Call) and not _is_len(n))]
        final_code = _code(final)
        if bad:
            return f"the accumulation condition `{final_code}` runs code: it cannot be evaluated again before the forward"
        changed = conflicts(chains(facts, final), assigned_chains(facts, stmts + between))
        if changed:
            return f"{', '.join(changed)} changes between the forward pass and the accumulation condition `{final_code}`"
        model = used[0]
        conditional = any(m.conditional for m in models if m.target == model)
        return _Region(stmts, final, final_code, model, conditional)

    def _accumulation(
        self, facts: ModuleFacts, scope: StepScope, call: cst.Call
    ) -> tuple[list[cst.BaseStatement], int, cst.BaseExpression, list[cst.BaseStatement]] | str:
        """(block body, index of the statement holding backward, final-micro-step condition, the statements between
        that one and the condition), or why no gradient accumulation was found."""
        project = self.project
        s = facts.statement_of(call)
        while True:
            block = facts.block_of(s)
            body = list(block.body)
            i = body.index(s)
            for j in range(i + 1, len(body)):
                t = body[j]
                steps = [c for c in facts.calls_in(t) if project.is_step_call(facts, c)]
                if isinstance(t, cst.If):
                    if any(project.is_step_call(facts, c) for c in facts.calls_in(t.body)):
                        return body, i, t.test, body[i + 1 : j]
                    if _is_continue(t) and any(
                        project.is_step_call(facts, c) for later in body[j + 1 :] for c in facts.calls_in(later)
                    ):
                        return body, i, _negated(t.test), body[i + 1 : j]
                if steps:
                    return "the optimizer steps after every backward(): no gradient accumulation"
            owner = facts.parent(block)
            if owner is None or owner is scope.owner or isinstance(owner, (cst.FunctionDef, cst.Module)):
                return "no condition on the optimizer step after backward(): no gradient accumulation"
            owner = facts.statement_of(owner)
            if owner is scope.owner:
                return "no condition on the optimizer step after backward(): no gradient accumulation"
            if isinstance(owner, (cst.For, cst.While)):
                return self._micro_loop(facts, owner, body, i)
            s = owner

    def _micro_loop(
        self, facts: ModuleFacts, loop: cst.For | cst.While, body: list[cst.BaseStatement], i: int
    ) -> tuple[list[cst.BaseStatement], int, cst.BaseExpression, list[cst.BaseStatement]] | str:
        """``for micro in range(n): ... backward()`` with the step after the loop: the last ``micro`` is final."""
        project = self.project
        if any(project.is_step_call(facts, c) for c in facts.calls_in(loop)):
            return "the optimizer steps inside the micro-step loop"
        block = list(facts.block_of(loop).body)
        after = block[block.index(loop) + 1 :]
        if not any(project.is_step_call(facts, c) for s in after for c in facts.calls_in(s)):
            return "no optimizer step follows the micro-step loop"
        if not (
            isinstance(loop, cst.For)
            and isinstance(loop.target, cst.Name)
            and isinstance(loop.iter, cst.Call)
            and isinstance(loop.iter.func, cst.Name)
            and loop.iter.func.value == "range"
            and 1 <= len(loop.iter.args) <= 2
            and all(a.keyword is None and not a.star for a in loop.iter.args)
            and loop.orelse is None
        ):
            return "the micro-step loop is not `for i in range(n)`: its last micro-step cannot be told"
        stop = loop.iter.args[-1].value
        if isinstance(stop, cst.Integer):
            final_code = f"{loop.target.value} == {int(stop.value) - 1}"
        else:
            bare = isinstance(stop, (cst.Name, cst.Attribute, cst.Call, cst.Subscript))
            final_code = f"{loop.target.value} == {_code(stop) if bare else f'({_code(stop)})'} - 1"
        # range() read n once, before the first micro-step: n must not change inside the loop
        changed = conflicts(chains(facts, stop), assigned_chains(facts, list(loop.body.body)))
        if changed:
            return f"{', '.join(changed)} changes inside the micro-step loop"
        if any(isinstance(n, cst.Call) and not _is_len(n) for n in walk(stop, itself=True)):
            return f"the micro-step count `{_code(stop)}` runs code: it cannot be evaluated again"
        return body, i, expr(final_code), []


# --- helpers -----------------------------------------------------------------------------------------------


def _forward_start(project, facts: ModuleFacts, body: list[cst.BaseStatement], end: int) -> int:
    """Where the micro-step's forward begins: after the previous zero_grad, step or backward in the block.

    Zero_grad() calls right before backward() belong to the step (forward, loss, zero_grad, backward), as for the
    autocast transform, so that a region autocast wraps always lies inside this one.
    """
    k = end
    while k > 0 and project.is_zero_grad_statement(facts, body[k - 1]):
        k -= 1
    start = k
    while start > 0 and not _separator(project, facts, body[start - 1]):
        start -= 1
    if start == 0 and body and is_docstring(body[0]) and isinstance(facts.parent(facts.block_of(body[0])), cst.FunctionDef):
        start = 1
    return start


def _separator(project, facts: ModuleFacts, s: cst.BaseStatement) -> bool:
    return any(
        project.is_zero_grad_call(c) or project.is_backward_call(facts, c) or project.is_step_call(facts, c)
        for c in facts.calls_in(s)
    )




def _is_continue(node: cst.If) -> bool:
    body = node.body
    return (
        node.orelse is None
        and isinstance(body, cst.IndentedBlock)
        and len(body.body) == 1
        and isinstance(body.body[0], cst.SimpleStatementLine)
        and len(body.body[0].body) == 1
        and isinstance(body.body[0].body[0], cst.Continue)
    )


def _negated(test: cst.BaseExpression) -> cst.BaseExpression:
    """``not test``, written plainly: ``a != b`` -> ``a == b``, ``not x`` -> ``x``."""
    if isinstance(test, cst.Comparison) and len(test.comparisons) == 1 and isinstance(test.comparisons[0].operator, cst.NotEqual):
        op = test.comparisons[0].operator
        equal = cst.Equal(whitespace_before=op.whitespace_before, whitespace_after=op.whitespace_after)
        return test.with_changes(comparisons=[test.comparisons[0].with_changes(operator=equal)], lpar=[], rpar=[])
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        return test.expression.with_changes(lpar=[], rpar=[]) if not isinstance(test.expression, (cst.BooleanOperation, cst.IfExp)) else test.expression
    inner = _code(test)
    if isinstance(test, (cst.BooleanOperation, cst.IfExp, cst.Lambda, cst.NamedExpr)) and not test.lpar:
        inner = f"({inner})"
    return expr(f"not {inner}")


def _is_len(call: cst.Call) -> bool:
    return isinstance(call.func, cst.Name) and call.func.value == "len"


def _calls(node: cst.CSTNode) -> list[cst.Call]:
    return [n for n in walk(node, itself=True) if isinstance(n, cst.Call)]


def _code(node: cst.CSTNode) -> str:
    return cst.Module(body=[]).code_for_node(node)


def _with(head: str, body: list[cst.BaseStatement]) -> cst.With:
    first = body[0]
    inner = [first.with_changes(leading_lines=[]), *body[1:]]
    return cst.With(items=[cst.WithItem(expr(head))], body=cst.IndentedBlock(body=inner), leading_lines=first.leading_lines)


# === runtime: what the patched script runs (python -m autotune.catalog copies it into autotune/runtime_helpers.py) ===

import contextlib
from autotune.knob_values import knob


def no_sync(model, final_micro_step: bool):
    """``model.no_sync()`` on an accumulation micro-step that does not step, when the knob is on; else a null
    context. A model the script left unwrapped (no DDP in this run) has no ``no_sync`` and gets the null context."""
    if final_micro_step or not knob("no_sync.enabled"):
        return contextlib.nullcontext()
    skip = getattr(model, "no_sync", None)
    return skip() if skip is not None else contextlib.nullcontext()
