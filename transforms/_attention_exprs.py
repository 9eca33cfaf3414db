"""The sdpa transform's vocabulary: what one hand-written attention is made of (``Match``), and the small
predicates over libcst expressions that recognise its parts (softmax, -inf, a causal mask, the default scale)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import libcst as cst
from libcst import matchers  # (``m`` names an attention match in this module)

from autotune.analysis import ModuleFacts
from autotune.syntax import (
    argument,
    assigned_names,
    assignments,
    int_value,
    is_name,
    is_param,
    names_read,
    one_index,
    positional,
    self_attr,
    walk,
)

from ._model import ClassRef

SDPA = "torch.nn.functional.scaled_dot_product_attention"
SOFTMAX = {"torch.nn.functional.softmax", "torch.softmax", "torch.special.softmax"}
MATMUL = {"torch.matmul"}
EINSUM = {"torch.einsum"}
DROPOUT_FN = {"torch.nn.functional.dropout", "torch.dropout"}
DROPOUT_MODULE = {"torch.nn.Dropout"}
_NUMBER_FUNCS = {"float", "int", "len", "abs", "min", "max", "round"}
_SHAPE_METHODS = {"size", "numel", "dim", "ndimension"}
_SAFE_SMALL = (cst.Assign, cst.AnnAssign, cst.AugAssign, cst.Expr, cst.Pass)


class _NoMatch(Exception):
    """Not attention at all: nothing to report."""


class _NotApplicable(Exception):
    """Looks like attention (softmax weights times values) but cannot become SDPA; the message says why."""


@dataclass
class _Mask:
    kind: str  # "fill" (masked_fill with -inf) or "add" (additive float mask)
    node: cst.BaseExpression  # the condition of masked_fill, or the added tensor
    guard: cst.BaseExpression | None = None  # ``if mask is not None:`` around the step


@dataclass
class _Match:
    """One hand-written attention and what SDPA needs to reproduce it."""

    out: cst.BaseExpression  # ``att @ v``
    softmax: cst.Call | None = None
    q: cst.BaseExpression | None = None
    k: cst.BaseExpression | None = None
    v: cst.BaseExpression | None = None
    scales: list[tuple[str, cst.BaseExpression]] = field(default_factory=list)  # ("mul"|"div", factor)
    masks: list[_Mask] = field(default_factory=list)
    dropout: str | None = None  # code of dropout_p
    used: set[int] = field(default_factory=set)  # indices of the block's statements the attention spans
    consumed: set[cst.Name] = field(default_factory=set)  # the reads of intermediates the pattern accounts for
    leaves: list[cst.BaseExpression] = field(default_factory=list)  # expressions SDPA evaluates
    cast_to: cst.BaseExpression | None = None  # ``softmax(s.float()).type_as(x)``: x must be the query
    rank4: cst.BaseExpression | None = None  # ``k.transpose(2, 3)``: the last two dims only while k is 4-D
    shared: set[str] = field(default_factory=set)  # "k", "v": one head for every query head (an einsum's broadcast)



# --- small predicates --------------------------------------------------------------------------------------


def _bound_in(facts: ModuleFacts, s: cst.CSTNode) -> set[str]:
    return assigned_names(facts, s)


def _rebinds(s: cst.BaseStatement, name: str) -> bool:
    if isinstance(s, cst.SimpleStatementLine) and len(s.body) == 1 and isinstance(s.body[0], cst.Assign):
        return any(is_name(t.target, name) for t in s.body[0].targets)
    return False


def _names_under(facts: ModuleFacts, node: cst.CSTNode) -> list[cst.Name]:
    if isinstance(node, cst.Name):
        return [node]
    return list(names_read(facts, node))


def _line(facts: ModuleFacts, s: cst.CSTNode) -> int:
    """The line of a statement (positions are known for calls, assignments and expressions inside it)."""
    first_call = next((n for n in walk(s) if isinstance(n, (cst.Call, cst.Assign, cst.Expr))), s)
    return facts.position(first_call)[0]


def _dropout_input(call: cst.CSTNode) -> cst.BaseExpression | None:
    """The input of what looks like dropout: ``F.dropout(w, ...)``, ``self.attn_drop(w)``, ``dropout(w)``."""
    if not isinstance(call, cst.Call) or not call.args or call.args[0].keyword is not None or call.args[0].star:
        return None
    func = call.func
    name = func.attr.value if isinstance(func, cst.Attribute) else func.value if isinstance(func, cst.Name) else ""
    if "drop" not in name.lower():
        return None
    if isinstance(func, cst.Attribute) and not is_name(func.value, "self") and name != "dropout":
        return None
    if name != "dropout" and len(call.args) != 1:
        return None
    return call.args[0].value


def _is_softmax(facts: ModuleFacts, call: cst.Call) -> bool:
    if facts.qualname(call.func) in SOFTMAX:
        return True
    func = call.func
    return isinstance(func, cst.Attribute) and func.attr.value == "softmax" and facts.qualname(func.value) not in (
        "torch.nn.functional",
        "torch",
    )


def _softmax_args(call: cst.Call) -> tuple[cst.BaseExpression | None, cst.BaseExpression | None]:
    """(input, dim) of ``F.softmax(x, dim)`` or ``x.softmax(dim)``."""
    func = call.func
    if isinstance(func, cst.Attribute) and func.attr.value == "softmax" and not _is_module_attr(func):
        return func.value, argument(call, 0, "dim")
    return argument(call, 0, "input"), argument(call, 1, "dim")


def _is_module_attr(func: cst.Attribute) -> bool:
    """``F.softmax`` / ``torch.softmax`` (a function) rather than ``scores.softmax`` (a method)."""
    root = func.value
    return isinstance(root, cst.Name) and root.value in ("F", "torch", "functional") or isinstance(root, cst.Attribute) and (
        isinstance(root.attr, cst.Name) and root.attr.value in ("functional", "special")
    )


# float("inf")
_FLOAT_OF_STRING = matchers.Call(func=matchers.Name("float"), args=[matchers.Arg(value=matchers.SimpleString())])


def _is_neg_inf(facts: ModuleFacts, node: cst.BaseExpression) -> bool:
    """``float('-inf')``, ``-float('inf')``, ``-math.inf``, ``-torch.inf``, ``float("-inf")``."""
    if matchers.matches(node, _FLOAT_OF_STRING):
        return node.args[0].value.evaluated_value.strip().lower() in ("-inf", "-infinity")
    if matchers.matches(node, matchers.UnaryOperation(operator=matchers.Minus())):
        inner = node.expression
        if matchers.matches(inner, _FLOAT_OF_STRING):
            return inner.args[0].value.evaluated_value.strip().lower() in ("inf", "infinity")
        return facts.qualname(inner) in ("math.inf", "torch.inf", "numpy.inf")
    return False


def _is_zero(node: cst.BaseExpression) -> bool:
    if isinstance(node, cst.Integer):
        return int(node.value) == 0
    if isinstance(node, cst.Float):
        return float(node.value) == 0.0
    return False


_VIEW_METHODS = ("view", "reshape", "unsqueeze", "bool", "to", "float")
_VIEW = matchers.Call(func=matchers.Attribute(attr=matchers.OneOf(*map(matchers.Name, _VIEW_METHODS))))


def _strip_view(node: cst.BaseExpression) -> cst.BaseExpression:
    """``torch.tril(...).view(1, 1, n, n)`` -> ``torch.tril(...)``."""
    while matchers.matches(node, _VIEW):
        node = node.func.value
    return node


def _is_tril_ones(facts: ModuleFacts, node: cst.BaseExpression) -> bool:
    """``torch.tril(torch.ones(n, n))``: the lower-triangular causal mask."""
    if not (isinstance(node, cst.Call) and facts.qualname(node.func) == "torch.tril" and len(node.args) == 1):
        return False
    inner = node.args[0].value
    if not (isinstance(inner, cst.Call) and facts.qualname(inner.func) == "torch.ones"):
        return False
    sizes = positional(inner)
    return len(sizes) == 2 and facts.code(sizes[0]) == facts.code(sizes[1])


def _gated(facts: ModuleFacts, test: cst.BaseExpression) -> bool:
    """``_autotune.sdpa_enabled()``, alone or first in an ``and``."""
    if isinstance(test, cst.BooleanOperation) and isinstance(test.operator, cst.And):
        test = test.left
    return facts.is_runtime_call(test, "sdpa_enabled")


def _is_float_cast(node: cst.BaseExpression) -> bool:
    """``x.float()``."""
    return (
        isinstance(node, cst.Call) and not node.args and isinstance(node.func, cst.Attribute) and node.func.attr.value == "float"
    )


def _cast_back(node: cst.BaseExpression) -> tuple[cst.BaseExpression, cst.BaseExpression] | None:
    """(softmax call, x) of ``softmax(...).type_as(x)``."""
    if (
        isinstance(node, cst.Call)
        and isinstance(node.func, cst.Attribute)
        and node.func.attr.value == "type_as"
        and len(node.args) == 1
        and not node.args[0].keyword
        and not node.args[0].star
    ):
        return node.func.value, node.args[0].value
    return None


def _transposes(kt: cst.BaseExpression, dims: tuple[int, int]) -> bool:
    """``k.transpose(a, b)`` with {a, b} = ``dims``."""
    if isinstance(kt, cst.Call) and isinstance(kt.func, cst.Attribute) and kt.func.attr.value in ("transpose", "swapaxes", "swapdims"):
        got = [int_value(a.value) for a in kt.args if a.keyword is None and not a.star]
        return len(kt.args) == 2 and sorted(d for d in got if d is not None) == sorted(dims)
    return False


def _untransposed(kt: cst.BaseExpression) -> cst.BaseExpression | None:
    """``k`` of ``k.transpose(-2, -1)``, ``k.transpose(-1, -2)`` or ``k.mT``."""
    if isinstance(kt, cst.Attribute) and kt.attr.value == "mT":
        return kt.value
    if isinstance(kt, cst.Call) and isinstance(kt.func, cst.Attribute) and kt.func.attr.value in ("transpose", "swapaxes", "swapdims"):
        dims = [int_value(a) for a in positional(kt)]
        if len(kt.args) == 2 and sorted(d for d in dims if d is not None) == [-2, -1]:
            return kt.func.value
    return None


class Operands(NamedTuple):
    """The two operands of an attention einsum; ``shared``: the second has no head dimension (multi-query attention:
    one key and value head that every query head uses, ``"bhtd,bsd->bhts"``)."""

    first: cst.BaseExpression
    second: cst.BaseExpression
    shared: bool = False


def _einsum(call: cst.Call, role: str) -> Operands | None:
    """The two operands of an einsum that computes ``q @ k^T`` (role "qk") or ``weights @ v`` (role "av")."""
    args = positional(call)
    if len(args) != 3 or not isinstance(args[0], cst.SimpleString):
        return None
    spec = args[0].evaluated_value.replace(" ", "")
    if spec.count("->") != 1 or spec.count(",") != 1:
        return None
    lhs, out = spec.split("->")
    a, b = lhs.split(",")

    def split(s: str) -> tuple[str, str] | None:
        if len(s) < 2 or not s[-2:].isalpha():
            return None
        return s[:-2], s[-2:]

    parts = [split(a), split(b), split(out)]
    if any(p is None for p in parts):
        return None
    (pa, xa), (pb, xb), (po, xo) = parts  # type: ignore[misc]
    # the second operand without the head dimension, the last of the first's batch dimensions: broadcast over it
    shared = pa == po and pb == pa[:-1] and pa[-1:].isalpha() and pa[-1:] not in xa + xb + xo
    if not (pa == pb == po or shared) or "..." in pa.replace("...", "", 1):
        return None
    if role == "qk":  # "...ld,...sd->...ls"
        ok = xa[1] == xb[1] and xo == xa[0] + xb[0] and len({xa[0], xb[0], xa[1]}) == 3
    else:  # "...ls,...se->...le"
        ok = xa[1] == xb[0] and xo == xa[0] + xb[1] and len({xa[0], xa[1], xb[1]}) == 3
    return Operands(args[1], args[2], shared) if ok else None


def _negate(facts: ModuleFacts, cond: cst.BaseExpression) -> str:
    """The keep-mask SDPA wants for ``masked_fill(cond, -inf)``: ``m != 0`` for ``m == 0``, else ``~cond``."""
    if isinstance(cond, cst.Comparison) and len(cond.comparisons) == 1:
        target = cond.comparisons[0]
        flip = {cst.Equal: "!=", cst.NotEqual: "=="}
        for kind, op in flip.items():
            if isinstance(target.operator, kind):
                return f"{facts.code(cond.left)} {op} {facts.code(target.comparator)}"
    if isinstance(cond, cst.UnaryOperation) and isinstance(cond.operator, cst.BitInvert):
        return facts.code(cond.expression)  # ``masked_fill(~keep, -inf)``: the keep-mask itself
    code = facts.code(cond)
    atomic = isinstance(cond, (cst.Name, cst.Attribute, cst.Call, cst.Subscript))
    return f"~{code}" if atomic else f"~({code})"


def _dim_of(facts: ModuleFacts, node: cst.BaseExpression, m: _Match) -> bool:
    """``k.size(-1)``, ``q.shape[-1]``: the head dimension of the q or k in the pattern."""
    names = {facts.code(m.q), facts.code(m.k)} if m.q is not None and m.k is not None else set()
    if isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and node.func.attr.value == "size":
        args = positional(node)
        return len(node.args) == 1 and len(args) == 1 and int_value(args[0]) == -1 and facts.code(node.func.value) in names
    if isinstance(node, cst.Subscript) and isinstance(node.value, cst.Attribute) and node.value.attr.value == "shape":
        index = one_index(node)
        return index is not None and int_value(index) == -1 and facts.code(node.value.value) in names
    return False


def _is_sqrt_of_dim(facts: ModuleFacts, node: cst.BaseExpression, m: _Match) -> bool:
    """``math.sqrt(d)`` or ``d ** 0.5`` for the head dimension d."""
    if isinstance(node, cst.Call) and facts.qualname(node.func) in ("math.sqrt", "numpy.sqrt") and len(node.args) == 1:
        return _dim_of(facts, node.args[0].value, m)
    if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.Power):
        return isinstance(node.right, cst.Float) and float(node.right.value) == 0.5 and _dim_of(facts, node.left, m)
    return False


def _is_default_scale(facts: ModuleFacts, m: _Match, op: str, factor: cst.BaseExpression) -> bool:
    """Whether one scale step is the 1/sqrt(head dim) SDPA applies by default."""
    if op == "div":
        return _is_sqrt_of_dim(facts, factor, m)
    if isinstance(factor, cst.BinaryOperation) and isinstance(factor.operator, cst.Divide):
        one = factor.left
        is_one = (isinstance(one, cst.Integer) and int(one.value) == 1) or (isinstance(one, cst.Float) and float(one.value) == 1.0)
        return is_one and _is_sqrt_of_dim(facts, factor.right, m)
    if isinstance(factor, cst.BinaryOperation) and isinstance(factor.operator, cst.Power):
        right = factor.right
        neg_half = (
            isinstance(right, cst.UnaryOperation)
            and isinstance(right.operator, cst.Minus)
            and isinstance(right.expression, cst.Float)
            and float(right.expression.value) == 0.5
        )
        return neg_half and _dim_of(facts, factor.left, m)
    return False


def _atomic(node: cst.BaseExpression) -> bool:
    return bool(getattr(node, "lpar", None)) or isinstance(
        node, (cst.Name, cst.Attribute, cst.Call, cst.Subscript, cst.Integer, cst.Float)
    )


def _scale_code(facts: ModuleFacts, m: _Match):
    """The ``scale=`` SDPA needs: None for its default 1/sqrt(d), else an expression; False when none can be written."""
    if len(m.scales) == 1 and _is_default_scale(facts, m, *m.scales[0]):
        return None
    if not m.scales:
        return "1.0"
    parts = []
    for op, factor in reversed(m.scales):  # innermost first: the order the script applies them
        if not _is_number(facts, factor, m):
            return False
        code = facts.code(factor)
        code = code if _atomic(factor) else f"({code})"
        parts.append(("*" if op == "mul" else "/", code))
    if parts[0][0] == "*":
        text = parts[0][1]
        rest = parts[1:]
    else:
        text = "1.0"
        rest = parts
    for op, code in rest:
        text = f"{text} {op} {code}"
    return text


def _is_number(facts: ModuleFacts, node: cst.BaseExpression, m: _Match, depth: int = 0) -> bool:
    """Whether ``node`` is a Python number (SDPA's scale= takes a float): literals, sizes, math, constructor args."""
    if depth > 6:
        return False
    if isinstance(node, (cst.Integer, cst.Float)):
        return True
    if isinstance(node, cst.UnaryOperation):
        return _is_number(facts, node.expression, m, depth + 1)
    if isinstance(node, cst.BinaryOperation):
        return not isinstance(node.operator, cst.MatrixMultiply) and _is_number(facts, node.left, m, depth + 1) and _is_number(
            facts, node.right, m, depth + 1
        )
    if isinstance(node, cst.Call):
        qual = facts.qualname(node.func)
        if qual and qual.startswith("math."):
            return all(_is_number(facts, a.value, m, depth + 1) for a in node.args)
        if isinstance(node.func, cst.Name) and node.func.value in _NUMBER_FUNCS:
            return True
        return isinstance(node.func, cst.Attribute) and node.func.attr.value in _SHAPE_METHODS
    if isinstance(node, cst.Subscript):
        value = node.value
        return (isinstance(value, cst.Attribute) and value.attr.value == "shape") or (
            isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute) and value.func.attr.value == "size"
        )
    fn = facts.function_of(node)
    if isinstance(node, cst.Attribute):
        attr = self_attr(node)
        if attr is not None:
            cls = facts.class_of(node)
            if cls is None:
                return False
            ref = ClassRef(facts, cls)
            if ref.buffer(attr) is not None:
                return False
            values = ref.attr_values(attr)
            return bool(values) and all(_is_number(facts, v, m, depth + 1) for v in values)
        root = node
        while isinstance(root, cst.Attribute):
            root = root.value
        return isinstance(root, cst.Name) and fn is not None and fn.name.value == "__init__" and is_param(fn, root.value)
    if isinstance(node, cst.Name):
        if fn is None:
            return False
        if fn.name.value == "__init__" and is_param(fn, node.value):
            return True  # constructor arguments that scale attention are sizes
        found = assignments(facts, fn, node.value)
        if found:
            return all(_is_number(facts, a.value, m, depth + 1) for a in found)
        for assign in facts.nodes_in(fn, cst.Assign):
            for t in assign.targets:
                if isinstance(t.target, cst.Tuple) and any(is_name(e.value, node.value) for e in t.target.elements):
                    return _is_number(facts, assign.value, m, depth + 1) or _is_shape(assign.value)
        return False
    return False


def _is_shape(node: cst.BaseExpression) -> bool:
    return (isinstance(node, cst.Attribute) and node.attr.value == "shape") or (
        isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and node.func.attr.value == "size"
    )
