"""Definite assignment: whether a name is bound on every path that reaches a statement (unknown counts as unbound).

Code autotune inserts may name the script's variables (``_autotune.unscale_(optimizer)``, the step hook's loss);
a variable bound only under a condition, or only inside a closure, would raise NameError in the patched script
with every knob at its default. Function scopes come from ``symtable`` (Python's own answer to which names are
local, free or global); the flow within a scope is followed statement by statement.
"""

from __future__ import annotations

import builtins
import symtable
import weakref
from collections.abc import Iterator

import libcst as cst

from autotune.analysis import ModuleFacts

_BUILTINS = frozenset(dir(builtins))
_BLOCKS = (cst.IndentedBlock, cst.SimpleStatementSuite, cst.Module)
_NO_FALLTHROUGH = (cst.Raise, cst.Return, cst.Continue, cst.Break)
_TABLES: weakref.WeakKeyDictionary[ModuleFacts, dict[tuple[str, int], symtable.SymbolTable]] = weakref.WeakKeyDictionary()


def unbound(facts: ModuleFacts, at: cst.BaseStatement, code: str, after: bool = False) -> list[str]:
    """The names expression ``code`` reads that some path leaves unbound before ``at`` (after it, with ``after``)."""
    names = dict.fromkeys(_reads(cst.parse_expression(code)))
    return [n for n in names if not is_bound(facts, at, n, after)]


def statement_reads(stmt: cst.BaseStatement) -> list[str]:
    """The variables a statement reads from outside itself (the names it binds first are its own)."""
    if not isinstance(stmt, cst.SimpleStatementLine):  # ``for block in model.blocks: block.compile()``
        own = set(_targets_inside(stmt))
        return [n for n in dict.fromkeys(_reads(stmt)) if n not in own]
    out: list[str] = []
    for small in stmt.body:
        if isinstance(small, (cst.Assign, cst.AnnAssign)):
            if small.value is not None:
                out.extend(_reads(small.value))
        elif not isinstance(small, (cst.Import, cst.ImportFrom)):
            out.extend(_reads(small))
    return list(dict.fromkeys(out))


def _targets_inside(node: cst.CSTNode) -> Iterator[str]:
    targets = {cst.For: "target", cst.CompFor: "target", cst.AssignTarget: "target", cst.AsName: "name"}
    field = targets.get(type(node))
    if field is not None:
        yield from _reads(getattr(node, field))
    for child in node.children:
        yield from _targets_inside(child)


def statement_binds(stmt: cst.BaseStatement) -> set[str]:
    """The names a simple statement binds (assignment targets, imports), or a function or class definition."""
    if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
        return {stmt.name.value}
    if not isinstance(stmt, cst.SimpleStatementLine):
        return set()
    out: set[str] = set()
    for small in stmt.body:
        if isinstance(small, cst.Assign):
            out.update(n for t in small.targets for n in _reads(t.target) if _target_binds(t.target, n))
        elif isinstance(small, (cst.Import, cst.ImportFrom)) and not isinstance(small.names, cst.ImportStar):
            out.update(_alias_name(a) for a in small.names)
    return out


def is_bound(facts: ModuleFacts, at: cst.BaseStatement, name: str, after: bool = False) -> bool:
    """Whether ``name`` is bound on every path that reaches statement ``at`` (or leaves it normally, ``after``)."""
    if after and binds(at, name):
        return True
    node: cst.CSTNode = at
    while True:
        block = facts.parent(node)
        if block is None:
            return False
        if isinstance(block, _BLOCKS):
            if _binds_seq(list(block.body)[: list(block.body).index(node)], name):
                return True
            if isinstance(block, cst.Module):
                return name in _BUILTINS
        child, node = block, facts.parent(block)
        # climb to the next statement that sits in a block, collecting what the clauses on the way bind
        while node is not None and not isinstance(facts.parent(node), _BLOCKS):
            if _clause_binds(node, child, name):
                return True
            child, node = node, facts.parent(node)
        if node is None:
            return False
        if isinstance(node, cst.FunctionDef):
            return _function_binds(facts, node, name)
        if _clause_binds(node, child, name):
            return True


def binds(stmt: cst.CSTNode, name: str) -> bool:
    """Whether running ``stmt`` to its end binds ``name`` on every path (a path that leaves the block counts)."""
    if isinstance(stmt, cst.SimpleStatementLine):
        return any(_small_binds(s, name) for s in stmt.body)
    if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
        return stmt.name.value == name
    if isinstance(stmt, (cst.If, cst.While)) and name in _sure_reads(stmt.test):
        return True  # the test read it (and raised NameError had it been unbound)
    if isinstance(stmt, cst.For) and name in _sure_reads(stmt.iter):
        return True
    if isinstance(stmt, cst.If):
        if _is_main_guard(stmt.test):  # a script's main path: autotune runs the script as __main__
            return _binds_block(stmt.body, name)
        if stmt.orelse is None or not _binds_block(stmt.body, name):
            return False
        return binds(stmt.orelse, name) if isinstance(stmt.orelse, cst.If) else _binds_block(stmt.orelse.body, name)
    if isinstance(stmt, cst.With):
        return any(_target_binds(i.asname, name) for i in stmt.items) or _binds_block(stmt.body, name)
    if isinstance(stmt, cst.Try):
        if stmt.finalbody is not None and _binds_block(stmt.finalbody.body, name):
            return True
        completes = _binds_block(stmt.body, name) or (stmt.orelse is not None and _binds_block(stmt.orelse.body, name))
        return completes and all(_binds_block(h.body, name) for h in stmt.handlers)
    return False  # loops may run no iteration; match and the rest: unknown


def _binds_block(block: cst.BaseSuite, name: str) -> bool:
    return _binds_seq(list(block.body), name)


def _binds_seq(stmts: list, name: str) -> bool:
    bound = False
    for s in stmts:
        if binds(s, name):
            bound = True
        elif _deletes(s, name):
            bound = False
    return bound


def _small_binds(small: cst.BaseSmallStatement, name: str) -> bool:
    if isinstance(small, _NO_FALLTHROUGH):
        return True  # the code after it is not reached this way
    read = {cst.Expr: "value", cst.Assign: "value", cst.AugAssign: "value", cst.AnnAssign: "value", cst.Assert: "test"}
    value = getattr(small, read[type(small)], None) if type(small) in read else None
    if value is not None and name in _sure_reads(value):
        return True  # it read the name and went on: had the name been unbound, it would have raised NameError
    if isinstance(small, cst.Assign):
        return any(_target_binds(t.target, name) for t in small.targets)
    if isinstance(small, cst.AnnAssign):
        return small.value is not None and _target_binds(small.target, name)
    if isinstance(small, cst.Import):
        return any(_alias_name(a) == name for a in small.names)
    if isinstance(small, cst.ImportFrom) and not isinstance(small.names, cst.ImportStar):
        return any(_alias_name(a) == name for a in small.names)
    return False


def _alias_name(alias: cst.ImportAlias) -> str:
    if alias.asname is not None:
        return alias.asname.name.value  # type: ignore[attr-defined]
    node = alias.name
    while isinstance(node, cst.Attribute):
        node = node.value
    return node.value  # type: ignore[attr-defined]


def _target_binds(target: cst.CSTNode | None, name: str) -> bool:
    if isinstance(target, cst.AsName):
        target = target.name
    if isinstance(target, cst.Name):
        return target.value == name
    if isinstance(target, (cst.Tuple, cst.List)):
        return any(_target_binds(e.value, name) for e in target.elements)
    if isinstance(target, cst.StarredElement):
        return _target_binds(target.value, name)
    return False


def _deletes(stmt: cst.CSTNode, name: str) -> bool:
    return isinstance(stmt, cst.SimpleStatementLine) and any(
        isinstance(s, cst.Del) and _target_binds(s.target, name) for s in stmt.body
    )


def _clause_binds(node: cst.CSTNode, child: cst.CSTNode, name: str) -> bool:
    """What a compound statement binds for the code in its part ``child``: a loop target, ``with ... as``,
    ``except ... as``, the try body before its ``else``."""
    if isinstance(node, cst.For):
        return child is node.body and _target_binds(node.target, name)
    if isinstance(node, cst.With):
        return child is node.body and any(_target_binds(i.asname, name) for i in node.items)
    if isinstance(node, cst.ExceptHandler):
        return _target_binds(node.name, name)
    if isinstance(node, cst.Try):
        return child is node.orelse and _binds_block(node.body, name)
    return False


def _is_main_guard(test: cst.BaseExpression) -> bool:
    if not (isinstance(test, cst.Comparison) and len(test.comparisons) == 1):
        return False
    if not isinstance(test.comparisons[0].operator, cst.Equal):
        return False
    sides = {type(test.left), type(test.comparisons[0].comparator)}
    values = [getattr(s, "value", None) for s in (test.left, test.comparisons[0].comparator)]
    return sides == {cst.Name, cst.SimpleString} and "__name__" in values and any(
        isinstance(v, str) and v.strip("'\"") == "__main__" for v in values
    )


def _function_binds(facts: ModuleFacts, fn: cst.FunctionDef, name: str) -> bool:
    """``name`` read at the start of ``fn``'s body: a parameter, or a variable of an enclosing scope."""
    table = _table(facts, fn)
    if table is None:
        return False
    try:
        symbol = table.lookup(name)
    except KeyError:
        symbol = None  # the function does not mention the name: it would read an enclosing scope's
    if symbol is not None and symbol.is_parameter():
        return True
    if symbol is not None and symbol.is_local() and not symbol.is_global():
        return False  # read before any assignment on some path
    if facts.function_of(fn) is not None and not (symbol is not None and symbol.is_global()):
        return is_bound(facts, fn, name)  # bound in the enclosing function before the def
    # a global: the module's own statements bind it before any function runs, or it is a builtin
    return _binds_seq(list(facts.module.body), name) or name in _BUILTINS


def _table(facts: ModuleFacts, fn: cst.FunctionDef) -> symtable.SymbolTable | None:
    """The symbol table of ``fn``, matched by name and first line."""
    tables = _TABLES.get(facts)
    if tables is None:
        tables = _TABLES[facts] = {}
        try:
            root = symtable.symtable(facts.source, facts.display, "exec")
        except SyntaxError:
            root = None
        stack = [root] if root is not None else []
        while stack:
            t = stack.pop()
            if t.get_type() == "function":
                tables[t.get_name(), t.get_lineno()] = t
            stack.extend(t.get_children())
    line = facts.position(fn)[0]
    return tables.get((fn.name.value, line))


def _sure_reads(node: cst.CSTNode) -> Iterator[str]:
    """The variables an expression reads whenever it is evaluated to its end: not those read only on some paths
    (the right of ``and``/``or``, an ``if``-expression's branches, later comparisons of a chain) or later (a lambda's
    body, a comprehension's)."""
    if isinstance(node, cst.Name):
        yield node.value
    elif isinstance(node, (cst.Attribute, cst.Await, cst.StarredElement, cst.Arg, cst.Element, cst.UnaryOperation)):
        yield from _sure_reads(node.value if not isinstance(node, cst.UnaryOperation) else node.expression)
    elif isinstance(node, cst.Subscript):
        yield from _sure_reads(node.value)
    elif isinstance(node, cst.Call):
        yield from _sure_reads(node.func)
        for arg in node.args:
            yield from _sure_reads(arg.value)
    elif isinstance(node, cst.BinaryOperation):
        yield from _sure_reads(node.left)
        yield from _sure_reads(node.right)
    elif isinstance(node, cst.BooleanOperation):
        yield from _sure_reads(node.left)
    elif isinstance(node, cst.Comparison):
        yield from _sure_reads(node.left)
        yield from _sure_reads(node.comparisons[0].comparator)
    elif isinstance(node, cst.IfExp):
        yield from _sure_reads(node.test)
    elif isinstance(node, (cst.Tuple, cst.List, cst.Set)):
        for element in node.elements:
            yield from _sure_reads(element.value)


def _reads(node: cst.CSTNode) -> Iterator[str]:
    """The variables an expression reads (not attribute names or keywords; a comprehension's own variables too,
    which only makes the answer more careful)."""
    if isinstance(node, cst.Name):
        yield node.value
    elif isinstance(node, cst.Attribute):
        yield from _reads(node.value)
    elif isinstance(node, cst.Arg):
        yield from _reads(node.value)
    else:
        for child in node.children:
            yield from _reads(child)
