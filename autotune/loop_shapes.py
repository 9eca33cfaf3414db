"""The shapes of a training loop's batches, recognised once for the step hooks (which batch a step trained on) and
the batch split (which micro-batch size and accumulation count it may change):

- an inner micro-batch loop, ``for micro in range(accum):`` around every backward of the step, the optimizer step
  after it, and the micro-batch it draws (``x, y = next(it)``, ``get_batch(...)``, ``loader.next_batch()``);
- a loop over slice starts, ``for i, start in enumerate(range(0, n, batch_size)):``, and the slice it takes
  (``xb = x[start:start + batch_size]``);
- a loop that counts its batches, ``for i, batch in enumerate(loader):``.

Each answers what the loop's syntax says; whether an edit is safe is the caller's question."""

from __future__ import annotations

from typing import NamedTuple

import libcst as cst
import libcst.matchers as m

from autotune.analysis import ModuleFacts
from autotune.project import StepScope

# ``range(x)``: one positional argument
_RANGE_OF_ONE = m.Call(func=m.Name("range"), args=[m.Arg(keyword=None, star="")])
_RANGE = m.Call(func=m.Name("range"))
# ``for i, x in enumerate(...)``
_ENUMERATED = m.For(target=m.Tuple(elements=[m.Element(m.Name()), m.Element()]), iter=m.Call(func=m.Name("enumerate")))
# ``xb = x[a:...]``: one name bound to a subscript
_SLICE_TAKEN = m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Name())], value=m.Subscript())])


class Enumerated(NamedTuple):
    """``for counter, item in enumerate(iterated)``."""

    counter: str
    item: cst.BaseAssignTargetExpression
    iterated: cst.BaseExpression


def enumerated(loop: cst.CSTNode) -> Enumerated | None:
    """The counter, the item and what ``loop`` enumerates, where it is ``for i, x in enumerate(...)``."""
    if not m.matches(loop, _ENUMERATED) or not loop.iter.args:  # type: ignore[attr-defined]
        return None
    counter, item = loop.target.elements  # type: ignore[attr-defined]
    return Enumerated(counter.value.value, item.value, loop.iter.args[0].value)  # type: ignore[attr-defined]


def slice_starts(loop: cst.CSTNode) -> tuple[str, cst.Call] | None:
    """(``start``, the range) of ``for i, start in enumerate(range(...))``: where each micro-batch starts."""
    found = enumerated(loop)
    if found is None or not m.matches(found.iterated, _RANGE) or not isinstance(found.item, cst.Name):
        return None
    return found.item.value, found.iterated  # type: ignore[return-value]


def first_slice(loop: cst.For, start: str) -> str | None:
    """``xb`` of the first statement ``xb = x[start:...]`` directly in the loop's body."""
    for statement in loop.body.body:
        if not m.matches(statement, _SLICE_TAKEN):
            continue
        assign = statement.body[0]  # type: ignore[attr-defined]
        bounds = assign.value.slice[0].slice if assign.value.slice else None
        if m.matches(bounds, m.Slice(lower=m.Name(start))):
            return assign.targets[0].target.value
    return None


def batch_of(loop: cst.CSTNode) -> str | None:
    """The batch a ``for`` loop iterates: ``batch`` of ``for batch in loader`` and of ``for i, batch in
    enumerate(loader)``, ``x`` of ``for x, y in loader``, the slice a loop over slice starts takes; None where it
    counts steps (``for step in range(n)``) or is no ``for``."""
    if not isinstance(loop, cst.For) or m.matches(loop.iter, _RANGE):
        return None
    found = enumerated(loop)
    if found is not None and m.matches(found.iterated, _RANGE):  # slice starts: the slice taken at each
        return first_slice(loop, found.item.value) if isinstance(found.item, cst.Name) else None
    target = found.item if found is not None else loop.target
    if isinstance(target, (cst.Tuple, cst.List)) and target.elements:
        target = target.elements[0].value
    return target.value if isinstance(target, cst.Name) else None


def micro_loop(facts: ModuleFacts, loop: cst.CSTNode, scope: StepScope) -> cst.For | None:
    """The outermost ``for`` inside ``loop`` (in its function) that holds every backward of ``scope`` and none of its
    optimizer steps (or hand-written updates): the loop over a step's micro-batches."""
    if not scope.backward:
        return None
    for inner in facts.nodes_in(loop.body, cst.For):  # type: ignore[attr-defined]
        if facts.function_of(inner) is facts.function_of(loop) and \
                all(facts.contains(inner.body, b) for b in scope.backward) and \
                not any(facts.contains(inner, step) for step in scope.stepping):
            return inner
    return None


def micro_count(inner: cst.For) -> cst.BaseExpression | None:
    """``accum`` of ``for micro in range(accum):``."""
    return inner.iter.args[0].value if m.matches(inner.iter, _RANGE_OF_ONE) else None  # type: ignore[attr-defined]


def micro_batch(facts: ModuleFacts, inner: cst.For) -> str | None:
    """The micro-batch ``inner`` draws: the first name bound in it from ``next(...)``, from a function of the
    module's own (``get_batch(...)``) or from ``loader.next_batch()`` (``x, y = next(batches)``: ``x``)."""
    defined = {d.name.value for d in facts.module.body if isinstance(d, cst.FunctionDef)}
    drawn = m.Call(func=m.Name("next") | m.Name(m.MatchIfTrue(defined.__contains__)) |
                   m.Attribute(attr=m.Name("next_batch")))
    for assign in facts.nodes_in(inner.body, cst.Assign):
        if len(assign.targets) != 1 or not m.matches(assign.value, drawn):
            continue
        target = assign.targets[0].target
        if isinstance(target, (cst.Tuple, cst.List)) and target.elements:
            target = target.elements[0].value
        if isinstance(target, cst.Name):
            return target.value
    return None
