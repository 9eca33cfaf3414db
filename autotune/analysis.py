"""The facts about a script and the local modules it imports: training loops, optimizers, calls, positions.

Nothing here imports or runs user code. Each file is parsed once with libcst (for rewriting) and once with
``ast`` (fast positions, see ``_positions``); one visitor pass records everything the transforms ask about.
"""

from __future__ import annotations

import ast
import bisect
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import libcst as cst

from autotune.errors import UnparseableScript, UsageError

RUNTIME_ALIAS = "_autotune"
RUNTIME_MODULE = "autotune.runtime"

# torch.optim classes that are not optimizers.
_NOT_OPTIMIZERS = ("torch.optim.lr_scheduler.", "torch.optim.swa_utils.", "torch.optim.Optimizer")


# --- loading -----------------------------------------------------------------------------------------------


def read_source(path: Path, display: str | None = None) -> str:
    """The text of a Python source file, or a UsageError that says in one line why it cannot be used."""
    display = display or str(path)
    if not path.exists():
        raise UsageError(f"{display}: no such file")
    if path.is_dir():
        raise UsageError(f"{display}: is a directory, expected a Python script")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"{display}: cannot read: {exc.strerror}") from None
    if b"\x00" in data:
        raise UsageError(f"{display}: is a binary file, expected a Python script")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{display}: is not UTF-8 text (byte {exc.start}: {data[exc.start]:#x})") from None
    if not text.strip():
        raise UsageError(f"{display}: is empty")
    return text


def parse(text: str, display: str) -> tuple[cst.Module, ast.Module]:
    """Both trees of one source text; a syntax error becomes ``path:line:col: message``."""
    try:
        tree = ast.parse(text, filename=display)
    except SyntaxError as exc:
        raise UnparseableScript(display, exc.lineno or 1, exc.offset or 1, exc.msg) from None
    try:
        module = cst.parse_module(text)
    except cst.ParserSyntaxError as exc:  # pragma: no cover - ast accepted it, so libcst rarely refuses
        raise UnparseableScript(display, exc.raw_line, exc.raw_column + 1, exc.message) from None
    return module, tree


# --- per-file facts ----------------------------------------------------------------------------------------


class _Collector(cst.CSTVisitor):
    """One pass: parents, pre-order spans, calls, loops, functions, classes and import aliases."""

    def __init__(self, facts: ModuleFacts) -> None:
        self.f = facts
        self.stack: list[cst.CSTNode] = []
        self.counter = 0

    # the base class's per-field callbacks cost a third of the pass and tell us nothing
    def on_visit_attribute(self, node: cst.CSTNode, attribute: str) -> None:
        pass

    def on_leave_attribute(self, original_node: cst.CSTNode, attribute: str) -> None:
        pass

    def on_visit(self, node: cst.CSTNode) -> bool:
        f = self.f
        if self.stack:
            f._parent[node] = self.stack[-1]
        f._enter[node] = self.counter
        self.counter += 1
        self.stack.append(node)
        kind = type(node)
        if kind is cst.Name:
            f.names.add(node.value)
        elif kind is cst.SimpleString:
            f.strings.append(node)
        elif kind is cst.Assign:
            f.assigns.append(node)
        elif kind is cst.Call:
            f.calls.append(node)
            f._call_enter.append(self.counter - 1)
        elif kind is cst.For or kind is cst.While:
            f.loops.append(node)
        elif kind is cst.FunctionDef:
            f.functions.append(node)
        elif kind is cst.ClassDef:
            f.classes[node.name.value] = node
        elif kind is cst.Import:
            for alias in node.names:
                dotted = _dotted(alias.name)
                if alias.asname is not None:
                    f.imports[_name_of(alias.asname.name)] = dotted
                else:
                    f.imports[dotted.split(".")[0]] = dotted.split(".")[0]
                f.imported_modules.append((dotted, 0))
        elif kind is cst.ImportFrom:
            base = _dotted(node.module) if node.module is not None else ""
            level = len(node.relative)
            prefix = "." * level + base
            f.imported_modules.append((base, level))
            if not isinstance(node.names, cst.ImportStar):
                for alias in node.names:
                    name = _dotted(alias.name)
                    local = _name_of(alias.asname.name) if alias.asname is not None else name
                    full = f"{prefix}.{name}" if base else f"{prefix}{name}"
                    f.imports[local] = f.resolve_relative(full)
                    if level or base:
                        f.imported_modules.append((f"{base}.{name}" if base else name, level))
        return True

    def on_leave(self, original_node: cst.CSTNode) -> None:
        self.f._exit[original_node] = self.counter
        self.stack.pop()


def _dotted(node: cst.BaseExpression) -> str:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        return f"{_dotted(node.value)}.{node.attr.value}"
    raise TypeError(type(node))


def _name_of(node: cst.BaseExpression) -> str:
    return node.value if isinstance(node, cst.Name) else _dotted(node)


@dataclass(eq=False)
class ModuleFacts:
    """Everything one source file tells about itself, without running it."""

    path: Path
    display: str  # the path as the user sees it
    modname: str  # dotted name relative to the entry script's directory ("train", "mylib.engine")
    is_package: bool
    source: str
    module: cst.Module
    tree: ast.Module
    imports: dict[str, str] = field(default_factory=dict)  # local alias -> qualified name
    imported_modules: list[tuple[str, int]] = field(default_factory=list)  # (dotted, relative level)
    calls: list[cst.Call] = field(default_factory=list)  # pre-order
    loops: list[cst.For | cst.While] = field(default_factory=list)
    functions: list[cst.FunctionDef] = field(default_factory=list)
    classes: dict[str, cst.ClassDef] = field(default_factory=dict)
    names: set[str] = field(default_factory=set)  # every identifier used
    strings: list[cst.SimpleString] = field(default_factory=list)
    assigns: list[cst.Assign] = field(default_factory=list)
    _call_enter: list[int] = field(default_factory=list, repr=False)  # pre-order index of each call
    _parent: dict[cst.CSTNode, cst.CSTNode] = field(default_factory=dict, repr=False)
    _enter: dict[cst.CSTNode, int] = field(default_factory=dict, repr=False)
    _exit: dict[cst.CSTNode, int] = field(default_factory=dict, repr=False)
    _pos: dict[cst.CSTNode, tuple[int, int]] | None = field(default=None, repr=False)
    _plain_functions: dict[str, cst.FunctionDef] | None = field(default=None, repr=False)
    _methods: dict[tuple[cst.ClassDef, str], cst.FunctionDef] | None = field(default=None, repr=False)

    @classmethod
    def load(cls, path: Path, display: str, modname: str, source: str | None = None) -> ModuleFacts:
        text = source if source is not None else read_source(path, display)
        module, tree = parse(text, display)
        facts = cls(path, display, modname, path.name == "__init__.py", text, module, tree)
        module.visit(_Collector(facts))
        return facts

    # navigation

    def parent(self, node: cst.CSTNode) -> cst.CSTNode | None:
        return self._parent.get(node)

    def ancestors(self, node: cst.CSTNode) -> Iterator[cst.CSTNode]:
        node = self._parent.get(node)
        while node is not None:
            yield node
            node = self._parent.get(node)

    def contains(self, outer: cst.CSTNode, inner: cst.CSTNode) -> bool:
        """Whether ``inner`` lies inside ``outer`` (or is it)."""
        return self._enter[outer] <= self._enter[inner] < self._exit[outer]

    def calls_in(self, node: cst.CSTNode) -> list[cst.Call]:
        lo = bisect.bisect_left(self._call_enter, self._enter[node])
        hi = bisect.bisect_left(self._call_enter, self._exit[node])
        return self.calls[lo:hi]

    def statement_of(self, node: cst.CSTNode) -> cst.BaseStatement:
        """The statement (a line or a compound statement) that holds ``node``, as it sits in its block."""
        current = node
        while not isinstance(current, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
            current = self._parent[current]
        return current

    def block_of(self, stmt: cst.BaseStatement) -> cst.CSTNode:
        """The block (IndentedBlock or Module) whose body lists ``stmt``."""
        return self._parent[stmt]

    def function_of(self, node: cst.CSTNode) -> cst.FunctionDef | None:
        return next((a for a in self.ancestors(node) if isinstance(a, cst.FunctionDef)), None)

    def class_of(self, node: cst.CSTNode) -> cst.ClassDef | None:
        return next((a for a in self.ancestors(node) if isinstance(a, cst.ClassDef)), None)

    def code(self, node: cst.CSTNode) -> str:
        return self.module.code_for_node(node)

    # names

    def resolve_relative(self, dotted: str) -> str:
        """``.model.Net`` inside package ``mylib`` -> ``mylib.model.Net``."""
        level = len(dotted) - len(dotted.lstrip("."))
        if not level:
            return dotted
        parts = self.modname.split(".")
        package = parts if self.is_package else parts[:-1]
        base = package[: len(package) - (level - 1)] if level > 1 else package
        rest = dotted[level:]
        return ".".join([*base, rest] if rest else base)

    def qualname(self, expr: cst.BaseExpression) -> str | None:
        """``o.AdamW`` with ``import torch.optim as o`` -> ``torch.optim.AdamW``; None for non-dotted expressions."""
        try:
            dotted = _dotted(expr)
        except TypeError:
            return None
        head, _, rest = dotted.partition(".")
        if head in self.imports:
            head = self.imports[head]
        elif head not in ("self", "cls") and (self.function_named(head) is not None or head in self.classes):
            head = f"{self.modname}.{head}"
        return f"{head}.{rest}" if rest else head

    def function_named(self, name: str) -> cst.FunctionDef | None:
        """The module-level or nested (not method) function called ``name``."""
        if self._plain_functions is None:
            self._plain_functions = {}
            for f in self.functions:
                if self.class_of(f) is None:
                    self._plain_functions.setdefault(f.name.value, f)
        return self._plain_functions.get(name)

    def method_named(self, cls: cst.ClassDef, name: str) -> cst.FunctionDef | None:
        if self._methods is None:
            self._methods = {}
            for f in self.functions:
                owner = self.class_of(f)
                if owner is not None:
                    self._methods.setdefault((owner, f.name.value), f)
        return self._methods.get((cls, name))

    def has_runtime_import(self) -> bool:
        return self.imports.get(RUNTIME_ALIAS) == RUNTIME_MODULE

    def is_runtime_call(self, call: cst.CSTNode, helper: str | None = None) -> bool:
        """Whether ``call`` is ``_autotune.<helper>(...)``, i.e. code autotune already injected."""
        if not isinstance(call, cst.Call):
            return False
        func = call.func
        return (
            isinstance(func, cst.Attribute)
            and isinstance(func.value, cst.Name)
            and func.value.value == RUNTIME_ALIAS
            and (helper is None or func.attr.value == helper)
        )

    # positions

    def position(self, node: cst.CSTNode) -> tuple[int, int]:
        """(line, column), both 1-based, of ``node`` or of the nearest enclosing node with a known position."""
        if self._pos is None:
            self._pos = _positions(self)
        current: cst.CSTNode | None = node
        while current is not None:
            if current in self._pos:
                return self._pos[current]
            current = self._parent.get(current)
        return (1, 1)


# libcst node types whose pre-order sequence matches the ast nodes of these types sorted by position.
_AST_TWINS: dict[type, tuple[type, ...]] = {
    cst.Call: (ast.Call,),
    cst.For: (ast.For, ast.AsyncFor),
    cst.While: (ast.While,),
    cst.With: (ast.With, ast.AsyncWith),
    cst.FunctionDef: (ast.FunctionDef, ast.AsyncFunctionDef),
    cst.ClassDef: (ast.ClassDef,),
    cst.Assign: (ast.Assign,),
    cst.Expr: (ast.Expr,),
    cst.Import: (ast.Import,),
    cst.ImportFrom: (ast.ImportFrom,),
}


def _positions(facts: ModuleFacts) -> dict[cst.CSTNode, tuple[int, int]]:
    """Positions of the libcst nodes that sites point at, taken from the ast of the same text.

    libcst's PositionProvider re-generates the whole file and costs about 1 s per 5,000 lines; ast already
    knows every position. Both trees list these node types in the same source order, so the k-th libcst
    node of a type is the k-th ast node of its twin type. If the counts ever disagree, fall back to libcst.
    """
    by_type: dict[type, list[ast.AST]] = {t: [] for t in _AST_TWINS}
    twin_of = {a: c for c, twins in _AST_TWINS.items() for a in twins}
    for node in ast.walk(facts.tree):
        ctype = twin_of.get(type(node))
        if ctype is not None:
            by_type[ctype].append(node)
    lines = facts.source.splitlines()
    cst_by_type: dict[type, list[cst.CSTNode]] = {t: [] for t in _AST_TWINS}
    for node in facts._enter:  # filled by the collector in pre-order
        bucket = cst_by_type.get(type(node))
        if bucket is not None:
            bucket.append(node)
    out: dict[cst.CSTNode, tuple[int, int]] = {}
    for ctype, anodes in by_type.items():
        cnodes = cst_by_type[ctype]
        if len(cnodes) != len(anodes):
            return _libcst_positions(facts)
        anodes.sort(key=lambda a: (a.lineno, a.col_offset, -(a.end_lineno or 0), -(a.end_col_offset or 0)))
        for c, a in zip(cnodes, anodes):
            out[c] = (a.lineno, _char_col(lines, a.lineno, a.col_offset) + 1)
    return out


def _char_col(lines: list[str], lineno: int, byte_col: int) -> int:
    """ast counts columns in UTF-8 bytes; users (and libcst) count characters."""
    line = lines[lineno - 1] if 0 < lineno <= len(lines) else ""
    return len(line.encode("utf-8")[:byte_col].decode("utf-8", errors="ignore")) if not line.isascii() else byte_col


def _libcst_positions(facts: ModuleFacts) -> dict[cst.CSTNode, tuple[int, int]]:
    wrapper = cst.MetadataWrapper(facts.module, unsafe_skip_copy=True)
    ranges = wrapper.resolve(cst.metadata.PositionProvider)
    return {n: (r.start.line, r.start.column + 1) for n, r in ranges.items() if type(n) in _AST_TWINS}


# --- the project: entry script plus its local import closure -----------------------------------------------


def _is_optimizer_ctor(qualname: str | None) -> bool:
    if not qualname or not qualname.startswith("torch.optim."):
        return False
    if qualname.startswith(_NOT_OPTIMIZERS):
        return False
    last = qualname.rsplit(".", 1)[-1]
    return last[:1].isupper()


def is_scheduler_ctor(qualname: str | None) -> bool:
    return bool(qualname) and qualname.startswith("torch.optim.lr_scheduler.")


@dataclass(frozen=True, eq=False)
class StepScope:
    """Where a training step happens: the block owner (a loop or a function) holding backward and step calls."""

    module: ModuleFacts
    owner: cst.CSTNode
    backward: tuple[cst.Call, ...]
    steps: tuple[cst.Call, ...]
    zero_grads: tuple[cst.Call, ...]

    def loss_exprs(self) -> list[cst.BaseExpression]:
        """The tensors ``backward()`` is called on, unwrapped from ``scaler.scale(...)``."""
        out = []
        for call in self.backward:
            recv = call.func.value  # type: ignore[attr-defined]
            if isinstance(recv, cst.Call) and isinstance(recv.func, cst.Attribute) and recv.func.attr.value == "scale":
                if recv.args:
                    recv = recv.args[0].value
            out.append(recv)
        return out


@dataclass(frozen=True, eq=False)
class TrainingLoop:
    """A loop whose body, directly or through local functions, calls ``backward()`` and an optimizer's ``step()``."""

    module: ModuleFacts
    node: cst.For | cst.While  # the innermost such loop: one iteration per step
    outer: cst.For | cst.While  # the outermost such loop in the same function (epochs around steps)
    scopes: tuple[StepScope, ...]


@dataclass(eq=False)
class Project:
    """The entry script and the local modules it imports, with the facts that span files."""

    root: Path
    entry: ModuleFacts
    modules: list[ModuleFacts]
    optimizer_names: set[str] = field(default_factory=set)  # code of the targets optimizers are assigned to
    scheduler_names: set[str] = field(default_factory=set)
    loops: list[TrainingLoop] = field(default_factory=list)
    module_classes: set[str] = field(default_factory=set)  # qualified names of local nn.Module subclasses

    def by_modname(self, name: str) -> ModuleFacts | None:
        return next((m for m in self.modules if m.modname == name), None)

    def optimizer_ctors(self, facts: ModuleFacts) -> list[cst.Call]:
        return [c for c in facts.calls if _is_optimizer_ctor(facts.qualname(c.func))]

    def is_optimizer_expr(self, facts: ModuleFacts, expr: cst.BaseExpression) -> bool:
        """Whether ``expr`` names an optimizer.

        Only its spelling can be seen where an optimizer arrives as a parameter (``def train(model, opt)``), so
        a name that was never assigned an optimizer counts when it says ``opt`` and is not a known scheduler.
        """
        code = facts.code(expr)
        if code in self.optimizer_names:
            return True
        if code in self.scheduler_names:
            return False
        last = code.rsplit(".", 1)[-1].lower()
        return "opt" in last and "sched" not in last and isinstance(expr, (cst.Name, cst.Attribute))

    def is_step_call(self, facts: ModuleFacts, call: cst.Call) -> bool:
        """``opt.step()``, ``scaler.step(opt)`` or autotune's own ``_autotune.optimizer_step(opt)``."""
        func = call.func
        if facts.is_runtime_call(call, "optimizer_step"):
            return True
        if not (isinstance(func, cst.Attribute) and func.attr.value == "step"):
            return False
        if self.is_optimizer_expr(facts, func.value):
            return True
        recv = facts.code(func.value).lower()
        return "scaler" in recv and bool(call.args) and self.is_optimizer_expr(facts, call.args[0].value)

    @staticmethod
    def is_backward_call(call: cst.Call) -> bool:
        return isinstance(call.func, cst.Attribute) and call.func.attr.value == "backward"

    @staticmethod
    def is_zero_grad_call(call: cst.Call) -> bool:
        return isinstance(call.func, cst.Attribute) and call.func.attr.value == "zero_grad"

    def is_zero_grad_statement(self, facts: ModuleFacts, stmt: cst.BaseStatement) -> bool:
        """Whether every call in ``stmt`` is a ``zero_grad()`` (and there is one)."""
        calls = facts.calls_in(stmt)
        return bool(calls) and all(self.is_zero_grad_call(c) for c in calls)

    def local_target(self, facts: ModuleFacts, call: cst.Call) -> tuple[ModuleFacts, cst.FunctionDef] | None:
        """The local function or method a call runs, when it can be resolved without running anything."""
        func = call.func
        if isinstance(func, cst.Attribute) and isinstance(func.value, cst.Name) and func.value.value == "self":
            cls = facts.class_of(call)
            target = facts.method_named(cls, func.attr.value) if cls is not None else None
            return (facts, target) if target is not None else None
        qual = facts.qualname(func)
        if qual is None:
            return None
        modname, _, name = qual.rpartition(".")
        owner = self.by_modname(modname)
        if owner is None:
            return None
        target = owner.function_named(name)
        return (owner, target) if target is not None else None


def _module_path(root: Path, dotted: str) -> Path | None:
    parts = dotted.split(".")
    base = root.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _modname(root: Path, path: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def load_project(entry: Path, display_root: Path | None = None) -> Project:
    """Parse ``entry`` and every local module it imports, transitively (files under the entry's directory)."""
    entry = Path(entry)
    display = str(entry)
    read_source(entry, display)  # one clear error for a missing, binary, empty or undecodable entry
    root = entry.resolve().parent
    entry_facts = ModuleFacts.load(entry.resolve(), display, entry.stem)
    modules = [entry_facts]
    seen = {entry.resolve()}
    queue = [entry_facts]
    while queue:
        facts = queue.pop(0)
        for dotted, level in facts.imported_modules:
            name = facts.resolve_relative("." * level + dotted) if level else dotted
            parts = name.split(".")
            # importing a.b.c runs a/__init__.py and a/b/__init__.py too
            for i in range(1, len(parts) + 1):
                path = _module_path(root, ".".join(parts[:i]))
                if path is None or path.resolve() in seen:
                    continue
                seen.add(path.resolve())
                shown = str(Path(display).parent / path.relative_to(root))
                child = ModuleFacts.load(path, shown, _modname(root, path))
                modules.append(child)
                queue.append(child)
    project = Project(root, entry_facts, modules)
    _collect_names(project)
    _find_loops(project)
    return project


def _collect_names(project: Project) -> None:
    for facts in project.modules:
        for call in facts.calls:
            qual = facts.qualname(call.func)
            parent = facts.parent(call)
            if not isinstance(parent, cst.Assign):
                continue
            targets = {facts.code(t.target) for t in parent.targets}
            if _is_optimizer_ctor(qual):
                project.optimizer_names |= targets
            elif is_scheduler_ctor(qual):
                project.scheduler_names |= targets
        for cls in facts.classes.values():
            for base in cls.bases:
                qual = facts.qualname(base.value)
                if qual in ("torch.nn.Module", "torch.nn.modules.module.Module"):
                    project.module_classes.add(f"{facts.modname}.{cls.name.value}")


def _scope_calls(
    project: Project, facts: ModuleFacts, owner: cst.CSTNode, depth: int, seen: set
) -> list[StepScope]:
    """The step scopes reachable from ``owner``'s calls: itself and the local functions it calls."""
    calls = facts.calls_in(owner)
    backward = tuple(c for c in calls if project.is_backward_call(c))
    steps = tuple(c for c in calls if project.is_step_call(facts, c))
    zero = tuple(c for c in calls if project.is_zero_grad_call(c))
    scopes = []
    if backward or steps:
        scopes.append(StepScope(facts, owner, backward, steps, zero))
    if depth < 3:
        for call in calls:
            target = project.local_target(facts, call)
            if target is None or target[1] in seen:
                continue
            seen.add(target[1])
            scopes.extend(_scope_calls(project, target[0], target[1], depth + 1, seen))
    return scopes


def _find_loops(project: Project) -> None:
    candidates: list[tuple[ModuleFacts, cst.CSTNode, tuple[StepScope, ...]]] = []
    for facts in project.modules:
        for loop in facts.loops:
            scopes = _scope_calls(project, facts, loop, 0, set())
            if any(s.backward for s in scopes) and any(s.steps for s in scopes):
                candidates.append((facts, loop, tuple(scopes)))
    def inside(call_facts: ModuleFacts, call: cst.Call, other: tuple) -> bool:
        return other[0] is call_facts and call_facts.contains(other[1], call)

    for facts, loop, scopes in candidates:
        steps = [(s.module, c) for s in scopes for c in s.steps]
        others = [c for c in candidates if c[1] is not loop and not (c[0] is facts and facts.contains(c[1], loop))]
        nested = any(c[0] is facts and facts.contains(loop, c[1]) for c in others)
        if nested or any(all(inside(m, c, other) for m, c in steps) for other in others):
            continue  # an epoch loop: its steps belong to an inner loop, here or in a function it calls
        outer = loop
        for other_facts, other, _ in candidates:
            if other_facts is facts and facts.contains(other, loop) and facts.function_of(other) is facts.function_of(loop):
                if facts.contains(other, outer):
                    outer = other
        project.loops.append(TrainingLoop(facts, loop, outer, scopes))
