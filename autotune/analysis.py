"""The facts about one file of a script: its calls, assignments, imports, names and positions.

Nothing here imports or runs user code. Each file is parsed once with libcst (for rewriting) and once with
``ast`` (fast positions, see ``_positions``, and the text of each top-level statement); one walk over the libcst
tree records everything the transforms ask about.
"""

from __future__ import annotations

import ast
import bisect
import re
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import libcst as cst

from autotune.source import BOM, parse, read_source

RUNTIME_ALIAS = "_autotune"
RUNTIME_MODULE = "autotune.runtime"

_UNKNOWN = object()  # not looked up yet (None is an answer)


# --- per-file facts ----------------------------------------------------------------------------------------


class _FieldOrder(cst.CSTVisitor):
    """Records the fields of one node in the order libcst visits them, which is source order."""

    def __init__(self, root: cst.CSTNode) -> None:
        self.root = root
        self.fields: list[str] = []

    def on_visit(self, node: cst.CSTNode) -> bool:
        return node is self.root

    def on_visit_attribute(self, node: cst.CSTNode, attribute: str) -> None:
        if node is self.root:
            self.fields.append(attribute)


_FIELDS: dict[type, tuple[str, ...]] = {}


def _fields(node: cst.CSTNode) -> tuple[str, ...]:
    """The fields of ``node``'s type that may hold child nodes, in source order (learnt from libcst once per type)."""
    fields = _FIELDS.get(type(node))
    if fields is None:
        recorder = _FieldOrder(node)
        node.visit(recorder)
        fields = tuple(recorder.fields)
        # libcst leaves out a few node fields when they are None (an f-string's format_spec): a type with such a
        # field may have more fields on another node, so it is learnt again for each of its nodes
        hints = typing.get_type_hints(type(node))
        skipped = [n for n in hints if n not in fields and getattr(node, n, "") is None and _holds_nodes(hints[n])]
        if not skipped:
            _FIELDS[type(node)] = fields
    return fields


def _holds_nodes(annotation: object) -> bool:
    """Whether a field with this type annotation can hold a node (or nodes)."""
    if isinstance(annotation, type):
        return issubclass(annotation, cst.CSTNode)
    return any(_holds_nodes(arg) for arg in typing.get_args(annotation))


# Layout nodes: no fact is about them, and they are well over half of all nodes.
_LAYOUT = frozenset(
    {cst.SimpleWhitespace, cst.ParenthesizedWhitespace, cst.Newline, cst.TrailingWhitespace, cst.EmptyLine, cst.Comment,
     cst.Comma, cst.Dot}
)  # fmt: skip


def _index(facts: ModuleFacts) -> None:
    """One pre-order walk over every node but layout: parents, pre-order spans and the nodes of each type.

    libcst's visitor machinery costs several times this plain walk over the same fields in the same order. It
    recurses once per level, which ``deep`` (every caller's way in) makes room for: a walk with its own stack
    measured 85 ms against 51 ms on bench_scan's 5,000 lines.
    """
    parent, enter, exit_, by_type = facts._parent, facts._enter, facts._exit, facts._by_type
    counter = 0
    layout, default = _LAYOUT, cst.MaybeSentinel.DEFAULT

    def walk(node: cst.CSTNode, up: cst.CSTNode | None) -> None:
        nonlocal counter
        if up is not None:
            parent[node] = up
        enter[node] = counter
        counter += 1
        kind = type(node)
        bucket = by_type.get(kind)
        if bucket is None:
            bucket = by_type[kind] = []
        bucket.append(node)
        for name in _FIELDS.get(kind) or _fields(node):
            # a child field holds a node, a sequence of nodes, None or MaybeSentinel (no isinstance: nodes are ABCs,
            # whose checks are slow)
            value = getattr(node, name)
            if type(value) is tuple or type(value) is list:
                for child in value:
                    if type(child) not in layout:
                        walk(child, node)
            elif value is not None and value is not default and type(value) not in layout:
                walk(value, node)
        exit_[node] = counter

    walk(facts.module, None)


def _collect(facts: ModuleFacts) -> None:
    """The facts the transforms ask about, from the nodes of each type."""
    f = facts
    f.calls = f.nodes(cst.Call)
    f._call_enter = [f._enter[c] for c in f.calls]
    f.loops = f.nodes(cst.For, cst.While)
    f.functions = f.nodes(cst.FunctionDef)
    f.classes = {c.name.value: c for c in f.nodes(cst.ClassDef)}
    f.names = {n.value for n in f.nodes(cst.Name)}
    f.strings = f.nodes(cst.SimpleString)
    f.assigns = f.nodes(cst.Assign)
    for node in f.nodes(cst.Import, cst.ImportFrom):
        if isinstance(node, cst.Import):
            for alias in node.names:
                dotted = _dotted(alias.name)
                if alias.asname is not None:
                    f.imports[_name_of(alias.asname.name)] = dotted
                else:
                    f.imports[dotted.split(".")[0]] = dotted.split(".")[0]
                f.imported_modules.append((dotted, 0))
            continue
        base = _dotted(node.module) if node.module is not None else ""
        level = len(node.relative)
        prefix = "." * level + base
        f.imported_modules.append((base, level))
        if isinstance(node.names, cst.ImportStar):
            f.star_imports.append(f.resolve_relative(prefix))
        else:
            for alias in node.names:
                name = _dotted(alias.name)
                local = _name_of(alias.asname.name) if alias.asname is not None else name
                full = f"{prefix}.{name}" if base else f"{prefix}{name}"
                f.imports[local] = f.resolve_relative(full)
                if level or base:
                    f.imported_modules.append((f"{base}.{name}" if base else name, level))


def _dotted(node: cst.BaseExpression) -> str:
    # a loop, not recursion: an attribute chain can be thousands of names long
    names = []
    while isinstance(node, cst.Attribute):
        names.append(node.attr.value)
        node = node.value
    if not isinstance(node, cst.Name):
        raise TypeError(type(node))
    names.append(node.value)
    return ".".join(reversed(names))


def _name_of(node: cst.BaseExpression) -> str:
    return node.value if isinstance(node, cst.Name) else _dotted(node)


@dataclass(eq=False)
class ModuleFacts:
    """Everything one source file tells about itself, without running it."""

    path: Path
    display: str  # the path as the user sees it
    modname: str  # dotted name relative to the entry script's directory ("train", "mylib.engine")
    is_package: bool
    source: str  # the file's text without a leading BOM: what the parsers and every position see
    module: cst.Module
    tree: ast.Module
    imports: dict[str, str] = field(default_factory=dict)  # local alias -> qualified name
    imported_modules: list[tuple[str, int]] = field(default_factory=list)  # (dotted, relative level)
    star_imports: list[str] = field(default_factory=list)  # modules named by ``from X import *``
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
    _by_type: dict[type, list[cst.CSTNode]] = field(default_factory=dict, repr=False)  # each in pre-order
    _pos: dict[cst.CSTNode, tuple[int, int]] = field(default_factory=dict, repr=False)
    _located: set[cst.CSTNode] = field(default_factory=set, repr=False)  # top-level statements in _pos
    _plain_functions: dict[str, cst.FunctionDef] | None = field(default=None, repr=False)
    _methods: dict[tuple[cst.ClassDef, str], cst.FunctionDef] | None = field(default=None, repr=False)
    _statements: dict[cst.CSTNode, list[ast.stmt]] | None = field(default=None, repr=False)
    _qualnames: dict[cst.CSTNode, str | None] = field(default_factory=dict, repr=False)
    _codes: dict[cst.CSTNode, str] = field(default_factory=dict, repr=False)
    _texts: dict[cst.CSTNode, str] | None = field(default=None, repr=False)
    _lines: list[str] | None = field(default=None, repr=False)
    bom: str = ""  # BOM when the file starts with one

    @property
    def text(self) -> str:
        """The file's text as read, BOM and all: what a copy of the file must hold."""
        return self.bom + self.source

    @classmethod
    def load(cls, path: Path, display: str, modname: str, source: str | None = None) -> ModuleFacts:
        text = source if source is not None else read_source(path, display, entry=False)
        bom = BOM if text.startswith(BOM) else ""
        text = text[len(bom):]
        module, tree = parse(text, display)
        facts = cls(path, display, modname, path.name == "__init__.py", text, module, tree, bom=bom)
        _index(facts)
        _collect(facts)
        return facts

    # navigation

    def nodes(self, *kinds: type) -> list:
        """Every node of the given types (exact types, not subclasses, not layout), in source order; a shared list."""
        if len(kinds) == 1:
            return self._by_type.get(kinds[0], [])
        found = [n for kind in kinds for n in self._by_type.get(kind, ())]
        return sorted(found, key=self._enter.__getitem__)

    def nodes_in(self, owner: cst.CSTNode, kind: type) -> list:
        """The nodes of type ``kind`` inside ``owner``: a slice of the source-ordered list, found by bisection."""
        found = self.nodes(kind)
        key = self._enter.__getitem__
        lo = bisect.bisect_left(found, self._enter[owner], key=key)
        hi = bisect.bisect_left(found, self._exit[owner], key=key)
        return found[lo:hi]

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

    # type() rather than isinstance(): libcst's node classes are ABCs, whose isinstance() is slow, and these two
    # are asked about most nodes the transforms look at

    def function_of(self, node: cst.CSTNode) -> cst.FunctionDef | None:
        return next((a for a in self.ancestors(node) if type(a) is cst.FunctionDef), None)

    def class_of(self, node: cst.CSTNode) -> cst.ClassDef | None:
        return next((a for a in self.ancestors(node) if type(a) is cst.ClassDef), None)

    def code(self, node: cst.CSTNode) -> str:
        # transforms compare the spellings of the same nodes again and again: remembered per node
        found = self._codes.get(node)
        if found is None:
            found = self._codes[node] = self.module.code_for_node(node)
        return found

    # names

    def resolve_relative(self, dotted: str) -> str:
        """``.model.Net`` inside package ``mylib`` -> ``mylib.model.Net``; unchanged where Python would refuse it."""
        level = len(dotted) - len(dotted.lstrip("."))
        if not level:
            return dotted
        parts = self.modname.split(".")
        package = parts if self.is_package else parts[:-1]
        if level > len(package):  # a script or top-level module has no package to be relative to
            return dotted
        base = package[: len(package) - (level - 1)] if level > 1 else package
        rest = dotted[level:]
        return ".".join([*base, rest] if rest else base)

    def qualname(self, expr: cst.BaseExpression) -> str | None:
        """``o.AdamW`` with ``import torch.optim as o`` -> ``torch.optim.AdamW``; None for non-dotted expressions."""
        # every transform asks about every call: remembered per node
        found = self._qualnames.get(expr, _UNKNOWN)
        if found is _UNKNOWN:
            found = self._qualnames[expr] = self._qualname(expr)
        return found

    def _qualname(self, expr: cst.BaseExpression) -> str | None:
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
        chain = [node, *self.ancestors(node)]
        top = chain[-2] if len(chain) > 1 and chain[-1] is self.module else None
        if top is not None and top not in self._located:
            self._locate(top)
        return next((self._pos[n] for n in chain if n in self._pos), (1, 1))

    def _locate(self, top: cst.CSTNode) -> None:
        """Positions for the nodes of one top-level statement: a report needs a few, and a long file has many."""
        roots = self.ast_statements().get(top)
        found = _positions(self, top, roots) if roots is not None else None
        if found is None:  # the trees disagree: libcst's own positions, for the whole file
            self._pos = _libcst_positions(self)
            self._located = set(self.module.body)
        else:
            self._pos.update(found)
            self._located.add(top)

    def ast_statements(self) -> dict[cst.CSTNode, list[ast.stmt]]:
        """The ast statements each top-level statement spans (``a = 1; b = 2`` is one line and two statements).

        Empty where the two trees do not line up.
        """
        if self._statements is None:
            self._statements = _top_level(self)
        return self._statements

    def lines(self) -> list[str]:
        """The source's lines, without their line breaks (see ``source_lines``)."""
        if self._lines is None:
            self._lines = source_lines(self.source)
        return self._lines

    def statement_texts(self) -> dict[cst.CSTNode, str]:
        """The source text of each top-level statement, with the blank lines and comments that lead it.

        Empty where the lines ast gives and the statements libcst gives do not line up.
        """
        if self._texts is None:
            self._texts = _statement_texts(self)
        return self._texts


def _top_level(facts: ModuleFacts) -> dict[cst.CSTNode, list[ast.stmt]]:
    """Top-level libcst statement -> the ast statements it spans, both in source order; empty if the counts differ."""
    groups: list[list[ast.stmt]] = []
    for node in facts.tree.body:
        # statements that share a line are one libcst SimpleStatementLine
        if groups and node.lineno == groups[-1][-1].end_lineno:
            groups[-1].append(node)
        else:
            groups.append([node])
    if len(groups) != len(facts.module.body):
        return {}
    return dict(zip(facts.module.body, groups))


# A line break as Python's tokenizer sees one (str.splitlines also splits at form feeds and other characters).
_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z")


def source_lines(text: str, keepends: bool = False) -> list[str]:
    """The lines of a source text as Python, ``ast``, ``diff`` and ``patch`` count them: ``str.splitlines`` also
    breaks at form feeds, ``\\x1c``-``\\x1e``, ``\\x85`` and U+2028/9, which may sit in a comment or a string."""
    lines = _LINE.findall(text)
    return lines if keepends else [line.rstrip("\r\n") for line in lines]


def _statement_texts(facts: ModuleFacts) -> dict[cst.CSTNode, str]:
    """Each top-level statement starts ``len(leading_lines)`` lines above its first line in the ast (its first
    decorator's); it ends where the next one starts, or where the module's footer does."""
    module, groups = facts.module, facts.ast_statements()
    if not groups:
        return {}
    lines = source_lines(facts.source, keepends=True)
    starts = []
    for stmt, (first, *_) in groups.items():
        line = min([first.lineno, *(d.lineno for d in getattr(first, "decorator_list", ()))])
        starts.append(line - len(stmt.leading_lines))
    starts.append(len(lines) - len(module.footer) + 1)
    if starts[0] != len(module.header) + 1 or any(a > b for a, b in zip(starts, starts[1:])):
        return {}
    return {stmt: "".join(lines[a - 1 : b - 1]) for stmt, a, b in zip(module.body, starts, starts[1:])}


# libcst node types whose pre-order sequence matches the ast nodes of these types sorted by position.
_AST_TWINS: dict[type, tuple[type, ...]] = {
    cst.Call: (ast.Call,),
    cst.For: (ast.For, ast.AsyncFor),
    cst.While: (ast.While,),
    cst.With: (ast.With, ast.AsyncWith),
    cst.FunctionDef: (ast.FunctionDef, ast.AsyncFunctionDef),
    cst.ClassDef: (ast.ClassDef,),
    cst.Assign: (ast.Assign,),
    cst.AugAssign: (ast.AugAssign,),
    cst.If: (ast.If,),
    cst.Expr: (ast.Expr,),
    cst.Import: (ast.Import,),
    cst.ImportFrom: (ast.ImportFrom,),
}


def _positions(facts: ModuleFacts, top: cst.CSTNode, roots: list[ast.stmt]) -> dict[cst.CSTNode, tuple[int, int]] | None:
    """Positions of the libcst nodes that sites point at inside top-level statement ``top``, taken from the ast
    statements ``roots`` it spans.

    libcst's PositionProvider re-generates the whole file and costs about 1 s per 5,000 lines; ast already
    knows every position. Both trees list these node types in the same source order, so the k-th libcst
    node of a type is the k-th ast node of its twin type. None if the counts disagree.
    """
    by_type: dict[type, list[ast.AST]] = {t: [] for t in _AST_TWINS}
    twin_of = {a: c for c, twins in _AST_TWINS.items() for a in twins}
    for root in roots:
        for node in ast.walk(root):
            ctype = twin_of.get(type(node))
            if ctype is not None:
                by_type[ctype].append(node)
    lines = facts.lines()
    out: dict[cst.CSTNode, tuple[int, int]] = {}
    for ctype, anodes in by_type.items():
        cnodes = facts.nodes_in(top, ctype)
        if len(cnodes) != len(anodes):
            return None
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
