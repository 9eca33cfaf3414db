"""zero_grad: report how each optimizer's ``zero_grad()`` clears gradients; the torch default is already the fast one."""

from __future__ import annotations

import libcst as cst

from autotune.analysis import ModuleFacts
from autotune.knobs import Knob, Numerics
from autotune.transform import Edits, Status, Transform
from autotune.syntax import is_literal, keyword

# Since torch 2.0 (autotune needs 2.4+) Optimizer.zero_grad() and Module.zero_grad() default to
# set_to_none=True: gradients are dropped instead of filled with zeros, which skips one memset per parameter
# and lets the next backward() write gradients instead of accumulating into zeros. So a bare zero_grad()
# already is the fast form and nothing is left to rewrite. The other value is deliberately not a choice:
# set_to_none=False is slower, and it changes what optimizers do with parameters that got no gradient this
# step (AdamW would decay them, momentum would move them), which is a change of training, not of speed.
# A script that writes set_to_none=False (or any expression) keeps it: that is the user's choice.


class ZeroGrad(Transform):
    """Report whether each optimizer's zero_grad() sets gradients to None (torch's default since 2.0)."""

    name = "zero_grad"
    knobs = (
        Knob(
            "zero_grad.set_to_none",
            (True,),
            True,
            Numerics.EXACT,
            help="zero_grad() already sets gradients to None by default; False is slower and is never searched",
        ),
    )

    def apply(self, facts: ModuleFacts, edits: Edits) -> None:
        for call in facts.calls:
            if not self.project.is_zero_grad_call(call):
                continue
            receiver = call.func.value  # type: ignore[attr-defined]
            recv = facts.code(receiver)
            # Only the receiver's spelling can be seen here (`opt.zero_grad()`): the optimizer test is by name.
            if not self.project.is_optimizer_expr(facts, receiver):
                self.report(
                    facts,
                    call,
                    Status.NOT_APPLICABLE,
                    f"{recv}.zero_grad(): not an optimizer (nn.Module.zero_grad also sets gradients to None "
                    "by default)",
                )
                continue
            arg = self._set_to_none(call)
            if any(a.star for a in call.args):
                self.report(facts, call, Status.USER, f"{facts.code(call)}: the script passes its own arguments")
            elif arg is None:
                self.report(facts, call, Status.PRESENT, "already default: set_to_none=True")
            elif is_literal(arg, True):
                self.report(facts, call, Status.PRESENT, f"{recv}.zero_grad(set_to_none=True)")
            else:
                self.report(
                    facts, call, Status.USER, f"{recv}.zero_grad(set_to_none={facts.code(arg)}) is the script's choice"
                )

    @staticmethod
    def _set_to_none(call: cst.Call) -> cst.BaseExpression | None:
        """The set_to_none argument as written, by keyword or as the first positional argument."""
        arg = keyword(call, "set_to_none")
        if arg is not None:
            return arg.value
        positional = [a for a in call.args if a.keyword is None and not a.star]
        return positional[0].value if positional else None
