"""Facts about a project's nn.Module classes that sdpa, checkpointing and compile share: what a class's attributes
are built from, which classes a name refers to across files, and where the repeated blocks of a model live."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import libcst as cst

from autotune.analysis import ModuleFacts
from autotune.project import Framework, Project
from autotune.syntax import argument, assignments, binds, is_name, positional, scope_of, self_attr
from autotune.transforms._sites import diffusers_model, strip_module_chain

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


def zoo_factory(facts: ModuleFacts, call: cst.Call) -> str | None:
    """``models.__dict__[args.arch]()`` (the ImageNet example's pick by name) -> ``torchvision.models.<arch>``."""
    func = call.func
    if isinstance(func, cst.Subscript) and isinstance(func.value, cst.Attribute) and func.value.attr.value == "__dict__":
        owner = facts.qualname(func.value.value) or ""
        if owner in ("torchvision.models", "timm.models"):
            return f"{owner}.<arch>"
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


def model_class(project: Project, facts: ModuleFacts, scope: cst.CSTNode, expr: cst.BaseExpression, depth: int = 0,
                index: int | None = None):
    """The class an expression builds or holds: a ClassRef for a local class, a qualified name for a torch one.

    Follows ``.to(device)`` chains, names assigned earlier in the same function (also unpacked from a tuple) and
    local factory functions; ``index``: the element of the tuple ``expr`` gives that is meant.
    """
    if depth > 4:
        return None
    while isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute) and expr.func.attr.value in MODULE_CHAIN:
        expr = expr.func.value
    if isinstance(expr, cst.Name):
        found = assignments(facts, scope, expr.value, before=None, unpacking=True)
        for assign in reversed(found):
            index = unpacked_index(facts, assign, expr.value)
            result = model_class(project, facts, scope, assign.value, depth + 1, index)
            if result is not None:
                return result
        return None
    if index is not None and isinstance(expr, (cst.Tuple, cst.List)):  # ``model, opt = GPT(cfg), None``
        elements = expr.elements
        return model_class(project, facts, scope, elements[index].value, depth + 1) if index < len(elements) else None
    if not isinstance(expr, cst.Call):
        return None
    qual = facts.qualname(expr.func) or zoo_factory(facts, expr)
    if index is None:
        ref = find_class(project, qual)
        if ref is not None:
            return ref
        if qual and (qual.startswith(("torch.nn.", "torchvision.models.", "timm.models.")) or qual == "timm.create_model"):
            return qual
        if diffusers_model(qual) is not None:
            return diffusers_model(qual)
    target = find_function(project, qual)
    if target is not None:  # a local factory: what it returns (element ``index`` of the tuple it returns)
        owner, fn = target
        for ret in owner.nodes_in(fn, cst.Return):
            if ret.value is not None and owner.function_of(ret) is fn:
                result = model_class(project, owner, fn, ret.value, depth + 1, index)
                if result is not None:
                    return result
    return None


def unpacked_index(facts: ModuleFacts, assign: cst.Assign, name: str) -> int | None:
    """Where ``name`` sits in the tuple ``assign`` unpacks (``model, opt = ...``: 0 for model); None where the
    assignment binds it whole."""
    for target in assign.targets:
        if isinstance(target.target, (cst.Tuple, cst.List)):
            elements = target.target.elements
            if any(isinstance(e, cst.StarredElement) for e in elements):
                return None
            for i, element in enumerate(elements):
                if binds(facts, element.value, name):
                    return i
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


def attr_stack_of(facts: ModuleFacts, init: cst.CSTNode | None, attr: str, value: cst.BaseExpression) -> Stack | None:
    """``stack_of`` for ``self.<attr> = value``, also when an empty ``nn.ModuleList()`` is filled in ``__init__``
    by ``self.<attr>.append(Block(...))`` (LLaMA's reference model)."""
    stack = stack_of(facts, init, value)
    if stack is None or stack.element is not None or stack.kind != MODULE_LIST or value.args or init is None:  # type: ignore[attr-defined]
        return stack
    calls = []
    for call in facts.calls_in(init):
        func = call.func
        if (
            isinstance(func, cst.Attribute)
            and func.attr.value == "append"
            and self_attr(func.value) == attr
            and len(call.args) == 1
            and isinstance(call.args[0].value, cst.Call)
        ):
            calls.append(call.args[0].value)
        elif isinstance(func, cst.Attribute) and self_attr(func.value) == attr:
            return stack  # extended, inserted into...: the elements cannot be seen
    quals = {facts.qualname(c.func) for c in calls}
    if len(quals) != 1:
        return stack
    return Stack(stack.kind, quals.pop(), None, tuple(calls), facts)


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
    if len(chain) == 1:
        return attr_stack_of(ref.facts, ref.method("__init__"), chain[0], value)
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
        stack = attr_stack_of(model.facts, init, attr, value)
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


# --- the models the training runs --------------------------------------------------------------------------

_MODULE_BASES = (
    "torch.nn.Module",
    "torch.nn.modules.module.Module",
    "lightning.LightningModule",
    "lightning.pytorch.LightningModule",
    "lightning.pytorch.core.LightningModule",
    "lightning.pytorch.core.module.LightningModule",
    "pytorch_lightning.LightningModule",
    "pytorch_lightning.core.LightningModule",
    "pytorch_lightning.core.module.LightningModule",
)
# DataParallel: a convenience wrapper that replicates the model at every forward, so whatever reaches the wrapper
# (``.apply(init)``, ``.to(memory_format=...)``) reaches the model; the script's own initialisation may follow it.
DATA_PARALLEL = {"torch.nn.DataParallel", "torch.nn.parallel.DataParallel", "torch.nn.parallel.data_parallel.DataParallel"}
# Wrappers that take hold of the parameters (gradient buckets, shards): the model must be final before them.
DIST_WRAPPERS = {
    "torch.nn.parallel.DistributedDataParallel",
    "torch.nn.parallel.distributed.DistributedDataParallel",
    "torch.distributed.fsdp.FullyShardedDataParallel",
    "torch.distributed.fsdp.fully_sharded_data_parallel.FullyShardedDataParallel",
}


def _wrapper(facts: ModuleFacts, assign: cst.Assign) -> str | None:
    """``"dp"`` or ``"dist"`` when ``assign`` wraps a model for data parallelism."""
    value = strip_module_chain(assign.value)  # ``DataParallel(model).cuda()``
    qual = facts.qualname(value.func) if isinstance(value, cst.Call) else None
    return "dp" if qual in DATA_PARALLEL else "dist" if qual in DIST_WRAPPERS else None


@dataclass(frozen=True, eq=False)
class TrainedModel:
    """A name a scope trains (``model``), the assignments that can bind it there, and where its training starts."""

    facts: ModuleFacts
    scope: cst.CSTNode
    name: str
    bindings: tuple[cst.Assign, ...]  # those that build a module, in source order: one per branch of an if/elif
    point: cst.BaseStatement  # convert or compile right after this statement: every binding and initialisation ran


class Training:
    """Which models a project trains: the names its optimizers, training loops and trainer functions use."""

    def __init__(self, project: Project) -> None:
        self.project = project
        self._callees: dict[cst.Call, cst.CSTNode | None] = {}
        self._holders: set[cst.CSTNode] | None = None

    def models(self) -> list[TrainedModel]:
        out: list[TrainedModel] = []
        seen: set[tuple[int, str]] = set()
        for facts in self.project.modules:
            for scope, name, use in self.uses(facts):
                if (id(scope), name) in seen:
                    continue
                found = assignments(facts, scope, name, before=use, unpacking=True)
                built = tuple(
                    a
                    for a in found
                    if _wrapper(facts, a) is None
                    and isinstance(strip_module_chain(a.value), cst.Call)
                    and model_class(self.project, facts, scope, a.value, index=unpacked_index(facts, a, name)) is not None
                )
                if not built:
                    continue
                seen.add((id(scope), name))
                dist = next((i for i, a in enumerate(found) if _wrapper(facts, a) == "dist"), len(found))
                start = found[max(dist - 1, 0)]
                out.append(TrainedModel(facts, scope, name, built, self._point(facts, name, start, use)))
        return out

    def uses(self, facts: ModuleFacts) -> Iterator[tuple[cst.CSTNode, str, cst.CSTNode]]:
        """(scope, name, use) for each name a scope trains: optimizer parameters, calls in the training loop, or
        arguments of a local function (or class) that holds the training loop."""
        project = self.project
        for ctor in project.optimizer_ctors(facts):
            for call in facts.calls_in(ctor):
                func = call.func
                if isinstance(func, cst.Attribute) and func.attr.value in ("parameters", "named_parameters"):
                    if isinstance(func.value, cst.Name):
                        yield scope_of(facts, ctor), func.value.value, ctor
                    elif self_attr(func.value) is not None:  # a trainer class's own ``self.model``
                        yield scope_of(facts, ctor), facts.code(func.value), ctor
        trainers = self.trainers()
        for loop in project.loops:
            if loop.module is not facts:
                continue
            scope = scope_of(facts, loop.node)
            for call in facts.calls_in(loop.node):
                if isinstance(call.func, cst.Name) and self.builds_module(facts, scope, call.func):
                    yield scope, call.func.value, call
        for fit in project.tuned_frameworks():  # ``trainer.fit(model, ...)``: the LightningModule it trains
            if fit.module is facts and fit.framework is Framework.LIGHTNING_TRAINER:
                arg = argument(fit.call, 0, "model")
                scope = scope_of(facts, fit.call)
                if isinstance(arg, cst.Name) and self.builds_module(facts, scope, arg):
                    yield scope, arg.value, fit.call
        for call in facts.calls:
            target = self.callee(facts, call)
            if target is None or target not in trainers:
                continue
            scope = scope_of(facts, call)
            for arg in call.args:
                if isinstance(arg.value, cst.Name) and self.builds_module(facts, scope, arg.value):
                    yield scope, arg.value.value, call

    def builds_module(self, facts: ModuleFacts, scope: cst.CSTNode, name: cst.Name) -> bool:
        built = model_class(self.project, facts, scope, name)
        if isinstance(built, str):
            last = built.rsplit(".", 1)[-1]
            return built.startswith(("torch.nn.", "torchvision.models.", "diffusers.")) and last[:1].isupper() and \
                not last.endswith("Loss")
        return built is not None and self.is_module_class(built)

    def is_module_class(self, ref: ClassRef, depth: int = 0) -> bool:
        for base in ref.node.bases:
            qual = ref.facts.qualname(base.value)
            if qual in _MODULE_BASES:
                return True
            parent = find_class(self.project, qual)
            if parent is not None and depth < 5 and self.is_module_class(parent, depth + 1):
                return True
        return False

    def callee(self, facts: ModuleFacts, call: cst.Call) -> cst.CSTNode | None:
        """The local function or class a call runs (a class: its ClassDef)."""
        # asked about every call, twice for calls in functions: remembered per call
        if call not in self._callees:
            self._callees[call] = self._resolve_callee(facts, call)
        return self._callees[call]

    def _resolve_callee(self, facts: ModuleFacts, call: cst.Call) -> cst.CSTNode | None:
        target = self.project.local_target(facts, call)
        if target is not None:
            return target[1]
        qual = facts.qualname(call.func)
        ref = find_class(self.project, qual)
        if ref is not None:
            return ref.node
        found = find_function(self.project, qual)
        return found[1] if found is not None else None

    def trainers(self) -> set[cst.CSTNode]:
        """Local functions (and classes, by a method) whose body holds a training loop, or calls one that does."""
        if self._holders is not None:
            return self._holders
        holders: set[cst.CSTNode] = set()
        for loop in self.project.loops:
            fn = loop.module.function_of(loop.node)
            if fn is not None:
                holders.add(fn)
                cls = loop.module.class_of(fn)
                if cls is not None:
                    holders.add(cls)
        for _ in range(2):  # one or two local calls away from the loop
            for facts in self.project.modules:
                for fn in facts.functions:
                    if fn in holders:
                        continue
                    if any(self.callee(facts, c) in holders for c in facts.calls_in(fn)):
                        holders.add(fn)
        self._holders = holders
        return holders

    # --- where training starts ----------------------------------------------------------------------------

    def _point(self, facts: ModuleFacts, name: str, last: cst.Assign, use: cst.CSTNode) -> cst.BaseStatement:
        """The statement after which ``name`` is bound on every path and initialised as the script wants it.

        From the last binding (lifted out of the if/elif that holds it, up to the block that also holds ``use``),
        past the statements that still touch the model (``.to(device)``, ``.apply(init_weights)``,
        ``load_state_dict``), up to the first that wraps it for data parallelism or starts training (an optimizer,
        a training loop, a trainer call).
        """
        around = set(facts.ancestors(use))
        node: cst.CSTNode = facts.statement_of(last)
        while not (isinstance(facts.parent(node), (cst.IndentedBlock, cst.Module)) and facts.parent(node) in around):
            parent = facts.parent(node)
            if parent is None or parent is use:
                break
            node = parent
        block = facts.parent(node)
        body = list(getattr(block, "body", ()))
        if node not in body:
            return facts.statement_of(last)
        point = node
        for s in body[body.index(node) + 1 :]:
            if facts.contains(s, use) or self._starts_training(facts, s) or self._wraps(facts, s, name):
                break
            if any(not _reads_only(facts, n) for n in _mentions(facts, s, name)):
                point = s
        return point

    def _starts_training(self, facts: ModuleFacts, s: cst.BaseStatement) -> bool:
        if any(loop.module is facts and facts.contains(s, loop.node) for loop in self.project.loops):
            return True
        if self.project.optimizer_ctors(facts) and any(facts.contains(s, c) for c in self.project.optimizer_ctors(facts)):
            return True
        trainers = self.trainers()
        for call in facts.calls_in(s):
            if self.callee(facts, call) in trainers:
                return True
            target = self.project.local_target(facts, call)  # ``build_optimizer(model, lr)``
            if target is not None and any(target[0].contains(target[1], c) for c in self.project.optimizer_ctors(target[0])):
                return True
        return False

    @staticmethod
    def _wraps(facts: ModuleFacts, s: cst.BaseStatement, name: str) -> bool:
        """Whether ``s`` rebinds ``name`` to a DDP/FSDP wrapper (on some path)."""
        return any(
            _wrapper(facts, a) == "dist" and any(binds(facts, t.target, name) for t in a.targets)
            for a in facts.nodes_in(s, cst.Assign)
        )


# Module methods that only read: parameter groups built from ``model.named_parameters()`` need no converted model.
_READERS = {"parameters", "named_parameters", "state_dict", "buffers", "named_buffers"}


def _mentions(facts: ModuleFacts, s: cst.CSTNode, name: str) -> list[cst.BaseExpression]:
    if "." in name:
        return [a for a in facts.nodes_in(s, cst.Attribute) if facts.code(a) == name]
    return [n for n in facts.nodes_in(s, cst.Name) if n.value == name]


def _reads_only(facts: ModuleFacts, name: cst.BaseExpression) -> bool:
    parent = facts.parent(name)
    return isinstance(parent, cst.Attribute) and parent.value is name and parent.attr.value in _READERS


_TRAINING: dict[int, tuple[Project, Training]] = {}


def training(project: Project) -> Training:
    """The project's Training, built once (transforms of one run share it)."""
    found = _TRAINING.get(id(project))
    if found is None or found[0] is not project:
        _TRAINING.clear()  # one project at a time: the previous one's trees are let go
        found = _TRAINING[id(project)] = (project, Training(project))
    return found[1]
