"""channels_last: store convolutional models and their 4-D inputs in NHWC (channels_last) memory format."""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst

from autotune.analysis import ModuleFacts
from autotune.knobs import Knob, Numerics
from autotune.transform import Edits, Status, Transform
from autotune.syntax import bound_names, keyword, self_attr, stmt
from autotune.transforms._model import training, zoo_factory
from autotune.transforms._sites import (
    DIFFUSERS_LOADERS,
    Region,
    diffusers_model,
    h2d_copy,
    is_module_ctor,
    is_module_expr,
    local_classes,
    module_names,
    strip_module_chain,
    training_regions,
)

# 2-D convolutions: the layers whose kernels have a channels_last fast path (cuDNN, oneDNN).
_CONV2D = {
    f"{prefix}.{name}"
    for prefix in ("torch.nn", "torch.nn.modules.conv")
    for name in ("Conv2d", "ConvTranspose2d", "LazyConv2d", "LazyConvTranspose2d")
} | {"torch.nn.functional.conv2d", "torch.nn.functional.conv_transpose2d"}

# Dropout that draws one mask element per tensor element, in memory order: on a channels_last activation it drops
# other elements than on the contiguous one (Dropout2d/3d draw one per channel and are not affected).
_DROPOUT = {
    f"{prefix}.{name}"
    for prefix in ("torch.nn", "torch.nn.modules.dropout")
    for name in ("Dropout", "AlphaDropout", "FeatureAlphaDropout")
} | {"torch.nn.functional.dropout", "torch.nn.functional.alpha_dropout", "torch.dropout", "torch.nn.functional.feature_alpha_dropout"}


DROPOUT_REASON = (
    "in train mode dropout draws its mask in memory order, so on channels_last activations other elements are "
    "dropped and the losses differ from the first step"
)


_FLATTEN = {"torch.flatten", "torch.nn.Flatten", "torch.nn.modules.flatten.Flatten"}
SEQUENTIAL = "torch.nn.Sequential"


# diffusers' models built of 2-D convolutions (ResNet blocks, a VAE's encoder and decoder)
_DIFFUSERS_CONV = {f"diffusers.{name}" for name in (
    "UNet2DModel", "UNet2DConditionModel", "AutoencoderKL", "AutoencoderTiny", "AsymmetricAutoencoderKL", "VQModel",
    "ControlNetModel")}


def _is_conv(qual: str | None) -> bool:
    if qual in _CONV2D or diffusers_model(qual) in _DIFFUSERS_CONV:
        return True
    return bool(qual) and qual.startswith("torchvision.models.") and not qual.startswith("torchvision.models.video.")


@dataclass(eq=False)
class _Model:
    """A model the training runs, and whether it has 2-D convolutions."""

    facts: ModuleFacts
    name: str  # the spelling of the variable that holds it ("model", "self.net")
    builds: tuple[cst.BaseStatement, ...]  # the statements that build it, one per branch
    site: cst.Call  # the (first) call that builds it, where reports point
    anchor: cst.BaseStatement  # convert after it: the model is built and initialised, training has not started
    label: str  # what it is, for reports ("Net", "nn.Sequential")
    conv: bool
    dropout: bool = False  # it applies element-wise dropout somewhere
    saved: str | None = None  # built by a library's loader from a saved config (``UNet2DModel.from_config``)
    converted: tuple[Status, str] | None = None  # the script (or autotune) already sets its memory format: why
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
            help="NHWC weights and inputs: faster convolution kernels on GPUs with tensor cores and on oneDNN CPUs. "
            "Floating-point reordering only, for models without element-wise dropout (those are left alone: in train "
            "mode dropout draws its mask in memory order, so other elements would be dropped)",
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
        for model_facts, call in self._untrained():
            if model_facts is facts:
                name = facts.code(facts.parent(call).targets[0].target)
                self.report(facts, call, Status.NOT_APPLICABLE, f"{name} is not trained in a training loop")
        for model in models:
            if model.facts is not facts:
                continue
            if not model.conv:
                self.report(facts, model.site, Status.NOT_APPLICABLE, f"{model.label} has no 2-D convolutions")
                continue
            if model.converted:
                self.report(facts, model.site, *model.converted)
                continue
            if model.dropout:
                self.report(facts, model.site, Status.NOT_APPLICABLE, f"{model.label} has dropout: {DROPOUT_REASON}")
                continue
            if model.saved:
                self.report(facts, model.site, Status.NOT_APPLICABLE, (
                    f"{model.saved} takes its dropout from a saved config, which is not read here; where it is on, "
                    f"{DROPOUT_REASON}"))
                continue
            self.report(facts, model.site, Status.APPLICABLE, f"{model.label} has 2-D convolutions")
            self._convert(edits, model.anchor, model.name, "to", after=True)
        self._inputs(facts, edits, regions, [m for m in models if m.conv and not m.dropout])

    # --- models ---------------------------------------------------------------------------------------------

    def _models(self, regions: list[Region]) -> list[_Model]:
        """The models the training runs (whichever branch of an if/elif builds them), converted where their
        training starts: after the script's own initialisation, which an in-place ``normal_()`` on a channels_last
        weight would fill in memory order (other weights, other losses)."""
        models: list[_Model] = []
        for trained in training(self.project).models():
            facts = trained.facts
            calls = [strip_module_chain(a.value) for a in trained.bindings]
            conv = [self._has_conv(facts, c, set()) for c in calls]
            labels = [self._label(facts, c) for c, has in zip(calls, conv) if has == any(conv)]
            builds = tuple(facts.statement_of(a) for a in trained.bindings)
            label = " or ".join(dict.fromkeys(labels))
            model = _Model(facts, trained.name, builds, calls[0], trained.point, label, any(conv))
            model.dropout = any(self._builds(facts, c, _spatial_dropout, set()) for c in calls)
            model.saved = next((f"{facts.code(c.func)}(...)" for c in calls if _saved_config(facts, c)), None)
            model.converted = self._converted(model)
            models.append(model)
        for model in models:
            for facts, owner in regions:
                for call in facts.calls_in(owner):
                    if facts.code(call.func) == model.name and (facts, call) not in model.inputs:
                        model.inputs.append((facts, call))
        return models

    def _label(self, facts: ModuleFacts, call: cst.Call) -> str:
        label = facts.code(call.func)
        return label if is_module_ctor(self.project, facts, call) else label + "()"  # a factory function

    def _untrained(self) -> list[tuple[ModuleFacts, cst.Call]]:
        """Convolutional models the entry script builds when nothing trains at all (a benchmark)."""
        if self.project.trains:
            return []
        facts = self.project.entry
        out = []
        for assign in facts.assigns:
            base = strip_module_chain(assign.value)
            if isinstance(base, cst.Call) and is_module_ctor(self.project, facts, base) and self._has_conv(facts, base, set()):
                out.append((facts, assign.value))
        return out

    def _has_conv(self, facts: ModuleFacts, node: cst.CSTNode, seen: set) -> bool:
        """Whether building ``node`` (a call, a class body, a function) creates a 2-D convolution."""
        return self._builds(facts, node, lambda f, call: _is_conv(f.qualname(call.func) or zoo_factory(f, call)), seen)

    def _builds(self, facts: ModuleFacts, node: cst.CSTNode, wanted, seen: set) -> bool:
        """Whether building ``node`` makes a call ``wanted(facts, call)`` accepts, through local classes (their
        bases too) and functions."""
        classes = local_classes(self.project)
        for call in facts.calls_in(node):
            qual = facts.qualname(call.func)
            if wanted(facts, call):
                return True
            if qual in classes and qual not in seen:
                seen.add(qual)
                cls_facts, cls = classes[qual]
                if self._builds(cls_facts, cls, wanted, seen):
                    return True
                for base in cls.bases:
                    base_qual = cls_facts.qualname(base.value)
                    if base_qual in classes and base_qual not in seen:
                        seen.add(base_qual)
                        if self._builds(*classes[base_qual], wanted, seen):
                            return True
                continue
            target = self.project.local_target(facts, call)
            if target is not None and target[1] not in seen:
                seen.add(target[1])
                if self._builds(target[0], target[1], wanted, seen):
                    return True
        return False

    def _converted(self, model: _Model) -> tuple[Status, str] | None:
        facts = model.facts  # a name is compared in its own file: `net` in another file is another model
        for call in facts.calls:
            if facts.is_runtime_call(call, "channels_last") and call.args:
                if facts.code(call.args[0].value) == model.name:
                    return Status.PRESENT, f"{model.name} is already channels_last"
            fmt = _memory_format(facts, call)
            if fmt is None:
                continue
            func = call.func
            if any(facts.contains(s, call) for s in (*model.builds, model.anchor)) or (
                isinstance(func, cst.Attribute) and facts.code(func.value) == model.name
            ):
                if fmt == "torch.channels_last":
                    return Status.PRESENT, f"{model.name} is already channels_last"
                return Status.USER, f"{model.name}: memory_format={fmt} is the script's choice"
        return None

    def _script_converts_batches(self) -> tuple[ModuleFacts, cst.Call] | None:
        """A tensor the script itself gives a memory format (in a collate function, a prefetcher, a transform)."""
        names = module_names(self.project)
        for facts in self.project.modules:
            for call in facts.calls:
                func = call.func
                if _memory_format(facts, call) is None or not isinstance(func, cst.Attribute):
                    continue
                if func.attr.value == "contiguous" or not is_module_expr(self.project, facts, func.value, names):
                    return facts, call
        return None

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
                own = self._script_converts_batches() if model.converted else None
                if own is not None:  # a model the script converts is fed the batches it converts
                    where = f"{own[0].display}:{own[0].position(own[1])[0]}"
                    self.report(facts, call, Status.USER, f"input {x}: the script sets the batches' memory format ({where})")
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


def _saved_config(facts: ModuleFacts, call: cst.Call) -> bool:
    """``UNet2DModel.from_pretrained(...)``/``from_config(...)``/``UNet2DModel(**config)``: a diffusers model whose
    settings, its dropout among them, come from a saved config."""
    qual = facts.qualname(call.func) or ""
    return diffusers_model(qual) is not None and (qual.rsplit(".", 1)[-1] in DIFFUSERS_LOADERS
                                                  or any(a.star == "**" for a in call.args))


def _spatial_dropout(facts: ModuleFacts, call: cst.Call) -> bool:
    """Whether ``call`` makes element-wise dropout that may see a 4-D activation: not one that comes after the
    flatten in an ``nn.Sequential`` or in its module's ``forward`` (a classifier head's dropout); a diffusers model
    given ``dropout=`` other than 0 (its resnet blocks drop element-wise)."""
    if diffusers_model(facts.qualname(call.func)) is not None:
        rate = keyword(call, "dropout")
        return rate is not None and not (isinstance(rate.value, (cst.Integer, cst.Float)) and float(rate.value.value) == 0)
    if facts.qualname(call.func) not in _DROPOUT:
        return False
    parent = facts.parent(facts.parent(call))  # Call <- Arg <- Call
    if isinstance(parent, cst.Call) and facts.qualname(parent.func) == SEQUENTIAL:
        before = [a.value for a in parent.args if facts._enter[a.value] < facts._enter[call]]
        return not any(isinstance(b, cst.Call) and facts.qualname(b.func) in _FLATTEN for b in before)
    fn = facts.function_of(call)
    cls = facts.class_of(call)
    if fn is not None and fn.name.value == "__init__" and cls is not None:
        assign = facts.parent(call)
        attr = self_attr(assign.targets[0].target) if isinstance(assign, cst.Assign) and len(assign.targets) == 1 else None
        forward = facts.method_named(cls, "forward")
        if attr is None or forward is None:
            return True
        uses = [c for c in facts.calls_in(forward) if self_attr(c.func) == attr]
        return not uses or any(not _after_flatten(facts, forward, u) for u in uses)
    return fn is None or not _after_flatten(facts, fn, call)


def _after_flatten(facts: ModuleFacts, fn: cst.FunctionDef, node: cst.CSTNode) -> bool:
    """Whether a flatten (``torch.flatten``, ``.view``, ``.reshape``, ``.flatten``) comes before ``node`` in ``fn``."""
    for call in facts.calls_in(fn):
        if facts._enter[call] >= facts._enter[node]:
            return False
        func = call.func
        if facts.qualname(func) in _FLATTEN or (isinstance(func, cst.Attribute) and func.attr.value in ("view", "reshape", "flatten")):
            return True
    return False


def _is_channels_last(facts: ModuleFacts, call: cst.Call) -> bool:
    return _memory_format(facts, call) is not None


def _memory_format(facts: ModuleFacts, call: cst.Call) -> str | None:
    """The memory format a call sets, as written: ``torch.channels_last``, or an expression the script chooses it
    with (``memory_format`` = a flag); None without one, or for the default formats."""
    arg = keyword(call, "memory_format")
    if arg is None:
        return None
    qual = facts.qualname(arg.value)
    if qual in ("torch.contiguous_format", "torch.preserve_format"):
        return None
    return qual if qual == "torch.channels_last" else " ".join(facts.code(arg.value).split())


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


# === runtime: what the patched script runs (python -m autotune.catalog copies it into autotune/runtime_helpers.py) ===

from autotune.knob_values import knob, took_effect


def channels_last(obj):
    """A module or 4-D tensor in channels_last memory format when the knob is on; anything else unchanged."""
    if not knob("channels_last.enabled", record=False):
        return obj
    import torch

    if isinstance(obj, torch.nn.Module):
        if any(p.dim() == 4 for p in obj.parameters()):  # a model without 4-D weights stays as it was
            took_effect("channels_last.enabled")
        return obj.to(memory_format=torch.channels_last)
    if isinstance(obj, torch.Tensor) and obj.dim() == 4:
        return obj.contiguous(memory_format=torch.channels_last)
    return obj
