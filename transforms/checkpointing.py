"""checkpointing: recompute the activations of repeated blocks in backward instead of keeping them (less memory)."""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from autotune.analysis import ModuleFacts
from autotune.knobs import Knob, Numerics, Role
from autotune.transform import Edits, Status, Transform
from autotune.syntax import (argument, attr_chain, expr, is_name, names_read, names_variable, positional, short, stmt,
                             unique_name)

from ._sites import diffusers_model
from ._model import SEQUENTIAL, ClassRef, Stack, attr_stack, find_class, is_block_class

EVERY = {"none": 0, "all": 1, "every_2nd": 2}
# Modules whose forward in training mode changes their state: recomputing them in backward would update their
# running statistics a second time (torch.utils.checkpoint does not undo it).
STATEFUL = {
    f"torch.nn.{n}"
    for n in ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm", "LazyBatchNorm1d", "LazyBatchNorm2d", "LazyBatchNorm3d")
}


# the libraries whose models carry their own activation-checkpointing switch, and its call
SWITCHES = {"transformers": "gradient_checkpointing_enable", "timm": "set_grad_checkpointing",
            "diffusers": "enable_gradient_checkpointing"}
SWITCH_ARGS = {"gradient_checkpointing_enable": 'gradient_checkpointing_kwargs={"use_reentrant": False}',
               "set_grad_checkpointing": "True",
               "enable_gradient_checkpointing": ""}  # diffusers checkpoints with use_reentrant=False itself
# the switches that turn it off again
SWITCHES_OFF = ("gradient_checkpointing_disable", "disable_gradient_checkpointing")
_TIMM_FACTORIES = {"timm.create_model", "timm.models.create_model"}


def _library_model(facts: ModuleFacts, value: cst.BaseExpression) -> str | None:
    """The library a model comes from: ``transformers.<Class>.from_pretrained(...)``, a transformers model class
    called with its config, or ``timm.create_model(...)``."""
    if not isinstance(value, cst.Call):
        return None
    qual = facts.qualname(value.func) or ""
    if qual in _TIMM_FACTORIES:
        return "timm"
    if diffusers_model(qual) is not None:
        return "diffusers"
    if qual.startswith("transformers.") and qual.endswith((".from_pretrained", ".from_config")):
        cls = qual.rsplit(".", 2)[-2]
        # a model class: AutoModel..., GPT2LMHeadModel, BertForSequenceClassification; not AutoTokenizer/AutoConfig
        return "transformers" if "Model" in cls or "For" in cls else None
    if qual.startswith("transformers.") and qual.count(".") == 1:
        # a model class built from its config (``GPT2LMHeadModel(config)``); the Auto classes cannot be built so
        cls = qual.split(".")[1]
        model = cls.endswith("Model") or "For" in cls and cls[cls.index("For") + 3:][:1].isupper()
        return "transformers" if model and not cls.startswith("Auto") else None
    return None


def _is_switch_call(call: cst.Call, name: str) -> bool:
    """``model.gradient_checkpointing_enable(...)`` / ``model.set_grad_checkpointing(...)`` (or its disabling twin)."""
    func = call.func
    return (
        isinstance(func, cst.Attribute)
        and is_name(func.value, name)
        and func.attr.value in (*SWITCHES.values(), *SWITCHES_OFF)
    )


def _bindings(facts: ModuleFacts, assign: cst.Assign, name: str) -> list[cst.Assign]:
    """The assignments of a library model to ``name`` in ``assign``'s scope (``model = other`` as opposed to
    ``model.to(...)``)."""
    scope = facts.function_of(assign) or facts.module
    return [a for a in facts.nodes_in(scope, cst.Assign)
            if any(is_name(t.target, name) for t in a.targets) and _library_model(facts, a.value) is not None]


def _branches(facts: ModuleFacts, found: list[cst.Assign]) -> cst.If | None:
    """The ``if``/``else`` whose two branches each bind the name to a model of one library, once, directly in the
    branch (diffusers' ``UNet2DModel(...)`` from arguments, else ``UNet2DModel.from_config(...)``), where ``found``,
    the scope's bindings of the name, are those two: the model is whichever branch ran, built once either way."""
    if len(found) != 2 or len({_library_model(facts, a.value) for a in found}) != 1:
        return None
    first, second = (facts.statement_of(a) for a in found)
    branch = facts.parent(facts.parent(first))  # statement <- IndentedBlock <- If
    if not (isinstance(branch, cst.If) and isinstance(branch.orelse, cst.Else) and first in branch.body.body
            and second in branch.orelse.body.body):
        return None
    return branch


# what a model only read for its weights or settings is used for: it is never run, so never trained
WEIGHTS_ONLY = frozenset({"state_dict", "config", "eval", "named_buffers", "buffers"})


def _weights_only(facts: ModuleFacts, assign: cst.Assign, name: str) -> str | None:
    """``model_hf.state_dict()``, where that is every use of ``name`` in its scope after ``assign`` (nanoGPT's
    ``from_pretrained``, which copies a transformers model's weights into its own): the first such use; else None."""
    scope = facts.function_of(assign) or facts.module
    target = assign.targets[0].target
    uses = [n for n in facts.nodes_in(scope, cst.Name)
            if n.value == name and n is not target and names_variable(facts, n)]
    reads = []
    for use in uses:
        parent = facts.parent(use)
        if isinstance(parent, (cst.Del, cst.AssignTarget)):
            continue  # ``del load_model`` once its weights are copied (diffusers' load_model_hook), or bound again
        if not (isinstance(parent, cst.Attribute) and parent.value is use and parent.attr.value in WEIGHTS_ONLY):
            return None
        reads.append(parent)
    return facts.code(reads[0]) if reads else None


# a function decorated with one of these runs without autograd: a model it builds and runs is evaluated, not trained
NO_GRAD = frozenset({"torch.no_grad", "torch.inference_mode", "torch.autograd.no_grad",
                     "torch.autograd.grad_mode.no_grad", "torch.autograd.grad_mode.inference_mode"})


def _built_without_grad(facts: ModuleFacts, assign: cst.Assign) -> str | None:
    """``@torch.no_grad()`` (or ``inference_mode``) on the function that builds the model, a stand-alone evaluator
    (build-nanogpt's HellaSwag ``evaluate()``): the function's name and its decorator as written; else None."""
    function = facts.function_of(assign)
    for decorator in function.decorators if function is not None else ():
        called = decorator.decorator
        func = called.func if isinstance(called, cst.Call) else called
        if facts.qualname(func) in NO_GRAD:
            return f"{function.name.value}(), which runs under @{facts.code(called)}"
    return None


@dataclass(frozen=True)
class _Site:
    """A place that runs repeated blocks one after the other."""

    node: cst.CSTNode  # the For loop, or the call of the Sequential
    container: cst.BaseExpression  # ``self.blocks``
    stack: Stack
    status: Status
    reason: str
    var: str | None = None  # the loop variable holding each block
    index: str | None = None  # the loop's enumerate() index, if any
    start: cst.BaseExpression | None = None  # enumerate's start, if any


class Checkpointing(Transform):
    """Run each repeated block (transformer layers, residual blocks) under torch.utils.checkpoint while training."""

    name = "checkpointing"
    knobs = (
        Knob(
            "checkpointing.blocks",
            tuple(EVERY),
            "none",
            Numerics.EXACT,
            role=Role.MEMORY_SAVER, on="all",
            help="none: keep all activations; all / every_2nd: recompute each block's (every other block's) "
            "activations in backward (use_reentrant=False, RNG state preserved: same losses, less memory, "
            "more compute)",
        ),
        Knob(
            "checkpointing.framework",
            (False, True),
            False,
            Numerics.EXACT,
            role=Role.MEMORY_SAVER, on=True,
            help="turn on the model library's own activation checkpointing: model.gradient_checkpointing_enable() "
            "(transformers, use_reentrant=False), model.set_grad_checkpointing() (timm) or "
            "model.enable_gradient_checkpointing() (diffusers, 0.32 or later for UNet2DModel)",
        ),
    )
    tracks_settings = True

    def apply(self, facts: ModuleFacts, edits: Edits) -> None:
        for site in self.sites_in(facts):
            self.report(facts, site.node, site.status, site.reason)
            if site.status is not Status.APPLICABLE:
                continue
            self.settings_read.add("blocks")
            if self.mode.gated:
                self._gate(facts, edits, site)
            else:
                self._bake(facts, edits, site)
        self._switches(facts, edits)

    # --- the model library's own switch ------------------------------------------------------------------

    def _switches(self, facts: ModuleFacts, edits: Edits) -> None:
        """``model = AutoModel...from_pretrained(...)`` / ``timm.create_model(...)``: the library checkpoints its
        own blocks, which autotune cannot see, when its switch is called."""
        for assign in facts.assigns:
            library = _library_model(facts, assign.value)
            if library is None or len(assign.targets) != 1 or not is_name(assign.targets[0].target):
                continue
            name = assign.targets[0].target.value  # type: ignore[attr-defined]
            bound = _bindings(facts, assign, name)
            branches = _branches(facts, bound)
            if branches is not None and assign is not bound[0]:
                continue  # the else branch's model: one site, at the first branch's, switched after the if/else
            method = SWITCHES[library]
            made = f"{name} = {short(facts, assign.value)}"
            own = next((c for c in facts.calls if _is_switch_call(c, name)), None)
            gated = any(
                facts.is_runtime_call(c, "checkpoint_switch") and c.args and is_name(c.args[0].value, name) for c in facts.calls
            )
            if gated:
                self.settings_read.add("framework")
                self.report(facts, assign, Status.PRESENT, f"{name}.{method}() is already behind the checkpointing.framework knob")
            elif own is not None:
                self.report(facts, assign, Status.USER, f"the script calls {facts.code(own.func)}() itself")
            elif not self.project.loops and any(f.framework.hugging_face
                                                for f in self.project.tuned_frameworks()):
                self.report(facts, assign, Status.NOT_APPLICABLE, "the Trainer's own gradient_checkpointing setting "
                            "is the knob here (hf_trainer.gradient_checkpointing)")
            elif not self.project.loops:
                self.report(facts, assign, Status.NOT_APPLICABLE, "no training loop in this script")
            elif len(bound) > 1 and branches is None:  # another model bound to the name in the same scope
                self.report(facts, assign, Status.NOT_APPLICABLE, f"`{name}` is bound more than once: which model trains is unclear")
            elif (read := _weights_only(facts, assign, name)) is not None:
                self.report(facts, assign, Status.NOT_APPLICABLE,
                            f"{made} is only read ({read}): the script never runs it, so nothing of it trains")
            elif (evaluator := _built_without_grad(facts, assign)) is not None:
                self.report(facts, assign, Status.NOT_APPLICABLE,
                            f"{made} is built and run in {evaluator}: nothing of it trains")
            else:
                either = " (or the else branch's, switched after the if/else)" if branches is not None else ""
                self.report(
                    facts, assign, Status.APPLICABLE,
                    f"{made}{either} is a {library} model: its own switch, {name}.{method}(), becomes a knob",
                )
                self.settings_read.add("framework")
                stmt_node = branches if branches is not None else facts.statement_of(assign)
                if self.mode.gated:
                    helper = edits.runtime("checkpoint_switch")
                    edits.insert_after(stmt_node, stmt(f'{helper}({name}, "{method}")\n'))
                elif self.mode.value(self.knob("framework")):
                    edits.insert_after(stmt_node, stmt(f"{name}.{method}({SWITCH_ARGS[method]})\n"))

    # --- finding blocks ----------------------------------------------------------------------------------

    def sites_in(self, facts: ModuleFacts, depth: int = 0) -> list[_Site]:
        out = []
        for loop in facts.loops:
            if isinstance(loop, cst.For):
                site = self._loop(facts, loop, depth)
                if site is not None:
                    out.append(site)
        for call in facts.calls:
            site = self._sequential_call(facts, call, depth)
            if site is not None:
                out.append(site)
        return sorted(out, key=lambda s: facts._enter[s.node])

    def _container(self, facts: ModuleFacts, node: cst.BaseExpression) -> tuple[ClassRef, Stack] | None:
        chain = attr_chain(node)
        cls = facts.class_of(node) if chain is not None else None
        if cls is None:
            return None
        ref = ClassRef(facts, cls)
        stack = attr_stack(ref, chain)
        return (ref, stack) if stack is not None else None

    def _loop(self, facts: ModuleFacts, loop: cst.For, depth: int) -> _Site | None:
        """``for block in self.blocks: x = block(x)`` (also through ``enumerate``)."""
        iterable, index, start = loop.iter, None, None
        target = loop.target
        if isinstance(iterable, cst.Call) and is_name(iterable.func, "enumerate") and positional(iterable):
            if not (isinstance(target, cst.Tuple) and len(target.elements) == 2 and is_name(target.elements[0].value)):
                return None
            index, target = target.elements[0].value.value, target.elements[1].value
            start = argument(iterable, 1, "start")
            iterable = positional(iterable)[0]
        if facts.is_runtime_call(iterable, "checkpoint_blocks") and iterable.args:
            found = self._container(facts, iterable.args[0].value)
            if found is not None:
                return _Site(loop, iterable.args[0].value, found[1], Status.PRESENT, "blocks already behind the checkpointing.blocks knob")
            return None
        found = self._container(facts, iterable)
        if found is None or not is_name(target):
            return None
        ref, stack = found
        var = target.value
        reads = [n for n in names_read(facts, loop.body) if n.value == var]
        calls = [n for n in reads if isinstance(facts.parent(n), cst.Call) and facts.parent(n).func is n]
        if not calls:
            return None  # the loop does not run the blocks
        where = facts.code(iterable)

        def site(status: Status, reason: str) -> _Site:
            return _Site(loop, iterable, stack, status, reason, var, index, start)

        if self._checkpointed(facts, loop.body):
            return site(Status.PRESENT, f"the blocks of {where} already run under torch.utils.checkpoint")
        problem = self._elements(stack, where, depth)
        if problem is not None:
            return site(Status.NOT_APPLICABLE, problem)
        if len(calls) != len(reads):
            other = next(n for n in reads if n not in calls)
            return site(
                Status.NOT_APPLICABLE,
                f"the loop over {where} also uses `{var}` itself ({short(facts, facts.parent(other))}), not only calls it",
            )
        return site(Status.APPLICABLE, f"{stack.short_kind} of {_elem(stack)} blocks run in a loop over {where}")

    def _sequential_call(self, facts: ModuleFacts, call: cst.Call, depth: int) -> _Site | None:
        """``x = self.blocks(x)`` for an nn.Sequential of blocks."""
        if facts.is_runtime_call(call, "checkpoint_sequential") and call.args:
            found = self._container(facts, call.args[0].value)
            if found is not None:
                return _Site(call, call.args[0].value, found[1], Status.PRESENT, "blocks already behind the checkpointing.blocks knob")
            return None
        found = self._container(facts, call.func)
        if found is None or found[1].kind != SEQUENTIAL:
            return None
        _, stack = found
        where = facts.code(call.func)
        if stack.element is None or not is_block_class(self.project, stack.element):
            return None  # a Sequential of layers (Linear, ReLU, ...): an ordinary module, not a stack of blocks
        problem = self._elements(stack, where, depth)
        if problem is not None:
            return _Site(call, call.func, stack, Status.NOT_APPLICABLE, problem)
        parent = facts.parent(call)
        if (
            len(call.args) != 1
            or call.args[0].keyword is not None
            or call.args[0].star
            or not isinstance(parent, cst.Assign)
            or len(parent.targets) != 1
            or not is_name(parent.targets[0].target)
        ):
            return _Site(
                call, call.func, stack, Status.NOT_APPLICABLE, f"{where}(...) is not called as `x = {where}(x)`"
            )
        return _Site(call, call.func, stack, Status.APPLICABLE, f"nn.Sequential of {_elem(stack)} blocks called as {where}(...)")

    def _elements(self, stack: Stack, where: str, depth: int) -> str | None:
        """Why the elements of a container are not blocks worth checkpointing one by one; None when they are."""
        if stack.element is None:
            return f"the elements of {where} differ or cannot be seen (build it from one block class)"
        if not is_block_class(self.project, stack.element):
            return f"{where} holds {stack.element.rsplit('.', 1)[-1]} layers, not blocks: too little to recompute"
        inner = find_class(self.project, stack.element)
        stateful = self._stateful_calls(stack.facts, stack.calls) if stack.facts is not None else None
        if stateful is not None:
            return (
                f"each {_elem(stack)} holds {stateful}, whose running statistics would be updated a second time "
                "when the block is recomputed in backward"
            )
        if inner is not None and depth < 3 and self._runs_blocks(inner, depth + 1):
            return (
                f"each {inner.name} runs repeated blocks of its own, which are checkpointed instead "
                "(checkpointing both levels would recompute twice)"
            )
        return None

    def _stateful_calls(self, facts: ModuleFacts, calls, depth: int = 0, seen=None) -> str | None:
        """The first module that keeps running statistics among what ``calls`` build: the calls themselves, their
        arguments (``nn.Sequential(nn.BatchNorm1d(...))``) and the local classes they instantiate."""
        seen = set() if seen is None else seen
        for outer in calls:
            for call in facts.calls_in(outer):
                qual = facts.qualname(call.func)
                if qual in STATEFUL:
                    return qual.rsplit(".", 1)[-1]
                inner = find_class(self.project, qual)
                if inner is not None and inner.node not in seen and depth < 3:
                    seen.add(inner.node)
                    found = self._stateful_calls(inner.facts, [inner.node], depth + 1, seen)
                    if found is not None:
                        return found
        return None

    def _runs_blocks(self, ref: ClassRef, depth: int) -> bool:
        """Whether a class's methods loop over repeated blocks of their own (checkpointed or not)."""
        return any(
            ref.facts.class_of(s.node) is ref.node and s.status in (Status.APPLICABLE, Status.PRESENT)
            for s in self.sites_in(ref.facts, depth)
        )

    def _checkpointed(self, facts: ModuleFacts, node: cst.CSTNode) -> bool:
        return any((facts.qualname(c.func) or "").startswith("torch.utils.checkpoint.") for c in facts.calls_in(node))

    # --- rewriting ---------------------------------------------------------------------------------------

    def _gate(self, facts: ModuleFacts, edits: Edits, site: _Site) -> None:
        if isinstance(site.node, cst.For):
            helper = edits.runtime("checkpoint_blocks")
            edits.rewrite(site.container, lambda node: cst.Call(func=expr(helper), args=[cst.Arg(node)]))
        else:
            helper = edits.runtime("checkpoint_sequential")
            edits.rewrite(
                site.node,
                lambda node: node.with_changes(
                    func=expr(helper),
                    args=[cst.Arg(node.func, comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))), *node.args],
                ),
            )

    def _checkpoint_fn(self, facts: ModuleFacts, edits: Edits) -> str:
        for alias, qual in facts.imports.items():
            if qual == "torch.utils.checkpoint.checkpoint":
                return alias
        if ("torch.utils.checkpoint", 0) not in facts.imported_modules:
            edits.require_import("torch.utils.checkpoint")
        return "torch.utils.checkpoint.checkpoint"

    def _bake(self, facts: ModuleFacts, edits: Edits, site: _Site) -> None:
        every = EVERY[self.mode.value(self.knobs[0])]
        fn = self._checkpoint_fn(facts, edits)
        if isinstance(site.node, cst.For):
            self._bake_loop(facts, edits, site, every, fn)
        else:
            self._bake_sequential(facts, edits, site, every, fn)

    def _bake_loop(self, facts: ModuleFacts, edits: Edits, site: _Site, every: int, fn: str) -> None:
        loop = site.node
        assert isinstance(loop, cst.For) and site.var is not None
        index = site.index
        if every > 1 and index is None:
            index = unique_name(facts, facts.function_of(loop) or facts.module, "i", "block_index")
            edits.rewrite(
                loop,
                lambda node: node.with_changes(
                    target=cst.Tuple(
                        [cst.Element(cst.Name(index), comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))), cst.Element(node.target)],
                        lpar=[],
                        rpar=[],
                    ),
                    iter=cst.Call(func=cst.Name("enumerate"), args=[cst.Arg(node.iter)]),
                ),
            )
        position = index if site.start is None else f"({index} - {facts.code(site.start)})"
        cond = f"{site.var}.training and torch.is_grad_enabled()"
        if every > 1:
            cond = f"{position} % {every} == 0 and {cond}"
        text = cst.Module([]).code_for_node

        def checkpointed(node: cst.Call) -> cst.BaseExpression:
            return expr(f"{fn}({', '.join([text(node.func), *(_arg_code(text, a) for a in node.args), 'use_reentrant=False'])})")

        for name in names_read(facts, loop.body):
            call = facts.parent(name)
            if name.value != site.var or not (isinstance(call, cst.Call) and call.func is name):
                continue
            parent = facts.parent(call)
            line = facts.statement_of(call)
            if (
                isinstance(parent, cst.Assign)
                and parent.value is call
                and isinstance(line, cst.SimpleStatementLine)
                and len(line.body) == 1
                and line.body[0] is parent
            ):
                # ``x = block(x)`` -> ``if <training>: x = checkpoint(block, x) else: x = block(x)``

                def as_if(node: cst.SimpleStatementLine) -> cst.BaseStatement:
                    assign = node.body[0]
                    fast = node.with_changes(body=[assign.with_changes(value=checkpointed(assign.value))], leading_lines=[])
                    return cst.If(
                        test=expr(cond),
                        body=cst.IndentedBlock([fast]),
                        orelse=cst.Else(cst.IndentedBlock([node.with_changes(leading_lines=[])])),
                        leading_lines=node.leading_lines,
                    )

                edits.rewrite(line, as_if)
            else:
                edits.rewrite(call, lambda node: expr(f"({text(checkpointed(node))} if {cond} else {text(node)})"))

    def _bake_sequential(self, facts: ModuleFacts, edits: Edits, site: _Site, every: int, fn: str) -> None:
        call = site.node
        assert isinstance(call, cst.Call)
        line = facts.statement_of(call)
        scope = facts.function_of(call) or facts.module
        target = facts.code(facts.parent(call).targets[0].target)
        seq = facts.code(call.func)
        arg = facts.code(call.args[0].value)
        block = unique_name(facts, scope, "block", "layer")
        step = f"{target} = {fn}({block}, {target}, use_reentrant=False)"
        if every > 1:
            index = unique_name(facts, scope, "i", "block_index")
            head = f"for {index}, {block} in enumerate({seq}):"
            step = f"{step} if {index} % {every} == 0 else {block}({target})"
        else:
            head = f"for {block} in {seq}:"
        first = "" if target == arg else f"    {target} = {arg}\n"
        original = cst.Module([]).code_for_node(line.with_changes(leading_lines=[])).strip()
        code = (
            f"if {seq}.training and torch.is_grad_enabled():\n{first}    {head}\n        {step}\n"
            f"else:\n    {original}\n"
        )
        new = stmt(code).with_changes(leading_lines=line.leading_lines)
        edits.rewrite(line, lambda node: new)


def _arg_code(text, arg: cst.Arg) -> str:
    """One argument as written: ``x``, ``attn_mask=mask``, ``*args``, ``**kwargs``."""
    if arg.keyword is not None:
        return f"{arg.keyword.value}={text(arg.value)}"
    return f"{arg.star}{text(arg.value)}"


def _elem(stack: Stack) -> str:
    return (stack.element or "?").rsplit(".", 1)[-1]


# === runtime: what the patched script runs (python -m autotune.catalog copies it into autotune/runtime_helpers.py) ===

from typing import Any
from autotune.knob_values import knob, took_effect


_CHECKPOINT_EVERY = {"none": 0, "all": 1, "every_2nd": 2}


def _checkpoint_every() -> int:
    return _CHECKPOINT_EVERY[knob("checkpointing.blocks")]


class _Checkpointed:
    """A block that runs under activation checkpointing while training with gradients, and plainly otherwise."""

    __slots__ = ("block",)

    def __init__(self, block: Any) -> None:
        self.block = block

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import torch

        if self.block.training and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            return checkpoint(self.block, *args, use_reentrant=False, **kwargs)
        return self.block(*args, **kwargs)


def checkpoint_blocks(blocks: Any) -> Any:
    """The blocks a loop runs: themselves by default, else every (or every other) one checkpointed."""
    every = _checkpoint_every()
    if not every:
        return blocks
    return [_Checkpointed(b) if i % every == 0 else b for i, b in enumerate(blocks)]


def checkpoint_sequential(seq: Any, x: Any) -> Any:
    """``seq(x)`` for an nn.Sequential of blocks, its blocks checkpointed as ``checkpoint_blocks`` does."""
    every = _checkpoint_every()
    if not every:
        return seq(x)
    for i, block in enumerate(seq):
        x = _Checkpointed(block)(x) if i % every == 0 else block(x)
    return x


def checkpoint_switch(model: Any, method: str) -> None:
    """Call the model library's own activation-checkpointing switch ``method`` when the knob is on."""
    if not knob("checkpointing.framework", record=False):
        return
    if False in (getattr(model, "supports_gradient_checkpointing", True),  # transformers
                 getattr(model, "_supports_gradient_checkpointing", True)):  # diffusers
        return  # a model class without it (diffusers' UNet2DModel before 0.32): the knob changes nothing
    took_effect("checkpointing.framework")
    if method == "gradient_checkpointing_enable":
        try:  # non-reentrant, as autotune checkpoints blocks itself
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        except TypeError:  # transformers before 4.35 takes no arguments
            model.gradient_checkpointing_enable()
    elif method == "enable_gradient_checkpointing":  # diffusers: non-reentrant already
        model.enable_gradient_checkpointing()
    else:
        getattr(model, method)(True)
