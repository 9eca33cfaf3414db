"""anomaly: switch off autograd anomaly detection a script leaves on (``torch.autograd.set_detect_anomaly(True)``)."""

from __future__ import annotations

import libcst as cst

from autotune.analysis import ModuleFacts
from autotune.knobs import Knob, Numerics
from autotune.transform import Edits, Status, Transform
from autotune.syntax import is_literal

SETTERS = ("torch.autograd.set_detect_anomaly", "torch.autograd.anomaly_mode.set_detect_anomaly")
SWITCHED_ON = "anomaly detection is switched on: a debugging aid that slows every backward"
BLOCKS = ("torch.autograd.detect_anomaly", "torch.autograd.anomaly_mode.detect_anomaly")


class Anomaly(Transform):
    """Switch off the autograd anomaly detection a script turns on for the whole run."""

    name = "anomaly"
    knobs = (
        Knob(
            "anomaly.detect",
            (True, False),
            True,
            Numerics.EXACT,
            help="only where the script calls torch.autograd.set_detect_anomaly(True): each backward then checks "
            "every gradient for NaN and keeps every forward op's stack trace, a debugging aid that slows training; "
            "False switches it off (the same numbers, no NaN check)",
        ),
    )

    def apply(self, facts: ModuleFacts, edits: Edits) -> None:
        for call in facts.calls:
            qual = facts.qualname(call.func)
            if qual in BLOCKS:
                self.report(facts, call, Status.NOT_APPLICABLE,
                            f"{facts.code(call)}: a block the script scoped itself; left as written")
            elif qual in SETTERS:
                self._setter(facts, edits, call)

    def _setter(self, facts: ModuleFacts, edits: Edits, call: cst.Call) -> None:
        mode = _mode_arg(call)
        if mode is None:
            self.report(facts, call, Status.NOT_APPLICABLE, f"{facts.code(call)}: no mode argument to read")
        elif facts.is_runtime_call(mode.value, "detect_anomaly"):
            self.report(facts, call, Status.PRESENT, "anomaly detection is already a knob")
        elif is_literal(mode.value, False):
            self.report(facts, call, Status.PRESENT, f"{facts.code(call)}: anomaly detection is off")
        elif not is_literal(mode.value, True):
            self.report(facts, call, Status.USER, f"{facts.code(call)}: the script decides when it is on; kept")
        else:
            self.report(facts, call, Status.APPLICABLE, SWITCHED_ON)
            if self.mode.gated:
                new = cst.parse_expression(f"{edits.runtime('detect_anomaly')}()")
            elif self.mode.value(self.knobs[0]) is False:
                new = cst.Name("False")
            else:
                return
            edits.rewrite(mode.value, lambda node, new=new: new)


def _mode_arg(call: cst.Call) -> cst.Arg | None:
    """The ``mode`` argument: the first positional one, or ``mode=``."""
    for i, arg in enumerate(call.args):
        if arg.star:
            return None
        if (arg.keyword is None and i == 0) or (arg.keyword is not None and arg.keyword.value == "mode"):
            return arg
    return None


# === runtime: what the patched script runs (python -m autotune.catalog copies it into autotune/runtime_helpers.py) ===

from autotune.knob_values import knob


def detect_anomaly() -> bool:
    """The mode for a script's ``set_detect_anomaly(True)``: on, as written, unless the knob switches it off."""
    return bool(knob("anomaly.detect"))
