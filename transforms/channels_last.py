"""channels_last: store convolutional models and their 4-D inputs in NHWC (channels_last) memory format."""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst

from autotune.analysis import ModuleFacts
from autotune.knobs import Knob, Numerics
from autotune.transform import Edits, Status, Transform, keyword, stmt
from autotune.transforms._model import bound_names
from autotune.transforms._sites import (
    Region,
    h2d_copy,
    is_module_ctor,
    local_classes,
    strip_module_chain,
    training_regions,
)

# 2-D convolutions: the layers whose kernels have a channels_last fast path (cuDNN, oneDNN).
_CONV2D = {
    f"{prefix}.{name}"
    for prefix in ("torch.nn", "torch.nn.modules.conv")
    for name in ("Conv2d", "ConvTranspose2d", "LazyConv2d", "LazyConvTranspose2d")
} | {"torch.nn.functional.conv2d", "torch.nn.functional.conv_transpose2d"}


@dataclass(eq=False)
class _Model:
    """A trained model built from a module with 2-D convolutions."""

    facts: ModuleFacts
    name: str  # the spelling of the variable that holds it ("model", "self.net")
    build: cst.BaseStatement  # the statement that builds it
    site: cst.Call  # the call that builds it, where reports point
    anchor: cst.BaseStatement  # the last statement of its block that builds it or moves it to the device
    label: str  # what it is, for reports ("Net", "nn.Sequential")
    conv: bool
    converted: bool = False  # the script (or autotune) already makes it channels_last
    inputs: list[tuple[ModuleFacts, cst.Call]] = field(default_factory=list)  # its forward calls in the loop


class ChannelsLast(Transform):
    """Convert models with 2-D convolutions and the 4-D batches fed to them to the channels_last memory format."""

    name = "channels_last"
    knobs = (
        Knob(
            "channels_last.enabled",
            (False, True),
            False,
            Numerics.REORDER,
            help="NHWC weights and inputs: faster convolution kernels on GPUs with tensor cores and on oneDNN CPUs",
        ),
    )

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._found: tuple[list[Region], list[_Model]] | None = None

    def apply(self, facts: ModuleFacts, edits: Edits) -> None:
        if self._found is None:  # the models of the whole project, found once for all its files
            regions = training_regions(self.project)
            self._found = (regions, self._models(regions))
        regions, models = self._found
        for model in models:
            if model.facts is not facts:
                continue
            if not model.conv:
                if self._is_trained(model):
                    self.report(facts, model.site, Status.NOT_APPLICABLE, f"{model.label} has no 2-D convolutions")
                continue
            if not model.inputs and not self._is_trained(model):
                self.report(facts, model.site, Status.NOT_APPLICABLE, f"{model.name} is not trained in a training loop")
                continue
            if model.converted:
                self.report(facts, model.site, Status.PRESENT, f"{model.name} is already channels_last")
                continue
            self.report(facts, model.site, Status.APPLICABLE, f"{model.label} has 2-D convolutions")
            self._convert(edits, model.anchor, model.name, "to", after=True)
        self._inputs(facts, edits, regions, [m for m in models if m.conv])

    # --- models ---------------------------------------------------------------------------------------------

    def _models(self, regions: list[Region]) -> list[_Model]:
        models: list[_Model] = []
        for facts in self.project.modules:
            for call in facts.calls:
                parent = facts.parent(call)
                if not (isinstance(parent, cst.Assign) and parent.value is call and len(parent.targets) == 1):
                    continue
                target = parent.targets[0].target
                if not isinstance(target, (cst.Name, cst.Attribute)):
                    continue
                cls = facts.class_of(call)
                if cls is not None and f"{facts.modname}.{cls.name.value}" in local_classes(self.project):
                    continue  # a layer of a model (`self.conv1 = nn.Conv2d(...)`), not a model
                base = strip_module_chain(call)
                if not isinstance(base, cst.Call) or not self._builds_module(facts, base):
                    continue
                name = facts.code(target)
                build = facts.statement_of(call)
                label = facts.code(base.func) if isinstance(base.func, (cst.Name, cst.Attribute)) else name
                if not is_module_ctor(self.project, facts, base):
                    label += "()"  # a factory function
                model = _Model(facts, name, build, call, build, label, self._has_conv(facts, base, set()))
                model.anchor = self._anchor(facts, build, name)
                model.converted = self._converted(model)
                models.append(model)
        for model in models:
            for facts, owner in regions:
                for call in facts.calls_in(owner):
                    if facts.code(call.func) == model.name and (facts, call) not in model.inputs:
                        model.inputs.append((facts, call))
        return models

    def _builds_module(self, facts: ModuleFacts, call: cst.Call) -> bool:
        if is_module_ctor(self.project, facts, call):
            return True
        target = self.project.local_target(facts, call)  # a factory: `model = build_model(cfg)`
        return target is not None and any(
            isinstance(base, cst.Call) and is_module_ctor(self.project, target[0], base)
            for base in (strip_module_chain(r.value) for r in _returns(target[1]))
        )

    def _has_conv(self, facts: ModuleFacts, node: cst.CSTNode, seen: set) -> bool:
        """Whether building ``node`` (a call, a class body, a function) creates a 2-D convolution."""
        for call in facts.calls_in(node):
            qual = facts.qualname(call.func)
            if qual in _CONV2D:
                return True
            if qual and qual.startswith("torchvision.models.") and not qual.startswith("torchvision.models.video."):
                return True
            classes = local_classes(self.project)
            if qual in classes and qual not in seen:
                seen.add(qual)
                cls_facts, cls = classes[qual]
                if self._class_has_conv(cls_facts, cls, seen):
                    return True
                continue
            target = self.project.local_target(facts, call)
            if target is not None and target[1] not in seen:
                seen.add(target[1])
                if self._has_conv(target[0], target[1], seen):
                    return True
        return False

    def _class_has_conv(self, facts: ModuleFacts, cls: cst.ClassDef, seen: set) -> bool:
        if self._has_conv(facts, cls, seen):
            return True
        classes = local_classes(self.project)
        for base in cls.bases:
            qual = facts.qualname(base.value)
            if qual in classes and qual not in seen:
                seen.add(qual)
                if self._class_has_conv(*classes[qual], seen):
                    return True
        return False

    @staticmethod
    def _anchor(facts: ModuleFacts, build: cst.BaseStatement, name: str) -> cst.BaseStatement:
        """The last statement after ``build`` in its block that moves ``name`` to the device (or ``build``)."""
        block = facts.block_of(build)
        body = list(getattr(block, "body", ()))
        anchor = build
        for node in body[body.index(build) + 1 :]:
            if not isinstance(node, cst.SimpleStatementLine) or len(node.body) != 1:
                break
            small = node.body[0]
            value = small.value if isinstance(small, (cst.Expr, cst.Assign)) else None
            if isinstance(small, cst.Assign) and [facts.code(t.target) for t in small.targets] != [name]:
                break
            if not (isinstance(value, cst.Call) and strip_module_chain(value) is not value):
                break
            inner = strip_module_chain(value)
            if facts.code(inner) != name:
                break
            anchor = node
        return anchor

    def _converted(self, model: _Model) -> bool:
        for facts in self.project.modules:
            for call in facts.calls:
                if facts.is_runtime_call(call, "channels_last") and call.args:
                    if facts.code(call.args[0].value) == model.name:
                        return True
                if _is_channels_last(facts, call):
                    func = call.func
                    inside = facts is model.facts and (
                        facts.contains(model.build, call) or facts.contains(model.anchor, call)
                    )
                    if inside or (isinstance(func, cst.Attribute) and facts.code(func.value) == model.name):
                        return True
        return False

    def _is_trained(self, model: _Model) -> bool:
        """Whether an optimizer is built over the model's parameters (``AdamW(model.parameters())``)."""
        for facts in self.project.modules:
            for ctor in self.project.optimizer_ctors(facts):
                for call in facts.calls_in(ctor):
                    func = call.func
                    if isinstance(func, cst.Attribute) and func.attr.value in ("parameters", "named_parameters"):
                        if facts.code(func.value) == model.name:
                            return bool(self.project.loops)
        return False

    # --- inputs ---------------------------------------------------------------------------------------------

    def _inputs(self, facts: ModuleFacts, edits: Edits, regions: list[Region], models: list[_Model]) -> None:
        done: set[tuple[cst.CSTNode, str]] = set()
        for model in models:
            for call_facts, call in model.inputs:
                if call_facts is not facts:
                    continue
                positional = [a.value for a in call.args if a.keyword is None and not a.star]
                if not positional or not isinstance(positional[0], cst.Name):
                    self.report(facts, call, Status.NOT_APPLICABLE, f"{facts.code(call)}: the input is not a name")
                    continue
                x = positional[0].value
                owner = next(o for f, o in regions if f is facts and f.contains(o, call))
                if self._input_converted(facts, owner, x):
                    self.report(facts, call, Status.PRESENT, f"input {x} is already channels_last")
                    continue
                place = self._input_place(facts, owner, call, x)
                if place is None:
                    self.report(
                        facts, call, Status.NOT_APPLICABLE, f"input {x} is not a batch copied to the device in the loop"
                    )
                    continue
                if (place[0], x) in done:
                    continue
                done.add((place[0], x))
                self.report(facts, call, Status.APPLICABLE, f"input {x} of {model.name} (converted when 4-D)")
                self._convert(edits, place[0], x, "contiguous", after=place[1])

    def _input_converted(self, facts: ModuleFacts, owner: cst.CSTNode, x: str) -> bool:
        for call in facts.calls_in(owner):
            if facts.is_runtime_call(call, "channels_last") and call.args and facts.code(call.args[0].value) == x:
                return True
            if _is_channels_last(facts, call) and isinstance(call.func, cst.Attribute):
                if facts.code(call.func.value) == x:
                    return True
                line = facts.statement_of(call)  # `x = x.to(device).contiguous(memory_format=...)`
                if isinstance(line, cst.SimpleStatementLine) and any(
                    isinstance(s, cst.Assign) and any(x in bound_names(t.target) for t in s.targets) for s in line.body
                ):
                    return True
        return False

    def _input_place(
        self, facts: ModuleFacts, owner: cst.CSTNode, forward: cst.Call, x: str
    ) -> tuple[cst.BaseStatement, bool] | None:
        """Where to convert input ``x``: (statement, after it?) -- after its copy to the device, else at the top of
        the loop or function that binds it."""
        blocks = set(facts.ancestors(forward))
        copy = None
        for call in facts.calls_in(owner):
            if facts._enter[call] >= facts._enter[forward]:
                break
            line = facts.statement_of(call)
            if facts.block_of(line) not in blocks or not isinstance(line, cst.SimpleStatementLine):
                continue
            for small in line.body:
                if isinstance(small, cst.Assign) and _assigns_copy(facts, small, x):
                    copy = line
        if copy is not None:
            return copy, True
        for node in facts.ancestors(forward):  # the nearest binding first
            if not facts.contains(owner, node):
                break
            if isinstance(node, cst.For) and x in bound_names(node.target):
                first = _first_statement(node.body)
                return (first, False) if first is not None else None
            if isinstance(node, cst.FunctionDef) and x in {p.name.value for p in node.params.params}:
                first = _first_statement(node.body, skip_docstring=True)
                return (first, False) if first is not None else None
        return None

    # --- edits ----------------------------------------------------------------------------------------------

    def _convert(self, edits: Edits, place: cst.BaseStatement, name: str, method: str, after: bool) -> None:
        if self.mode.gated:
            line = stmt(f"{name} = {edits.runtime('channels_last')}({name})\n")
        elif self.mode.value(self.knobs[0]):
            edits.require_import("torch")
            line = stmt(f"{name} = {name}.{method}(memory_format=torch.channels_last)\n")
        else:
            return
        if after:
            edits.insert_after(place, line)
        else:
            edits.insert_before(place, line)


def _is_channels_last(facts: ModuleFacts, call: cst.Call) -> bool:
    arg = keyword(call, "memory_format")
    return arg is not None and facts.qualname(arg.value) == "torch.channels_last"


def _assigns_copy(facts: ModuleFacts, assign: cst.Assign, x: str) -> bool:
    """Whether ``assign`` binds ``x`` to a host-to-device copy (``x = x.to(device)``, ``x, y = x.cuda(), ...``)."""
    for target in assign.targets:
        t, value = target.target, assign.value
        if isinstance(t, cst.Name) and t.value == x:
            return h2d_copy(facts, value)
        if isinstance(t, (cst.Tuple, cst.List)) and isinstance(value, (cst.Tuple, cst.List)):
            for te, ve in zip(t.elements, value.elements):
                if isinstance(te.value, cst.Name) and te.value.value == x:
                    return h2d_copy(facts, ve.value)
    return False


def _first_statement(body: cst.BaseSuite, skip_docstring: bool = False) -> cst.BaseStatement | None:
    if not isinstance(body, cst.IndentedBlock) or not body.body:
        return None
    stmts = list(body.body)
    if skip_docstring and len(stmts) > 1:
        first = stmts[0]
        if (
            isinstance(first, cst.SimpleStatementLine)
            and isinstance(first.body[0], cst.Expr)
            and isinstance(first.body[0].value, (cst.SimpleString, cst.ConcatenatedString))
        ):
            return stmts[1]
    return stmts[0]


def _returns(fn: cst.FunctionDef) -> list[cst.Return]:
    out, stack = [], [fn.body]
    while stack:
        node = stack.pop()
        if isinstance(node, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            continue
        if isinstance(node, cst.Return) and node.value is not None:
            out.append(node)
        stack.extend(node.children)
    return out

