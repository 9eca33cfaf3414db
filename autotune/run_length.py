"""How long the user's whole run is: the loops around a training step, read by the trial as each one starts.

patch.py puts ``_autotune.loop_length(lambda: ITERABLE, TEXT, GROUP, OF)`` just before each loop around the step
(the epoch loop, the loop over batches, and a loop of another function that calls the one holding them): outside a
trial it does nothing and the lambda is never called; in a trial the runtime records len(ITERABLE) as the loop
starts, and the run's optimizer steps are the product (see ``runtime._Trial.run_length``). Where that product would
not be the run's length (a while loop, a loop that may break off early, an iterable of no known size), a single
``_autotune.loop_length(None, WHY, GROUP, 0)`` says why instead, and the search falls back to steady-state speed.
"""

from __future__ import annotations

from typing import NamedTuple

import libcst as cst

from autotune.analysis import ModuleFacts
from autotune.project import TrainingLoop
from autotune.syntax import assigned_names, is_literal, is_setting, stores

# calls whose first argument is what the loop really iterates over: enumerate(loader), tqdm(loader, ...)
_WRAPPERS = {"enumerate", "tqdm", "tqdm.tqdm", "tqdm.auto.tqdm", "tqdm.notebook.tqdm"}
# what the arguments of range() may hold: nothing a call to it could change by being made once more
_PURE_CALLS = {"int", "len", "min", "max", "round", "math.ceil", "math.floor"}
# methods of a tensor (or array) that read its size: ``train_data.size(0) - 1`` (word_language_model)
_SIZES = {"size", "numel", "dim"}


def markers(facts: ModuleFacts, loop: TrainingLoop, name: str) -> list[Marker]:
    """The markers before the loops of ``loop``'s run, outermost first (a bound that ends them all early before
    them); one (loop, None, why, 0) where the run's length cannot be read. ``name``: the file as the user reads it
    (relative to the project, so the patched code is the same wherever it lies)."""
    chain = [node for node in facts.loops
             if facts.contains(node, loop.node) and facts.function_of(node) is facts.function_of(loop.node)]
    callers = [node for f, node in loop.callers]
    if any(f is not facts for f, _ in loop.callers):
        return [Marker(loop.outer, None, "the loop over batches is in a function another module's loop calls", 0)]
    if callers and not all(facts.contains(a, b) or facts.contains(b, a) for a in callers for b in callers):
        return [Marker(loop.outer, None, "the training function is called from more than one loop", 0)]
    chain = sorted(callers, key=lambda n: facts.position(n)) + sorted(chain, key=lambda n: facts.position(n))
    assigned = set().union(*(assigned_names(facts, node) for node in chain))  # (a for loop's target too)
    cap = None if callers or any(isinstance(node, cst.While) for node in chain) else _cap(facts, chain, assigned)
    out = []
    for node in chain:
        where = f"{name}:{facts.position(node)[0]}"
        if isinstance(node, cst.While):
            counted = _while_count(facts, node) if node is chain[0] else None  # counted once, from its start
            if counted is None:
                return [Marker(chain[0], None, f"the loop at {where} is a while loop that does not end on a counter's "
                               "bound (`while step < n` or `if step >= n: break`): its length is known only as it ends",
                               0)]
            out.append((node, *counted))
            continue
        capped = cap.breaks if cap is not None else frozenset()
        guards = _guards(facts, node, capped, assigned) if isinstance(node.body, cst.IndentedBlock) else None
        if guards is None or _ends_early(node, capped | set(guards)):
            why = f"the loop at {where} may end before its iterable does (break or return)"
            return [Marker(chain[0], None, why, 0)]
        read = _iterable(facts, node.iter)
        if read is None:
            code = facts.code(node.iter)
            return [Marker(chain[0], None, f"the loop at {where} iterates over {code[:60]}, whose length is not read",
                           0)]
        out.append((node, _guarded(facts, read[0], [], list(guards.values())), read[1]))
    found = [Marker(node, code, text, len(out)) for node, code, text in out]
    return found if cap is None else [Marker(chain[0], cap.code, cap.text, len(out), cap=True), *found]


class Marker(NamedTuple):
    """One ``loop_length`` call before ``node``: ``code`` (what len() is taken of, or None: the length is not
    known), ``text`` (how the user reads it, or why not), ``of`` (how many loops the run has); ``cap``: not a loop
    but the counter's bound that ends every loop of the run early (``if step >= max_steps: break``)."""
    node: cst.For | cst.While
    code: str | None
    text: str
    of: int
    cap: bool = False


class _Cap(NamedTuple):
    code: str
    text: str
    breaks: frozenset[cst.BaseStatement]


def _cap(facts: ModuleFacts, chain: list[cst.For | cst.While], assigned: set[str]) -> _Cap | None:
    """The bound that ends all the loops of a run of for loops (a training script's ``--max-iters``): the innermost
    loop counts (``step += 1``, once, at its top level) and breaks on ``[cond and] step >= n`` at its top level, and
    every loop around it breaks on the same test at its own, so no step runs once the count is reached. ``step`` is
    bound nowhere else in the outermost loop, ``n`` and ``cond`` nowhere in it; no ``continue`` skips the count.
    None for anything else (a break in the inner loop only runs one more step each epoch after it). ``assigned``:
    the names the run's loops bind (a setting's way out of the inner loop is read against them)."""
    inner, outer = chain[-1], chain[0]
    if not all(isinstance(node.body, cst.IndentedBlock) for node in chain):
        return None
    body = list(inner.body.body)
    found = [(i, parsed) for i, s in enumerate(body) if (parsed := _bound(facts, _breaks_on(s))) is not None]
    if len(found) != 1:
        return None
    at, (conditions, compare) = found[0]
    test = facts.code(_breaks_on(body[at]))
    counter = compare.left.value
    counts = [i for i, s in enumerate(body) if _counts(s, counter)]
    if len(counts) != 1 or len(stores(facts, outer.body, counter)) != 1 or _declared_global(facts, counter):
        return None
    breaks = {body[at]}
    for node in chain[:-1]:
        same = [s for s in node.body.body if _breaks_on(s) is not None and facts.code(_breaks_on(s)) == test]
        if len(same) != 1:
            return None
        breaks.add(same[0])
    reads = _names(facts, compare.comparisons[0].comparator).union(*(_names(facts, c) for c in conditions))
    # (a setting's way out, as word_language_model's dry run)
    guards = _guards(facts, inner, frozenset(breaks), assigned)
    if guards is None or reads & assigned_names(facts, outer.body) or _ends_early(
            inner, frozenset(breaks | set(guards)), continues=True):
        return None
    code = _count_code(facts, compare, counter, after=at > counts[0])
    if conditions:  # where they do not hold the breaks never run: no bound
        code = f"{code} if {' and '.join(facts.code(c) for c in conditions)} else None"
    return _Cap(code, f"until {facts.code(compare)}", frozenset(breaks))


def _bound(facts: ModuleFacts,
           test: cst.BaseExpression | None) -> tuple[list[cst.BaseExpression], cst.Comparison] | None:
    """(the plain conditions, the comparison) of ``[cond and ...] step >= n`` (or ``>``): a counter's name against
    plain values, after plain conditions of the run's settings; else None."""
    if test is None:
        return None
    *conditions, compare = _conjuncts(test)
    if (not isinstance(compare, cst.Comparison) or len(compare.comparisons) != 1
            or not isinstance(compare.left, cst.Name)):
        return None
    op, limit = compare.comparisons[0].operator, compare.comparisons[0].comparator
    if not isinstance(op, (cst.GreaterThanEqual, cst.GreaterThan)) or not _plain(facts, limit):
        return None
    return (conditions, compare) if all(_plain_condition(facts, c) for c in conditions) else None


def _count_code(facts: ModuleFacts, compare: cst.Comparison, counter: str, after: bool) -> str:
    """The range of counter values a loop runs for, from the counter's value as it starts, until ``compare``
    (``counter >= n``, ``counter > n``, ``counter < n`` or ``<=``); ``after``: checked after the count, so at least
    one iteration runs."""
    op = compare.comparisons[0].operator
    bound = facts.code(compare.comparisons[0].comparator)
    end = f"{bound} + 1" if isinstance(op, (cst.GreaterThan, cst.LessThanEqual)) else bound
    return f"range({counter}, max({end}, {counter} + 1))" if after else f"range({counter}, {end})"


def _iterable(facts: ModuleFacts, it: cst.BaseExpression) -> tuple[str, str] | None:
    """(code to call len() on, how the user reads it) for ``range(...)`` of plain values or a name or attribute
    (inside enumerate() or tqdm()); None for anything whose evaluation once more could do something."""
    while isinstance(it, cst.Call) and it.args and not it.args[0].star and _name(facts, it.func) in _WRAPPERS:
        it = it.args[0].value
    if isinstance(it, cst.Call) and isinstance(it.func, cst.Name) and it.func.value == "range":
        if it.args and all(_plain(facts, a.value) and not a.star for a in it.args):
            code = facts.code(it)
            return code, code
        return None
    if _plain_reference(it):
        code = facts.code(it)
        return code, f"len({code})"
    return None


def _while_count(facts: ModuleFacts, loop: cst.While) -> tuple[str, str] | None:
    """(code whose len() is how many times ``loop`` runs, counted from where it starts, and how the user reads it)
    for the counted while loops of training scripts, else None:

    - ``while step < n:`` (or ``<=``) with ``step += 1`` once in its body, no break;
    - ``while True:`` whose last statement is ``if step >= n: break`` (or ``>``, or ``cond and step >= n`` with a
      plain ``cond``: karpathy/makemore) below its one ``step += 1`` (nanoGPT), or whose first statement is that
      ``if`` (checked before the iteration's work);
    - other ``if ...: break`` statements of the body only where one of their ``and`` terms is a plain setting the loop
      does not assign (nanoGPT's ``if iter_num == 0 and eval_only: break``): counted where it is off.

    ``step`` is a local or global name bound nowhere else in the loop (nor declared global by a function), ``n`` plain
    values the loop does not assign. No ``continue`` (it would skip the count) and no other way out."""
    if not isinstance(loop.body, cst.IndentedBlock) or loop.orelse is not None:
        return None
    body = list(loop.body.body)
    conditions: list[cst.BaseExpression] = []
    if isinstance(loop.test, cst.Comparison):
        compare, until, at_top = loop.test, False, False
        comparison = compare.comparisons[0] if len(compare.comparisons) == 1 else None
        if (comparison is None or not isinstance(compare.left, cst.Name) or not _plain(facts, comparison.comparator)
                or not isinstance(comparison.operator, (cst.LessThan, cst.LessThanEqual))):
            return None
    elif is_literal(loop.test, True) and body and (parsed := _bound(facts, _breaks_on(body[-1]))) is not None:
        (conditions, compare), until, at_top = parsed, True, False
    elif is_literal(loop.test, True) and body and (parsed := _bound(facts, _breaks_on(body[0]))) is not None:
        (conditions, compare), until, at_top = parsed, True, True
    else:
        return None
    counter = compare.left.value
    if sum(_counts(s, counter) for s in body) != 1 or len(stores(facts, loop.body, counter)) != 1:
        return None
    assigned = assigned_names(facts, loop.body)
    ending = body[-1] if until and not at_top else body[0] if until else None
    # other ways out that a setting of the run closes (nanoGPT: ``if iter_num == 0 and eval_only: break``): counted
    # where the setting, read as the loop starts, is off
    guards = _guards(facts, loop, frozenset({ending}), assigned)
    if guards is None or _ends_early(loop, frozenset({ending, *guards}), continues=True):
        return None
    reads = _names(facts, compare.comparisons[0].comparator).union(*(_names(facts, c) for c in conditions))
    if reads & assigned or _declared_global(facts, counter):
        return None
    code = _guarded(facts, _count_code(facts, compare, counter, after=until and not at_top), conditions,
                    list(guards.values()))
    return code, f"iterations until {facts.code(compare)}" if until else f"iterations while {facts.code(compare)}"


def _guards(facts: ModuleFacts, loop: cst.For | cst.While, skip: frozenset[cst.BaseStatement | None],
            assigned: set[str]) -> dict[cst.Break, cst.BaseExpression] | None:
    """The ``break`` statements of ``loop``'s own (outside the statements ``skip``) that a setting of the run closes,
    each with the setting: an ``and`` term of an ``if`` around it (in its body, not its else), of plain values the
    run's loops do not assign (``assigned``: word_language_model's ``if args.dry_run: break``, mnist's inside its
    logging ``if``, nanoGPT's ``if iter_num == 0 and eval_only: break``). None where a break has no such term."""
    out = {}
    stack: list[cst.CSTNode] = [s for s in loop.body.body if s not in skip]
    while stack:
        node = stack.pop()
        if isinstance(node, (cst.FunctionDef, cst.ClassDef, cst.Lambda, cst.For, cst.While)):
            continue
        if not isinstance(node, cst.Break):
            stack.extend(node.children)
            continue
        settings, inner = [], node
        while (up := facts.parent(inner)) is not None and up is not loop:
            if isinstance(up, cst.If) and inner is up.body:
                settings += [c for c in _conjuncts(up.test)
                             if _plain_condition(facts, c) and not _names(facts, c) & assigned]
            inner = up
        if not settings:
            return None
        out[node] = settings[0]
    return out


def _guarded(facts: ModuleFacts, code: str, conditions: list[cst.BaseExpression],
             guards: list[cst.BaseExpression]) -> str:
    """``code`` where ``conditions`` hold and no ``guards`` setting is on, else None (no length)."""
    terms = [facts.code(c) for c in conditions] + [
        f"not {facts.code(g)}" if _plain_reference(g) else f"not ({facts.code(g)})" for g in guards]
    return f"{code} if {' and '.join(terms)} else None" if terms else code


def _breaks_on(statement: cst.BaseStatement) -> cst.BaseExpression | None:
    """``X`` of ``if X: break`` (no elif or else, the break alone in its body), else None."""
    if not isinstance(statement, cst.If) or statement.orelse is not None:
        return None
    body = statement.body
    if isinstance(body, cst.IndentedBlock):  # ``break`` on a line of its own
        body = body.body[0] if len(body.body) == 1 and isinstance(body.body[0], cst.SimpleStatementLine) else None
    return statement.test if body is not None and len(body.body) == 1 and isinstance(body.body[0], cst.Break) else None


def _counts(statement: cst.BaseStatement, counter: str) -> bool:
    """``counter += 1`` as a statement of its own."""
    if not isinstance(statement, cst.SimpleStatementLine) or len(statement.body) != 1:
        return False
    small = statement.body[0]
    return (isinstance(small, cst.AugAssign) and isinstance(small.operator, cst.AddAssign)
            and isinstance(small.target, cst.Name) and small.target.value == counter and is_literal(small.value, 1))


def _conjuncts(node: cst.BaseExpression) -> list[cst.BaseExpression]:
    """``a``, ``b`` and ``c`` of ``a and b and c``; ``[node]`` for anything else."""
    if isinstance(node, cst.BooleanOperation) and isinstance(node.operator, cst.And):
        return _conjuncts(node.left) + _conjuncts(node.right)
    return [node]


def _names(facts: ModuleFacts, node: cst.CSTNode) -> set[str]:
    return {n.value for n in facts.nodes_in(node, cst.Name)}


def _plain_condition(facts: ModuleFacts, node: cst.BaseExpression) -> bool:
    """A comparison of plain values, a plain value itself (``eval_only``), ``not`` or ``and`` of such
    (``args.max_steps >= 0``)."""
    if isinstance(node, cst.BooleanOperation) and isinstance(node.operator, cst.And):
        return _plain_condition(facts, node.left) and _plain_condition(facts, node.right)
    if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.Not):
        return _plain_condition(facts, node.expression)
    if _plain_reference(node):
        return True
    if isinstance(node, cst.Comparison):
        return _plain(facts, node.left) and all(_plain(facts, c.comparator) for c in node.comparisons)
    return False


def _declared_global(facts: ModuleFacts, name: str) -> bool:
    """Whether some function of the module declares ``name`` global or nonlocal (a call could change it)."""
    return any(n.name.value == name for kind in (cst.Global, cst.Nonlocal)
               for statement in facts.nodes_in(facts.module, kind) for n in statement.names)


def _name(facts: ModuleFacts, func: cst.BaseExpression) -> str | None:
    if isinstance(func, cst.Name):
        return facts.qualname(func) or func.value
    return facts.qualname(func)


def _plain_reference(node: cst.BaseExpression) -> bool:
    """A name or a chain of attributes of one, and of entries by a string key (``loader``, ``self.train_loader``,
    ``args.epochs``, a config dict's ``config["max_iters"]``, ``loaders["train"]``): a setting (``is_setting``)."""
    return isinstance(node, cst.Name) or is_setting(node)


def _plain(facts: ModuleFacts, node: cst.BaseExpression) -> bool:
    """Numbers, references and arithmetic on them, a few calls that only compute (len, int, math.ceil) and sizes
    (``data.size(0)``, ``data.shape[0]``)."""
    if isinstance(node, (cst.Integer, cst.Float)) or _plain_reference(node):
        return True
    if isinstance(node, cst.BinaryOperation):
        return _plain(facts, node.left) and _plain(facts, node.right)
    if isinstance(node, cst.UnaryOperation):
        return _plain(facts, node.expression)
    if isinstance(node, cst.Call) and (_name(facts, node.func) in _PURE_CALLS or (
            isinstance(node.func, cst.Attribute) and node.func.attr.value in _SIZES and _plain_reference(node.func))):
        return all(_plain(facts, a.value) and not a.star for a in node.args)
    if isinstance(node, cst.Subscript) and _plain_reference(node.value):  # ``data.shape[0]``
        return all(isinstance(e.slice, cst.Index) and _plain(facts, e.slice.value) for e in node.slice)
    return False


def _ends_early(loop: cst.For | cst.While, allowed: frozenset[cst.CSTNode | None] = frozenset(),
                continues: bool = False) -> bool:
    """Whether ``loop``'s own body may leave it before its iterable ends: a ``break`` of its own or a ``return``
    (outside the statements and breaks ``allowed``; with ``continues``, a ``continue`` of its own too: it skips a
    count)."""
    exits = (cst.Break, cst.Continue) if continues else cst.Break
    stack: list[tuple[cst.CSTNode, bool]] = [(s, True) for s in loop.body.body]
    while stack:
        node, own = stack.pop()
        if isinstance(node, (cst.FunctionDef, cst.ClassDef, cst.Lambda)) or node in allowed:
            continue
        if isinstance(node, cst.Return) or (own and isinstance(node, exits)):
            return True
        inner = own and not isinstance(node, (cst.For, cst.While))
        stack.extend((child, inner) for child in node.children)
    return False


def length_marker(runtime: str, marker: Marker, group: str, counted: bool) -> str:
    """The statement that tells a trial one loop's length (or, with ``code`` None, why the run's is unknown)."""
    length = f"lambda: {marker.code}" if marker.code is not None else "None"
    keywords = (", counted=True" if counted else "") + (", cap=True" if marker.cap else "")
    return f"{runtime}({length}, {marker.text!r}, {group!r}, {marker.of}{keywords})\n"

