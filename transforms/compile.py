"""compile: torch.compile the model in place (Module.compile: state_dict keys unchanged), whole or block by block, for
its training steps: where gradients are off (evaluation, sampling) it runs as written."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import cached_property

import libcst as cst

from autotune.analysis import ModuleFacts
from autotune.knobs import Knob, Numerics
from autotune.transform import Edits, Status, Transform
from autotune.syntax import is_setting, scope_of, stmt, unique_name

from ._model import ClassRef, block_paths, model_class, training, unpacked_index

# inductor's own random numbers give other dropout masks than eager (char_gpt: losses 1e-3 apart from step 1, 1e-7
# with this), so the loss gate could never accept compile on a model with dropout
EAGER_RNG_COMMENT = "# dropout masks drawn as without compile: same losses"
MODES = ("none", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass(frozen=True, eq=False)
class _Target:
    """A model the training uses, and where it exists to be compiled."""

    facts: ModuleFacts
    anchor: cst.BaseStatement  # the statement that builds it (compile after it), or the loop (compile before it)
    after: bool
    code: str  # how the scope spells it: ``model``
    cls: ClassRef | str | None
    blocks: tuple[str, ...]
    report_at: cst.CSTNode
    switch: str | None = None  # the script's own compile switch (``compile``, ``args.compile``): compiled where off


class Compile(Transform):
    """Compile the model with torch.compile in place (Module.compile), whole or one repeated block at a time."""

    name = "compile"
    knobs = (
        Knob(
            "compile.mode",
            MODES,
            "none",
            Numerics.REORDER,
            help="none: eager; otherwise torch.compile's mode (reduce-overhead and max-autotune use CUDA graphs "
            "on CUDA), for the training steps: under no_grad/inference_mode (evaluation, sampling) the model runs "
            "as written and compiles nothing for their shapes. The first steps pay for compilation: trials count "
            "them as warm-up",
            compiles=True,
        ),
        Knob(
            "compile.scope",
            ("model", "blocks"),
            "model",
            Numerics.REORDER,
            help="model: compile the whole model; blocks: compile each repeated block (regional compilation: "
            "one block's graph is compiled once and reused, so it compiles much faster)",
        ),
        Knob(
            "compile.dynamic",
            ("default", True, False),
            "default",
            Numerics.REORDER,
            help="default: torch decides (recompiles as dynamic when a shape changes); true: dynamic shapes from the "
            "start; false: specialise on every shape",
        ),
    )

    def apply(self, facts: ModuleFacts, edits: Edits) -> None:
        present = self._present
        for node, reason in present:
            if node[0] is facts:
                self.report(facts, node[1], Status.PRESENT, reason)
        if present:
            return
        switches = self._switches
        targets = switches or self._targets
        for where, call, name in self._plain:
            if where is facts:
                self.report(facts, call, Status.NOT_APPLICABLE, (
                    f"{facts.code(call.func)} is a {name}, a plain class of the script's (not an nn.Module): it has no "
                    "Module.compile to compile it in place"))
        eager_rng_set = False
        helper = None  # the name of compile_for_training in a baked file
        for target in targets:
            if target.facts is not facts:
                continue
            if target.switch is not None:
                self.report(facts, target.report_at, Status.APPLICABLE, (
                    f"if {target.switch}: {facts.code(target.report_at)}: the script's own switch (present, switched "
                    f"off where {target.switch} is false), which the compile knobs turn on there: "
                    f"{target.code} compiled in place for its training steps, state_dict keys unchanged"))
            else:
                self.report(facts, target.report_at, Status.APPLICABLE, self._reason(target))
            if self.mode.gated:
                code = self._gated_call(edits, target)
                new = [stmt(code)]
            else:
                if helper is None:
                    helper = unique_name(facts, facts.module, compile_for_training.__name__)
                new = self._baked(facts, target, helper)
                if new and not eager_rng_set:
                    edits.require_import("torch._inductor.config")
                    edits.after_imports(_helper_def(helper))
                    new.insert(0, stmt(f"torch._inductor.config.fallback_random = True  {EAGER_RNG_COMMENT}\n"))
                    eager_rng_set = True
            if target.after:
                edits.insert_after(target.anchor, *new)
            else:
                edits.insert_before(target.anchor, *new)
        if not targets:
            return
        if self.mode.gated:
            marker = f"{edits.runtime('compile_step_begin')}()\n" if any(l.module is facts for l in self.project.loops) else None
        else:
            mode = self.mode.value(self.knob("mode"))
            marker = "torch.compiler.cudagraph_mark_step_begin()\n" if mode in CUDAGRAPH_MODES and self.mode.device == "cuda" else None
            if marker is not None and facts.imports.get("torch") != "torch":
                edits.require_import("torch")
        if marker is None:
            return
        for loop in self.project.loops:
            if loop.module is not facts or not isinstance(loop.node.body, cst.IndentedBlock) or not loop.node.body.body:
                continue
            edits.insert_before(loop.node.body.body[0], stmt(marker))

    # --- what is there -----------------------------------------------------------------------------------

    @cached_property
    def _switches(self) -> list[_Target]:
        """``if compile: model = torch.compile(model)`` (or ``model.compile()``): the script's own switch, with the
        model a name. Where it is off, the knobs compile that model in place right after the ``if``."""
        out = []
        for facts in self.project.modules:
            for call in facts.calls:
                model = self._compiled_model(facts, call)
                switch = _switch_of(facts, call) if model is not None else None
                if switch is not None:
                    out.append(_Target(facts, switch, True, model, None, (), call, facts.code(switch.test)))
        return out

    def _compiled_model(self, facts: ModuleFacts, call: cst.Call) -> str | None:
        """``model`` of ``torch.compile(model)`` or ``model.compile()``, where ``model`` is a name."""
        func = call.func
        if facts.qualname(func) == "torch.compile" and call.args and call.args[0].keyword is None:
            arg = call.args[0].value
        elif isinstance(func, cst.Attribute) and func.attr.value == "compile" and not call.args:
            arg = func.value
        else:
            return None
        return arg.value if isinstance(arg, cst.Name) else None

    @cached_property
    def _present(self) -> list[tuple[tuple[ModuleFacts, cst.CSTNode], str]]:
        """torch.compile, Module.compile or autotune's compile_model already in the project (a script's own switch
        around one is not: see ``_switches``)."""
        out = []
        models = {t.code for t in self._targets}
        switched = {t.report_at for t in self._switches}
        for facts in self.project.modules:
            for call in facts.calls:
                func = call.func
                if call in switched:
                    continue
                if facts.is_runtime_call(call, "compile_model"):
                    out.append(((facts, call), "the model is already compiled behind the compile knobs"))
                elif facts.is_runtime_call(call, "compile_step_begin"):
                    continue
                elif facts.qualname(func) == "torch.compile":
                    out.append(((facts, call), self._torch_compile_reason(facts, call, models)))
                elif isinstance(func, cst.Attribute) and func.attr.value == "compile" and facts.code(func.value) in models:
                    out.append(((facts, call), f"{facts.code(func.value)}.compile() already compiles the model in place"))
        return out

    def _torch_compile_reason(self, facts: ModuleFacts, call: cst.Call, models: set[str]) -> str:
        arg = call.args[0].value if call.args and call.args[0].keyword is None else None
        if arg is None:
            return "torch.compile already used (as a decorator or with options)"
        code = facts.code(arg)
        built = model_class(self.project, facts, scope_of(facts, call), arg)
        if code in models or built is not None or self._is_module_expr(facts, arg):
            return (
                f"{code} is already compiled with torch.compile({code}), which returns a wrapper: its state_dict "
                f"keys gain an '_orig_mod.' prefix, so checkpoints it saves load only into compiled models "
                f"({code}.compile() compiles in place and keeps the keys)"
            )
        return f"torch.compile({code}) already compiles part of the training"

    def _is_module_expr(self, facts: ModuleFacts, node: cst.BaseExpression) -> bool:
        code = facts.code(node)
        return any(
            isinstance(c.func, cst.Attribute) and c.func.attr.value in ("parameters", "named_parameters") and f.code(c.func.value) == code
            for f in self.project.modules
            for c in f.calls
        )

    # --- finding the model -------------------------------------------------------------------------------

    @property
    def _targets(self) -> list[_Target]:
        return self._found[0]

    @cached_property
    def _found(self) -> tuple[list[_Target], list[tuple[ModuleFacts, cst.Call, str]]]:
        """The models to compile, and (where none is found) the calls of a plain class's instance trained instead."""
        out: list[_Target] = []
        seen: set[cst.CSTNode] = set()
        for model in training(self.project).models():
            if model.point in seen:
                continue
            seen.add(model.point)
            classes = [model_class(self.project, model.facts, model.scope, a.value,
                                   index=unpacked_index(model.facts, a, model.name)) for a in model.bindings]
            # one block path for every class the branches may build: blocks compiled whichever branch ran
            paths = [block_paths(self.project, cls) for cls in classes]
            blocks = tuple(p for p in paths[-1] if all(p in other for other in paths))
            cls = classes[-1] if len({id(c) if isinstance(c, ClassRef) else c for c in classes}) == 1 else None
            out.append(_Target(model.facts, model.point, True, model.name, cls, blocks, model.bindings[-1].value))
        if not out:
            return self._fallback()
        return out, []

    @property
    def _plain(self) -> list[tuple[ModuleFacts, cst.Call, str]]:
        """The training loop's calls of a model that is a plain class's instance, where no other model was found."""
        return self._found[1]

    def _fallback(self) -> tuple[list[_Target], list[tuple[ModuleFacts, cst.Call, str]]]:
        """A model that arrives as an argument (``def train(model, ...)``) with no caller in sight: compile before
        the loop that trains it; and the calls of a plain class's instance in its place, which compile cannot."""
        out: list[_Target] = []
        plain: list[tuple[ModuleFacts, cst.Call, str]] = []
        receivers = {
            f.code(c.func.value)
            for f in self.project.modules
            for c in f.calls
            if isinstance(c.func, cst.Attribute) and c.func.attr.value in ("parameters", "named_parameters", "train")
        }
        seen = set()
        for loop in self.project.loops:
            facts = loop.module
            for call in facts.calls_in(loop.node):
                code = facts.code(call.func)
                if isinstance(call.func, (cst.Name, cst.Attribute)) and code in receivers and (facts, code) not in seen:
                    seen.add((facts, code))
                    cls = model_class(self.project, facts, scope_of(facts, call), call.func)
                    if isinstance(cls, ClassRef) and not cls.node.bases:
                        # a from-scratch network (a plain class with __call__ and parameters()): no Module.compile
                        plain.append((facts, call, cls.name))
                        continue
                    anchor = facts.statement_of(loop.outer)
                    out.append(_Target(facts, anchor, False, code, None, (), call))
        return out, plain

    # --- rewriting ---------------------------------------------------------------------------------------

    def _reason(self, target: _Target) -> str:
        cls = target.cls.name if isinstance(target.cls, ClassRef) else (target.cls or "").rsplit(".", 1)[-1]
        what = f"{target.code} ({cls})" if cls else target.code
        blocks = f"; repeated blocks: {', '.join(target.blocks)}" if target.blocks else "; no repeated blocks found"
        return (f"{what}: Module.compile in place for the training steps (evaluation and sampling under no_grad run "
                f"as written), state_dict keys unchanged{blocks}")

    def _gated_call(self, edits: Edits, target: _Target) -> str:
        helper = edits.runtime("compile_model")
        if target.switch is not None:
            return f"{helper}({target.code}, switch={target.switch})\n"
        if target.blocks:
            paths = ", ".join(f'"{p}"' for p in target.blocks)
            return f"{helper}({target.code}, blocks=[{paths}])\n"
        return f"{helper}({target.code})\n"

    def _baked(self, facts: ModuleFacts, target: _Target, helper: str) -> list[cst.BaseStatement]:
        mode = self.mode.value(self.knob("mode"))
        if mode == "none":
            return []
        kwargs = [] if mode == "default" else [f'mode="{mode}"']
        dynamic = self.mode.value(self.knob("dynamic"))
        if dynamic != "default":
            kwargs.append(f"dynamic={bool(dynamic)}")
        args = "".join(f", {k}" for k in kwargs)
        if self.mode.value(self.knob("scope")) == "blocks" and target.blocks:
            scope = facts.function_of(target.anchor) or facts.module
            var = unique_name(facts, scope, "block", "layer")
            return [stmt(f"for {var} in {target.code}.{path}:\n    {helper}({var}{args})\n") for path in target.blocks]
        if target.switch is not None:  # where the script's own switch is off
            return [stmt(f"if not {target.switch}:\n    {helper}({target.code}{args})\n")]
        return [stmt(f"{helper}({target.code}{args})\n")]


def _helper_def(name: str) -> cst.BaseStatement:
    """The runtime's compile_for_training, word for word, as a function of the baked file named ``name``: the tuned
    script compiles as the trials did."""
    source = inspect.getsource(compile_for_training).replace(f"def {compile_for_training.__name__}(", f"def {name}(", 1)
    return cst.parse_statement(source).with_changes(leading_lines=[cst.EmptyLine(), cst.EmptyLine()])


def _switch_of(facts: ModuleFacts, call: cst.Call) -> cst.If | None:
    """The ``if <switch>:`` whose body holds ``call``'s statement, where the switch is a name or an attribute
    (``compile``, ``args.compile``, ``config.compile``, ``config["compile"]``) and the ``if`` has no ``else``."""
    at = facts.statement_of(call)
    for node in facts.ancestors(at):
        if isinstance(node, cst.If):
            body = node.body.body if isinstance(node.body, cst.IndentedBlock) else ()
            if at in body and node.orelse is None and is_setting(node.test):
                return node
            return None
        if isinstance(node, (cst.FunctionDef, cst.ClassDef, cst.For, cst.While, cst.With, cst.Try)):
            return None
    return None


# === runtime: what the patched script runs (python -m autotune.catalog copies it into autotune/runtime_helpers.py) ===

import time
from typing import Any
from autotune.knob_values import device_type, knob, took_effect


# the modes that record CUDA graphs: each step must tell them it begins, in the baked script as in the patched one
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")
_compile_spans: list[tuple[float, float]] = []
_compile_began: float | None = None
_compile_watched = False


def _compile_kwargs() -> dict[str, Any]:
    mode = knob("compile.mode", record=False)
    kwargs: dict[str, Any] = {} if mode == "default" else {"mode": mode}
    dynamic = knob("compile.dynamic")
    if dynamic != "default":
        kwargs["dynamic"] = bool(dynamic)
    return kwargs


def compile_model(model: Any, blocks: Any = (), switch: Any = False) -> Any:
    """Compile ``model`` in place as the knobs ask: nothing by default, nor where the script's own ``switch`` is on
    (it compiled the model itself).

    Module.compile() compiles in place, so ``model`` stays the same object and its state_dict keys never gain
    the ``_orig_mod.`` prefix that ``model = torch.compile(model)`` adds. With ``compile.scope: blocks`` each
    module of the containers at the attribute paths ``blocks`` (``["transformer.h"]``) is compiled instead;
    without such containers the whole model is.
    """
    if switch or knob("compile.mode", record=False) == "none" or getattr(model, "_autotune_compiled", False):
        return model
    import torch._inductor.config

    inner = model
    if type(model).__name__ == "_FabricModule" and type(model).__module__.startswith("lightning"):
        # a model Fabric set up: its wrapper hands every attribute to the module it wraps, so compiling the
        # wrapper in place recurses; the module it runs (the model, or DDP around it) is compiled instead
        inner = model._forward_module
    if isinstance(inner, (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)):
        # the wrapped model is compiled: DDP runs it as it is; DataParallel runs it itself on one device, but
        # its replicas on several would call the original's compiled forward on another device's inputs
        if isinstance(inner, torch.nn.DataParallel) and len(inner.device_ids or ()) > 1:
            return model
        inner = inner.module
    kwargs = _compile_kwargs()
    # eager's random numbers: inductor's own give other dropout masks, and the losses could not be compared
    torch._inductor.config.fallback_random = True
    _watch_compile_time()
    targets: list[Any] = []
    if knob("compile.scope", record=False) == "blocks":
        for path in blocks:
            targets.extend(inner.get_submodule(path))
    for module in targets or [inner]:
        compile_for_training(module, **kwargs)
    took_effect("compile.mode", *(("compile.scope",) if targets else ()))
    model._autotune_compiled = True  # a plain attribute: not a parameter, buffer or state_dict entry
    return model


def compile_for_training(module, **options):
    """Module.compile for the training steps only: the module runs compiled where gradients are on, and as written
    under torch.no_grad() or torch.inference_mode() (evaluation, sampling), so their other shapes and modes compile
    nothing. state_dict keys are unchanged; a copy (copy.deepcopy) or a pickled module runs uncompiled."""
    from torch import is_grad_enabled

    module.compile(**options)
    compiled, eager = module._compiled_call_impl, module._call_impl  # what Module.compile set, and the plain call

    def call(*args, **kwargs):
        return (compiled if is_grad_enabled() else eager)(*args, **kwargs)

    module._compiled_call_impl = call


def compile_step_begin() -> None:
    """At the start of each training step: tell CUDA graphs a new step begins (modes that use them, on CUDA)."""
    if knob("compile.mode") in CUDAGRAPH_MODES and device_type() == "cuda":
        import torch

        torch.compiler.cudagraph_mark_step_begin()


def _watch_compile_time() -> None:
    """Record the wall time torch spends compiling (tracing, lazy backward compilation, CUDA graph recording)."""
    global _compile_watched
    if _compile_watched:
        return
    _compile_watched = True
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:  # pragma: no cover - a torch without compile callbacks: compile time stays unknown
        return

    def began(_args: Any) -> None:
        global _compile_began
        _compile_began = time.perf_counter()

    def ended(_args: Any) -> None:
        if _compile_began is not None:
            _compile_spans.append((_compile_began, time.perf_counter()))

    callback_handler.register_start_callback(began)
    callback_handler.register_end_callback(ended)


def compile_seconds(since: float | None = None) -> float | None:
    """Seconds spent compiling (only the part after ``since``, a perf_counter time, when given); None when
    nothing was compiled through ``compile_model``."""
    if not _compile_watched:
        return None
    lower = float("-inf") if since is None else since
    return sum(max(0.0, end - max(start, lower)) for start, end in _compile_spans)
