"""autocast: run forward and loss in bf16 or fp16 autocast, with a GradScaler only where fp16 needs one."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import libcst as cst
import libcst.matchers as m

from autotune.analysis import ModuleFacts
from autotune.project import Project, TrainingLoop, is_framework_backward
from autotune.bound import unbound
from autotune.knobs import Knob, Numerics, Role
from autotune.transform import Edits, Status, Transform
from autotune.syntax import (
    add_args,
    expr,
    fresh_name,
    is_literal,
    keyword,
    kwarg,
    positional_arg,
    stmt,
    walk,
)
from autotune.transforms._step import CLIP, device_type_code, forward_statements, last_steps

AUTOCAST = {
    "torch.autocast",
    "torch.amp.autocast",
    "torch.amp.autocast_mode.autocast",
    "torch.cuda.amp.autocast",
    "torch.cpu.amp.autocast",
}
GRAD_SCALER = {
    "torch.amp.GradScaler",
    "torch.amp.grad_scaler.GradScaler",
    "torch.cuda.amp.GradScaler",
    "torch.cpu.amp.GradScaler",
}
# enabled= by position: GradScaler(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled)
SCALER_ENABLED_AT = {"torch.cuda.amp.GradScaler": 4, "torch.cpu.amp.GradScaler": 4}
DTYPE_CODE = {"bf16": "bfloat16", "fp16": "float16"}


@dataclass
class _Plan:
    """What to do in one file: sites to report and nodes to rewrite."""

    reports: list[tuple[cst.CSTNode, Status, str]] = field(default_factory=list)
    wraps: list[list[cst.BaseStatement]] = field(default_factory=list)
    # bake: the device_type of each wrap's autocast, as code read at run time (None: whichever device torch has)
    devices: dict[cst.BaseStatement, str | None] = field(default_factory=dict)
    autocasts: list[cst.Call] = field(default_factory=list)  # the script's own, to make their dtype a knob
    switches: dict[cst.Call, cst.BaseExpression] = field(default_factory=dict)  # of those, their own switch (enabled=)
    scalers: list[cst.Call] = field(default_factory=list)  # the script's own GradScalers
    scale: list[cst.Call] = field(default_factory=list)  # backward() calls whose loss goes through a scaler
    steps: list[cst.Call] = field(default_factory=list)
    updates: list[cst.Call] = field(default_factory=list)  # bake: steps followed by scaler.update()
    unscale: list[tuple[cst.BaseStatement, str]] = field(default_factory=list)  # (clip statement, optimizer code)
    scaler_before: list[cst.BaseStatement] = field(default_factory=list)  # bake: create the scaler before these
    scaler_at_top: bool = False  # bake: create the scaler after the imports


class Autocast(Transform):
    """Wrap forward and loss in torch.autocast (bf16 or fp16) and add a GradScaler only for fp16."""

    name = "autocast"
    knobs = (
        Knob(
            "autocast.dtype",
            ("default", "bf16", "fp16"),
            "default",
            Numerics.LOWP,
            role=Role.PRECISION,
            help="default: the script's own precision; bf16 or fp16 autocast around forward and loss "
            "(fp16 adds a GradScaler; a script's GradScaler is turned off under bf16)",
        ),
    )

    def __init__(self, project: Project, mode) -> None:
        super().__init__(project, mode)
        self._plans: dict[ModuleFacts, _Plan] | None = None
        self._scaler_name = "scaler"
        self._settled = False  # the script autocasts in bf16 only, without a GradScaler: nothing to tune
        self._bf16_only: str | None = None  # why fp16 is not offered (its gradient scaling cannot be placed safely)

    def knobs_read(self) -> tuple[Knob, ...]:
        """bf16 needs no gradient scaling: where fp16's cannot be placed safely, the knob offers bf16 alone."""
        if self._bf16_only is None:
            return self.knobs
        knob = self.knobs[0]
        return (replace(knob, choices=("default", "bf16"), help=f"{knob.help}; fp16 not offered here: {self._bf16_only}"),)

    # --- gated or baked code ---------------------------------------------------------------------------------

    def _dtype(self) -> str:
        return self.mode.value(self.knobs[0])

    def apply(self, facts: ModuleFacts, edits: Edits) -> None:
        if self._plans is None:
            self._plans = self._plan_project()
        plan = self._plans.get(facts)
        if plan is None:
            return
        for node, status, reason in plan.reports:
            self.report(facts, node, status, reason)
        if self.baking() and self._dtype() == "default":
            return
        if self.baking() and self._dtype() == "fp16" and self._bf16_only is not None:
            return  # (not offered: its scaling cannot be placed here; the site says why)
        if not (plan.autocasts or plan.scalers or plan.wraps or plan.scale or plan.steps):
            return
        torch = _torch_name(facts, edits, self.baking())
        for call in plan.autocasts:
            self._knob_autocast(facts, edits, call, torch, plan.switches.get(call))
        for call in plan.scalers:
            self._knob_scaler(facts, edits, call)
        for group in plan.wraps:
            if self.mode.gated:
                head = f"{edits.runtime('autocast')}(" + ("bf16_only=True" if self._bf16_only else "") + ")"
            else:
                # the script's own device, not the search's: a CPU search's "cpu" autocast does nothing on a GPU
                device = plan.devices.get(group[0]) or f'"cuda" if {torch}.cuda.is_available() else "cpu"'
                head = f"{torch}.autocast(device_type={device}, dtype={torch}.{DTYPE_CODE[self._dtype()]})"
            edits.wrap(group, lambda body, head=head: _with(head, body))
        if not self.mode.gated and self._dtype() != "fp16":
            return  # a GradScaler only serves fp16
        scaler = self._scaler_name
        for call in plan.scale:
            fn = edits.runtime("scale") if self.mode.gated else f"{scaler}.scale"
            edits.rewrite(call.func.value, lambda node, fn=fn: _call(fn, node))  # type: ignore[attr-defined]
        for call in plan.steps:
            # opt.step() -> _autotune.optimizer_step(opt), or scaler.step(opt) followed by scaler.update()
            fn = edits.runtime("optimizer_step") if self.mode.gated else f"{scaler}.step"
            edits.rewrite(call, lambda node, fn=fn: _call(fn, node.func.value))
            if not self.mode.gated and call in plan.updates:
                _add_after(facts, edits, call, f"{scaler}.update()")
        for clip_stmt, opt in plan.unscale:
            fn = edits.runtime("unscale_") if self.mode.gated else f"{scaler}.unscale_"
            edits.insert_before(clip_stmt, stmt(f"{fn}({opt})\n"))
        if not self.mode.gated:
            create = stmt(f'{scaler} = {torch}.amp.GradScaler("{self.mode.device}")\n')
            for loop_stmt in plan.scaler_before:
                edits.insert_before(loop_stmt, create)
            if plan.scaler_at_top:
                edits.after_imports(create.with_changes(leading_lines=[cst.EmptyLine()]))

    def _knob_autocast(
        self, facts: ModuleFacts, edits: Edits, call: cst.Call, torch: str, switched: cst.BaseExpression | None
    ) -> None:
        switch = facts.code(switched) if switched is not None else None
        if self.mode.gated:
            fn = edits.runtime("autocast_dtype")
            extra = f", enabled={switch}" if switch is not None else ""
            new = lambda value: expr(f"{fn}({value}{extra})")  # noqa: E731
            if switch is not None:
                on = edits.runtime("autocast_enabled")
                edits.rewrite(keyword(call, "enabled"), lambda node: node.with_changes(value=expr(f"{on}({switch})")))
        else:
            baked = f"{torch}.{DTYPE_CODE[self._dtype()]}"
            new = lambda value: expr(baked)  # noqa: E731
            if switch is not None and self._dtype() == "bf16":  # the plain setting: the region on
                edits.rewrite(keyword(call, "enabled"), lambda node: node.with_changes(value=expr("True")))
        arg = keyword(call, "dtype")
        if arg is None and positional_arg(call, 1) is not None:
            arg = positional_arg(call, 1)
        if arg is not None:
            code = facts.code(arg.value)
            edits.rewrite(arg, lambda node: node.with_changes(value=new(code)))
        else:
            edits.rewrite(call, lambda node: add_args(node, kwarg("dtype", new("None"))))

    def _knob_scaler(self, facts: ModuleFacts, edits: Edits, call: cst.Call) -> None:
        if self.mode.gated:
            fn = edits.runtime("scaler_enabled")
            new = lambda value: expr(f"{fn}({value})")  # noqa: E731
        elif self._dtype() == "bf16":
            new = lambda value: expr("False")  # noqa: E731
        else:
            return
        arg = _scaler_enabled_arg(facts, call)
        if arg is not None:
            code = facts.code(arg.value)
            edits.rewrite(arg, lambda node: node.with_changes(value=new(code)))
        else:
            edits.rewrite(call, lambda node: add_args(node, kwarg("enabled", new("True"))))

    # --- analysis --------------------------------------------------------------------------------------------

    def _plan_project(self) -> dict[ModuleFacts, _Plan]:
        project = self.project
        plans = {facts: _Plan() for facts in project.modules}
        autocasts = [(f, c) for f in project.modules for c in f.calls if f.qualname(c.func) in AUTOCAST]
        scalers = [(f, c) for f in project.modules for c in f.calls if f.qualname(c.func) in GRAD_SCALER]
        self._scaler_name = fresh_name(set().union(*(f.names for f in project.modules)), "scaler", "grad_scaler", "amp_scaler")
        in_loops: set[cst.Call] = set()
        for loop in project.loops:
            for scope in loop.scopes:
                in_loops.update(scope.backward)
        for facts in project.modules:
            for call in facts.calls:
                if project.is_backward_call(facts, call) and call not in in_loops:
                    plans[facts].reports.append((call, Status.NOT_APPLICABLE, "backward() outside any training loop"))
        if not project.loops:
            for facts, call in autocasts + scalers:
                plans[facts].reports.append((call, Status.NOT_APPLICABLE, "no training loop to tune the precision of"))
            return plans

        enabled_autocasts = [(f, c) for f, c in autocasts if _enabled_autocast(f, c)]
        # bf16 autocast without a GradScaler is already the optimization: trying fp16 would mean adding a scaler
        # (not where the script switches its region itself, enabled=use_amp: it may be off, and bf16 turns it on)
        self._settled = bool(enabled_autocasts) and not scalers and all(
            _dtype_qualname(f, c) == "torch.bfloat16" and _switch(c) is None for f, c in enabled_autocasts
        )
        for facts, call in autocasts:
            plan, code = plans[facts], _short(facts, call)
            enabled = keyword(call, "enabled")
            dtype = keyword(call, "dtype") or positional_arg(call, 1)
            if enabled is not None and is_literal(enabled.value, False):
                plan.reports.append((call, Status.USER, f"{code}: an autocast-free region, kept as written"))
            elif self._settled:
                reason = "the script already autocasts in bf16, which needs no GradScaler"
                plan.reports.append((call, Status.PRESENT, reason))
            elif dtype is not None and facts.is_runtime_call(dtype.value, "autocast_dtype"):
                plan.reports.append((call, Status.PRESENT, f"{code}: its dtype is already a knob"))
            else:
                uses = f"dtype={facts.code(dtype.value)}" if dtype is not None else "the device's default dtype"
                reason = f"the script autocasts ({uses}); its dtype becomes the knob"
                switch = _switch(call)
                if switch is not None:
                    reason = (
                        f"the script autocasts ({uses}) behind its own switch, enabled={facts.code(switch)} (present, "
                        "switched off where that is false): its dtype becomes the knob, and bf16 switches the region on"
                    )
                    plan.switches[call] = switch
                plan.reports.append((call, Status.PRESENT, reason))
                plan.autocasts.append(call)
        for facts, call in scalers:
            plan, code = plans[facts], _short(facts, call)
            enabled = _scaler_enabled_arg(facts, call)
            if enabled is not None and facts.is_runtime_call(enabled.value, "scaler_enabled"):
                plan.reports.append((call, Status.PRESENT, f"{code}: already turned off under bf16"))
            else:
                plan.reports.append((call, Status.PRESENT, f"the script has {code}; it is turned off under bf16"))
                plan.scalers.append(call)

        seen: set[cst.Call] = set()
        for loop in project.loops:
            self._plan_loop(loop, plans, bool(scalers), seen)
        if not any(p.autocasts or p.wraps for p in plans.values()):
            # bf16 would only turn the scaler off: no autocast region the knob controls runs in the training
            for facts, call in scalers:
                plan = plans[facts]
                if call in plan.scalers:
                    plan.scalers.remove(call)
                    reason = f"{_short(facts, call)}: no autocast region the knob could switch to bf16, so it stays"
                    plan.reports = [(n, st, r) if n is not call else (n, Status.NOT_APPLICABLE, reason) for n, st, r in plan.reports]
        return plans

    def _plan_loop(self, loop: TrainingLoop, plans: dict[ModuleFacts, _Plan], has_scaler: bool, seen: set) -> None:
        project = self.project
        backwards = [(s, c) for s in loop.scopes for c in s.backward if c not in seen]
        seen.update(c for _, c in backwards)
        if not backwards:
            return
        blocker = _blocker(project, loop)
        if blocker is not None:
            for scope, call in backwards:
                plans[scope.module].reports.append((call, Status.NOT_APPLICABLE, blocker))
            return
        script_autocast = _autocast_in_reach(project, loop)
        work = {facts: _Plan() for facts in {s.module for s in loop.scopes}}
        covered = False  # some forward and loss runs under autocast: fp16 then needs a GradScaler
        for scope, call in backwards:
            facts, plan = scope.module, work[scope.module]
            recv = call.func.value  # type: ignore[attr-defined]
            loss, scaled = _unwrap_scale(recv)
            if scaled and not facts.is_runtime_call(recv):
                has_scaler = True  # a scaler the script was handed: it manages scaling
            if not scaled:
                plan.scale.append(call)
            if script_autocast is not None:
                where, at = script_autocast
                line = where.position(at)[0]
                plan.reports.append((call, Status.PRESENT, f"the loop already autocasts ({where.display}:{line})"))
                covered = covered or not self._settled
                continue
            if any(isinstance(n, cst.Call) for n in walk(loss, itself=True)):
                reason = "the loss is computed in the backward() statement itself"
                plan.reports.append((call, Status.NOT_APPLICABLE, reason))
                continue
            group, why = forward_statements(project, facts, call)
            if group is None:
                plan.reports.append((call, Status.NOT_APPLICABLE, why))
                continue
            covered = True
            if any(_enabled_autocast(facts, c) for s in group for c in facts.calls_in(s)):
                plan.reports.append((call, Status.PRESENT, "already under autocast"))
                continue
            n = len(group)
            plan.reports.append(
                (call, Status.APPLICABLE, f"{n} statement{'s' if n > 1 else ''} of forward and loss before "
                 f"{facts.code(call.func)}() run under autocast")
            )
            plan.wraps.append(group)
            if self.baking():
                plan.devices[group[0]] = device_type_code(facts, scope, call, group)
        if has_scaler or not covered:
            for plan in work.values():
                plan.scale.clear()
        else:
            # fp16 without a GradScaler in the script: autotune's own scales every backward of the loop
            unbound_at: list[str] = []
            for scope in loop.scopes:
                facts, plan = scope.module, work[scope.module]
                steps = [c for c in scope.steps if not facts.is_runtime_call(c) and c not in plan.steps]
                plan.steps.extend(steps)
                plan.updates.extend(last_steps(facts, scope, steps))
                unbound_at.extend(self._plan_clips(scope, plan))
            by_hand = next(((s.module, u) for s in loop.scopes for u in s.updates), None)
            reason = None
            if unbound_at:
                reason = f"{unbound_at[0]}, where fp16 would unscale its gradients"
            elif by_hand is not None:
                where, update = by_hand
                reason = (f"the parameters are updated by hand ({where.display}:{where.position(update)[0]}), "
                          "from gradients fp16 would scale and no GradScaler unscales")
            elif self.baking() and self._dtype() == "fp16" and not self._place_scaler(loop, work):
                reason = "fp16 needs one GradScaler for backward() and step(), and they sit in different files"
            if reason is not None and (unbound_at or by_hand is not None) and not has_scaler:
                # bf16 needs none of that scaling: the autocast regions stay, with bf16 the only choice
                self._bf16_only = reason
                for plan in work.values():
                    plan.scale.clear()
                    plan.steps.clear()
                    plan.updates.clear()
                    plan.unscale.clear()
                    plan.reports = [
                        (n, st, f"{r}; bf16 only: {reason}" if st is Status.APPLICABLE else r) for n, st, r in plan.reports
                    ]
            elif reason is not None:
                work = {f: _Plan() for f in work}
                for scope, call in backwards:
                    work[scope.module].reports.append((call, Status.NOT_APPLICABLE, reason))
        for facts, plan in work.items():
            # a helper two loops call (a warm-up loop and the training loop both stepping through
            # manager.step_optimizers()) is planned once per loop: its nodes are rewritten once
            target = plans[facts]
            for name in ("reports", "wraps", "scale", "steps", "updates", "unscale", "scaler_before"):
                have = getattr(target, name)
                have.extend(x for x in getattr(plan, name) if x not in have)
            target.devices.update(plan.devices)
            target.scaler_at_top |= plan.scaler_at_top

    @staticmethod
    def _plan_clips(scope, plan: _Plan) -> list[str]:
        """Under fp16, gradients are unscaled before clipping, for the optimizer whose step follows the clip; says
        where that optimizer is not bound on every path to the clip."""
        facts = scope.module
        order = facts._enter
        unbound_at = []
        for clip in facts.calls_in(scope.owner):
            if facts.qualname(clip.func) not in CLIP:
                continue
            clip_stmt = facts.statement_of(clip)
            if _after_unscale(facts, clip_stmt):
                continue
            later = sorted((c for c in scope.steps if order[c] > order[clip]), key=order.__getitem__)
            if not later:
                reason = "no optimizer step follows this clipping in its scope: under fp16 it clips scaled gradients"
                plan.reports.append((clip, Status.NOT_APPLICABLE, reason))
                continue
            opt = _optimizer_of(facts, later[0])
            if unbound(facts, clip_stmt, opt):  # ``if args.optimizer: optimizer = ...`` else a hand-written update
                unbound_at.append(f"{opt} is not bound on every path to the clipping at {facts.display}:{facts.position(clip)[0]}")
            plan.unscale.append((clip_stmt, opt))
        return unbound_at

    def _place_scaler(self, loop: TrainingLoop, work: dict[ModuleFacts, _Plan]) -> bool:
        """Bake: create the scaler before the loop, or after the imports of the one file that uses it.

        Before the loop only when that runs once per call of a function no loop calls again, so the scaler keeps
        its scale for the whole run, as the runtime's does.
        """
        nodes = [(f, c) for f, p in work.items() for c in p.scale + p.steps]
        home = loop.module.function_of(loop.outer)
        if home is not None and self._called_in_a_loop(home):
            home = False  # type: ignore[assignment]
        if all(f is loop.module and f.function_of(c) is home for f, c in nodes):
            work[loop.module].scaler_before.append(loop.outer)
            return True
        files = {f for f, _ in nodes}
        if len(files) == 1:
            work[files.pop()].scaler_at_top = True
            return True
        return False

    def _called_in_a_loop(self, function: cst.FunctionDef) -> bool:
        for facts in self.project.modules:
            for call in facts.calls:
                target = self.project.local_target(facts, call)
                if target is not None and target[1] is function:
                    if any(isinstance(a, (cst.For, cst.While)) for a in facts.ancestors(call)):
                        return True
        return False


# --- helpers -----------------------------------------------------------------------------------------------


def _short(facts: ModuleFacts, call: cst.Call) -> str:
    return f"{facts.code(call.func)}(...)"


def _dtype_qualname(facts: ModuleFacts, call: cst.Call) -> str | None:
    dtype = keyword(call, "dtype") or positional_arg(call, 1)
    return facts.qualname(dtype.value) if dtype is not None else None


def _switch(call: cst.Call) -> cst.BaseExpression | None:
    """The script's own switch of an autocast region, ``enabled=use_amp``: an expression that reads names,
    attributes, items and literals, and compares them (the knob's code reads it twice, so it must do nothing of its
    own); None where the region is always on, off by a literal, or switched by anything else (a call)."""
    enabled = keyword(call, "enabled")
    if enabled is None or is_literal(enabled.value, True) or is_literal(enabled.value, False):
        return None
    acts = (cst.Call, cst.NamedExpr, cst.Await, cst.Yield, cst.Lambda, cst.ListComp, cst.SetComp, cst.DictComp,
            cst.GeneratorExp)
    if any(isinstance(n, acts) for n in walk(enabled.value, itself=True)):
        return None
    return enabled.value


def _enabled_autocast(facts: ModuleFacts, call: cst.Call) -> bool:
    if facts.is_runtime_call(call, "autocast"):
        return True
    if facts.qualname(call.func) not in AUTOCAST:
        return False
    enabled = keyword(call, "enabled")
    return enabled is None or not is_literal(enabled.value, False)


def _autocast_in_reach(project: Project, loop: TrainingLoop) -> tuple[ModuleFacts, cst.Call] | None:
    """An autocast the script runs in this loop: in it, in the local functions it calls, or in a local model."""
    queue: list[tuple[ModuleFacts, cst.CSTNode, int]] = [(loop.module, loop.outer, 0)]
    seen: set[cst.CSTNode] = {loop.outer}
    for facts in project.modules:
        for cls_name, cls in facts.classes.items():
            if f"{facts.modname}.{cls_name}" in project.module_classes:
                queue.append((facts, cls, 0))
    while queue:
        facts, node, depth = queue.pop(0)
        for call in facts.calls_in(node):
            if _enabled_autocast(facts, call) and not facts.is_runtime_call(call):
                return facts, call
        for with_ in facts.nodes_in(node, cst.With):
            found = _autocast_context(facts, with_)
            if found is not None:
                return facts, found
            if depth < 3:
                target = project.local_target(facts, call)
                if target is not None and target[1] not in seen:
                    seen.add(target[1])
                    queue.append((target[0], target[1], depth + 1))
    return None


def _autocast_context(facts: ModuleFacts, with_: cst.With) -> cst.Call | None:
    """The autocast a ``with ctx:`` enters, where ``ctx`` is a variable the file binds to an autocast (nanoGPT's
    ``ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(...)``)."""
    for item in with_.items:
        if not isinstance(item.item, cst.Name):
            continue
        for assign in facts.assigns:
            if any(isinstance(t.target, cst.Name) and t.target.value == item.item.value for t in assign.targets):
                found = next((c for c in facts.calls_in(assign.value) if _enabled_autocast(facts, c)), None)
                if found is not None:
                    return found
    return None


def _unwrap_scale(recv: cst.BaseExpression) -> tuple[cst.BaseExpression, bool]:
    """The loss inside ``scaler.scale(loss)`` or ``_autotune.scale(loss)``, and whether it was scaled."""
    if m.matches(recv, m.Call(func=m.Attribute(attr=m.Name("scale")), args=[m.Arg()])):
        return recv.args[0].value, True
    return recv, False


def _scaler_enabled_arg(facts: ModuleFacts, call: cst.Call) -> cst.Arg | None:
    at = SCALER_ENABLED_AT.get(facts.qualname(call.func) or "", 5)
    return keyword(call, "enabled") or positional_arg(call, at)


def _after_unscale(facts: ModuleFacts, s: cst.BaseStatement) -> bool:
    """Whether the statement before ``s`` is ``_autotune.unscale_(...)`` (already patched)."""
    body = list(facts.block_of(s).body)
    i = body.index(s)
    if i == 0 or not isinstance(body[i - 1], cst.SimpleStatementLine):
        return False
    return any(facts.is_runtime_call(c, "unscale_") for c in facts.calls_in(body[i - 1]))


def _optimizer_of(facts: ModuleFacts, step: cst.Call) -> str:
    return facts.code(step.func.value)  # type: ignore[attr-defined]


def _blocker(project: Project, loop: TrainingLoop) -> str | None:
    """Why no GradScaler can serve this loop, if one cannot."""
    for scope in loop.scopes:
        facts = scope.module
        for call in scope.backward:
            if facts.qualname(call.func) in ("torch.autograd.backward", "torch.backward"):
                return f"{facts.code(call.func)}() is not a loss.backward() a GradScaler can scale"
            if is_framework_backward(facts, call):
                return f"{facts.code(call.func)}(loss): the library runs backward and mixed precision itself"
        for call in scope.steps:
            recv = call.func.value if isinstance(call.func, cst.Attribute) else None
            if call.args and recv is not None and project.is_optimizer_expr(facts, recv):
                return f"{facts.code(call.func)}(closure): a GradScaler cannot step with a closure"
    return None


def _call(fn: str, arg: cst.BaseExpression) -> cst.Call:
    """``fn(arg)``, without the parentheses ``arg`` carried as a receiver (``(loss / n).backward()``)."""
    if isinstance(arg, (cst.BinaryOperation, cst.Name, cst.Attribute, cst.Subscript, cst.Call)) and arg.lpar:
        arg = arg.with_changes(lpar=[], rpar=[])
    return cst.Call(func=expr(fn), args=[cst.Arg(arg)])


def _add_after(facts: ModuleFacts, edits: Edits, call: cst.Call, code: str) -> None:
    """Run ``code`` right after the small statement holding ``call``, on its own line when it has one."""
    small = next(a for a in facts.ancestors(call) if isinstance(a, cst.BaseSmallStatement))
    container = facts.parent(small)
    if isinstance(container, cst.SimpleStatementLine) and len(container.body) == 1:
        edits.insert_after(container, stmt(code + "\n"))
        return
    at = list(container.body).index(small) + 1
    extra = cst.Expr(expr(code))

    def insert(node):
        body = list(node.body)
        body[at - 1] = body[at - 1].with_changes(semicolon=cst.MaybeSentinel.DEFAULT)
        body.insert(at, extra)
        return node.with_changes(body=body)

    edits.rewrite(container, insert)


def _with(head: str, body: list[cst.BaseStatement]) -> cst.With:
    first = body[0]
    inner = [first.with_changes(leading_lines=[]), *body[1:]]
    return cst.With(
        items=[cst.WithItem(expr(head))],
        body=cst.IndentedBlock(body=inner),
        leading_lines=first.leading_lines,
    )


def _torch_name(facts: ModuleFacts, edits: Edits, baking: bool) -> str:
    """The name this module binds to the torch package (baked code spells dtypes and autocast through it)."""
    for alias, qual in facts.imports.items():
        if qual == "torch":
            return alias
    if baking:
        edits.require_import("torch")
    return "torch"


# === runtime: what the patched script runs (python -m autotune.catalog copies it into autotune/runtime_helpers.py) ===

import contextlib
from autotune.knob_values import _fail, device_type, knob, took_effect


_scaler_obj = None
_update_pending = False  # an optimizer stepped through the scaler since its last update()


def _dtype(name: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}[name]


def autocast(bf16_only: bool = False):
    """The autocast region autotune injected around forward and loss; a null context by default.

    ``bf16_only``: the script has no place where fp16's gradient scaling could go (an optimizer not bound on every
    path to a clipping), so fp16 is refused rather than run unscaled.
    """
    dtype = knob("autocast.dtype")
    if dtype == "default":
        return contextlib.nullcontext()
    if bf16_only and dtype != "bf16":
        _fail(f"autocast.dtype={dtype} is not offered for this script (bf16 only: fp16's gradient scaling has no "
              "safe place here; see autotune scan)")
    import torch

    return torch.autocast(device_type=device_type(), dtype=_dtype(dtype))


def autocast_dtype(script_dtype, enabled=True):
    """The dtype of an autocast region the script already had: its own by default, else the knob's. ``enabled``:
    the script's own switch of the region (``enabled=use_amp``), where it has one: the knob takes effect only
    where the region runs (see autocast_enabled)."""
    dtype = knob("autocast.dtype", record=False)
    if dtype == "default":
        return script_dtype
    chosen = _dtype(dtype)
    if chosen != script_dtype and (enabled or dtype == "bf16"):  # (the script's own dtype changes nothing)
        took_effect("autocast.dtype")
    return chosen


def autocast_enabled(script_enabled):
    """Whether a region the script switches itself (``enabled=use_amp``) runs: as the script says, and under bf16
    also where its switch is off (bf16 needs no loss scaling; fp16 keeps the switch, as the script's own scaler
    goes with it)."""
    if script_enabled or knob("autocast.dtype", record=False) != "bf16":
        return script_enabled
    took_effect("autocast.dtype")
    return True


def scaler_enabled(script_enabled: bool = True) -> bool:
    """Whether the script's own GradScaler stays on: off under bf16, which needs no loss scaling."""
    # not recorded as applied: bf16 takes effect where a region runs in it (a scaler turned off alone changes no
    # numbers: nanoGPT's is on by its own flag on a CPU, where it disables itself)
    return bool(script_enabled) and knob("autocast.dtype", record=False) != "bf16"


def _scaler():
    global _scaler_obj
    if _scaler_obj is None:
        import torch

        _scaler_obj = torch.amp.GradScaler(device_type())
    return _scaler_obj


def _fp16_injected() -> bool:
    # (autotune's own autocast region records the knob where it enters one: these helpers only follow it)
    return knob("autocast.dtype", record=False) == "fp16"


def scale(loss):
    """``loss`` scaled by autotune's GradScaler under fp16; ``loss`` itself otherwise."""
    global _update_pending
    if not _fp16_injected():
        return loss
    scaler = _scaler()
    if _update_pending:
        # one update() after all the optimizer steps that followed the previous backward (several optimizers
        # stepped on one loss must be unscaled with the same scale)
        scaler.update()
        _update_pending = False
    return scaler.scale(loss)


def unscale_(optimizer) -> None:
    """Unscale gradients before clipping, under fp16 only."""
    if _fp16_injected():
        _scaler().unscale_(optimizer)


def optimizer_step(optimizer, *args, **kwargs):
    """``optimizer.step()``, through autotune's GradScaler under fp16 (its update() comes with the next scale())."""
    global _update_pending
    if not _fp16_injected():
        return optimizer.step(*args, **kwargs)
    result = _scaler().step(optimizer, *args, **kwargs)
    _update_pending = True
    return result
