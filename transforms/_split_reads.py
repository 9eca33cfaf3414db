"""The batch split's reading of an accumulating loop: how it counts its micro-batches (``enumerate`` and the
optimizer step's ``(i + 1) % accum == 0``), what else reads the micro-batch size or the accumulation count (a read
the split would change refuses it), and the statement after which both are bound, where the split goes."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import NamedTuple

import libcst as cst

from autotune.analysis import ModuleFacts
from autotune.bound import unbound
from autotune.syntax import assignments, is_assigned, is_reference, names_variable, scope_of, walk
from autotune.transform import Status


class Refusal(NamedTuple):
    """Where and why the batch split does not apply (``status`` PRESENT where it is already a knob): a (node,
    reason) pair to every check that reads one."""

    node: cst.CSTNode
    reason: str
    status: Status = Status.NOT_APPLICABLE


# the split already patched in: a site of its own, not a refusal
ALREADY = "the batch split is already a knob"


@dataclass(frozen=True)
class Split:
    micro: str  # how the script spells the micro-batch size: ``args.batch_size``
    accumulation: str  # and the accumulation steps: ``args.accum``
    after: cst.BaseStatement  # both are bound (once) by here, and not yet read
    first: bool = False  # both are parameters of the function: the split goes before ``after``, its first statement
    note: str = ""  # what else the split changes (when the script logs), for the report
    # where the split is made in one argument of a call (a loader object's constructor, ``B=B``): that argument,
    # given ``bound`` (a name the split binds before ``after``) instead; the script's own micro-batch size is kept
    argument: cst.Arg | None = None
    bound: str | None = None


def last_micro_test(facts: ModuleFacts, name: cst.Name, accumulation: str) -> bool:
    """``micro == accum - 1`` (the last micro-batch of a step, which a DDP script syncs on): still the last one after
    a split."""
    parent = facts.parent(name)
    if not (isinstance(parent, cst.Comparison) and parent.left is name and len(parent.comparisons) == 1):
        return False
    target = parent.comparisons[0]
    right = target.comparator
    return (isinstance(target.operator, (cst.Equal, cst.NotEqual)) and isinstance(right, cst.BinaryOperation)
            and isinstance(right.operator, cst.Subtract) and facts.code(right.left) == accumulation
            and isinstance(right.right, cst.Integer) and right.right.value == "1")


def enumerate_start(loop: cst.For) -> int | None:
    """enumerate's start: 0, 1, or None where it is something else."""
    args = loop.iter.args  # type: ignore[attr-defined]
    if len(args) == 1:
        return 0
    value = args[1].value
    return int(value.value) if isinstance(value, cst.Integer) and value.value in ("0", "1") else None


def accumulation_of(facts: ModuleFacts, test: cst.BaseExpression, counter: str, start: int | None,
                  loader: str | None = None):
    """``A`` of ``(i + 1) % A == 0`` (``i % A == 0`` where enumerate counts from 1), where A is a variable; also with
    ``or i + 1 == len(loader)`` after it (a last, shorter step at the end of each epoch: ceil(n / A) steps, which
    the split keeps)."""
    if isinstance(test, cst.BooleanOperation) and isinstance(test.operator, cst.Or) and loader is not None and \
            _last_of_epoch(facts, test.right, counter, start, loader):
        test = test.left
    if not (isinstance(test, cst.Comparison) and len(test.comparisons) == 1):
        return None
    target = test.comparisons[0]
    if not (isinstance(target.operator, cst.Equal) and isinstance(target.comparator, cst.Integer)
            and target.comparator.value == "0"):
        return None
    mod = test.left
    if not (isinstance(mod, cst.BinaryOperation) and isinstance(mod.operator, cst.Modulo)):
        return None
    left, right = mod.left, mod.right
    counted = (start == 0 and isinstance(left, cst.BinaryOperation) and isinstance(left.operator, cst.Add)
               and isinstance(left.left, cst.Name) and left.left.value == counter
               and isinstance(left.right, cst.Integer) and left.right.value == "1")
    counted = counted or (start == 1 and isinstance(left, cst.Name) and left.value == counter)
    if not counted or not is_reference(right):
        return None
    return right


def _last_of_epoch(facts: ModuleFacts, test: cst.BaseExpression, counter: str, start: int | None, loader: str) -> bool:
    """``i + 1 == len(loader)`` (or ``i == len(loader) - 1``; ``i == len(loader)`` where enumerate counts from 1):
    the last micro-batch of the epoch."""
    spelled = re.sub(r"[\s()]", "", facts.code(test))
    last = {0: {f"{counter}+1==len{loader}", f"len{loader}=={counter}+1", f"{counter}==len{loader}-1"},
            1: {f"{counter}==len{loader}", f"len{loader}=={counter}"}}.get(start, set())
    return spelled in last


# calls that only report: print(...), logger.info(...), writer.add_scalar(...), wandb.log(...), pbar.set_postfix(...)
_LOG_CALLS = {"print", "info", "debug", "warning", "log", "add_scalar", "add_scalars", "set_postfix",
              "set_description", "write"}


def logging_if(facts: ModuleFacts, name: cst.Name, loop: cst.CSTNode) -> cst.If | None:
    """The ``if`` that holds ``name`` (in its test or its body) and only reports (``if i % log_every == 0:
    print(i, ...)``); None where ``name`` is read anywhere else or the body does more than report."""
    test_of = next((a for a in facts.ancestors(name) if isinstance(a, cst.If) or a is loop), None)
    if not isinstance(test_of, cst.If) or test_of.orelse is not None:  # (the nearest if, inside the loop)
        return None
    if isinstance(test_of.body, cst.SimpleStatementSuite):  # ``if i % 10 == 0: print(...)`` on one line
        smalls = list(test_of.body.body)
    elif all(isinstance(st, cst.SimpleStatementLine) for st in test_of.body.body):
        smalls = [small for st in test_of.body.body for small in st.body]
    else:
        return None
    local: set[str] = set()
    for small in smalls:
        if isinstance(small, cst.Expr) and isinstance(small.value, cst.Call):
            func = small.value.func
            called = func.value if isinstance(func, cst.Name) else func.attr.value if isinstance(func, cst.Attribute) else None
            if called not in _LOG_CALLS:
                return None
        elif isinstance(small, cst.Assign) and all(isinstance(t.target, cst.Name) for t in small.targets):
            local.update(t.target.value for t in small.targets)  # a value for the message: read nowhere else
        else:
            return None
    for other in facts.nodes_in(loop, cst.Name):
        if other.value in local and not facts.contains(test_of.body, other):
            return None
    return test_of


def module_function(facts: ModuleFacts, name: str) -> cst.FunctionDef | None:
    """The module-level ``def name`` of this module, if it is the only binding of ``name`` there."""
    found = [d for d in facts.module.body if isinstance(d, cst.FunctionDef) and d.name.value == name]
    return found[0] if len(found) == 1 else None


def first_dimension(facts: ModuleFacts, bounds: cst.Slice) -> bool:
    """Whether the slice ``bounds`` is the first (or only) index of its subscript: ``x[a:b]``, ``x[a:b, :]``."""
    element = facts.parent(bounds)
    subscript = facts.parent(element)
    return isinstance(subscript, cst.Subscript) and subscript.slice[0] is element


def line_of(facts: ModuleFacts, node: cst.CSTNode) -> int:
    """The line of the statement that holds ``node``."""
    return position_of(facts, facts.statement_of(node))[0]


def position_of(facts: ModuleFacts, statement: cst.BaseStatement) -> tuple[int, int]:
    """Where a statement is (a simple statement line has no position of its own: its first statement's)."""
    return facts.position(statement.body[0] if isinstance(statement, cst.SimpleStatementLine) and statement.body
                          else statement)


@dataclass(frozen=True)
class Expected:
    """The reads of the micro-batch size and the accumulation count that the split leaves right, besides their own
    binding: the loss divided by the count in ``loop`` (or scaled back by it for a log line: the ``losses``' names),
    their product where ``products`` (the samples per step), an epoch's optimizer steps over the training DataLoader
    ``loader`` (``math.ceil(len(loader) / accum)``), the ends of the slices the micro-batch size sizes (``allowed``),
    and the last micro-step's test; looked for ``within`` that node (the module where None)."""

    loop: cst.CSTNode
    losses: frozenset[str] = frozenset()
    products: bool = False
    within: cst.CSTNode | None = None
    loader: str | None = None
    allowed: frozenset[cst.CSTNode] = frozenset()


def read_elsewhere(facts: ModuleFacts, micro: cst.BaseExpression, accumulation: cst.BaseExpression,
                   expected: Expected) -> Refusal | None:
    """(where, why) for a read of the micro-batch size or the accumulation count that the split would change (any
    read but the ``expected`` ones), or None."""
    micro_code, code = facts.code(micro), facts.code(accumulation)
    as_micro = dataclasses.replace(expected, losses=frozenset(), loader=None)
    as_count = expected
    for expr_code, own, partner, reads in ((micro_code, micro, code, as_micro),
                                           (code, accumulation, micro_code, as_count)):
        other = _other_use(facts, expr_code, own, reads, partner if expected.products else None)
        if other is not None:
            return Refusal(other, f"{expr_code} is also read at line {line_of(facts, other)}: the split would change it")
    return None


def count_read_elsewhere(facts: ModuleFacts, accumulation: cst.BaseExpression, expected: Expected,
                         partner: str) -> Refusal | None:
    """(where, why) for a read of the accumulation count the split would change (any read but the ``expected`` ones,
    and its products with ``partner``, the micro-batch size as the split leaves it right), or None."""
    code = facts.code(accumulation)
    other = _other_use(facts, code, accumulation, expected, partner)
    if other is not None:
        return Refusal(other, f"{code} is also read at line {line_of(facts, other)}: the split would change it")
    return None


def length_read(facts: ModuleFacts, loader: str, accumulation: str, loop: cst.CSTNode,
                 test: cst.CSTNode | None = None) -> Refusal | None:
    """(where, why) for ``len(loader)`` in the loop's function: the micro-batches of an epoch, which the split divides
    by k (a scheduler's length, an epoch's steps, a resume position); None where there is none, or where each is the
    optimizer steps of an epoch, ``math.ceil(len(loader) / accumulation)``, which the split leaves as it is
    (ceil(ceil(n / k) / (a / k)) = ceil(n / a)), or in ``test``, the optimizer step's condition (its last
    micro-batch, which stays the last one)."""
    for call in facts.nodes_in(scope_of(facts, loop), cst.Call):
        if test is not None and facts.contains(test, call):
            continue
        if not _len_of(facts, call, loader):
            continue
        if _epoch_steps(facts, facts.parent(call), loader, accumulation):
            continue
        return Refusal(call, (f"len({loader}) at line {line_of(facts, call)} counts micro-batches: the split would change it (only "
                              f"math.ceil(len({loader}) / {accumulation}), an epoch's optimizer steps, stays the same)"))
    return None


def _epoch_steps(facts: ModuleFacts, divided: cst.CSTNode, loader: str | None, accumulation: str) -> bool:
    """Whether ``divided`` is ``len(loader) / accumulation`` inside ``math.ceil(...)``: an epoch's optimizer steps."""
    arg = facts.parent(divided)
    ceil = facts.parent(arg) if isinstance(arg, cst.Arg) else None
    if not (loader is not None and isinstance(divided, cst.BinaryOperation) and isinstance(divided.operator, cst.Divide)):
        return False
    return (_len_of(facts, divided.left, loader) and facts.code(divided.right) == accumulation
            and isinstance(ceil, cst.Call) and facts.qualname(ceil.func) == "math.ceil")


def _len_of(facts: ModuleFacts, node: cst.CSTNode, loader: str) -> bool:
    """Whether ``node`` is ``len(loader)``."""
    return (isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and node.func.value == "len"
            and facts.qualname(node.func) in ("len", "builtins.len", None) and len(node.args) == 1
            and isinstance(node.args[0].value, cst.Name) and node.args[0].value.value == loader)


def placed_split(facts: ModuleFacts, micro: str, accumulation: str, before: cst.BaseStatement, when: str) -> Split | str:
    """The split of ``micro`` and ``accumulation`` before ``before``: on entry of the function whose parameters they
    are, else after the statement that binds them; or why not (``when``: what happens at ``before``, as the reason
    says it: "the DataLoader is built")."""
    entry = parameters_of(facts, [micro, accumulation], before)
    if entry is not None:
        return Split(micro, accumulation, entry, first=True)
    after = _bound_once(facts, [micro, accumulation], before, when)
    return after if isinstance(after, str) else Split(micro, accumulation, after)


def _other_use(facts: ModuleFacts, code: str, own: cst.CSTNode, expected: Expected,
               partner: str | None) -> cst.CSTNode | None:
    """A read of ``code`` other than ``own`` and the ``expected`` ones (the loss scaled back for a log line,
    ``loss.item() * accum``, is the last micro-batch's mean loss whatever its size; a product with ``partner`` is the
    samples per step, ``batch_size * accum * block_size``: unchanged), or None."""
    loop, losses, within, loader, allowed = (expected.loop, expected.losses, expected.within, expected.loader,
                                             expected.allowed)
    kind = cst.Attribute if "." in code else cst.Name
    for n in facts.nodes_in(within or facts.module, kind):
        if n is own or n in allowed or facts.code(n) != code or (isinstance(n, cst.Name) and not names_variable(facts, n)):
            continue
        parent = facts.parent(n)
        if isinstance(parent, (cst.AssignTarget, cst.Param)) or (isinstance(n, cst.Name) and is_assigned(facts, n)):
            continue  # the binding, alone or unpacked
        if isinstance(parent, cst.BinaryOperation) and isinstance(parent.operator, cst.Divide) and parent.right is n \
                and facts.contains(loop, n):
            continue
        if isinstance(parent, cst.AugAssign) and parent.value is n and facts.contains(loop, n):
            continue
        if isinstance(parent, cst.BinaryOperation) and parent.right is n and _epoch_steps(facts, parent, loader, code):
            continue
        if isinstance(parent, cst.BinaryOperation) and isinstance(parent.operator, cst.Multiply):
            other = parent.left if parent.right is n else parent.right
            if any(isinstance(m, cst.Name) and m.value in losses for m in walk(other, itself=True)):
                continue
            if partner is not None and partner in factors(facts, outermost_product(facts, n)):
                continue
        target = facts.parent(parent)
        test = facts.parent(target) if isinstance(target, cst.ComparisonTarget) else None
        if isinstance(parent, cst.BinaryOperation) and isinstance(parent.operator, cst.Subtract) and \
                isinstance(test, cst.Comparison) and isinstance(test.left, cst.Name) and facts.contains(loop, n) and \
                last_micro_test(facts, test.left, code):
            continue
        return n
    return None


def outermost_product(facts: ModuleFacts, node: cst.CSTNode) -> cst.CSTNode:
    """The outermost product ``node`` is a factor of."""
    while isinstance(parent := facts.parent(node), cst.BinaryOperation) and isinstance(parent.operator, cst.Multiply):
        node = parent
    return node


def factors(facts: ModuleFacts, node: cst.CSTNode) -> set[str]:
    """The code of each factor of a product (``a * b * c``: a, b, c)."""
    if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.Multiply):
        return factors(facts, node.left) | factors(facts, node.right)
    return {facts.code(node)}


def _bound_once(facts: ModuleFacts, codes: list[str], before: cst.BaseStatement, when: str) -> cst.BaseStatement | str:
    """The statement after which every one of ``codes`` is bound, each by one statement of one block, or why not
    (``when``: what happens at ``before``, as the reason says it: "the DataLoader is built")."""
    statements = []
    for code in codes:
        base = code.split(".", 1)[0]
        scope = scope_of(facts, before)
        found = assignments(facts, scope, base, before=before, unpacking=True)
        if not found and scope is not facts.module:
            found = assignments(facts, facts.module, base, unpacking=True)
        if len(found) != 1:
            return f"{base} is bound {len(found)} times before {when}: its value there is not known"
        statements.append(facts.statement_of(found[0]))
    last = max(statements, key=lambda s: position_of(facts, s))
    block = facts.block_of(last)
    if any(facts.block_of(s) is not block for s in statements):
        return f"{' and '.join(codes)} are bound in different blocks"
    if any(unbound(facts, before, code) for code in codes) and facts.function_of(last) is facts.function_of(before):
        return f"{' and '.join(codes)} may be unbound where {when}"
    return last


def parameters_of(facts: ModuleFacts, codes: list[str], before: cst.BaseStatement) -> cst.BaseStatement | None:
    """The first statement of the function holding ``before`` (after its docstring), where every one of ``codes``
    is a plain parameter of it that the function never rebinds: split there, each call splits its own values."""
    function = facts.function_of(before)
    if function is None:
        return None
    params = {p.name.value for p in function.params.params} | {p.name.value for p in function.params.kwonly_params}
    bases = {code.split(".", 1)[0] for code in codes}
    if not all(base in params and not assignments(facts, function, base) for base in bases):
        return None
    if any(isinstance(n, (cst.AugAssign, cst.AnnAssign, cst.AssignTarget)) and
           (facts.code(n.target) in codes or facts.code(n.target).split(".", 1)[0] in bases and "." in facts.code(n.target))
           for n in walk(function.body)):
        return None  # the function rebinds them (or attributes of the options object) itself
    if any("." in code for code in codes) and not _called_once(facts, function):
        return None  # an options object split at each call would be split again by a second call
    body = list(function.body.body)
    if len(body) > 1 and isinstance(body[0], cst.SimpleStatementLine) and isinstance(body[0].body[0], cst.Expr) \
            and isinstance(body[0].body[0].value, (cst.SimpleString, cst.ConcatenatedString)):
        return body[1]
    return body[0]


def _called_once(facts: ModuleFacts, function: cst.FunctionDef) -> bool:
    """Whether the module calls ``function`` (by its name) exactly once, outside any loop."""
    calls = [c for c in facts.calls if isinstance(c.func, cst.Name) and c.func.value == function.name.value]
    return len(calls) == 1 and not any(isinstance(a, (cst.For, cst.While)) for a in facts.ancestors(calls[0]))
