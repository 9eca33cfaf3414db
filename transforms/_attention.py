"""The sdpa transform's matcher: reads one ``weights @ v`` backwards through the statements of its block, as far
as the attention goes, and proves that SDPA computes the same thing (see sdpa.py)."""

from __future__ import annotations

import copy

import libcst as cst

from autotune.analysis import ModuleFacts
from autotune.transform import Transform
from autotune.syntax import argument, int_value, is_name, names_read, positional, self_attr, short

from ._attention_exprs import (
    _SAFE_SMALL,
    DROPOUT_FN,
    DROPOUT_MODULE,
    EINSUM,
    MATMUL,
    _bound_in,
    _cast_back,
    _dropout_input,
    _einsum,
    _is_float_cast,
    _is_neg_inf,
    _is_number,
    _is_softmax,
    _is_tril_ones,
    _is_zero,
    _line,
    _Mask,
    _Match,
    _names_under,
    _NoMatch,
    _NotApplicable,
    _rebinds,
    _scale_code,
    _softmax_args,
    _strip_view,
    _transposes,
    _untransposed,
)
from ._model import ClassRef


class _Matcher:
    """Reads one ``weights @ v`` backwards through the statements of its block, as far as the attention goes."""

    def __init__(self, owner: Transform, facts: ModuleFacts, body: list, cls: ClassRef | None, scope: cst.CSTNode) -> None:
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
            weights, v, shared = operands
            if shared:
                self.m.shared.add("v")
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
                f"dropout on the weights only under `if`, through {short(facts, guarded.func)}, a module passed "
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
            raise self.fail(f"the weights are cast to the dtype of {short(facts, self.m.cast_to)}, not of the query")

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
        raise self.fail(f"dropout through {short(facts, call.func)}, not built as nn.Dropout here: its probability cannot be read")

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
                self.m.q, self.m.k = operands.first, operands.second
                self.m.leaves.extend((operands.first, operands.second))
                if operands.shared:
                    self.m.shared.add("k")
                return None
        raise self.fail(
            f"softmax weights are applied to values, but the scores ({short(facts, node)}) are not q @ k^T: "
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
                f"the scores are {short(self.facts, q)} @ {short(self.facts, kt)}, not q @ k.transpose(-2, -1)"
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


