"""Facts about a project's nn.Module classes that sdpa, checkpointing and compile share: what a class's attributes
are built from, which classes a name refers to across files, and where the repeated blocks of a model live."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import libcst as cst

from autotune.analysis import ModuleFacts, Project
from autotune.transform import fresh_name

# torch.nn modules that are a whole transformer block: worth checkpointing or compiling one at a time.
TORCH_BLOCKS = {"torch.nn.TransformerEncoderLayer", "torch.nn.TransformerDecoderLayer"}
# torch.nn modules that run repeated blocks kept under a known attribute path.
TORCH_STACKS = {
    "torch.nn.TransformerEncoder": ("layers",),
    "torch.nn.TransformerDecoder": ("layers",),
    "torch.nn.Transformer": ("encoder.layers", "decoder.layers"),
}
MODULE_LIST = "torch.nn.ModuleList"
SEQUENTIAL = "torch.nn.Sequential"
MODULE_DICT = "torch.nn.ModuleDict"
# Module methods that return the module itself: ``GPT(cfg).to(device)`` is still a GPT.
MODULE_CHAIN = {"to", "cuda", "cpu", "train", "eval", "float", "half", "double", "bfloat16", "requires_grad_"}


def is_name(node: cst.CSTNode, value: str | None = None) -> bool:
    return isinstance(node, cst.Name) and (value is None or node.value == value)


def self_attr(node: cst.CSTNode) -> str | None:
    """``self.blocks`` -> ``"blocks"``."""
    if isinstance(node, cst.Attribute) and is_name(node.value, "self"):
        return node.attr.value
    return None


def attr_chain(node: cst.CSTNode) -> list[str] | None:
    """``self.transformer.h`` -> ``["transformer", "h"]``; None for anything not rooted at ``self``."""
    parts: list[str] = []
    while isinstance(node, cst.Attribute):
        parts.append(node.attr.value)
        node = node.value
    return parts[::-1] if is_name(node, "self") and parts else None


def int_value(node: cst.BaseExpression) -> int | None:
    """The value of an integer literal, with an optional minus sign."""
    if isinstance(node, cst.Integer):
        return int(node.value)
    if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.Minus) and isinstance(node.expression, cst.Integer):
        return -int(node.expression.value)
    return None


def positional(call: cst.Call) -> list[cst.BaseExpression]:
    return [a.value for a in call.args if a.keyword is None and not a.star]


def argument(call: cst.Call, index: int | None, name: str) -> cst.BaseExpression | None:
    """The argument at ``index`` (None: keyword only) or named ``name``."""
    for a in call.args:
        if a.keyword is not None and a.keyword.value == name:
            return a.value
    pos = [a for a in call.args if a.keyword is None]
    if index is not None and 0 <= index < len(pos) and not pos[index].star:
        return pos[index].value
    return None


def bound_names(target: cst.BaseExpression) -> Iterator[str]:
    if isinstance(target, cst.Name):
        yield target.value
    elif isinstance(target, (cst.Tuple, cst.List)):
        for element in target.elements:
            yield from bound_names(element.value)
    elif isinstance(target, cst.StarredElement):
        yield from bound_names(target.value)


def names_read(facts: ModuleFacts, owner: cst.CSTNode) -> Iterator[cst.Name]:
    """The Name nodes under ``owner`` that read a variable (not assignment targets, attributes or keywords)."""
    for name in facts.nodes_in(owner, cst.Name):
        parent = facts.parent(name)
        if isinstance(parent, cst.Attribute) and parent.attr is name:
            continue
        if isinstance(parent, (cst.Arg, cst.Param)) and (getattr(parent, "keyword", None) is name or getattr(parent, "name", None) is name):
            continue
        if isinstance(parent, (cst.FunctionDef, cst.ClassDef, cst.ImportAlias, cst.AsName)):
            continue
        if _is_store(facts, name):
            continue
        yield name


def _is_store(facts: ModuleFacts, name: cst.Name) -> bool:
    node: cst.CSTNode = name
    parent = facts.parent(node)
    while isinstance(parent, (cst.Tuple, cst.List, cst.Element, cst.StarredElement)):
        node, parent = parent, facts.parent(parent)
    if isinstance(parent, cst.AssignTarget) and parent.target is node:
        return True
    if isinstance(parent, (cst.AnnAssign, cst.AugAssign)) and parent.target is node:
        return True
    if isinstance(parent, (cst.For, cst.CompFor)) and parent.target is node:
        return True
    return isinstance(parent, cst.AsName)


def assigned_names(facts: ModuleFacts, owner: cst.CSTNode) -> set[str]:
    """Names bound anywhere under ``owner`` (assignments, augmented assignments, loop targets, ``as``)."""
    out = set()
    for name in facts.nodes_in(owner, cst.Name):
        if _is_store(facts, name):
            out.add(name.value)
    return out


def scope_of(facts: ModuleFacts, node: cst.CSTNode) -> cst.CSTNode:
    """The function holding ``node``, or the module."""
    return facts.function_of(node) or facts.module


def assignments(facts: ModuleFacts, scope: cst.CSTNode, name: str, before: cst.CSTNode | None = None) -> list[cst.Assign]:
    """The ``name = ...`` statements of ``scope`` (not of functions nested in it), before ``before`` when given."""
    out = []
    for assign in facts.nodes_in(scope, cst.Assign):
        if scope_of(facts, assign) is not scope:
            continue
        if before is not None and facts._enter[assign] >= facts._enter[before]:
            continue
        if any(is_name(t.target, name) for t in assign.targets):
            out.append(assign)
    return out


def unique_name(facts: ModuleFacts, scope: cst.CSTNode, *candidates: str) -> str:
    """The first candidate the scope does not use yet (then ``candidate_2``...)."""
    return fresh_name({n.value for n in facts.nodes_in(scope, cst.Name)}, *candidates)


# --- classes -----------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class ClassRef:
    """A class defined in one of the project's files."""

    facts: ModuleFacts
    node: cst.ClassDef

    @property
    def name(self) -> str:
        return self.node.name.value

    @property
    def qualname(self) -> str:
        return f"{self.facts.modname}.{self.name}"

    def method(self, name: str) -> cst.FunctionDef | None:
        return self.facts.method_named(self.node, name)

    def attr_values(self, attr: str) -> list[cst.BaseExpression]:
        """What ``self.<attr>`` is assigned in the class's methods."""
        out = []
        for assign in self.facts.nodes_in(self.node, cst.Assign):
            if self.facts.class_of(assign) is not self.node:
                continue
            if any(self_attr(t.target) == attr for t in assign.targets):
                out.append(assign.value)
        return out

    def attr_value(self, attr: str) -> cst.BaseExpression | None:
        """The one value ``self.<attr>`` is given; None when it is given none or several."""
        values = self.attr_values(attr)
        return values[0] if len(values) == 1 else None

    def attrs(self) -> list[tuple[str, cst.BaseExpression]]:
        """``(attr, value)`` for each ``self.attr = value`` of ``__init__``, in order."""
        init = self.method("__init__")
        if init is None:
            return []
        out = []
        for assign in self.facts.nodes_in(init, cst.Assign):
            if self.facts.function_of(assign) is not init:
                continue
            for t in assign.targets:
                attr = self_attr(t.target)
                if attr is not None:
                    out.append((attr, assign.value))
        return out

    def buffer(self, name: str) -> cst.BaseExpression | None:
        """The value of ``self.register_buffer("name", value)``."""
        for call in self.facts.calls_in(self.node):
            func = call.func
            if isinstance(func, cst.Attribute) and func.attr.value == "register_buffer" and is_name(func.value, "self"):
                first = argument(call, 0, "name")
                if isinstance(first, cst.SimpleString) and first.evaluated_value == name:
                    return argument(call, 1, "tensor")
        return None

    def attr_ctor(self, attr: str, project: Project) -> str | None:
        """The qualified name of the class ``self.<attr>`` is built from (``torch.nn.Dropout``)."""
        value = self.attr_value(attr)
        if isinstance(value, cst.Call):
            return self.facts.qualname(value.func)
        return None


def find_class(project: Project, qual: str | None, depth: int = 0) -> ClassRef | None:
    """The local class named by a qualified name, following re-exports (``mylib.GPT`` -> ``mylib.model.GPT``)."""
    if not qual or depth > 3:
        return None
    modname, _, name = qual.rpartition(".")
    owner = project.by_modname(modname)
    if owner is None:
        return None
    if name in owner.classes and owner.class_of(owner.classes[name]) is None:
        return ClassRef(owner, owner.classes[name])
    alias = owner.imports.get(name)
    if alias and alias != qual:
        return find_class(project, alias, depth + 1)
    return None


def find_function(project: Project, qual: str | None) -> tuple[ModuleFacts, cst.FunctionDef] | None:
    if not qual:
        return None
    modname, _, name = qual.rpartition(".")
    owner = project.by_modname(modname)
    if owner is None:
        return None
    fn = owner.function_named(name)
    if fn is not None:
        return owner, fn
    alias = owner.imports.get(name)
    return find_function(project, alias) if alias and alias != qual else None


def enclosing_class(facts: ModuleFacts, node: cst.CSTNode) -> ClassRef | None:
    cls = facts.class_of(node)
    return ClassRef(facts, cls) if cls is not None else None


# --- what a model is built from ---------------------------------------------------------------------------


def model_class(project: Project, facts: ModuleFacts, scope: cst.CSTNode, expr: cst.BaseExpression, depth: int = 0):
    """The class an expression builds or holds: a ClassRef for a local class, a qualified name for a torch one.

    Follows ``.to(device)`` chains, names assigned earlier in the same function and local factory functions.
    """
    if depth > 4:
        return None
    while isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute) and expr.func.attr.value in MODULE_CHAIN:
        expr = expr.func.value
    if isinstance(expr, cst.Name):
        found = assignments(facts, scope, expr.value, before=None)
        for assign in reversed(found):
            result = model_class(project, facts, scope, assign.value, depth + 1)
            if result is not None:
                return result
        return None
    if not isinstance(expr, cst.Call):
        return None
    qual = facts.qualname(expr.func)
    ref = find_class(project, qual)
    if ref is not None:
        return ref
    if qual and qual.startswith("torch.nn."):
        return qual
    target = find_function(project, qual)
    if target is not None:
        owner, fn = target
        for ret in owner.nodes_in(fn, cst.Return):
            if ret.value is not None and owner.function_of(ret) is fn:
                result = model_class(project, owner, fn, ret.value, depth + 1)
                if result is not None:
                    return result
    return None


# --- repeated blocks ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stack:
    """A container of modules: its kind (ModuleList or Sequential) and the class its elements are built from."""

    kind: str
    element: str | None  # qualified class name, None when the elements differ or cannot be seen
    count: int | None  # how many elements, when written out one by one
    calls: tuple[cst.Call, ...] = ()  # the calls that build the elements
    facts: ModuleFacts | None = field(default=None, compare=False)  # the file those calls are in

    @property
    def short_kind(self) -> str:
        return self.kind.rsplit(".", 1)[-1]


def _element_calls(facts: ModuleFacts, scope: cst.CSTNode | None, node: cst.BaseExpression) -> list[cst.Call] | None:
    """The calls that build the elements of ``[Block() for _ in range(n)]``, ``[A(), B()]`` or a list built by appends."""
    if isinstance(node, (cst.ListComp, cst.GeneratorExp)):
        return [node.elt] if isinstance(node.elt, cst.Call) else None
    if isinstance(node, (cst.List, cst.Tuple)):
        calls = [e.value for e in node.elements]
        return calls if calls and all(isinstance(c, cst.Call) for c in calls) else None
    if isinstance(node, cst.Name) and scope is not None:
        found = assignments(facts, scope, node.value, before=node)
        if len(found) != 1:
            return None
        value = found[0].value
        if isinstance(value, cst.List) and not value.elements:
            appended = []
            for call in facts.calls_in(scope):
                func = call.func
                if isinstance(func, cst.Attribute) and func.attr.value == "append" and is_name(func.value, node.value):
                    args = positional(call)
                    if len(args) != 1 or not isinstance(args[0], cst.Call):
                        return None
                    appended.append(args[0])
            return appended or None
        return _element_calls(facts, None, value)
    return None


def stack_of(facts: ModuleFacts, scope: cst.CSTNode | None, value: cst.BaseExpression) -> Stack | None:
    """``nn.ModuleList([Block() for _ in range(n)])``, ``nn.Sequential(*blocks)``, ``nn.Sequential(A(), A())``."""
    if not isinstance(value, cst.Call):
        return None
    kind = facts.qualname(value.func)
    if kind not in (MODULE_LIST, SEQUENTIAL):
        return None
    calls: list[cst.Call] | None = None
    if kind == MODULE_LIST and len(value.args) == 1 and value.args[0].keyword is None and not value.args[0].star:
        calls = _element_calls(facts, scope, value.args[0].value)
    elif kind == SEQUENTIAL and len(value.args) == 1 and value.args[0].star == "*":
        calls = _element_calls(facts, scope, value.args[0].value)
    elif kind == SEQUENTIAL and value.args and all(a.keyword is None and not a.star for a in value.args):
        calls = [a.value for a in value.args] if all(isinstance(a.value, cst.Call) for a in value.args) else None
    if not calls:
        return Stack(kind, None, None, (), facts)
    quals = {facts.qualname(c.func) for c in calls}
    count = len(calls) if len(calls) > 1 else None
    return Stack(kind, quals.pop() if len(quals) == 1 else None, count, tuple(calls), facts)


def is_block_class(project: Project, qual: str | None) -> bool:
    """Whether elements built from ``qual`` are blocks: a local class, a torch transformer layer, or an
    nn.Sequential of layers (a block written inline)."""
    return qual in TORCH_BLOCKS or qual == SEQUENTIAL or find_class(project, qual) is not None


def dict_entry(facts: ModuleFacts, value: cst.BaseExpression, key: str) -> cst.BaseExpression | None:
    """The entry ``key`` of ``nn.ModuleDict(dict(key=...))`` or ``nn.ModuleDict({"key": ...})``."""
    if not (isinstance(value, cst.Call) and facts.qualname(value.func) == MODULE_DICT and len(value.args) == 1):
        return None
    inner = value.args[0].value
    if isinstance(inner, cst.Call) and is_name(inner.func, "dict"):
        return argument(inner, None, key)
    if isinstance(inner, cst.Dict):
        for element in inner.elements:
            if isinstance(element, cst.DictElement) and isinstance(element.key, cst.SimpleString):
                if element.key.evaluated_value == key:
                    return element.value
    return None


def dict_entries(facts: ModuleFacts, value: cst.BaseExpression) -> list[tuple[str, cst.BaseExpression]]:
    if not (isinstance(value, cst.Call) and facts.qualname(value.func) == MODULE_DICT and len(value.args) == 1):
        return []
    inner = value.args[0].value
    if isinstance(inner, cst.Call) and is_name(inner.func, "dict"):
        return [(a.keyword.value, a.value) for a in inner.args if a.keyword is not None]
    if isinstance(inner, cst.Dict):
        return [
            (e.key.evaluated_value, e.value)
            for e in inner.elements
            if isinstance(e, cst.DictElement) and isinstance(e.key, cst.SimpleString)
        ]
    return []


def attr_stack(ref: ClassRef, chain: list[str]) -> Stack | None:
    """The container ``self.a`` or ``self.a.b`` (through a ModuleDict) is built as, in class ``ref``."""
    value = ref.attr_value(chain[0])
    if value is None:
        return None
    if len(chain) == 2:
        value = dict_entry(ref.facts, value, chain[1])
    elif len(chain) != 1:
        return None
    if value is None:
        return None
    return stack_of(ref.facts, ref.method("__init__"), value)


def block_paths(project: Project, model, depth: int = 0) -> list[str]:
    """Attribute paths, from a model of class ``model``, of the containers that hold its repeated blocks.

    The outermost ones only: ``transformer.h`` for nanoGPT, ``encoder.layers`` for an nn.TransformerEncoder.
    """
    if isinstance(model, str):
        return list(TORCH_STACKS.get(model, ()))
    if model is None or depth > 3:
        return []
    init = model.method("__init__")
    out: list[str] = []
    for attr, value in model.attrs():
        stack = stack_of(model.facts, init, value)
        if stack is not None:
            if stack.element and is_block_class(project, stack.element):
                out.append(attr)
            continue
        entries = dict_entries(model.facts, value)
        if entries:
            for key, sub in entries:
                stack = stack_of(model.facts, init, sub)
                if stack is not None and stack.element and is_block_class(project, stack.element):
                    out.append(f"{attr}.{key}")
            continue
        if isinstance(value, cst.Call):
            qual = model.facts.qualname(value.func)
            if qual in TORCH_STACKS:
                out.extend(f"{attr}.{p}" for p in TORCH_STACKS[qual])
                continue
            inner = find_class(project, qual)
            if inner is not None and inner is not model:
                out.extend(f"{attr}.{p}" for p in block_paths(project, inner, depth + 1))
    return list(dict.fromkeys(out))
