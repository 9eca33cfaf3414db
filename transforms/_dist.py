"""Facts the distributed transforms share: DDP and FSDP constructors, the process group, keyword arguments moved
into a runtime helper."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import libcst as cst

from autotune.analysis import ModuleFacts
from autotune.project import Project
from autotune.transform import Status
from autotune.syntax import positional

DDP = {"torch.nn.parallel.DistributedDataParallel", "torch.nn.parallel.distributed.DistributedDataParallel"}
FSDP = {
    "torch.distributed.fsdp.FullyShardedDataParallel",
    "torch.distributed.fsdp.fully_sharded_data_parallel.FullyShardedDataParallel",
}
FULLY_SHARD = {
    "torch.distributed.fsdp.fully_shard",
    "torch.distributed.fsdp._fully_shard.fully_shard",
    "torch.distributed.fsdp._fully_shard._fully_shard.fully_shard",
    "torch.distributed._composable.fsdp.fully_shard",
    "torch.distributed._composable.fsdp.fully_shard.fully_shard",
}
INIT_PROCESS_GROUP = {"torch.distributed.init_process_group", "torch.distributed.distributed_c10d.init_process_group"}
INIT_DEVICE_MESH = {"torch.distributed.device_mesh.init_device_mesh", "torch.distributed.init_device_mesh"}


def calls_to(facts: ModuleFacts, names: set[str]) -> list[cst.Call]:
    return [c for c in facts.calls if facts.qualname(c.func) in names]


def short_name(facts: ModuleFacts, call: cst.Call) -> str:
    return (facts.qualname(call.func) or facts.code(call.func)).rsplit(".", 1)[-1]


def runtime_splat(facts: ModuleFacts, call: cst.Call, helper: str) -> bool:
    """Whether ``call`` already passes ``**_autotune.<helper>(...)``: autotune patched it before."""
    return any(a.star == "**" and facts.is_runtime_call(a.value, helper) for a in call.args)


def wrapper_settings(
    transform, facts: ModuleFacts, call: cst.Call, label: str, settings: tuple[str, ...], helper: str,
    max_positional: int, leave_out: tuple[tuple[str, str], ...] = (),
) -> tuple[list[str], set[str]] | None:
    """The keyword settings of a wrapper call (``DDP(model, ...)``, ``FSDP(model, ...)``) that become knobs, and
    those the script wrote itself, with the call's site reported; None where none can: already knobs, settings that
    may come from ``**kwargs`` or by position, or every one written. ``leave_out``: (setting, why) never offered."""
    if runtime_splat(facts, call, helper):
        transform.report(facts, call, Status.PRESENT, f"{label} settings are already knobs")
        return None
    splat = next((a for a in call.args if a.star), None)
    if splat is not None:
        reason = f"{splat.star}{facts.code(splat.value)} may set the {label} settings"
        transform.report(facts, call, Status.NOT_APPLICABLE, reason)
        return None
    if len(positional(call)) > max_positional:
        transform.report(facts, call, Status.NOT_APPLICABLE, f"{label} settings may be passed by position")
        return None
    written = {a.keyword.value: a for a in call.args if a.keyword is not None and a.keyword.value in settings}
    kept = ", ".join(f"{n}={facts.code(a.value)}" for n, a in written.items())
    if len(written) == len(settings):
        transform.report(facts, call, Status.USER, f"{label}({kept}) is the script's choice")
        return None
    free = [n for n in settings if n not in written]
    notes = ""
    for name, why in leave_out:
        if name in free:
            free.remove(name)
            notes += f"; {name} left out: {why}"
    verb = "becomes a knob" if len(free) == 1 else "become knobs"
    reason = f"{label}: {', '.join(free)} {verb}" + (f"; {kept} kept as written" if kept else "") + notes
    transform.report(facts, call, Status.APPLICABLE, reason)
    return free, set(written)




# --- which names hold a DDP model ---------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Wrapped:
    """A ``DistributedDataParallel(...)`` call and the name the wrapped model is kept under."""

    facts: ModuleFacts
    call: cst.Call
    target: str | None  # code of the assignment target ("model", "self.model"), None when not seen
    conditional: bool  # assigned under an if (or as one branch of ``a if c else b``): may stay unwrapped


def _enclosing(facts: ModuleFacts, node: cst.CSTNode) -> Iterator[cst.CSTNode]:
    """Ancestors of ``node`` up to (not including) its function or the module."""
    for anc in facts.ancestors(node):
        if isinstance(anc, (cst.FunctionDef, cst.Module)):
            return
        yield anc


def _assigned(facts: ModuleFacts, node: cst.CSTNode) -> tuple[str | None, bool]:
    """The target ``node`` (a call, possibly one branch of a conditional expression) is assigned to."""
    conditional = False
    value = node
    parent = facts.parent(value)
    while isinstance(parent, cst.IfExp):  # model = DDP(model) if distributed else model
        conditional = True
        value, parent = parent, facts.parent(parent)
    if isinstance(parent, cst.Assign) and parent.value is value and len(parent.targets) == 1:
        target = parent.targets[0].target
        if isinstance(target, (cst.Name, cst.Attribute)):
            under_if = any(isinstance(a, (cst.If, cst.Try)) for a in _enclosing(facts, parent))
            return facts.code(target), conditional or under_if
    if isinstance(parent, cst.AnnAssign) and parent.value is value and isinstance(parent.target, (cst.Name, cst.Attribute)):
        under_if = any(isinstance(a, (cst.If, cst.Try)) for a in _enclosing(facts, parent))
        return facts.code(parent.target), conditional or under_if
    return None, conditional


def ddp_models(project: Project) -> list[Wrapped]:
    """Every DDP constructor of the project and where its result lands, through one local ``return`` if need be."""
    out = []
    for facts in project.modules:
        for call in calls_to(facts, DDP):
            target, conditional = _assigned(facts, call)
            if target is None and isinstance(facts.parent(call), cst.Return):
                fn = facts.function_of(call)
                for other in project.modules:
                    for site in other.calls:
                        if fn is not None and project.local_target(other, site) == (facts, fn):
                            t, c = _assigned(other, site)
                            if t is not None:
                                out.append(Wrapped(facts, call, t, c or conditional))
                continue
            out.append(Wrapped(facts, call, target, conditional))
    return out


class _Chains(cst.CSTVisitor):
    """The code of every name and attribute chain an expression reads (``self.step``, ``self``, ``i``)."""

    def __init__(self, facts: ModuleFacts) -> None:
        self.facts = facts
        self.found: set[str] = set()
        self.skip: set[cst.CSTNode] = set()

    def visit_Attribute(self, node: cst.Attribute) -> None:
        self.skip.add(node.attr)
        self.found.add(self.facts.module.code_for_node(node))

    def visit_Arg(self, node: cst.Arg) -> None:
        if node.keyword is not None:
            self.skip.add(node.keyword)

    def visit_Name(self, node: cst.Name) -> None:
        if node not in self.skip:
            self.found.add(node.value)


def chains(facts: ModuleFacts, node: cst.CSTNode) -> set[str]:
    visitor = _Chains(facts)
    node.visit(visitor)
    return visitor.found


class _Targets(cst.CSTVisitor):
    """The chains a block of statements assigns to (``i``, ``self.step``, ``counts`` for ``counts[0] = ...``)."""

    def __init__(self, facts: ModuleFacts) -> None:
        self.facts = facts
        self.found: set[str] = set()

    def _add(self, target: cst.BaseExpression) -> None:
        if isinstance(target, (cst.Tuple, cst.List)):
            for element in target.elements:
                self._add(element.value)
        elif isinstance(target, cst.StarredElement):
            self._add(target.value)
        elif isinstance(target, cst.Subscript):
            self._add(target.value)
        elif isinstance(target, (cst.Name, cst.Attribute)):
            self.found.add(self.facts.module.code_for_node(target))

    def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
        self._add(node.target)

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        self._add(node.target)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        self._add(node.target)

    def visit_For(self, node: cst.For) -> None:
        self._add(node.target)

    def visit_AsName(self, node: cst.AsName) -> None:
        self._add(node.name)

    def visit_NamedExpr(self, node: cst.NamedExpr) -> None:
        self._add(node.target)

    def visit_Del(self, node: cst.Del) -> None:
        self._add(node.target)

    def visit_Global(self, node: cst.Global) -> None:
        for item in node.names:
            self.found.add(item.name.value)


def assigned_chains(facts: ModuleFacts, stmts: list[cst.BaseStatement]) -> set[str]:
    visitor = _Targets(facts)
    for s in stmts:
        s.visit(visitor)
    return visitor.found


def conflicts(reads: set[str], writes: set[str]) -> list[str]:
    """The chains in ``reads`` that an assignment to one of ``writes`` changes (``self.step`` by ``self.step``)."""
    return sorted(r for r in reads if any(r == w or r.startswith(w + ".") for w in writes))


# --- the process group --------------------------------------------------------------------------------------


def backend_arg(call: cst.Call) -> cst.BaseExpression | None:
    """The backend an ``init_process_group`` call names, by keyword or first position."""
    for a in call.args:
        if a.keyword is not None and a.keyword.value == "backend":
            return a.value
    args = positional(call)
    return args[0] if args else None


def literal_string(node: cst.BaseExpression | None) -> str | None:
    if isinstance(node, cst.SimpleString):
        value = node.evaluated_value
        return value if isinstance(value, str) else None
    return None
