"""The base of every transform: its knobs, the sites it reports and the edits it asks for."""

from __future__ import annotations

import importlib
import pkgutil
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from functools import cache
from typing import Any, ClassVar

import libcst as cst

from autotune.analysis import RUNTIME_ALIAS, ModuleFacts
from autotune.project import Project
from autotune.errors import UsageError
from autotune.inputs import shown
from autotune.knobs import NO_CHOICE, NUMERICS_ORDER, Knob, Numerics


class Status(str, Enum):
    """What a transform found at one site."""

    APPLICABLE = "applicable"
    PRESENT = "already present"
    USER = "kept as written"
    NOT_APPLICABLE = "not applicable"
    NOT_ANALYSED = "not analysed"  # the transform failed inside its own analysis of the file: nothing changed

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Site:
    """One place in the user's code a transform looked at, and what it decided."""

    transform: str
    path: str
    line: int
    col: int
    status: Status
    reason: str

    @property
    def location(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass(frozen=True)
class Mode:
    """How transforms write code: gated behind knobs (patch), or baked with fixed values (bake)."""

    values: Mapping[str, Any] | None = None  # None: gated
    device: str = "cpu"

    @property
    def gated(self) -> bool:
        return self.values is None

    def value(self, knob: Knob) -> Any:
        """The declared choice to write for ``knob``: code is never written from a value that is not one."""
        assert self.values is not None, "value() is for baking"
        choice = knob.choice(self.values.get(knob.name, knob.default))
        if choice is NO_CHOICE:
            raise UsageError(f"knob '{knob.name}' has no choice {shown(self.values[knob.name])}")
        return choice


Rewrite = Callable[[Any], Any]


@dataclass
class Edits:
    """The changes transforms ask for in one file, keyed by nodes of the original tree and applied in one pass."""

    replace: dict[cst.CSTNode, list[Rewrite]] = field(default_factory=dict)
    before: dict[cst.CSTNode, list[cst.BaseStatement]] = field(default_factory=dict)
    after: dict[cst.CSTNode, list[cst.BaseStatement]] = field(default_factory=dict)
    wraps: list[tuple[list[cst.BaseStatement], Callable[[list[cst.BaseStatement]], cst.BaseStatement]]] = field(
        default_factory=list
    )
    top: list[cst.BaseStatement] = field(default_factory=list)  # before the first import
    post_imports: list[cst.BaseStatement] = field(default_factory=list)
    imports: list[str] = field(default_factory=list)  # modules that baked code needs ("gc", "os")
    uses_runtime: bool = False
    runtime_calls: int = 0  # how many times runtime() was asked: gated code that reads knobs

    def rewrite(self, node: cst.CSTNode, fn: Rewrite) -> None:
        """Replace ``node`` by ``fn(updated_node)``; rewrites of one node compose in registration order."""
        self.replace.setdefault(node, []).append(fn)

    def insert_before(self, stmt: cst.BaseStatement, *stmts: cst.BaseStatement) -> None:
        self.before.setdefault(stmt, []).extend(stmts)

    def insert_after(self, stmt: cst.BaseStatement, *stmts: cst.BaseStatement) -> None:
        self.after.setdefault(stmt, []).extend(stmts)

    def wrap(self, stmts: Sequence[cst.BaseStatement], fn: Callable[[list[cst.BaseStatement]], cst.BaseStatement]) -> None:
        """Replace consecutive statements of one block by ``fn(updated statements)`` (a ``with`` around them).

        ``fn`` returns one statement or a list of statements.
        """
        self.wraps.append((list(stmts), fn))

    def prelude(self, *stmts: cst.BaseStatement) -> None:
        """Statements at the very top of the module, before its first import (environment variables)."""
        self.top.extend(stmts)

    def after_imports(self, *stmts: cst.BaseStatement) -> None:
        self.post_imports.extend(stmts)

    def require_import(self, module: str) -> None:
        if module not in self.imports:
            self.imports.append(module)

    def runtime(self, helper: str) -> str:
        """The code that calls runtime helper ``helper``; records that the file needs the runtime import."""
        self.uses_runtime = True
        self.runtime_calls += 1
        return f"{RUNTIME_ALIAS}.{helper}"

    def __bool__(self) -> bool:
        return bool(self.replace or self.before or self.after or self.wraps or self.top or self.post_imports)

    def merge(self, other: Edits) -> None:
        """Add ``other``'s edits after this one's, as if they had been registered here in that order."""
        for mine, theirs in ((self.replace, other.replace), (self.before, other.before), (self.after, other.after)):
            for node, items in theirs.items():
                mine.setdefault(node, []).extend(items)
        self.wraps.extend(other.wraps)
        self.top.extend(other.top)
        self.post_imports.extend(other.post_imports)
        for module in other.imports:
            self.require_import(module)
        self.uses_runtime |= other.uses_runtime
        self.runtime_calls += other.runtime_calls


def stmt(code: str) -> cst.BaseStatement:
    """A statement node from its code."""
    return cst.parse_statement(code)


def expr(code: str) -> cst.BaseExpression:
    """An expression node from its code."""
    return cst.parse_expression(code)


def kwarg(name: str, value: cst.BaseExpression | str) -> cst.Arg:
    value = expr(value) if isinstance(value, str) else value
    return cst.Arg(
        value=value,
        keyword=cst.Name(name),
        equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")),
    )


def star_kwargs(value: cst.BaseExpression | str) -> cst.Arg:
    value = expr(value) if isinstance(value, str) else value
    return cst.Arg(value=value, star="**")


def add_args(call: cst.Call, *new: cst.Arg) -> cst.Call:
    """``call`` with arguments appended, keeping a one-argument-per-line layout and trailing comma as written."""
    args = list(call.args)
    space = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
    if not args:
        return call.with_changes(args=[*(a.with_changes(comma=space) for a in new[:-1]), new[-1]])
    last_comma = args[-1].comma
    if last_comma is cst.MaybeSentinel.DEFAULT:
        args[-1] = args[-1].with_changes(comma=space)
        return call.with_changes(args=[*args, *(a.with_changes(comma=space) for a in new[:-1]), new[-1]])
    # a trailing comma: the whitespace between arguments is the one before the last argument; a comment at the end
    # of a line stays with the argument it follows
    between = args[-2].comma if len(args) > 1 else cst.Comma(whitespace_after=call.whitespace_before_args)
    between = _with_comment(between, None)
    args[-1] = args[-1].with_changes(comma=_with_comment(between, _comment(last_comma)))
    added = [a.with_changes(comma=between) for a in new[:-1]] + [new[-1].with_changes(comma=_with_comment(last_comma, None))]
    return call.with_changes(args=[*args, *added])


def _comment(comma: cst.Comma | cst.MaybeSentinel) -> cst.Comment | None:
    """The comment at the end of the line a comma ends."""
    if isinstance(comma, cst.Comma) and isinstance(comma.whitespace_after, cst.ParenthesizedWhitespace):
        return comma.whitespace_after.first_line.comment
    return None


def _with_comment(comma: cst.Comma, comment: cst.Comment | None) -> cst.Comma:
    """``comma`` with ``comment`` (or none) at the end of its line, when it ends a line."""
    ws = comma.whitespace_after
    if not isinstance(ws, cst.ParenthesizedWhitespace) or ws.first_line.comment is comment:
        return comma
    line = ws.first_line.with_changes(comment=comment, whitespace=cst.SimpleWhitespace("  " if comment else ""))
    return comma.with_changes(whitespace_after=ws.with_changes(first_line=line))


def is_docstring(node: cst.BaseStatement) -> bool:
    """Whether a statement is a bare string literal (a module, class or function docstring)."""
    return (
        isinstance(node, cst.SimpleStatementLine)
        and len(node.body) == 1
        and isinstance(node.body[0], cst.Expr)
        and isinstance(node.body[0].value, (cst.SimpleString, cst.ConcatenatedString))
    )


def move_into_helper(call: cst.Call, names: set[str], helper: str, splats: bool = False) -> cst.Call:
    """``call`` whose keyword arguments in ``names`` (and, with ``splats``, its ``**dict`` arguments) move, as
    written, into ``**helper(...)`` appended last."""
    args = list(call.args)
    taken = [a for a in args if (a.keyword is not None and a.keyword.value in names) or (splats and a.star == "**")]
    keep = [a for a in args if a not in taken]
    if keep and taken and keep[-1] is not args[-1]:
        keep[-1] = keep[-1].with_changes(comma=args[-1].comma)  # the last argument's comma: trailing or none
    space = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
    inner_args = [star_kwargs(a.value) if a.star else kwarg(a.keyword.value, a.value) for a in taken]
    inner_args = [a.with_changes(comma=space) for a in inner_args[:-1]] + inner_args[-1:]
    inner = cst.Call(func=expr(helper), args=inner_args)
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


def fresh_name(used: set[str], *candidates: str) -> str:
    """The first candidate not in ``used``, else ``<first>_2``, ``<first>_3``..."""
    for name in candidates:
        if name not in used:
            return name
    i = 2
    while f"{candidates[0]}_{i}" in used:
        i += 1
    return f"{candidates[0]}_{i}"


def keyword(call: cst.Call, name: str) -> cst.Arg | None:
    return next((a for a in call.args if a.keyword is not None and a.keyword.value == name), None)


def positional_args(call: cst.Call) -> list[cst.Arg]:
    """The arguments ``call`` passes by position, as written (no keyword, no ``*`` or ``**``)."""
    return [a for a in call.args if a.keyword is None and not a.star]


def positional(call: cst.Call) -> list[cst.BaseExpression]:
    """The values ``call`` passes by position."""
    return [a.value for a in positional_args(call)]


def positional_arg(call: cst.Call, index: int) -> cst.Arg | None:
    """The argument at position ``index``, or None where ``call`` passes fewer."""
    args = positional_args(call)
    return args[index] if index < len(args) else None


def is_literal(node: cst.BaseExpression, value: Any) -> bool:
    """Whether ``node`` is the literal ``True``/``False``/``None`` or a number equal to ``value``."""
    if isinstance(node, cst.Name) and node.value in ("True", "False", "None"):
        return {"True": True, "False": False, "None": None}[node.value] is value
    if isinstance(node, cst.Integer):
        return int(node.value) == value
    return False


class Transform(ABC):
    """One optimization: detects its sites, reports them, and rewrites them behind its knobs.

    Subclasses live one per file in ``transforms/``; the file name is the transform name and the knob prefix.
    The class docstring's first line is its description.
    """

    name: ClassVar[str]
    knobs: ClassVar[tuple[Knob, ...]]
    devices: ClassVar[frozenset[str]] = frozenset({"cpu", "cuda"})
    entry_only: ClassVar[bool] = False  # process-wide settings belong in the entry script only
    # True: the gated code reads only the settings recorded in ``settings_read`` (the rest the script wrote itself)
    tracks_settings: ClassVar[bool] = False

    def __init__(self, project: Project, mode: Mode) -> None:
        self.project = project
        self.mode = mode
        self.sites: list[Site] = []
        self.settings_read: set[str] = set()  # "<setting>" of each knob gated code reads, when tracks_settings

    @classmethod
    def description(cls) -> str:
        return (cls.__doc__ or "").strip().splitlines()[0]

    @classmethod
    def numerics(cls) -> Numerics:
        return max((k.numerics for k in cls.knobs), key=NUMERICS_ORDER.index, default=Numerics.EXACT)

    def knob(self, setting: str) -> Knob:
        return next(k for k in self.knobs if k.name == f"{self.name}.{setting}")

    def report(self, facts: ModuleFacts, node: cst.CSTNode, status: Status, reason: str) -> None:
        line, col = facts.position(node)
        self.sites.append(Site(self.name, facts.display, line, col, status, reason))

    def baking(self) -> bool:
        return not self.mode.gated

    def knobs_read(self) -> tuple[Knob, ...]:
        """The knobs the gated code this transform wrote reads: all of them, or those in ``settings_read``."""
        if not self.tracks_settings:
            return self.knobs
        return tuple(k for k in self.knobs if k.name.split(".", 1)[1] in self.settings_read)

    @abstractmethod
    def apply(self, facts: ModuleFacts, edits: Edits) -> None:
        """Report this transform's sites in ``facts`` and register the edits for the applicable ones."""


@cache
def all_transforms() -> tuple[type[Transform], ...]:
    """Every transform class, found by walking the ``autotune.transforms`` package (no list to edit)."""
    import autotune.transforms as pkg

    found = []
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{pkg.__name__}.{info.name}")
        classes = [
            obj
            for obj in vars(mod).values()
            if isinstance(obj, type) and issubclass(obj, Transform) and obj is not Transform and obj.__module__ == mod.__name__
        ]
        if len(classes) != 1 or classes[0].name != info.name:
            raise RuntimeError(f"transforms/{info.name}.py must define exactly one Transform named {info.name!r}")
        found.append(classes[0])
    return tuple(found)


def all_knobs() -> dict[str, Knob]:
    return {k.name: k for t in all_transforms() for k in t.knobs}
