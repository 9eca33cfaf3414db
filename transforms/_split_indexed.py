"""The batch split's reading of micro-batches picked by their index: ``x, y = get_batch(step, micro, batch_size)``
in ``for micro in range(accum):``, where the script's own ``get_batch`` takes the rows from ``micro * batch_size``
on, ``rows[start:start + batch_size]``. The k slices of B rows from ``micro * B`` are the one slice of k x B rows
from ``micro' * k x B`` that replaces them, in the same order; an offset added to the start is the same after the
split where it reads neither the micro-batch size nor the accumulation count, or reads them only as their product
(``step * accum * batch_size``: the rows of the steps before)."""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from autotune.analysis import ModuleFacts
from autotune.syntax import assignments, is_reference, names_variable, walk
from autotune.transforms._split_reads import Refusal, factors, first_dimension, line_of, module_function


def bound_arguments(defined: cst.FunctionDef, call: cst.Call) -> dict[str, cst.BaseExpression] | None:
    """Each parameter of ``defined`` that ``call`` gives a value, by name; None where the call unpacks arguments or
    gives one the function has no parameter for."""
    params = [p.name.value for p in defined.params.params]
    out: dict[str, cst.BaseExpression] = {}
    for i, arg in enumerate(call.args):
        if arg.star:
            return None
        name = arg.keyword.value if arg.keyword is not None else (params[i] if i < len(params) else None)
        if name is None or name not in params + [p.name.value for p in defined.params.kwonly_params]:
            return None
        out[name] = arg.value
    return out


def indexed_call(facts: ModuleFacts, read: cst.Name) -> cst.Call | None:
    """The call of a module-level function of the script's own that ``read`` (the micro-step counter) is given to
    as a whole argument (``get_batch(step, micro, batch_size)``), or None."""
    arg = facts.parent(read)
    call = facts.parent(arg) if isinstance(arg, cst.Arg) and arg.value is read else None
    if not (isinstance(call, cst.Call) and isinstance(call.func, cst.Name)):
        return None
    return call if module_function(facts, call.func.value) is not None else None


def from_indexed(facts: ModuleFacts, inner: cst.For, call: cst.Call, accumulation: cst.BaseExpression):
    """(the micro-batch size's expression, the statement before which it is split, the reads of it and of the
    accumulation count the split leaves right) for ``call``, which is given the micro-step counter of ``inner``; or a
    Refusal."""
    name = call.func.value  # type: ignore[attr-defined]
    defined = module_function(facts, name)
    counter = inner.target.value  # type: ignore[attr-defined]
    given = bound_arguments(defined, call)
    index = [p for p, v in (given or {}).items() if m.matches(v, m.Name(counter))]
    if len(index) != 1:
        return Refusal(call, f"{name}() is given {counter} in a way not read here: which rows it takes is not known")
    index = index[0]
    if assignments(facts, defined, index, unpacking=True):
        return Refusal(defined, f"{name}() rebinds {index}: which rows it takes is not known")
    products, sizes = [], set()
    for n in facts.nodes_in(defined.body, cst.Name):
        if n.value != index or not names_variable(facts, n):
            continue
        product = facts.parent(n)
        if not m.matches(product, m.BinaryOperation(operator=m.Multiply())):
            return Refusal(n, f"{index} is read at line {line_of(facts, n)} other than as {index} * batch_size: which "
                              f"rows {name}() takes at a bigger micro-batch is not known")
        size = product.right if product.left is n else product.left
        products.append((product, size))
        sizes.add(facts.code(size))
    if not products:
        return Refusal(defined, f"{name}() does not read {index}: which rows it takes is not known")
    if len(sizes) != 1 or not is_reference(products[0][1]):
        return Refusal(products[0][0], f"{name}() multiplies {index} by {' and '.join(sorted(sizes))}: not one "
                                       "variable, the micro-batch size is not known")
    (size,) = sizes
    inside_count = _inside(facts, given, accumulation)
    allowed: list[cst.CSTNode] = []
    for product, _ in products:
        taken = _slices_from(facts, defined, product, size, inside_count, allowed)
        if isinstance(taken, Refusal):
            return taken
    base = size.split(".", 1)[0]
    if base in given:  # a parameter: the caller's argument is the micro-batch size
        micro = given[base]
        if "." in size or not is_reference(micro):
            return Refusal(call, f"{name}() is given {facts.code(micro)} as {base}: not a variable or option of the "
                                 "script's own")
    else:  # a setting of the module's: every call of the function takes rows by it
        if assignments(facts, defined, base, unpacking=True) or base in [p.name.value for p in defined.params.params]:
            return Refusal(products[0][0], f"{base} is {name}()'s own: the micro-batch size is not a setting")
        micro = products[0][1]
        others = [c for c in facts.calls if m.matches(c.func, m.Name(name)) and c is not call]
        if others:
            return Refusal(others[0], f"{name}() is also called at line {line_of(facts, others[0])}: a bigger {size} "
                                      "would change the rows it takes there")
    reads = []
    for n in walk(defined.body):
        if not isinstance(n, (cst.Name, cst.Attribute)) or facts.code(n) not in (size, inside_count) or \
                (isinstance(n, cst.Name) and not names_variable(facts, n)):
            continue
        if not any(n is a or facts.contains(a, n) for a in allowed):
            return Refusal(n, f"{facts.code(n)} is read at line {line_of(facts, n)} in {name}() other than in the rows' "
                              "start and length: the split would change it")
        reads.append(n)
    given_sizes = [v for v in given.values() if facts.code(v) in (facts.code(micro), facts.code(accumulation))]
    return micro, facts.statement_of(call), frozenset(reads + given_sizes)


def _inside(facts: ModuleFacts, given: dict[str, cst.BaseExpression], accumulation: cst.BaseExpression) -> str:
    """How the function spells the accumulation count: the parameter the caller gives it to, else as the caller."""
    code = facts.code(accumulation)
    return next((p for p, v in given.items() if facts.code(v) == code), code)


def _slices_from(facts: ModuleFacts, defined: cst.FunctionDef, product: cst.BinaryOperation, size: str, count: str,
                 allowed: list[cst.CSTNode]) -> Refusal | None:
    """Check that ``index * size`` (``product``), with an offset added or not, starts first-dimension slices
    ``[start:start + size]``, directly or through one local name; add the reads found right to ``allowed``."""
    start: cst.CSTNode = product
    parent = facts.parent(product)
    if m.matches(parent, m.BinaryOperation(operator=m.Add())):
        offset = parent.right if parent.left is product else parent.left
        if not _offset_kept(facts, offset, size, count):
            return Refusal(offset, f"the offset {facts.code(offset)} of the rows' start reads {size} or {count} other "
                                   "than as their product: the split would move it")
        allowed.append(offset)
        start = parent
    allowed.append(product)
    holder = facts.parent(start)
    if m.matches(holder, m.Assign(targets=[m.AssignTarget(m.Name())])) and holder.value is start:
        local = holder.targets[0].target.value
        if len(assignments(facts, defined, local, unpacking=True)) != 1:
            return Refusal(holder, f"{local} is bound more than once in {defined.name.value}(): where the rows start "
                                   "is not known")
        reads = [n for n in facts.nodes_in(defined.body, cst.Name) if n.value == local and names_variable(facts, n)
                 and facts.parent(n) is not holder.targets[0]]
        for read in reads:
            if any(facts.contains(a, read) for a in allowed):
                continue  # the slice's end, ``start + batch_size``, of a slice already read
            refused = _slice_start(facts, read, size, allowed)
            if refused is not None:
                return refused
        return None if reads else Refusal(holder, f"{local} is not read: where the rows start is not known")
    return _slice_start(facts, start, size, allowed)


def _slice_start(facts: ModuleFacts, start: cst.CSTNode, size: str, allowed: list[cst.CSTNode]) -> Refusal | None:
    """``start`` is the lower bound of ``x[start:start + size]``, the subscript's first index."""
    bounds = facts.parent(start)
    length = m.BinaryOperation(left=m.MatchIfTrue(lambda left: facts.code(left) == facts.code(start)),
                               operator=m.Add(), right=m.MatchIfTrue(lambda right: facts.code(right) == size))
    if not (m.matches(bounds, m.Slice(upper=length, step=None)) and bounds.lower is start
            and first_dimension(facts, bounds)):
        return Refusal(start, f"{facts.code(start)} at line {line_of(facts, start)} is not the start of a slice "
                              f"[{facts.code(start)}:{facts.code(start)} + {size}] of rows: which rows are taken at a "
                              "bigger micro-batch is not known")
    allowed.append(bounds.upper)
    return None


def _offset_kept(facts: ModuleFacts, offset: cst.BaseExpression, size: str, count: str) -> bool:
    """Whether ``offset`` is the same after the split: it reads neither ``size`` nor ``count``, or is a product with
    both among its factors (and neither elsewhere)."""
    codes = [facts.code(n) for n in walk(offset, itself=True) if isinstance(n, (cst.Name, cst.Attribute))]
    if size not in codes and count not in codes:
        return True
    # each read once, and as a factor of the product (not inside a sum within it)
    return codes.count(size) == codes.count(count) == 1 and {size, count} <= factors(facts, offset)
