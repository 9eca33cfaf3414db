"""non_blocking: make the training loop's host-to-device copies of batch tensors asynchronous."""

from __future__ import annotations

import libcst as cst

from autotune.analysis import ModuleFacts
from autotune.knobs import Knob, Numerics
from autotune.transform import Edits, Status, Transform, add_args, is_literal, keyword, kwarg
from autotune.transforms._sites import (
    device_arg,
    in_regions,
    is_host_device,
    is_module_expr,
    module_names,
    short,
    training_regions,
)

# The positional slot of non_blocking: Tensor.to(device, dtype, non_blocking), Tensor.cuda(device, non_blocking).
_POSITION = {"to": 2, "cuda": 1}


class NonBlocking(Transform):
    """Pass non_blocking=True to the host-to-device copies of batch tensors inside the training loop."""

    name = "non_blocking"
    devices = frozenset({"cuda"})
    knobs = (
        Knob(
            "non_blocking.enabled",
            (False, True),
            False,
            Numerics.EXACT,
            devices=frozenset({"cuda"}),
            help="asynchronous host-to-device copies (overlap with compute when the batch is in pinned memory)",
        ),
    )

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._regions = training_regions(self.project)
        self._modules = module_names(self.project)

    def apply(self, facts: ModuleFacts, edits: Edits) -> None:
        regions, modules = self._regions, self._modules
        for call in facts.calls:
            func = call.func
            if not isinstance(func, cst.Attribute) or func.attr.value not in ("to", "cuda", "cpu"):
                continue
            inside = in_regions(regions, facts, call)
            what = f"{short(facts, func.value)}.{func.attr.value}(...)"
            if func.attr.value == "cpu" or (func.attr.value == "to" and self._to_host(facts, call)):
                if inside:
                    self.report(facts, call, Status.NOT_APPLICABLE, f"{what} copies to the host, which must wait")
                continue
            if is_module_expr(self.project, facts, func.value, modules):
                self.report(facts, call, Status.NOT_APPLICABLE, f"{what} moves a module, not a batch")
                continue
            if device_arg(facts, call) is None:
                if inside:
                    self.report(facts, call, Status.NOT_APPLICABLE, f"{what} changes dtype or layout, no device copy")
                continue
            if not inside:
                self.report(facts, call, Status.NOT_APPLICABLE, f"{what} is outside any training loop")
                continue
            written = self._non_blocking(call, func.attr.value)
            if written is not None:
                if is_literal(written, True) or facts.is_runtime_call(written, "non_blocking"):
                    self.report(facts, call, Status.PRESENT, f"{what} is already non_blocking")
                else:
                    self.report(
                        facts, call, Status.USER, f"{what}: non_blocking={facts.code(written)} is the script's choice"
                    )
                continue
            if any(a.star for a in call.args):
                self.report(facts, call, Status.NOT_APPLICABLE, f"{what} passes its own arguments")
                continue
            self.report(facts, call, Status.APPLICABLE, f"{what} is a synchronous host-to-device copy")
            if self.mode.gated:
                value = f"{edits.runtime('non_blocking')}()"
            elif self.mode.value(self.knobs[0]):
                value = "True"
            else:
                continue
            edits.rewrite(call, lambda node, value=value: add_args(node, kwarg("non_blocking", value)))

    @staticmethod
    def _non_blocking(call: cst.Call, method: str) -> cst.BaseExpression | None:
        arg = keyword(call, "non_blocking")
        if arg is not None:
            return arg.value
        positional = [a.value for a in call.args if a.keyword is None and not a.star]
        if method == "to" and len(positional) == 2 and (is_literal(positional[1], True) or is_literal(positional[1], False)):
            return positional[1]  # Tensor.to(other, non_blocking): a dtype is never a bool
        slot = _POSITION[method]
        return positional[slot] if len(positional) > slot else None

    @staticmethod
    def _to_host(facts: ModuleFacts, call: cst.Call) -> bool:
        device = keyword(call, "device")
        if device is not None:
            return is_host_device(facts, device.value)
        positional = [a.value for a in call.args if a.keyword is None and not a.star]
        return bool(positional) and is_host_device(facts, positional[0])
