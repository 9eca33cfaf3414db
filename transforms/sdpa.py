"""sdpa: run hand-written softmax(q @ k^T * scale [+ mask]) @ v attention as F.scaled_dot_product_attention."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import libcst as cst

from autotune.analysis import ModuleFacts
from autotune.knobs import Knob, Numerics
from autotune.transform import Edits, Status, Transform, expr, positional

from ._model import (
    ClassRef,
    argument,
    assigned_names,
    assignments,
    enclosing_class,
    int_value,
    is_name,
    names_read,
    scope_of,
    self_attr,
)

SDPA = "torch.nn.functional.scaled_dot_product_attention"
SOFTMAX = {"torch.nn.functional.softmax", "torch.softmax", "torch.special.softmax"}
MATMUL = {"torch.matmul"}
EINSUM = {"torch.einsum"}
DROPOUT_FN = {"torch.nn.functional.dropout", "torch.dropout"}
DROPOUT_MODULE = {"torch.nn.Dropout"}
# torch modules that already run F.scaled_dot_product_attention inside
ATTENTION_MODULES = {
    "torch.nn.MultiheadAttention",
    "torch.nn.TransformerEncoderLayer",
    "torch.nn.TransformerDecoderLayer",
    "torch.nn.Transformer",
}
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


class Sdpa(Transform):
    """Replace hand-written attention (softmax of q @ k^T, mask, dropout, times v) by F.scaled_dot_product_attention."""

    name = "sdpa"
    knobs = (
        Knob(
            "sdpa.attention",
            ("manual", "sdpa"),
            "manual",
            Numerics.REORDER,
            help="manual: the script's own softmax(q @ k^T) @ v; sdpa: F.scaled_dot_product_attention (fused "
            "kernels, no T x T weights kept for backward; with attention dropout on CUDA the random masks differ)",
        ),
    )

    def apply(self, facts: ModuleFacts, edits: Edits) -> None:
        for call in facts.calls:
            qual = facts.qualname(call.func)
            if qual in ATTENTION_MODULES:
                short = qual.rsplit(".", 1)[-1]
                self.report(facts, call, Status.PRESENT, f"nn.{short} already runs F.scaled_dot_product_attention")
        with_sdpa = set()
        for call in facts.calls:
            if facts.qualname(call.func) == SDPA:
                with_sdpa.add(scope_of(facts, call))
        manual_scopes = set()
        reported: set[cst.CSTNode] = set()
        for out in self._products(facts):
            try:
                match = self._match(facts, out)
            except _NoMatch:
                continue
            except _NotApplicable as why:
                key = getattr(why, "softmax", None) or out
                if key not in reported and scope_of(facts, out) not in with_sdpa:
                    reported.add(key)
                    self.report(facts, key, Status.NOT_APPLICABLE, str(why))
                manual_scopes.add(scope_of(facts, out))
                continue
            scope = scope_of(facts, out)
            manual_scopes.add(scope)
            if match.softmax in reported or scope in with_sdpa:
                continue
            reported.add(match.softmax)
            self._rewrite(facts, edits, match)
        for call in facts.calls:
            if facts.qualname(call.func) != SDPA:
                continue
            gate = next((a for a in facts.ancestors(call) if isinstance(a, cst.If) and _gated(facts, a.test)), None)
            if gate is not None:
                reason = "attention already behind the sdpa.attention knob"
            elif scope_of(facts, call) in manual_scopes:
                reason = "F.scaled_dot_product_attention, beside a manual fallback chosen by a flag"
            else:
                reason = "already uses F.scaled_dot_product_attention"
            self.report(facts, call, Status.PRESENT, reason)

    # --- finding attention -------------------------------------------------------------------------------

    @staticmethod
    def _products(facts: ModuleFacts) -> list[cst.BaseExpression]:
        """Every ``a @ b``, ``torch.matmul(a, b)`` and two-operand ``torch.einsum``: candidate ``weights @ v``."""
        out: list[cst.BaseExpression] = list(
            n for n in facts.nodes(cst.BinaryOperation) if isinstance(n.operator, cst.MatrixMultiply)
        )
        for call in facts.calls:
            qual = facts.qualname(call.func)
            if qual in MATMUL or qual in EINSUM:
                out.append(call)
        return sorted(out, key=facts._enter.__getitem__)

    def _match(self, facts: ModuleFacts, out: cst.BaseExpression) -> _Match:
        line = facts.statement_of(out)
        block = facts.block_of(line)
        body = list(block.body)
        if not isinstance(line, cst.SimpleStatementLine) or line not in body:
            raise _NoMatch
        matcher = _Matcher(self, facts, body, enclosing_class(facts, out), scope_of(facts, out))
        return matcher.run(out, body.index(line))

    # --- rewriting ---------------------------------------------------------------------------------------

    def _rewrite(self, facts: ModuleFacts, edits: Edits, m: _Match) -> None:
        lo, hi = min(m.used), max(m.used)
        line = facts.statement_of(m.out)
        body = list(facts.block_of(line).body)
        group = body[lo : hi + 1]
        hoisted = [i for i in range(lo, hi + 1) if i not in m.used]
        call = self._sdpa_call(facts, edits, m)
        # a trailing comment describes the manual product; the SDPA line goes without it
        bare = line.with_changes(trailing_whitespace=cst.TrailingWhitespace())
        new_line = bare.deep_replace(m.out, call)
        indent = " " * (4 * sum(1 for a in facts.ancestors(line) if isinstance(a, cst.IndentedBlock)))
        if len(indent + cst.Module([]).code_for_node(new_line).splitlines()[0]) > 110:
            new_line = bare.deep_replace(m.out, self._sdpa_call(facts, edits, m, wrap=True))
        features = self._features(facts, m)
        where = self._where(facts, m.out)
        self.report(facts, m.softmax, Status.APPLICABLE, f"manual attention{where}{features}")
        keep = group[0].leading_lines

        rank = f"{facts.code(m.rank4)}.dim() == 4" if m.rank4 is not None else None
        if self.mode.gated:
            test = expr(f"{edits.runtime('sdpa_enabled')}()" + (f" and {rank}" if rank else ""))

            def gated(stmts: list[cst.BaseStatement]) -> cst.BaseStatement:
                first = stmts[0].with_changes(leading_lines=[])
                fast = [stmts[i - lo].with_changes(leading_lines=[]) for i in hoisted] + [new_line.with_changes(leading_lines=[])]
                return cst.If(
                    test=test,
                    body=cst.IndentedBlock(body=fast),
                    orelse=cst.Else(body=cst.IndentedBlock(body=[first, *stmts[1:]])),
                    leading_lines=keep,
                )

            edits.wrap(group, gated)
        else:

            def baked(stmts: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
                fast = [stmts[i - lo].with_changes(leading_lines=[]) for i in hoisted] + [new_line.with_changes(leading_lines=[])]
                if rank:  # the script's own code stays for keys of another rank
                    first = stmts[0].with_changes(leading_lines=[])
                    return [cst.If(test=expr(rank), body=cst.IndentedBlock(body=fast),
                                   orelse=cst.Else(body=cst.IndentedBlock(body=[first, *stmts[1:]])), leading_lines=keep)]
                fast[0] = fast[0].with_changes(leading_lines=keep)
                return fast

            edits.wrap(group, baked)

    def _sdpa_call(self, facts: ModuleFacts, edits: Edits, m: _Match, wrap: bool = False) -> cst.BaseExpression:
        fn = self._functional(facts, edits)
        args = [facts.code(m.q), facts.code(m.k), facts.code(m.v)]
        causal = [x for x in m.masks if x.kind == "causal"]
        others = [x for x in m.masks if x.kind != "causal"]
        if others:
            args.append(f"attn_mask={self._mask_code(facts, others[0])}")
        if m.dropout is not None:
            args.append(f"dropout_p={m.dropout}")
        if causal:
            args.append("is_causal=True")
        scale = _scale_code(facts, m)
        if scale is not None:
            args.append(f"scale={scale}")
        if wrap:
            lines = [", ".join(args[:3]), *args[3:]]
            inner = "".join(f"    {a},\n" for a in lines)
            return expr(f"{fn}.scaled_dot_product_attention(\n{inner})")
        return expr(f"{fn}.scaled_dot_product_attention({', '.join(args)})")

    @staticmethod
    def _mask_code(facts: ModuleFacts, mask: _Mask) -> str:
        if mask.kind == "add":
            code = facts.code(mask.node)
        else:
            code = _negate(facts, mask.node)
        if mask.guard is not None:
            return f"({code} if {facts.code(mask.guard)} else None)"
        return code

    @staticmethod
    def _functional(facts: ModuleFacts, edits: Edits) -> str:
        for alias, qual in facts.imports.items():
            if qual == "torch.nn.functional":
                return alias
        if facts.imports.get("torch") != "torch":
            edits.require_import("torch")
        return "torch.nn.functional"

    @staticmethod
    def _features(facts: ModuleFacts, m: _Match) -> str:
        parts = []
        if any(x.kind == "causal" for x in m.masks):
            parts.append("causal")
        if any(x.kind != "causal" for x in m.masks):
            parts.append("masked")
        if m.dropout is not None:
            parts.append("dropout")
        if _scale_code(facts, m) is not None:
            parts.append("own scale")
        return f" ({', '.join(parts)})" if parts else ""

    @staticmethod
    def _where(facts: ModuleFacts, node: cst.CSTNode) -> str:
        fn = facts.function_of(node)
        cls = facts.class_of(node)
        if fn is None:
            return ""
        return f" in {cls.name.value}.{fn.name.value}" if cls is not None else f" in {fn.name.value}()"


class _Matcher:
    """Reads one ``weights @ v`` backwards through the statements of its block, as far as the attention goes."""

    def __init__(self, owner: Sdpa, facts: ModuleFacts, body: list, cls: ClassRef | None, scope: cst.CSTNode) -> None:
        self.owner, self.facts, self.body, self.cls, self.scope = owner, facts, body, cls, scope
        self.m: _Match

    def fail(self, reason: str) -> _NotApplicable:
        exc = _NotApplicable(reason)
        exc.softmax = self.m.softmax  # type: ignore[attr-defined]
        return exc

    # statements

    def definition(self, name: cst.Name, idx: int):
        """The statement before ``idx`` in this block that last binds ``name``: (kind, index, payload) or None."""
        facts = self.facts
        for j in range(idx - 1, -1, -1):
            s = self.body[j]
            if name.value not in _bound_in(facts, s):
                continue
            if isinstance(s, cst.SimpleStatementLine) and len(s.body) == 1:
                small = s.body[0]
                if isinstance(small, cst.Assign) and len(small.targets) == 1 and is_name(small.targets[0].target, name.value):
                    return ("assign", j, small.value)
                if isinstance(small, cst.AugAssign) and is_name(small.target, name.value):
                    return ("aug", j, small)
            if isinstance(s, cst.If) and s.orelse is None and isinstance(s.body, cst.IndentedBlock):
                inner = s.body.body
                if len(inner) == 1 and isinstance(inner[0], cst.SimpleStatementLine) and len(inner[0].body) == 1:
                    small = inner[0].body[0]
                    if isinstance(small, cst.Assign) and len(small.targets) == 1 and is_name(small.targets[0].target, name.value):
                        return ("if", j, (s.test, small.value))
                    if isinstance(small, cst.AugAssign) and is_name(small.target, name.value):
                        return ("if", j, (s.test, small))
            return ("other", j, s)
        return None

    def follow(self, node: cst.BaseExpression, idx: int) -> tuple[cst.BaseExpression, int]:
        """Through plain ``name = value`` statements of this block, to the expression a name holds."""
        while isinstance(node, cst.Name):
            found = self.definition(node, idx)
            if found is None or found[0] != "assign":
                return node, idx
            self.m.consumed.add(node)
            self.m.used.add(found[1])
            node, idx = found[2], found[1]
        return node, idx

    # the pattern

    def run(self, out: cst.BaseExpression, idx: int) -> _Match:
        self.m = _Match(out)
        self.m.used.add(idx)
        facts = self.facts
        if isinstance(out, cst.BinaryOperation):
            weights, v = out.left, out.right
        elif isinstance(out, cst.Call) and facts.qualname(out.func) in MATMUL and len(positional(out)) == 2:
            weights, v = positional(out)
        elif isinstance(out, cst.Call) and facts.qualname(out.func) in EINSUM:
            operands = _einsum(out, "av")
            if operands is None:
                raise _NoMatch
            weights, v = operands
        else:
            raise _NoMatch
        self.weights(weights, idx)
        self.m.v = v
        self.m.leaves.append(v)
        self.check()
        return self.m

    def weights(self, node: cst.BaseExpression, idx: int) -> None:
        facts = self.facts
        node, idx = self.follow(node, idx)
        guarded = None  # ``if dropout is not None: p = dropout(p)``
        if isinstance(node, cst.Name):
            found = self.definition(node, idx)
            if found is not None and found[0] == "if" and isinstance(found[2][1], cst.Call):
                inner = _dropout_input(found[2][1])
                if inner is not None and is_name(inner, node.value):
                    self.m.consumed.update((node, inner))
                    self.m.used.add(found[1])
                    guarded = found[2][1]
                    node, idx = self.follow(inner, found[1])
        drop = node if guarded is None and isinstance(node, cst.Call) and _dropout_input(node) is not None else None
        if drop is not None:
            node, idx = self.follow(_dropout_input(drop), idx)
        cast = _cast_back(node)
        if cast is not None:  # LLaMA: softmax(scores.float()).type_as(xq), the weights in the query's dtype
            node, self.m.cast_to = cast
        if not (isinstance(node, cst.Call) and _is_softmax(facts, node)):
            raise _NoMatch
        self.m.softmax = node
        softmax_at = self.body.index(facts.statement_of(node))
        final = max(self.m.used)
        weights: set[str] = set()
        for i in self.m.used - {final}:
            weights |= _bound_in(facts, self.body[i])
        self.check_reads(weights, softmax_at, final, what="the attention weights", after=node)
        if guarded is not None:
            raise self.fail(
                f"dropout on the weights only under `if`, through {_short(facts, guarded.func)}, a module passed "
                "in: its probability cannot be read"
            )
        if drop is not None:
            self.m.dropout = self.dropout_p(drop)
        scores, dim = _softmax_args(node)
        if scores is None or dim is None or int_value(dim) != -1:
            raise self.fail("softmax over a dimension other than the last: not the key dimension of attention")
        if any(a.keyword is not None and a.keyword.value == "dtype" for a in node.args):
            raise self.fail("softmax with an explicit dtype: SDPA picks its own accumulation type")
        if _is_float_cast(scores):
            if self.m.cast_to is None:
                raise self.fail("softmax of scores cast to float32, never cast back: the weights stay float32")
            scores = scores.func.value  # type: ignore[attr-defined]
        self.scores(scores, idx, scaled=False)
        if self.m.cast_to is not None and facts.code(self.m.cast_to) != facts.code(self.m.q):
            raise self.fail(f"the weights are cast to the dtype of {_short(facts, self.m.cast_to)}, not of the query")

    def dropout_p(self, call: cst.Call) -> str:
        """The code of SDPA's dropout_p for ``self.attn_dropout(w)`` or ``F.dropout(w, p, training)``."""
        facts = self.facts
        qual = facts.qualname(call.func)
        if qual in DROPOUT_FN:
            p = argument(call, 1, "p")
            training = argument(call, 2, "train" if qual == "torch.dropout" else "training")
            p_code = facts.code(p) if p is not None else "0.5"
            if training is None and qual == "torch.dropout":
                raise self.fail("torch.dropout without its train argument")
            t_code = facts.code(training) if training is not None else "True"
            if p is not None and not _is_number(facts, p, self.m):
                raise self.fail(f"the dropout probability {p_code} is not a plain number")
            return p_code if t_code == "True" else f"{p_code} if {t_code} else 0.0"
        attr = self_attr(call.func)
        if attr is not None and self.cls is not None and self.cls.attr_ctor(attr, self.owner.project) in DROPOUT_MODULE:
            return f"self.{attr}.p if self.{attr}.training else 0.0"
        raise self.fail(f"dropout through {_short(facts, call.func)}, not built as nn.Dropout here: its probability cannot be read")

    def scores(self, node: cst.BaseExpression, idx: int, scaled: bool) -> None:
        """Walk from the softmax input down to ``q @ k^T``, collecting scale factors and masks."""
        facts = self.facts
        if isinstance(node, cst.Name):
            found = self.definition(node, idx)
            if found is None:
                raise self.fail(f"the scores `{node.value}` come from outside this block, not from q @ k^T here")
            kind, j, payload = found
            self.m.consumed.add(node)
            self.m.used.add(j)
            if kind == "assign":
                return self.scores(payload, j, scaled)
            if kind == "aug":
                return self.step(payload.operator, node, payload.value, j, scaled, guard=None)
            if kind == "if":
                test, inner = payload
                if isinstance(inner, cst.AugAssign):
                    if not isinstance(inner.operator, cst.AddAssign):
                        raise self.fail("a conditional step on the scores that is not a mask")
                    return self.step(inner.operator, node, inner.value, j, scaled, guard=test)
                return self.guarded(node, inner, j, scaled, test)
            raise self.fail(f"`{node.value}` is changed at line {facts.position(payload)[0]} in a way SDPA cannot express")
        if isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and node.func.attr.value == "masked_fill":
            self.fill(node, guard=None)
            return self.scores(node.func.value, idx, scaled)
        if isinstance(node, cst.BinaryOperation):
            op = node.operator
            if isinstance(op, cst.MatrixMultiply):
                return self.qk(node.left, node.right, idx)
            if isinstance(op, cst.Divide):
                self.m.scales.append(("div", node.right))
                self.m.leaves.append(node.right)
                return self.scores(node.left, idx, True)
            if isinstance(op, (cst.Multiply, cst.Add)):
                # either side may hold the scores: try the left one, then the right one
                for scores, other in ((node.left, node.right), (node.right, node.left)):
                    saved = {k: copy.copy(v) for k, v in vars(self.m).items()}
                    try:
                        if isinstance(op, cst.Multiply):
                            self.m.scales.append(("mul", other))
                            self.m.leaves.append(other)
                            return self.scores(scores, idx, True)
                        if scaled:
                            raise self.fail("the mask is added before the scores are scaled (SDPA adds it after)")
                        self.m.masks.append(_Mask("add", other))
                        self.m.leaves.append(other)
                        return self.scores(scores, idx, scaled)
                    except _NotApplicable:
                        vars(self.m).update(saved)
                        if scores is node.right:
                            raise
                raise AssertionError("unreachable")
        if isinstance(node, cst.Call):
            qual = facts.qualname(node.func)
            if qual in MATMUL and len(positional(node)) == 2:
                return self.qk(*positional(node), idx)
            if qual in EINSUM:
                operands = _einsum(node, "qk")
                if operands is None:
                    raise self.fail("an einsum whose subscripts are not q @ k^T over the last dimension")
                self.m.q, self.m.k = operands
                self.m.leaves.extend(operands)
                return None
        raise self.fail(
            f"softmax weights are applied to values, but the scores ({_short(facts, node)}) are not q @ k^T: "
            "a weighted average, not attention"
        )

    def step(self, op, name: cst.Name, value: cst.BaseExpression, j: int, scaled: bool, guard) -> None:
        """``scores *= c``, ``scores /= c`` or ``scores += mask``, at statement ``j``."""
        if isinstance(op, cst.MultiplyAssign) and guard is None:
            self.m.scales.append(("mul", value))
        elif isinstance(op, cst.DivideAssign) and guard is None:
            self.m.scales.append(("div", value))
        elif isinstance(op, cst.AddAssign):
            if scaled:
                raise self.fail("the mask is added before the scores are scaled (SDPA adds it after)")
            self.m.masks.append(_Mask("add", value, guard))
            if guard is not None:
                self.m.leaves.append(guard)
            self.m.leaves.append(value)
            return self.scores(name, j, scaled)
        else:
            raise self.fail("the scores are changed in a way SDPA cannot express")
        self.m.leaves.append(value)
        return self.scores(name, j, True)

    def guarded(self, name: cst.Name, value: cst.BaseExpression, j: int, scaled: bool, test) -> None:
        """``if mask is not None: scores = scores.masked_fill(...)`` (or ``scores = scores + mask``)."""
        self.m.leaves.append(test)
        if isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute) and value.func.attr.value == "masked_fill":
            if not is_name(value.func.value, name.value):
                raise self.fail("a conditional step on the scores that is not a mask")
            self.m.consumed.add(value.func.value)
            self.fill(value, guard=test)
            return self.scores(name, j, scaled)
        if isinstance(value, cst.BinaryOperation) and isinstance(value.operator, cst.Add):
            for mine, other in ((value.left, value.right), (value.right, value.left)):
                if is_name(mine, name.value):
                    self.m.consumed.add(mine)
                    if scaled:
                        raise self.fail("the mask is added before the scores are scaled (SDPA adds it after)")
                    self.m.masks.append(_Mask("add", other, test))
                    self.m.leaves.append(other)
                    return self.scores(name, j, scaled)
        raise self.fail("a conditional step on the scores that is not a mask")

    def fill(self, call: cst.Call, guard) -> None:
        facts = self.facts
        cond, value = argument(call, 0, "mask"), argument(call, 1, "value")
        if cond is None or value is None:
            raise self.fail("masked_fill with arguments that cannot be read")
        if not _is_neg_inf(facts, value):
            raise self.fail(
                f"masked_fill with {facts.code(value)} instead of -inf: rows masked everywhere would differ from SDPA"
            )
        if guard is None and self.causal(cond):
            self.m.masks.append(_Mask("causal", cond))
            return
        self.m.masks.append(_Mask("fill", cond, guard))
        self.m.leaves.append(cond)

    def causal(self, cond: cst.BaseExpression) -> bool:
        """``self.bias[:, :, :T, :T] == 0`` for a registered ``torch.tril(torch.ones(n, n))``, or a tril built inline."""
        facts = self.facts
        if not (isinstance(cond, cst.Comparison) and len(cond.comparisons) == 1):
            return False
        target = cond.comparisons[0]
        if not (isinstance(target.operator, cst.Equal) and _is_zero(target.comparator)):
            return False
        left = cond.left
        if isinstance(left, cst.Call) and _is_tril_ones(facts, left):
            sizes = positional(positional(left)[0])
            return len(sizes) == 2 and facts.code(sizes[0]) == facts.code(sizes[1])
        if not isinstance(left, cst.Subscript):
            return False
        attr = self_attr(left.value)
        if attr is None or self.cls is None:
            return False
        built = self.cls.buffer(attr) or self.cls.attr_value(attr)
        if built is None or not _is_tril_ones(facts, _strip_view(built)):
            return False
        elements = left.slice
        if len(elements) not in (2, 4):
            return False
        bounds = []
        for i, element in enumerate(elements):
            sl = element.slice
            if not isinstance(sl, cst.Slice) or sl.lower is not None or sl.step is not None:
                return False
            if i < len(elements) - 2:
                if sl.upper is not None:
                    return False
            else:
                if sl.upper is None:
                    return False
                bounds.append(facts.code(sl.upper))
        return bounds[0] == bounds[1]

    def qk(self, q: cst.BaseExpression, kt: cst.BaseExpression, idx: int) -> None:
        kt, _ = self.follow(kt, idx)
        k = _untransposed(kt)
        if k is None and _transposes(kt, (2, 3)):
            # the last two dims of a 4-D (batch, heads, seq, dim) key: the rewrite checks the rank when it runs
            k = self.m.rank4 = kt.func.value  # type: ignore[attr-defined]
        if k is None:
            raise self.fail(
                f"the scores are {_short(self.facts, q)} @ {_short(self.facts, kt)}, not q @ k.transpose(-2, -1)"
            )
        self.m.q, self.m.k = q, k
        self.m.leaves.extend([q, k])

    # whole-pattern checks

    def check(self) -> None:
        facts, m = self.facts, self.m
        causal = [x for x in m.masks if x.kind == "causal"]
        others = [x for x in m.masks if x.kind != "causal"]
        if causal and others:
            raise self.fail("a causal mask combined with another mask (SDPA takes is_causal or attn_mask, not both)")
        if len(causal) > 1 or len(others) > 1:
            raise self.fail("several masks on the same scores")
        scale = _scale_code(facts, m)
        if scale is False:
            raise self.fail(
                "the scale is not a plain number that can be read here (SDPA's scale= takes a float, not a tensor)"
            )
        lo, hi = min(m.used), max(m.used)
        temps = set()
        for i in m.used:
            if i != hi:
                temps |= _bound_in(facts, self.body[i])
        hoisted = [i for i in range(lo, hi + 1) if i not in m.used]
        for i in hoisted:
            s = self.body[i]
            line = facts.position(s)[0] if not isinstance(s, cst.SimpleStatementLine) else _line(facts, s)
            if not isinstance(s, cst.SimpleStatementLine) or not all(isinstance(x, _SAFE_SMALL) for x in s.body):
                raise self.fail(f"the attention is interleaved with other code (line {line})")
            reads = {n.value for n in names_read(facts, s)}
            shared = (reads | _bound_in(facts, s)) & temps
            if shared:
                raise self.fail(
                    f"`{sorted(shared)[0]}` (an intermediate of the attention) is also used at line {line}; "
                    "SDPA never materialises it"
                )
            earlier = set()
            for j in range(lo, i):
                if j in m.used:
                    earlier |= {n.value for n in names_read(facts, self.body[j])}
            if _bound_in(facts, s) & earlier:
                raise self.fail(f"line {line} changes a name the attention reads before it")
        for leaf in m.leaves:
            leaf_names = {n.value for n in _names_under(facts, leaf)}
            clash = leaf_names & temps
            if clash:
                raise self.fail(f"`{sorted(clash)[0]}` is both an input and an intermediate of the attention")
        self.check_reads(temps, lo, hi)

    def check_reads(
        self, temps: set[str], lo: int, hi: int, what: str = "an intermediate of the attention", after: cst.CSTNode | None = None
    ) -> None:
        """The intermediates (scores, weights) must not be read anywhere but where the pattern reads them.

        With ``after``, only reads that follow that node count (the weights, checked before the scores are read).
        """
        facts, m = self.facts, self.m
        first, last = self.body[lo], self.body[hi]
        scope = self.scope
        loops = [a for a in facts.ancestors(first) if isinstance(a, (cst.For, cst.While)) and facts.contains(scope, a)]
        block = facts.block_of(first)
        for read in names_read(facts, scope):
            if read.value not in temps or read in m.consumed:
                continue
            if facts.function_of(read) is not (scope if isinstance(scope, cst.FunctionDef) else None):
                continue
            where = _line(facts, facts.statement_of(read))
            if after is not None and facts._enter[read] < facts._exit[after]:
                continue
            if facts._enter[read] < facts._enter[first]:
                if not any(facts.contains(loop, read) for loop in loops):
                    continue
            elif facts._enter[read] >= facts._exit[last]:
                holder = next((a for a in [read, *facts.ancestors(read)] if facts.parent(a) is block), None)
                if holder is not None:
                    i = self.body.index(holder)
                    if any(_rebinds(self.body[j], read.value) for j in range(hi + 1, i)):
                        continue
            raise self.fail(f"`{read.value}` ({what}) is also used at line {where}; SDPA never materialises it")


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
    first_call = next((n for n in _walk(s) if isinstance(n, (cst.Call, cst.Assign, cst.Expr))), s)
    return facts.position(first_call)[0]


def _walk(node: cst.CSTNode):
    for child in node.children:
        yield child
        yield from _walk(child)


def _short(facts: ModuleFacts, node: cst.CSTNode, limit: int = 40) -> str:
    code = " ".join(facts.code(node).split())
    return code if len(code) <= limit else code[: limit - 3] + "..."


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


def _is_neg_inf(facts: ModuleFacts, node: cst.BaseExpression) -> bool:
    """``float('-inf')``, ``-float('inf')``, ``-math.inf``, ``-torch.inf``, ``float("-inf")``."""
    if isinstance(node, cst.Call) and is_name(node.func, "float") and len(node.args) == 1:
        arg = node.args[0].value
        return isinstance(arg, cst.SimpleString) and arg.evaluated_value.strip().lower() in ("-inf", "-infinity")
    if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.Minus):
        inner = node.expression
        if isinstance(inner, cst.Call) and is_name(inner.func, "float") and len(inner.args) == 1:
            arg = inner.args[0].value
            return isinstance(arg, cst.SimpleString) and arg.evaluated_value.strip().lower() in ("inf", "infinity")
        return facts.qualname(inner) in ("math.inf", "torch.inf", "numpy.inf")
    return False


def _is_zero(node: cst.BaseExpression) -> bool:
    if isinstance(node, cst.Integer):
        return int(node.value) == 0
    if isinstance(node, cst.Float):
        return float(node.value) == 0.0
    return False


def _strip_view(node: cst.BaseExpression) -> cst.BaseExpression:
    """``torch.tril(...).view(1, 1, n, n)`` -> ``torch.tril(...)``."""
    while isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and node.func.attr.value in (
        "view",
        "reshape",
        "unsqueeze",
        "bool",
        "to",
        "float",
    ):
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


def _einsum(call: cst.Call, role: str) -> tuple[cst.BaseExpression, cst.BaseExpression] | None:
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
    if not (pa == pb == po) or "..." in pa.replace("...", "", 1):
        return None
    if role == "qk":  # "...ld,...sd->...ls"
        ok = xa[1] == xb[1] and xo == xa[0] + xb[0] and len({xa[0], xb[0], xa[1]}) == 3
    else:  # "...ls,...se->...le"
        ok = xa[1] == xb[0] and xo == xa[0] + xb[1] and len({xa[0], xa[1], xb[1]}) == 3
    return (args[1], args[2]) if ok else None


def _negate(facts: ModuleFacts, cond: cst.BaseExpression) -> str:
    """The keep-mask SDPA wants for ``masked_fill(cond, -inf)``: ``m != 0`` for ``m == 0``, else ``~cond``."""
    if isinstance(cond, cst.Comparison) and len(cond.comparisons) == 1:
        target = cond.comparisons[0]
        flip = {cst.Equal: "!=", cst.NotEqual: "=="}
        for kind, op in flip.items():
            if isinstance(target.operator, kind):
                return f"{facts.code(cond.left)} {op} {facts.code(target.comparator)}"
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
        if len(node.slice) == 1 and isinstance(node.slice[0].slice, cst.Index):
            return int_value(node.slice[0].slice.value) == -1 and facts.code(node.value.value) in names
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
        return isinstance(root, cst.Name) and fn is not None and fn.name.value == "__init__" and _is_param(fn, root.value)
    if isinstance(node, cst.Name):
        if fn is None:
            return False
        if fn.name.value == "__init__" and _is_param(fn, node.value):
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


def _is_param(fn: cst.FunctionDef, name: str) -> bool:
    params = fn.params
    every = [*params.posonly_params, *params.params, *params.kwonly_params]
    return any(p.name.value == name for p in every)


# === runtime: what the patched script runs (python -m autotune.catalog copies it into autotune/runtime_helpers.py) ===

from autotune.knob_values import knob


def sdpa_enabled() -> bool:
    """Whether hand-written attention runs as F.scaled_dot_product_attention instead of the script's own code."""
    return knob("sdpa.attention") == "sdpa"
