"""Facts the distributed transforms share: DDP and FSDP constructors, the process group, keyword arguments moved
into a runtime helper."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import libcst as cst

from autotune.analysis import ModuleFacts, Project
from autotune.transform import add_args, kwarg, star_kwargs

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


def nodes_of(facts: ModuleFacts, kind: type | tuple[type, ...]) -> list:
    """Every node of type ``kind`` in the file, in source order."""
    found: list = []

    class _Visitor(cst.CSTVisitor):
        def on_visit(self, node: cst.CSTNode) -> bool:
            if isinstance(node, kind):
                found.append(node)
            return True

    facts.module.visit(_Visitor())
    return found


def calls_to(facts: ModuleFacts, names: set[str]) -> list[cst.Call]:
    return [c for c in facts.calls if facts.qualname(c.func) in names]


def short_name(facts: ModuleFacts, call: cst.Call) -> str:
    return (facts.qualname(call.func) or facts.code(call.func)).rsplit(".", 1)[-1]


def positional(call: cst.Call) -> list[cst.Arg]:
    return [a for a in call.args if a.keyword is None and not a.star]


def runtime_splat(facts: ModuleFacts, call: cst.Call, helper: str) -> bool:
    """Whether ``call`` already passes ``**_autotune.<helper>(...)``: autotune patched it before."""
    return any(a.star == "**" and facts.is_runtime_call(a.value, helper) for a in call.args)


def moved(call: cst.Call, names: set[str], helper: str) -> cst.Call:
    """``call`` whose keyword arguments in ``names`` move, as written, into ``**helper(...)`` appended last."""
    args = list(call.args)
    taken = [a for a in args if a.keyword is not None and a.keyword.value in names]
    keep = [a for a in args if a not in taken]
    if keep and taken and keep[-1] is not args[-1]:
        keep[-1] = keep[-1].with_changes(comma=args[-1].comma)  # the last argument's comma: trailing or none
    space = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
    inner_args = [kwarg(a.keyword.value, a.value) for a in taken]
    inner_args = [a.with_changes(comma=space) for a in inner_args[:-1]] + inner_args[-1:]
    inner = cst.Call(func=cst.parse_expression(helper), args=inner_args)
    out = add_args(call.with_changes(args=keep), star_kwargs(inner))
    # a comment that followed a moved argument (one argument per line) now follows the helper's line
    comments = [c for a in taken if (c := _comment(a.comma)) is not None]
    last = out.args[-1]
    if comments and _comment(last.comma) is None and isinstance(last.comma, cst.Comma):
        ws = last.comma.whitespace_after
        if isinstance(ws, cst.ParenthesizedWhitespace):
            line = ws.first_line.with_changes(whitespace=cst.SimpleWhitespace("  "), comment=comments[0])
            out = out.with_changes(args=[*out.args[:-1], last.with_changes(comma=last.comma.with_changes(
                whitespace_after=ws.with_changes(first_line=line)))])
    return out


def _comment(comma: cst.Comma | cst.MaybeSentinel) -> cst.Comment | None:
    if isinstance(comma, cst.Comma) and isinstance(comma.whitespace_after, cst.ParenthesizedWhitespace):
        return comma.whitespace_after.first_line.comment
    return None


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
    return args[0].value if args else None


def literal_string(node: cst.BaseExpression | None) -> str | None:
    if isinstance(node, cst.SimpleString):
        value = node.evaluated_value
        return value if isinstance(value, str) else None
    return None
