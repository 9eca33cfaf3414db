"""Reading and building libcst nodes: the one set of syntax helpers every transform and the analysis share.

Reading: a call's arguments (``positional``, ``keyword``, ``argument``), names and what binds or reads them
(``names_read``, ``assigned_names``, ``assignments``), attribute chains, literals. Building: statements and
expressions from code, arguments appended keeping the script's layout and comments."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import libcst as cst
import libcst.matchers as m

from autotune.analysis import ModuleFacts


# --- building --------------------------------------------------------------------------------------------------


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
        # the line break before the closing parenthesis, where there is one, stays before it
        closing = args[-1].whitespace_after_arg
        args[-1] = args[-1].with_changes(comma=space, whitespace_after_arg=cst.SimpleWhitespace(""))
        return call.with_changes(args=[*args, *(a.with_changes(comma=space) for a in new[:-1]),
                                       new[-1].with_changes(whitespace_after_arg=closing)])
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


# --- reading -------------------------------------------------------------------------------------------------


_DOCSTRING = m.SimpleStatementLine(body=[m.Expr(value=m.SimpleString() | m.ConcatenatedString())])


def is_docstring(node: cst.BaseStatement) -> bool:
    """Whether a statement is a bare string literal (a module, class or function docstring)."""
    return m.matches(node, _DOCSTRING)


def is_literal(node: cst.BaseExpression, value: Any) -> bool:
    """Whether ``node`` is the literal ``True``/``False``/``None`` or a number equal to ``value``."""
    if isinstance(node, cst.Name) and node.value in ("True", "False", "None"):
        return {"True": True, "False": False, "None": None}[node.value] is value
    if isinstance(node, cst.Integer):
        return int(node.value) == value
    return False


def is_constant(node: cst.BaseExpression) -> bool:
    """A value written as a constant (``0``, ``-1``, ``2.5``, ``"bf16"``, ``True``, ``None``): the script's own
    choice, where a name or an expression (``args.workers``) may be a switch it sets per run."""
    if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.Minus):
        node = node.expression
    if isinstance(node, (cst.Integer, cst.Float, cst.SimpleString, cst.ConcatenatedString)):
        return True
    return isinstance(node, cst.Name) and node.value in ("True", "False", "None")


def is_name(node: cst.CSTNode, value: str | None = None) -> bool:
    return isinstance(node, cst.Name) and (value is None or node.value == value)


def int_value(node: cst.BaseExpression) -> int | None:
    """The value of an integer literal, with an optional minus sign."""
    if isinstance(node, cst.Integer):
        return int(node.value)
    if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.Minus) and isinstance(node.expression, cst.Integer):
        return -int(node.expression.value)
    return None


def self_attr(node: cst.CSTNode) -> str | None:
    """``self.blocks`` -> ``"blocks"``."""
    return node.attr.value if m.matches(node, m.Attribute(value=m.Name("self"))) else None


def attr_chain(node: cst.CSTNode) -> list[str] | None:
    """``self.transformer.h`` -> ``["transformer", "h"]``; None for anything not rooted at ``self``."""
    parts: list[str] = []
    while isinstance(node, cst.Attribute):
        parts.append(node.attr.value)
        node = node.value
    return parts[::-1] if is_name(node, "self") and parts else None


def is_param(fn: cst.FunctionDef, name: str) -> bool:
    """Whether ``fn`` takes a parameter called ``name`` (positional or keyword; not ``*args`` or ``**kwargs``)."""
    params = fn.params
    return any(p.name.value == name for p in (*params.posonly_params, *params.params, *params.kwonly_params))


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


def argument(call: cst.Call, index: int | None, name: str) -> cst.BaseExpression | None:
    """The argument at ``index`` (None: keyword only) or named ``name``."""
    for a in call.args:
        if a.keyword is not None and a.keyword.value == name:
            return a.value
    pos = [a for a in call.args if a.keyword is None]
    if index is not None and 0 <= index < len(pos) and not pos[index].star:
        return pos[index].value
    return None


def walk(node: cst.CSTNode, itself: bool = False) -> Iterator[cst.CSTNode]:
    """The nodes under ``node``, depth first in source order (``node`` first where ``itself``)."""
    if itself:
        yield node
    for child in node.children:
        yield child
        yield from walk(child)


def short(facts: ModuleFacts, node: cst.CSTNode, limit: int = 40) -> str:
    """``node``'s code on one line, cut to ``limit`` characters: how a message names a piece of the script."""
    code = " ".join(facts.code(node).split())
    return code if len(code) <= limit else code[: limit - 3] + "..."


# --- names: what binds them and what reads them -------------------------------------------------------------


def bound_names(target: cst.BaseExpression) -> Iterator[str]:
    if isinstance(target, cst.Name):
        yield target.value
    elif isinstance(target, (cst.Tuple, cst.List)):
        for element in target.elements:
            yield from bound_names(element.value)
    elif isinstance(target, cst.StarredElement):
        yield from bound_names(target.value)


def is_reference(node: cst.BaseExpression | None, indexes: tuple[type, ...] = ()) -> bool:
    """A variable, an attribute chain on one (``accum``, ``args.accum``, ``cfg.train.accum``), or one of them indexed
    by a constant of the kinds ``indexes`` allows (``config["compile"]``, ``batch[0]``): read a second time it is the
    same value, and nothing runs to get it."""
    while True:
        if isinstance(node, cst.Name):
            return node.value not in ("True", "False", "None")
        if isinstance(node, cst.Attribute):
            node = node.value
        elif indexes and isinstance(node, cst.Subscript) and isinstance(one_index(node), indexes):
            node = node.value
        else:
            return False


def one_index(node: cst.Subscript) -> cst.BaseExpression | None:
    """The index of ``node`` where it has one and no slice (``x[-1]``, ``config["compile"]``); else None."""
    if len(node.slice) == 1 and isinstance(node.slice[0].slice, cst.Index):
        return node.slice[0].slice.value
    return None


def string_key(node: cst.Subscript) -> str | None:
    """The key of ``config["compile"]``: the string ``node`` is indexed by; None for any other index."""
    index = one_index(node)
    key = index.evaluated_value if isinstance(index, cst.SimpleString) else None
    return key if isinstance(key, str) else None


def is_setting(node: cst.BaseExpression) -> bool:
    """A setting a script switches on: a variable, an attribute chain on one (``args.compile``,
    ``config.train.compile``) or one of them indexed by a string (``config["compile"]``)."""
    return is_reference(node, (cst.SimpleString,))


def names_variable(facts: ModuleFacts, name: cst.Name) -> bool:
    """Whether ``name`` names a variable, read or bound (not the attribute of ``opt.step``, nor the keyword of
    ``f(step=1)``)."""
    parent = facts.parent(name)
    if isinstance(parent, cst.Attribute) and parent.attr is name:
        return False
    return not (isinstance(parent, (cst.Arg, cst.Param)) and getattr(parent, "keyword", None) is name)


def enclosing_if(facts: ModuleFacts, node: cst.CSTNode, *stops: cst.CSTNode) -> cst.If | None:
    """The innermost ``if`` whose body (not its ``else``) holds ``node``, met before any of ``stops``."""
    child: cst.CSTNode = node
    for parent in facts.ancestors(node):
        if any(parent is stop for stop in stops):
            return None
        if isinstance(parent, cst.If) and facts.contains(parent.body, child):
            return parent
        child = parent
    return None


def names_read(facts: ModuleFacts, owner: cst.CSTNode) -> Iterator[cst.Name]:
    """The Name nodes under ``owner`` that read a variable (not assignment targets, attributes or keywords)."""
    for name in facts.nodes_in(owner, cst.Name):
        parent = facts.parent(name)
        if not names_variable(facts, name) or (isinstance(parent, cst.Param) and parent.name is name):
            continue
        if isinstance(parent, (cst.FunctionDef, cst.ClassDef, cst.ImportAlias, cst.AsName)):
            continue
        if _is_store(facts, name):
            continue
        yield name


def _target_of(facts: ModuleFacts, name: cst.Name) -> tuple[cst.CSTNode, cst.CSTNode | None]:
    """(the whole target ``name`` is part of, what holds that target): ``(a, b)`` and its AssignTarget for ``b``."""
    node: cst.CSTNode = name
    parent = facts.parent(node)
    while isinstance(parent, (cst.Tuple, cst.List, cst.Element, cst.StarredElement)):
        node, parent = parent, facts.parent(parent)
    return node, parent


def is_assigned(facts: ModuleFacts, name: cst.Name) -> bool:
    """Whether ``name`` is bound by an ``=`` assignment, alone or unpacked (``batch_size, accum = 4, 8``)."""
    node, parent = _target_of(facts, name)
    return isinstance(parent, cst.AssignTarget) and parent.target is node


def _is_store(facts: ModuleFacts, name: cst.Name) -> bool:
    node, parent = _target_of(facts, name)
    if isinstance(parent, (cst.AssignTarget, cst.AnnAssign, cst.AugAssign, cst.For, cst.CompFor)) and \
            parent.target is node:
        return True
    return isinstance(parent, cst.AsName)


def stores(facts: ModuleFacts, owner: cst.CSTNode, name: str) -> list[cst.Name]:
    """The Name nodes under ``owner`` that bind ``name`` (assignment and loop targets, ``as`` names)."""
    return [n for n in facts.nodes_in(owner, cst.Name) if n.value == name and _is_store(facts, n)]


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


def assignments(facts: ModuleFacts, scope: cst.CSTNode, name: str, before: cst.CSTNode | None = None,
                unpacking: bool = False) -> list[cst.Assign]:
    """The ``name = ...`` statements of ``scope`` (not of functions nested in it), before ``before`` when given;
    with ``unpacking``, also those that bind it as an element of a tuple (``batch_size, accum = 4, 8``)."""
    out = []
    for assign in facts.nodes_in(scope, cst.Assign):
        if scope_of(facts, assign) is not scope:
            continue
        if before is not None and facts._enter[assign] >= facts._enter[before]:
            continue
        if any(binds(facts, t.target, name) or (unpacking and isinstance(t.target, (cst.Tuple, cst.List)) and any(
                binds(facts, e.value, name) for e in t.target.elements)) for t in assign.targets):
            out.append(assign)
    return out


def binds(facts: ModuleFacts, target: cst.BaseExpression, name: str) -> bool:
    """Whether an assignment target is ``name``: a variable, or an attribute chain (``self.model``)."""
    if "." in name:
        return isinstance(target, cst.Attribute) and facts.code(target) == name
    return is_name(target, name)


def unique_name(facts: ModuleFacts, scope: cst.CSTNode, *candidates: str) -> str:
    """The first candidate the scope does not use yet (then ``candidate_2``...)."""
    return fresh_name({n.value for n in facts.nodes_in(scope, cst.Name)}, *candidates)
