"""non_blocking: make the training loop's host-to-device copies of batch tensors asynchronous."""

from __future__ import annotations

import libcst as cst

from autotune.analysis import ModuleFacts
from autotune.knobs import Knob, Numerics
from autotune.transform import Edits, Status, Transform
from autotune.syntax import add_args, is_literal, is_reference, keyword, kwarg, star_kwargs
from autotune.transforms._sites import (
    device_arg,
    in_regions,
    is_host_device,
    is_module_expr,
    module_names,
    short,
    training_regions,
)

# a receiver read again for the runtime's check: x, batch.x, batch["x"], batch[0], batch[key]
_SAME_EACH_TIME = (cst.Name, cst.SimpleString, cst.Integer)
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
            branch = off_cuda_branch(facts, call)
            if branch is not None:
                self.report(
                    facts, call, Status.NOT_APPLICABLE, f"{what} runs only without CUDA (under `{branch}`): nothing to overlap"
                )
                continue
            written = self._non_blocking(call, func.attr.value)
            if written is not None:
                if is_literal(written, True):
                    self.report(facts, call, Status.PRESENT, f"{what} is already non_blocking")
                else:
                    self.report(
                        facts, call, Status.USER, f"{what}: non_blocking={facts.code(written)} is the script's choice"
                    )
                continue
            if any(a.star for a in call.args):
                if any(a.star == "**" and facts.is_runtime_call(a.value, "non_blocking") for a in call.args):
                    self.report(facts, call, Status.PRESENT, f"{what} is already non_blocking")
                    continue
                self.report(facts, call, Status.NOT_APPLICABLE, f"{what} passes its own arguments")
                continue
            self.report(facts, call, Status.APPLICABLE, f"{what} is a synchronous host-to-device copy")
            if self.mode.gated:
                # ``**{}`` at the default: the call as written, for any object whose ``.to`` the script calls (a
                # tokenizer's BatchEncoding of transformers 4 takes no non_blocking); the receiver, where it is a
                # plain name or subscript, is shown to the runtime, which passes non_blocking only where its
                # method takes it
                receiver = facts.code(func.value) if is_reference(func.value, _SAME_EACH_TIME) else ""
                new = star_kwargs(f"{edits.runtime('non_blocking')}({receiver})")
            elif self.mode.value(self.knobs[0]):
                new = kwarg("non_blocking", "True")
            else:
                continue
            edits.rewrite(call, lambda node, new=new: add_args(node, new))

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


# Device names a branch test compares with: any but "cuda" means the branch runs off CUDA.
_DEVICE_NAMES = {"cpu", "cuda", "mps", "xla", "xpu", "meta", "hpu", "npu"}


def off_cuda_branch(facts: ModuleFacts, node: cst.CSTNode) -> str | None:
    """The test of an enclosing ``if`` (or its ``else``) that lets ``node`` run only without CUDA, as the report
    shows it (``else`` of ``if device_type == "cuda"``); None when CUDA may reach it."""
    child = node
    for anc in facts.ancestors(node):
        if isinstance(anc, (cst.If, cst.IfExp)):
            in_body = child is anc.body
            if in_body or child is anc.orelse:
                when_true, when_false = _branch_devices(facts, anc.test)
                if (when_true if in_body else when_false) == "off":
                    test = " ".join(facts.code(anc.test).split())
                    return f"if {test}" if in_body else f"else of if {test}"
        if isinstance(anc, (cst.FunctionDef, cst.ClassDef)):
            return None
        child = anc
    return None


def _branch_devices(facts: ModuleFacts, test: cst.BaseExpression) -> tuple[str | None, str | None]:
    """(device when ``test`` holds, device when it does not): "cuda", "off" (not CUDA) or None (either)."""
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        when_true, when_false = _branch_devices(facts, test.expression)
        return when_false, when_true
    if isinstance(test, cst.BooleanOperation):
        left, right = _branch_devices(facts, test.left), _branch_devices(facts, test.right)
        if isinstance(test.operator, cst.And):  # both hold when it holds
            return left[0] or right[0], None
        return None, left[1] or right[1]  # neither holds when it does not
    if isinstance(test, cst.Call):
        return ("cuda", "off") if facts.qualname(test.func) == "torch.cuda.is_available" else (None, None)
    if isinstance(test, cst.Comparison) and len(test.comparisons) == 1:
        op = test.comparisons[0].operator
        sides = (test.left, test.comparisons[0].comparator)
        names = [s.evaluated_value for s in sides if isinstance(s, cst.SimpleString)]
        device = names[0].split(":")[0] if names else None
        if device not in _DEVICE_NAMES:
            return None, None
        if isinstance(op, (cst.Equal, cst.Is)) or (isinstance(op, cst.In) and isinstance(sides[0], cst.SimpleString)):
            return ("cuda", "off") if device == "cuda" else ("off", None)
        if isinstance(op, (cst.NotEqual, cst.IsNot)) or (isinstance(op, cst.NotIn) and isinstance(sides[0], cst.SimpleString)):
            return ("off", "cuda") if device == "cuda" else (None, "off")
    return None, None


# === runtime: what the patched script runs (python -m autotune.catalog copies it into autotune/runtime_helpers.py) ===

from typing import Any

from autotune.knob_values import knob, on_reset, reports_applied

_TAKES: dict[type, bool] = {}
_NOTHING = object()
_copies: dict[str, int] = {}  # "async": copies made asynchronous, "refused": receivers whose method takes no flag


def non_blocking(receiver: Any = _NOTHING) -> dict[str, bool]:
    """The keyword arguments that make a host-to-device copy asynchronous: none where the knob is off (the call as
    written), and none where ``receiver``'s ``.to`` takes no ``non_blocking`` (a batch class of the script's own, a
    tokenizer's BatchEncoding in transformers 4). The knob counts as applied only where no receiver refused it: its
    baked form writes non_blocking=True at every site."""
    if not knob("non_blocking.enabled", record=False):
        return {}
    import torch

    if receiver is not _NOTHING and not isinstance(receiver, (torch.Tensor, torch.nn.Module)):
        kind = type(receiver)
        if kind not in _TAKES:
            _TAKES[kind] = _takes_non_blocking(kind)
        if not _TAKES[kind]:
            _copies["refused"] = _copies.get("refused", 0) + 1
            return {}
    _copies["async"] = _copies.get("async", 0) + 1
    return {"non_blocking": True}


def _takes_non_blocking(kind: type) -> bool:
    import inspect

    method = getattr(kind, "to", None)
    try:
        parameters = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return method is not None  # a builtin's signature is not read: as torch's own
    return any(p.name == "non_blocking" or p.kind is p.VAR_KEYWORD for p in parameters)


reports_applied(lambda: ["non_blocking.enabled"] if _copies.get("async") and not _copies.get("refused") else [])
on_reset(_copies.clear)
