"""A switched-off flag turned on where the script defines it, as a person would: ``FLASH = False`` -> ``True``."""

from __future__ import annotations

from collections.abc import Sequence

import libcst as cst

from autotune.analysis import ModuleFacts
from autotune.project import Project
from autotune.syntax import is_name, names_variable, string_key

# literals that switch a flag off, and what turns it on in the same spelling
ON = {"False": "True", "0": "1"}
# calls that read or write a module's variables by name, where no reference to the flag is seen
_DYNAMIC = {"exec", "eval", "globals", "locals", "vars"}


def flag_of(test: cst.BaseExpression) -> tuple[str, str | None] | None:
    """(variable, key) of a switch's test: ``FLASH`` -> ("FLASH", None), ``config["flash"]`` -> ("config",
    "flash"); None for anything else (an attribute, a call)."""
    if isinstance(test, cst.Name):
        return test.value, None
    if isinstance(test, cst.Subscript) and isinstance(test.value, cst.Name):
        key = string_key(test)
        if key is not None:
            return test.value.value, key
    return None


def definition(project: Project, facts: ModuleFacts, tests: Sequence[cst.BaseExpression]) -> cst.BaseExpression | None:
    """The literal (False or 0, True or 1) that decides the flag ``tests`` read (each the test of a switch turned on
    together), where flipping it turns on those switches and nothing else: a variable bound once in ``facts`` by a
    literal (``FLASH = False``), or an entry of a dict written out once (``config = dict(flash=False)``, ``{"flash":
    0}``) whose every other use reads one of its entries (``config["lr"]``, never ``config`` passed on); read nowhere
    else, in no other module, in a module that reads no variables by name (``exec``, ``globals()``: nanoGPT's
    configurator). None wherever that cannot be shown; the switch then stays where it is."""
    flags = {flag_of(t) for t in tests}
    if len(flags) != 1 or None in flags:
        return None
    [(variable, key)] = flags
    if any(is_name(c.func) and c.func.value in _DYNAMIC for c in facts.calls):  # type: ignore[attr-defined]
        return None
    if any(other is not facts and _mentions(other, variable) for other in project.modules):
        return None
    value: cst.BaseExpression | None = None
    for name in facts.nodes(cst.Name):
        if name.value != variable or not names_variable(facts, name):
            continue
        bound = _bound_value(facts, name)
        if bound is not None:
            if value is not None:
                return None  # bound twice
            value = bound if key is None else _entry(bound, key)
            if value is None:
                return None
        elif key is None:
            if not any(name is t for t in tests):
                return None
        else:
            read = facts.parent(name)
            if not (isinstance(read, cst.Subscript) and read.value is name and string_key(read) is not None
                    and _loaded(facts, read)):
                return None  # passed on, called a method of, written into: what else reads the flag is unseen
            if string_key(read) == key and not any(read is t for t in tests):
                return None
    if value is None or not isinstance(value, (cst.Name, cst.Integer)) or value.value not in (*ON, *ON.values()):
        return None
    return value


def is_on(literal: cst.BaseExpression) -> bool:
    """Whether a definition ``definition`` found switches its flag on already (True, 1)."""
    return literal.value in ON.values()  # type: ignore[attr-defined]


def defined(facts: ModuleFacts, literal: cst.BaseExpression) -> str:
    """The code that defines the flag, as a reason quotes it: ``USE_FLASH = False``, ``"flash": False``."""
    holder = facts.parent(literal)
    if isinstance(holder, (cst.DictElement, cst.Arg)):
        return facts.code(holder.with_changes(comma=cst.MaybeSentinel.DEFAULT)).strip()
    return facts.code(holder).strip()


def turned_on(literal: cst.BaseExpression) -> cst.BaseExpression:
    """``literal`` (False, 0) in the spelling that switches its flag on."""
    return literal.with_changes(value=ON[literal.value])  # type: ignore[attr-defined]


def _bound_value(facts: ModuleFacts, name: cst.Name) -> cst.BaseExpression | None:
    """The value of ``name = value`` (or ``name: type = value``) where ``name`` is its only target, outside any
    class body; None where ``name`` is not bound that way."""
    target = facts.parent(name)
    if isinstance(target, cst.AssignTarget) and target.target is name:
        assign = facts.parent(target)
        ok = isinstance(assign, cst.Assign) and len(assign.targets) == 1
    elif isinstance(target, cst.AnnAssign) and target.target is name and target.value is not None:
        assign, ok = target, True
    else:
        return None
    if not ok or any(isinstance(a, cst.ClassDef) for a in facts.ancestors(assign)):
        return None
    return assign.value  # type: ignore[union-attr]


def _entry(value: cst.BaseExpression, key: str) -> cst.BaseExpression | None:
    """The value ``key`` has in a dict written out with literal keys and nothing unpacked into it."""
    if isinstance(value, cst.Call) and is_name(value.func, "dict"):
        if any(a.star or a.keyword is None for a in value.args):
            return None
        found = [a.value for a in value.args if a.keyword.value == key]  # type: ignore[union-attr]
    elif isinstance(value, cst.Dict):
        if any(not isinstance(e, cst.DictElement) or not isinstance(e.key, cst.SimpleString) for e in value.elements):
            return None
        found = [e.value for e in value.elements if e.key.evaluated_value == key]  # type: ignore[union-attr]
    else:
        return None
    return found[0] if len(found) == 1 else None


def _loaded(facts: ModuleFacts, node: cst.CSTNode) -> bool:
    """Whether ``node`` is read, not written or deleted (an assignment's or a ``for``'s target, ``del``)."""
    child, parent = node, facts.parent(node)
    while isinstance(parent, (cst.Tuple, cst.List, cst.Element, cst.StarredElement)):
        child, parent = parent, facts.parent(parent)
    if isinstance(parent, (cst.AssignTarget, cst.AnnAssign, cst.AugAssign, cst.For, cst.CompFor, cst.AsName)):
        return getattr(parent, "target", getattr(parent, "name", None)) is not child
    return not isinstance(parent, cst.Del)


def _mentions(facts: ModuleFacts, variable: str) -> bool:
    """Whether another module names ``variable`` at all (``from train import FLASH``, ``train.FLASH = 1``)."""
    return any(n.value == variable for n in facts.nodes(cst.Name))
