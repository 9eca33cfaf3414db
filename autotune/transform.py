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

    def insert_first_before(self, stmt: cst.BaseStatement, *stmts: cst.BaseStatement) -> None:
        """Before ``stmt`` and ahead of what transforms put there (their own markers, gc_pause(), stay next to it)."""
        self.before[stmt] = [*stmts, *self.before.get(stmt, [])]

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
