"""How long the user's whole run is: the loops around a training step, read by the trial as each one starts.

patch.py puts ``_autotune.loop_length(lambda: ITERABLE, TEXT, GROUP, OF)`` just before each loop around the step
(the epoch loop, the loop over batches, and a loop of another function that calls the one holding them): outside a
trial it does nothing and the lambda is never called; in a trial the runtime records len(ITERABLE) as the loop
starts, and the run's optimizer steps are the product (see ``runtime._Trial.run_length``). Where that product would
not be the run's length (a while loop, a loop that may break off early, an iterable of no known size), a single
``_autotune.loop_length(None, WHY, GROUP, 0)`` says why instead, and the search falls back to steady-state speed.
"""

from __future__ import annotations

import libcst as cst

from autotune.analysis import ModuleFacts
from autotune.project import TrainingLoop

# calls whose first argument is what the loop really iterates over: enumerate(loader), tqdm(loader, ...)
_WRAPPERS = {"enumerate", "tqdm", "tqdm.tqdm", "tqdm.auto.tqdm", "tqdm.notebook.tqdm"}
# what the arguments of range() may hold: nothing a call to it could change by being made once more
_PURE_CALLS = {"int", "len", "min", "max", "round", "math.ceil", "math.floor"}


def markers(facts: ModuleFacts, loop: TrainingLoop, name: str) -> list[tuple[cst.For | cst.While, str | None, str, int]]:
    """(loop, the iterable's code or None, its text or why not, how many) for each marker before a loop of
    ``loop``'s run, outermost first; one (loop, None, why, 0) where the run's length cannot be read. ``name``: the
    file as the user reads it (relative to the project, so the patched code is the same wherever it lies)."""
    chain = [node for node in facts.loops
             if facts.contains(node, loop.node) and facts.function_of(node) is facts.function_of(loop.node)]
    callers = [node for f, node in loop.callers]
    if any(f is not facts for f, _ in loop.callers):
        return [(loop.outer, None, "the loop over batches is in a function another module's loop calls", 0)]
    if callers and not all(facts.contains(a, b) or facts.contains(b, a) for a in callers for b in callers):
        return [(loop.outer, None, "the training function is called from more than one loop", 0)]
    chain = sorted(callers, key=lambda n: facts.position(n)) + sorted(chain, key=lambda n: facts.position(n))
    out = []
    for node in chain:
        where = f"{name}:{facts.position(node)[0]}"
        if isinstance(node, cst.While):
            return [(chain[0], None, f"the loop at {where} is a while loop: its length is known only as it ends", 0)]
        if _ends_early(node):
            return [(chain[0], None, f"the loop at {where} may end before its iterable does (break or return)", 0)]
        read = _iterable(facts, node.iter)
        if read is None:
            code = facts.code(node.iter)
            return [(chain[0], None, f"the loop at {where} iterates over {code[:60]}, whose length is not read", 0)]
        out.append((node, *read))
    return [(node, code, text, len(out)) for node, code, text in out]


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


def _name(facts: ModuleFacts, func: cst.BaseExpression) -> str | None:
    if isinstance(func, cst.Name):
        return facts.qualname(func) or func.value
    return facts.qualname(func)


def _plain_reference(node: cst.BaseExpression) -> bool:
    """A name or a chain of attributes of one (``loader``, ``self.train_loader``, ``args.epochs``)."""
    while isinstance(node, cst.Attribute):
        node = node.value
    return isinstance(node, cst.Name)


def _plain(facts: ModuleFacts, node: cst.BaseExpression) -> bool:
    """Numbers, references and arithmetic on them, and a few calls that only compute (len, int, math.ceil)."""
    if isinstance(node, (cst.Integer, cst.Float)) or _plain_reference(node):
        return True
    if isinstance(node, cst.BinaryOperation):
        return _plain(facts, node.left) and _plain(facts, node.right)
    if isinstance(node, cst.UnaryOperation):
        return _plain(facts, node.expression)
    if isinstance(node, cst.Call) and _name(facts, node.func) in _PURE_CALLS:
        return all(_plain(facts, a.value) and not a.star for a in node.args)
    return False


def _ends_early(loop: cst.For) -> bool:
    """Whether ``loop``'s own body may leave it before its iterable ends: a ``break`` of its own or a ``return``."""
    stack: list[tuple[cst.CSTNode, bool]] = [(s, True) for s in loop.body.body]
    while stack:
        node, own = stack.pop()
        if isinstance(node, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            continue
        if isinstance(node, cst.Return) or (own and isinstance(node, cst.Break)):
            return True
        inner = own and not isinstance(node, (cst.For, cst.While))
        stack.extend((child, inner) for child in node.children)
    return False


def length_marker(runtime: str, code: str | None, text: str, group: str, of: int, counted: bool) -> str:
    """The statement that tells a trial one loop's length (or, with ``code`` None, why the run's is unknown)."""
    length = f"lambda: {code}" if code is not None else "None"
    return f"{runtime}({length}, {text!r}, {group!r}, {of}{', counted=True' if counted else ''})\n"

