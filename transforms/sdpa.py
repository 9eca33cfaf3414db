"""sdpa: run hand-written softmax(q @ k^T * scale [+ mask]) @ v attention as F.scaled_dot_product_attention."""

from __future__ import annotations

import libcst as cst

from autotune.analysis import ModuleFacts
from autotune.knobs import Knob, Numerics
from autotune.transform import Edits, Status, Transform
from autotune.syntax import expr, is_setting, scope_of

from ._attention import _Matcher
from ._flag import defined, definition, flag_of, is_on, turned_on
from ._attention_exprs import (
    EINSUM,
    MATMUL,
    SDPA,
    _gated,
    _Mask,
    _Match,
    _negate,
    _NoMatch,
    _NotApplicable,
    _scale_code,
)
from ._model import enclosing_class

# torch modules that already run F.scaled_dot_product_attention inside
ATTENTION_MODULES = {
    "torch.nn.MultiheadAttention",
    "torch.nn.TransformerEncoderLayer",
    "torch.nn.TransformerDecoderLayer",
    "torch.nn.Transformer",
}


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
        manual: list[cst.CSTNode] = []  # the products of hand-written attention
        reported: set[cst.CSTNode] = set()
        for out in self._products(facts):
            try:
                match = self._match(facts, out)
            except _NoMatch:
                continue
            except _NotApplicable as why:
                manual.append(out)
                key = getattr(why, "softmax", None) or out
                if key not in reported and scope_of(facts, out) not in with_sdpa:
                    reported.add(key)
                    self.report(facts, key, Status.NOT_APPLICABLE, str(why))
                manual_scopes.add(scope_of(facts, out))
                continue
            scope = scope_of(facts, out)
            manual_scopes.add(scope)
            manual.append(out)
            if match.softmax in reported or scope in with_sdpa:
                continue
            reported.add(match.softmax)
            self._rewrite(facts, edits, match)
        found = []  # (call, the gate of the knob's helper around it, the script's own switch)
        for call in facts.calls:
            if facts.qualname(call.func) != SDPA:
                continue
            gate = next((a for a in facts.ancestors(call) if isinstance(a, cst.If) and _gated(facts, a.test)), None)
            found.append((call, gate, self._switch(facts, call, manual)))
        plain = [s for _, g, s in found if g is None and s is not None and not _always_on(facts, s.test)
                 and not facts.is_runtime_call(s.test, "sdpa_switch")]  # the script's own switches, as it wrote them
        flips = self._flips(facts, plain)
        flipped: set[cst.CSTNode] = set()
        for call, gate, switch in found:
            literal = flips.get(switch) if switch is not None else None
            if gate is not None:
                reason = "attention already behind the sdpa.attention knob"
            elif switch is not None and facts.is_runtime_call(switch.test, "sdpa_switch"):
                reason = "the script's own attention switch is already the sdpa.attention knob"
            elif switch is not None and _always_on(facts, switch.test):
                reason = (f"F.scaled_dot_product_attention where {facts.code(switch.test)}, which the script sets "
                          "wherever torch has it")
            elif literal is not None and is_on(literal):
                reason = (f"F.scaled_dot_product_attention where {facts.code(switch.test)}, which the script "
                          f"defines on ({facts.code(literal)})")
            elif switch is not None:
                flag = facts.code(switch.test)
                where = (f"; the tuned script turns {flag} on where it is defined ({defined(facts, literal)} -> "
                         f"{facts.code(turned_on(literal))}), as nothing else reads it") if literal is not None else ""
                self.report(facts, call, Status.APPLICABLE, (
                    f"if {flag}: F.scaled_dot_product_attention, else the manual attention: the script's own switch "
                    f"(present, switched off where {flag} is false), which sdpa.attention=sdpa turns on there{where}"))
                if self.mode.gated:
                    code = f"{edits.runtime('sdpa_switch')}({flag})"
                    edits.rewrite(switch.test, lambda node, code=code: expr(code))
                elif self.mode.value(self.knobs[0]) == "sdpa" and literal is not None:
                    if literal not in flipped:  # one definition, however many switches read it
                        flipped.add(literal)
                        edits.rewrite(literal, turned_on)
                elif self.mode.value(self.knobs[0]) == "sdpa":
                    note = cst.Comment(f"# autotune: F.scaled_dot_product_attention whatever {flag} says")
                    edits.rewrite(switch, lambda node, note=note: node.with_changes(
                        test=cst.Name("True"), body=node.body.with_changes(header=cst.TrailingWhitespace(
                            whitespace=cst.SimpleWhitespace("  "), comment=note, newline=node.body.header.newline))))
                continue
            elif scope_of(facts, call) in manual_scopes:
                reason = "F.scaled_dot_product_attention, beside a manual fallback chosen by a flag"
            else:
                reason = "already uses F.scaled_dot_product_attention"
            self.report(facts, call, Status.PRESENT, reason)

    def _flips(self, facts: ModuleFacts, switches: list[cst.If]) -> dict[cst.If, cst.BaseExpression]:
        """The definition (a literal) to turn each switch on at, where the script defines its flag once and reads it
        only in these switches (``_flag.definition``): every switch of one flag is turned on there, or none."""
        by_flag: dict[tuple[str, str | None], list[cst.If]] = {}
        for switch in switches:
            key = flag_of(switch.test)
            if key is not None:
                by_flag.setdefault(key, []).append(switch)
        out = {}
        for group in by_flag.values():
            literal = definition(self.project, facts, [s.test for s in group])
            if literal is not None:
                out.update((s, literal) for s in group)
        return out

    @staticmethod
    def _switch(facts: ModuleFacts, call: cst.Call, manual: list[cst.CSTNode]) -> cst.If | None:
        """``if FLASH: y = F.scaled_dot_product_attention(...) else: <hand-written attention>``: the innermost ``if``
        of ``call``'s function whose body holds it and whose ``else`` holds the manual attention, tested on a
        variable or attribute of the script's own (``FLASH``, ``self.flash``, ``args.flash``), or on the knob's
        helper already."""
        function = facts.function_of(call)
        for node in facts.ancestors(call):
            if node is function:
                return None
            if not isinstance(node, cst.If) or not facts.contains(node.body, call):
                continue
            if not isinstance(node.orelse, cst.Else) or not any(facts.contains(node.orelse, m) for m in manual):
                return None
            if facts.is_runtime_call(node.test, "sdpa_switch"):
                return node
            return node if is_setting(node.test) else None
        return None

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
        q = facts.code(m.q)
        args = [q, facts.code(m.k), facts.code(m.v)]
        for i, role in ((1, "k"), (2, "v")):
            if role in m.shared:  # one key/value head: broadcast to the query's heads (a view, no copy)
                node = m.k if role == "k" else m.v
                atomic = isinstance(node, (cst.Name, cst.Attribute, cst.Call, cst.Subscript))
                operand = args[i] if atomic else f"({args[i]})"
                args[i] = f"{operand}.unsqueeze(-3).expand(*{q}.shape[:-2], -1, -1)"
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
        if m.shared:
            parts.append("one key/value head for every query head")
        return f" ({', '.join(parts)})" if parts else ""

    @staticmethod
    def _where(facts: ModuleFacts, node: cst.CSTNode) -> str:
        fn = facts.function_of(node)
        cls = facts.class_of(node)
        if fn is None:
            return ""
        return f" in {cls.name.value}.{fn.name.value}" if cls is not None else f" in {fn.name.value}()"



def _always_on(facts: ModuleFacts, flag: cst.BaseExpression) -> bool:
    """Whether the flag is set from ``hasattr(torch.nn.functional, "scaled_dot_product_attention")`` (nanoGPT's
    ``self.flash``), which any torch autotune runs on has: then SDPA already runs."""
    name = facts.code(flag).rsplit(".", 1)[-1]
    for assign in facts.assigns:
        value = assign.value
        if any(facts.code(t.target).rsplit(".", 1)[-1] == name for t in assign.targets) and \
                isinstance(value, cst.Call) and isinstance(value.func, cst.Name) and value.func.value == "hasattr" \
                and "scaled_dot_product_attention" in facts.code(value):
            return True
    return False


# === runtime: what the patched script runs (python -m autotune.catalog copies it into autotune/runtime_helpers.py) ===

from typing import Any

from autotune.knob_values import knob, took_effect


def sdpa_enabled() -> bool:
    """Whether hand-written attention runs as F.scaled_dot_product_attention instead of the script's own code."""
    return knob("sdpa.attention") == "sdpa"


def sdpa_switch(flag: Any) -> Any:
    """``if FLASH:`` choosing between the script's F.scaled_dot_product_attention and its manual attention: the
    script's flag where it is on; where it is off, True when the knob asks for SDPA."""
    if flag or knob("sdpa.attention", record=False) != "sdpa":
        return flag
    took_effect("sdpa.attention")
    return True
