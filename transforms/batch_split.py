"""batch_split: the same samples per optimizer step in fewer, bigger micro-batches, where the script accumulates
gradients over the batches of its DataLoader (``if (i + 1) % accum == 0: optimizer.step()``)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import libcst as cst

from autotune.analysis import ModuleFacts
from autotune.bound import unbound
from autotune.knobs import Knob, Numerics, Role
from autotune.project import TrainingLoop
from autotune.syntax import (
    argument, assignments, enclosing_if, is_assigned, is_literal, is_reference, names_variable, scope_of, stmt, walk,
)
from autotune.transform import Edits, Status, Transform
from autotune.transforms._step import CLIP
from autotune.transforms.accelerator import ACCELERATORS
from autotune.transforms.checkpointing import STATEFUL
from autotune.transforms.dataloader import DATALOADERS
from autotune.transforms.lightning_trainer import TRAINERS

# layers whose training depends on which samples share a micro-batch, or on the order of random draws per layer
BATCH_NORMS = STATEFUL | {"torch.nn.functional.batch_norm"}
DROPOUTS = {
    "torch.nn.Dropout", "torch.nn.Dropout1d", "torch.nn.Dropout2d", "torch.nn.Dropout3d", "torch.nn.AlphaDropout",
    "torch.nn.functional.dropout", "torch.nn.functional.dropout1d", "torch.nn.functional.dropout2d",
    "torch.nn.functional.dropout3d", "torch.nn.functional.alpha_dropout",
}  # fmt: skip
# torch layers with dropout built in (a ``dropout=`` argument, on by default for the transformer layers)
DROPOUT_KEYWORD = {
    "torch.nn.TransformerEncoderLayer": 0.1, "torch.nn.TransformerDecoderLayer": 0.1, "torch.nn.Transformer": 0.1,
    "torch.nn.MultiheadAttention": 0.0, "torch.nn.LSTM": 0.0, "torch.nn.GRU": 0.0, "torch.nn.RNN": 0.0,
}  # fmt: skip



@dataclass(frozen=True)
class _Split:
    micro: str  # how the script spells the micro-batch size: ``args.batch_size``
    accumulation: str  # and the accumulation steps: ``args.accum``
    after: cst.BaseStatement  # both are bound (once) by here, and not yet read
    first: bool = False  # both are parameters of the function: the split goes before ``after``, its first statement
    note: str = ""  # what else the split changes (when the script logs), for the report


class BatchSplit(Transform):
    """Split each optimizer step's samples into fewer, bigger micro-batches where the script accumulates gradients
    over its DataLoader's batches: the micro-batch size times k, the accumulation steps divided by k."""

    name = "batch_split"
    knobs = (
        Knob(
            "batch_split.factor",
            (1, 2, 4, 8, 16, 0.5, 0.25),
            1,
            Numerics.REORDER,
            role=Role.SPLIT,
            help="the micro-batch size times this, the accumulation steps divided by it: the same samples in the "
            "same order in each optimizer step, the loss still their mean (only where it divides exactly; 0.5 and "
            "0.25 halve or quarter the micro-batch, for memory: the search tries them only where a configuration "
            "at the script's own micro-batch ran out of memory; where an epoch's samples do not fill its last "
            "bigger micro-batch, that shorter micro-batch counts as one whole micro-batch in the loss's division, as "
            "the script counts its own, so the last step of such an epoch alone can differ)",
        ),
    )

    def apply(self, facts: ModuleFacts, edits: Edits) -> None:
        found_at = [(loop.node, self._split(facts, loop)) for loop in self.project.loops if loop.module is facts]
        for call in facts.calls:
            if self.project.derives(facts, call.func, TRAINERS):
                found_at.append((call, self._lightning_split(facts, call)))
            elif self.project.derives(facts, call.func, ACCELERATORS):
                found_at.append((call, self._accelerate_split(facts, call)))
        for at, found in found_at:
            if found is None:
                continue
            if isinstance(found, tuple):
                node, reason = found
                status = Status.PRESENT if reason.startswith("the batch split is already") else Status.NOT_APPLICABLE
                self.report(facts, node, status, reason)
                continue
            self.report(facts, at, Status.APPLICABLE, (
                f"micro-batches of {found.micro} x {found.accumulation} accumulation steps: the split of each "
                "optimizer step's samples becomes a knob (bigger micro-batches, fewer accumulation steps, the same "
                f"samples in the same order){found.note}"))
            pair = f"{found.micro}, {found.accumulation}"
            insert = edits.insert_before if found.first else edits.insert_after
            if self.mode.gated:
                insert(found.after, stmt(f"{pair} = {edits.runtime('batch_split')}({pair})\n"))
                continue
            k = self.mode.value(self.knobs[0])
            if k > 1:
                insert(found.after, stmt(
                    f"if {found.accumulation} % {k} == 0:  # autotune: micro-batch x{k}, accumulation /{k}: same "
                    f"samples per step\n    {pair} = {found.micro} * {k}, {found.accumulation} // {k}\n"))
            elif k < 1:
                d = round(1 / k)
                insert(found.after, stmt(
                    f"if {found.micro} % {d} == 0:  # autotune: micro-batch /{d}, accumulation x{d}: same samples "
                    f"per step\n    {pair} = {found.micro} // {d}, {found.accumulation} * {d}\n"))

    def _split(self, facts: ModuleFacts, loop: TrainingLoop) -> _Split | tuple[cst.CSTNode, str] | None:
        """The split of ``loop``'s accumulation, or (where, why not), or None where the loop does not accumulate
        over the batches it iterates."""
        node = loop.node
        scopes = [s for s in loop.scopes if s.module is facts and s.steps]
        if not scopes:
            return None
        scope = scopes[-1]
        inner = _micro_loop(facts, node, scope)
        if inner is not None:
            return self._inner_split(facts, loop, scope, inner)
        if not isinstance(node, cst.For):
            return None
        conditions = [a for call in scope.steps if (a := enclosing_if(facts, call, node)) is not None]
        if not conditions:
            return None  # the optimizer steps on every batch: nothing accumulates
        if_ = conditions[0]
        counter, source = _enumerated(node)
        loader = source.value if isinstance(source, cst.Name) else None
        if counter is None or (loader is None and not _slice_starts(source)):
            return if_, ("the loop is not `for i, batch in enumerate(loader)` nor `for i, start in enumerate(range(0, "
                         "n, batch_size))`: its micro-batches cannot be told")
        if any(facts.is_runtime_call(c, "batch_split") for c in facts.calls):
            return if_, "the batch split is already a knob"
        logs: list[cst.If] = []
        for n in facts.nodes_in(node.body, cst.Name):
            if n.value == counter and names_variable(facts, n) and not facts.contains(if_.test, n):
                log = _logging_if(facts, n, node)
                if log is None:
                    line = _line(facts, n)
                    return n, f"{counter} counts micro-batches (line {line}): the split changes it"
                logs.append(log)
        accumulation = _accumulation(facts, if_.test, counter, _start(node), loader)
        if accumulation is None:
            return if_, (f"the optimizer step's condition `{facts.code(if_.test)}` is not `({counter} + 1) % "
                         f"accumulation == 0` (or that, `or {counter} + 1 == len(loader)`)")
        code = facts.code(accumulation)
        if not any(_divides(facts, n, code) for n in walk(node.body, itself=True)):
            return if_, f"the loss is not divided by {code}: the split would change the gradient's scale"
        losses = {facts.code(e) for e in scope.loss_exprs()}
        if loader is None:  # slices [start:start + batch_size] of the script's tensors
            sliced = _sliced(facts, node, source)
            if isinstance(sliced[1], str):
                return sliced
            micro, uppers = sliced
            read = _read_elsewhere(facts, micro, accumulation, node, losses, allowed=uppers)
            built = before = facts.statement_of(node)
        else:
            found = _loader_size(facts, node, loader)
            if isinstance(found[1], str):
                return found
            built, micro = found
            read = _read_elsewhere(facts, micro, accumulation, node, losses, loader=loader) or \
                _length_read(facts, loader, code, node, if_.test)
            before = facts.statement_of(built)
        if read is not None:
            return read
        counted = self._per_micro_step(facts, node.body, if_)
        if counted is not None:
            return counted
        changed = self._changes_the_math()
        if changed is not None:
            return node, changed
        when = "the DataLoader is built" if loader is not None else "the slices are taken"
        placed = _placed(facts, facts.code(micro), code, before, built, when)
        if logs and isinstance(placed, _Split):
            lines = ", ".join(str(_line(facts, log)) for log in dict.fromkeys(logs))
            placed = dataclasses.replace(placed, note=(
                f"; {counter} only decides when to log (line {lines}): it counts micro-batches, so at a split of k "
                f"the script logs 1/k as often (x2: half as often), the training the same"))
        return placed

    def _inner_split(self, facts: ModuleFacts, loop: TrainingLoop, scope, inner: cst.For) -> _Split | tuple[cst.CSTNode, str]:
        """The split of an inner micro-batch loop, ``for micro in range(accum):`` holding the backward and not the
        optimizer step, whose micro-batches come from ``next(iterator)`` of a DataLoader or from a function of the
        script's own that draws ``torch.randint(..., (batch_size,))`` indices (nanoGPT's ``get_batch``)."""
        accumulation = inner.iter.args[0].value  # type: ignore[attr-defined]
        code = facts.code(accumulation)
        if any(facts.is_runtime_call(c, "batch_split") for c in facts.calls):
            return inner, "the batch split is already a knob"
        counter = inner.target.value if isinstance(inner.target, cst.Name) else None
        for n in facts.nodes_in(inner.body, cst.Name):
            if n.value == counter and names_variable(facts, n) and not _last_micro_test(facts, n, code):
                return n, f"{counter} counts micro-batches (line {_line(facts, n)}): the split changes it"
        if not any(_divides(facts, n, code) for n in walk(inner.body, itself=True)):
            return inner, f"the loss is not divided by {code}: the split would change the gradient's scale"
        source = _micro_source(facts, loop, inner, code)
        if isinstance(source[1], str):
            return source
        micro, before = source
        micro_code = facts.code(micro)
        for call in facts.calls:
            if isinstance(call.func, cst.Name) and call.func.value in ("exec", "globals") and \
                    facts.qualname(call.func) in (call.func.value, f"builtins.{call.func.value}", None):
                return call, (f"{call.func.value}() at line {_line(facts, call)} may rebind {micro_code} and {code}: "
                              "their values where the split is made are not known")
        losses = {facts.code(e) for e in scope.loss_exprs()}
        first = _parameters(facts, [micro_code, code], before)
        within = facts.function_of(before) if first is not None else None  # parameters: read in their function only
        read = _read_elsewhere(facts, micro, accumulation, inner, losses, products=True, within=within)
        if read is not None:
            return read
        counted = self._per_micro_step(facts, inner.body, None)
        if counted is not None:
            return counted
        changed = self._changes_the_math()
        if changed is not None:
            return inner, changed
        return _placed(facts, micro_code, code, before, inner, "the micro-batches are drawn")

    def _lightning_split(self, facts: ModuleFacts, call: cst.Call) -> _Split | tuple[cst.CSTNode, str] | None:
        """``trainer = L.Trainer(accumulate_grad_batches=args.accum)`` trained by ``trainer.fit(...)``, whose training
        DataLoader's batch size is a variable of the script: the DataLoader given to fit, or the one the
        LightningDataModule (or LightningModule) builds in ``train_dataloader`` from ``self.batch_size`` or
        ``self.hparams.batch_size``, given to its constructor. Lightning divides each micro-batch's loss by the
        accumulation count itself."""
        accumulation = _accumulation_keyword(facts, call, "accumulate_grad_batches")
        if not isinstance(accumulation, cst.BaseExpression):
            return accumulation
        fit = _fit_of(facts, call)
        if fit is None:
            return call, "no trainer.fit(...) of this Trainer is found: which DataLoader it trains on is not known"
        source = _lightning_loader(self.project, facts, fit)
        if isinstance(source[1], str):
            return source
        micro, built, before = source
        refused = _loader_refuses(built)
        if refused is not None:
            return built, refused
        loader = argument(fit, 1, "train_dataloaders")
        read = _read_elsewhere(facts, micro, accumulation, call, products=True) or (
            _length_read(facts, loader.value, facts.code(accumulation), fit) if isinstance(loader, cst.Name) else None)
        if read is not None:
            return read
        changed = self._changes_the_math()
        if changed is not None:
            return call, changed
        first = min((before, facts.statement_of(call)), key=lambda st: _at(facts, st))
        return _placed(facts, facts.code(micro), facts.code(accumulation), first, call, "the Trainer and its data are built")

    def _accelerate_split(self, facts: ModuleFacts, call: cst.Call) -> _Split | tuple[cst.CSTNode, str] | None:
        """``Accelerator(gradient_accumulation_steps=args.accum)`` with a loop of the script's own that runs each
        micro-batch ``with accelerator.accumulate(model):`` over a DataLoader built with a batch size of the
        script's: Accelerate divides each micro-batch's loss by the count and steps on the last of each count."""
        accumulation = _accumulation_keyword(facts, call, "gradient_accumulation_steps")
        if not isinstance(accumulation, cst.BaseExpression):
            return accumulation
        loops = [loop for loop in self.project.loops if loop.module is facts and isinstance(loop.node, cst.For)
                 and facts.function_of(loop.node) is facts.function_of(call)]
        inside = [loop for loop in loops if any(_accumulate_context(facts, w) for w in facts.nodes_in(loop.node, cst.With))]
        if not inside:
            return call, "no loop runs its micro-batches `with accelerator.accumulate(model):`: Accelerate does not " \
                         "accumulate them"
        loop = inside[0].node
        it = loop.iter.args[0].value if isinstance(loop.iter, cst.Call) and isinstance(loop.iter.func, cst.Name) \
            and loop.iter.func.value == "enumerate" and loop.iter.args else loop.iter
        if not isinstance(it, cst.Name):
            return loop, f"the loop iterates {facts.code(it)}, not a DataLoader by name: its batch size is not known"
        built = [a.value for a in assignments(facts, scope_of(facts, loop), it.value, before=loop)
                 if isinstance(a.value, cst.Call) and facts.qualname(a.value.func) in DATALOADERS]
        if len(built) != 1:
            return loop, f"{it.value} is not built by one DataLoader(...) in this function: its batch size is not known"
        built = built[0]
        micro = _batch_size_of(facts, built)
        if isinstance(micro, str):
            return built, micro
        read = _read_elsewhere(facts, micro, accumulation, call, products=True, loader=it.value) or \
            _length_read(facts, it.value, facts.code(accumulation), loop)
        if read is not None:
            return read
        counted = self._per_micro_step(facts, loop.body, None, accelerated=True)
        if counted is not None:
            return counted
        changed = self._changes_the_math()
        if changed is not None:
            return call, changed
        first = min((facts.statement_of(built), facts.statement_of(call)), key=lambda st: _at(facts, st))
        return _placed(facts, facts.code(micro), facts.code(accumulation), first, call,
                       "the Accelerator and the DataLoader are built")

    def _per_micro_step(self, facts: ModuleFacts, body: cst.CSTNode, step_if: cst.If | None, accelerated: bool = False):
        """(where, why) for a scheduler step or a gradient clip that runs once per micro-batch in ``body`` (outside
        ``step_if``, the optimizer step's condition): the split would change how often it runs."""
        for call in facts.nodes_in(body, cst.Call):
            if step_if is not None and facts.contains(step_if, call):
                continue
            func = call.func
            qual = facts.qualname(func) or ""
            if accelerated:
                # Accelerate's prepared scheduler steps with the optimizer (on the last micro-batch of each step);
                # accelerator.clip_grad_norm_ clips only where gradients sync
                if isinstance(func, cst.Attribute) and func.attr.value in ("clip_grad_norm_", "clip_grad_value_") \
                        and "accelerator" in facts.code(func.value).lower():
                    continue
                if isinstance(func, cst.Attribute) and func.attr.value == "step":
                    continue
            if isinstance(func, cst.Attribute) and func.attr.value == "step" and \
                    facts.code(func.value) in self.project.scheduler_names:
                return call, (f"{facts.code(func.value)}.step() at line {_line(facts, call)} runs once per "
                              "micro-batch: the split would change the learning-rate schedule")
            if qual in CLIP:
                return call, (f"{qual.rsplit('.', 1)[-1]} at line {_line(facts, call)} clips each micro-batch's "
                              "gradients: the split would change what is clipped")
        return None

    def _changes_the_math(self) -> str | None:
        """Why the same samples in other micro-batches would train differently, if they would: a layer that works
        per micro-batch, or a loss summed over samples."""
        return self._per_micro_batch() or _summed_loss(self.project)

    def _per_micro_batch(self) -> str | None:
        """Why the model trains differently on other micro-batches of the same samples, if it may."""
        for facts in self.project.modules:
            for call in facts.calls:
                qual = facts.qualname(call.func) or ""
                where = f"{facts.display}:{facts.position(call)[0]}"
                if qual in BATCH_NORMS:
                    return f"{qual.rsplit('.', 1)[-1]} at {where}: its statistics are per micro-batch"
                if qual.startswith(("torchvision.models.", "timm.")):
                    return f"{qual} at {where}: a library model whose layers (BatchNorm, dropout) are not read here"
                p = None
                if qual in DROPOUTS:
                    p = argument(call, 1 if "functional" in qual else 0, "p")
                    if p is None:
                        return f"{qual.rsplit('.', 1)[-1]} at {where}: dropout draws its masks per micro-batch"
                elif qual in DROPOUT_KEYWORD:
                    p = argument(call, None, "dropout")
                    if p is None and DROPOUT_KEYWORD[qual]:
                        return f"{qual.rsplit('.', 1)[-1]} at {where}: dropout draws its masks per micro-batch"
                if p is not None and not _zero(p):
                    return (f"{qual.rsplit('.', 1)[-1]}({facts.code(p)}) at {where}: dropout draws its masks per "
                            "micro-batch (0 is the only probability known here to be safe)")
        return None


def _batch_size_of(facts: ModuleFacts, built: cst.Call) -> cst.BaseExpression | str:
    """The batch size a ``DataLoader(...)`` call is given, where it is a variable or option of the script's own
    and the loader's batches would split into the same samples; else why not."""
    micro = argument(built, 1, "batch_size")
    if not is_reference(micro):
        shown = facts.code(micro) if micro is not None else "DataLoader's default of 1"
        return f"the batch size {shown} is not a variable or option of the script's own"
    return _loader_refuses(built) or micro


def _loader_refuses(built: cst.Call) -> str | None:
    """Why a DataLoader's batches would not split into the same samples, if they would not: a sampler chooses each
    batch's samples, or drop_last drops another tail of each epoch at another batch size."""
    for keyword in ("batch_sampler", "sampler"):
        if argument(built, None, keyword) is not None:
            return f"{keyword}=: the samples of a micro-batch are the sampler's choice"
    drop_last = argument(built, None, "drop_last")
    if drop_last is not None and not is_literal(drop_last, False):
        return "drop_last: a bigger batch would drop another tail of each epoch"
    return None


def _summed_loss(project) -> str | None:
    """Where a loss is summed over its samples (``reduction="sum"``), if anywhere: divided by the accumulation steps
    it is the step's sum over micro-batches of k times fewer, k times bigger sums, k times the gradient."""
    for facts in project.modules:
        for call in facts.calls:
            value = argument(call, None, "reduction")
            if isinstance(value, cst.SimpleString) and value.evaluated_value == "sum":
                return (f"{facts.code(call.func)}(reduction=\"sum\") at {facts.display}:{facts.position(call)[0]}: a "
                        "loss summed over samples, which the split would scale")
    return None


def _micro_loop(facts: ModuleFacts, loop: cst.For | cst.While, scope) -> cst.For | None:
    """The ``for micro in range(accum):`` loop inside ``loop`` that holds every backward of ``scope`` and none of
    its optimizer steps, where ``accum`` is a variable or an attribute chain on one."""
    if not scope.backward:
        return None
    for inner in facts.nodes_in(loop.body, cst.For):
        if facts.function_of(inner) is not facts.function_of(loop):
            continue
        it = inner.iter
        if not (isinstance(it, cst.Call) and isinstance(it.func, cst.Name) and it.func.value == "range"
                and len(it.args) == 1 and it.args[0].keyword is None and not it.args[0].star):
            continue
        if not all(facts.contains(inner.body, b) for b in scope.backward):
            continue
        if any(facts.contains(inner, step) for step in scope.steps):
            continue
        value = it.args[0].value
        return inner if is_reference(value) else None
    return None


def _last_micro_test(facts: ModuleFacts, name: cst.Name, accumulation: str) -> bool:
    """``micro == accum - 1`` (the last micro-batch of a step, which a DDP script syncs on): still the last one after
    a split."""
    parent = facts.parent(name)
    if not (isinstance(parent, cst.Comparison) and parent.left is name and len(parent.comparisons) == 1):
        return False
    target = parent.comparisons[0]
    right = target.comparator
    return (isinstance(target.operator, (cst.Equal, cst.NotEqual)) and isinstance(right, cst.BinaryOperation)
            and isinstance(right.operator, cst.Subtract) and facts.code(right.left) == accumulation
            and isinstance(right.right, cst.Integer) and right.right.value == "1")


RANDINT = "torch.randint"


def _micro_source(facts: ModuleFacts, loop: TrainingLoop, inner: cst.For, accumulation: str):
    """(the micro-batch size's expression, the statement before which it must be split) for the batches drawn in
    ``inner``, or (where, why not)."""
    for call in facts.nodes_in(inner.body, cst.Call):
        func = call.func
        if isinstance(func, cst.Name) and func.value == "next" and call.args and isinstance(call.args[0].value, cst.Name):
            return _from_iterator(facts, inner, call.args[0].value.value, accumulation)
        if isinstance(func, cst.Name):
            defined = _function(facts, func.value)
            if defined is not None and any(facts.qualname(c.func) == RANDINT for c in facts.nodes_in(defined, cst.Call)):
                return _from_sampler(facts, loop, inner, defined)
    return inner, ("the micro-batches of the inner loop come neither from next() of a DataLoader's iterator nor from a "
                   "function of the script's that draws torch.randint indices: their size is not known")


def _function(facts: ModuleFacts, name: str) -> cst.FunctionDef | None:
    """The module-level ``def name`` of this module, if it is the only binding of ``name`` there."""
    found = [d for d in facts.module.body if isinstance(d, cst.FunctionDef) and d.name.value == name]
    return found[0] if len(found) == 1 else None


def _from_iterator(facts: ModuleFacts, inner: cst.For, name: str, accumulation: str):
    """``batch = next(it)`` where every binding of ``it`` is ``iter(loader)`` of one DataLoader."""
    scope = scope_of(facts, inner)
    bound = assignments(facts, scope, name) or assignments(facts, facts.module, name)
    loaders = set()
    for assign in bound:
        value = assign.value
        if not (isinstance(value, cst.Call) and isinstance(value.func, cst.Name) and value.func.value == "iter"
                and value.args and isinstance(value.args[0].value, cst.Name)):
            return assign, f"{name} = {facts.code(value)}: not iter() of a DataLoader, its batches' size is not known"
        loaders.add(value.args[0].value.value)
    if len(loaders) != 1:
        return inner, f"next({name}): {name} is not bound to iter() of one DataLoader"
    (loader,) = loaders
    found = _loader_size(facts, inner, loader)
    if isinstance(found[1], str):
        return found
    built, micro = found
    return _length_read(facts, loader, accumulation, inner) or (micro, facts.statement_of(built))


def _from_sampler(facts: ModuleFacts, loop: TrainingLoop, inner: cst.For, defined: cst.FunctionDef):
    """``get_batch()`` whose body draws ``torch.randint(n, (batch_size,))`` with a global ``batch_size``: one draw of
    k times as many indices on the CPU generator is the k draws it replaces, one after another. Every other call of
    the function must be a fetch ahead of the loop (nanoGPT's first batch), or it would draw differently."""
    name = defined.name.value
    draws = [c for c in facts.nodes_in(defined, cst.Call) if facts.qualname(c.func) == RANDINT]
    if len(draws) != 1:
        return defined, f"{name}() draws torch.randint {len(draws)} times: which one is the micro-batch is not known"
    draw = draws[0]
    size = argument(draw, None, "size")
    if size is None:
        size = next((a.value for a in draw.args if a.keyword is None and isinstance(a.value, (cst.Tuple, cst.List))),
                    None)
    elements = size.elements if isinstance(size, (cst.Tuple, cst.List)) else ()
    micro = elements[0].value if len(elements) == 1 else None
    if not is_reference(micro):
        shown = facts.code(size) if size is not None else "no size"
        return draw, f"torch.randint's size {shown} is not (batch_size,) of a variable of the script's own"
    base = micro.value if isinstance(micro, cst.Name) else facts.code(micro).split(".", 1)[0]
    if assignments(facts, defined, base) or any(p.name.value == base for p in defined.params.params):
        return draw, f"{base} is {name}()'s own: the micro-batch size is not a setting of the script"
    device = argument(draw, None, "device")
    if device is not None and not (isinstance(device, cst.SimpleString) and device.evaluated_value == "cpu"):
        return draw, (f"torch.randint(device={facts.code(device)}): a bigger draw on an accelerator's generator is "
                      "not the smaller draws it replaces")
    calls = [c for c in facts.calls if isinstance(c.func, cst.Name) and c.func.value == name]
    outer_function = facts.function_of(loop.outer)
    for call in calls:
        if facts.contains(inner, call):
            continue
        ahead = facts.function_of(call) is outer_function and facts.block_of(facts.statement_of(call)) is \
            facts.block_of(loop.outer) and facts.position(call) < facts.position(loop.outer)
        if not ahead:
            return call, (f"{name}() is also called at line {_line(facts, call)}: a bigger {facts.code(micro)} would "
                          "change what it draws there, and the draws after it")
    first = min(calls, key=facts.position)
    return micro, facts.statement_of(first)


def _accumulate_context(facts: ModuleFacts, node: cst.With) -> bool:
    """``with accelerator.accumulate(model):``."""
    return any(isinstance(item.item, cst.Call) and isinstance(item.item.func, cst.Attribute)
               and item.item.func.attr.value == "accumulate" for item in node.items)


def _fit_of(facts: ModuleFacts, call: cst.Call) -> cst.Call | None:
    """``trainer.fit(...)`` of the Trainer ``call`` builds (``trainer = L.Trainer(...)``), in the same function."""
    at = facts.statement_of(call)
    node = at.body[0] if isinstance(at, cst.SimpleStatementLine) and len(at.body) == 1 else None
    if not (isinstance(node, cst.Assign) and node.value is call and len(node.targets) == 1
            and isinstance(node.targets[0].target, cst.Name)):
        return None
    name = node.targets[0].target.value
    for fit in facts.calls:
        func = fit.func
        if isinstance(func, cst.Attribute) and func.attr.value == "fit" and isinstance(func.value, cst.Name) \
                and func.value.value == name and facts.function_of(fit) is facts.function_of(call):
            return fit
    return None


def _lightning_loader(project, facts: ModuleFacts, fit: cst.Call):
    """(the batch size's expression in the script, the training DataLoader call, the statement before which the
    split goes) for ``trainer.fit(model, train_dataloaders=loader)`` or ``trainer.fit(model, datamodule=data)``,
    or (where, why not)."""
    loader = argument(fit, 1, "train_dataloaders")
    datamodule = argument(fit, None, "datamodule")
    if isinstance(loader, cst.Name) and datamodule is None:
        found = assignments(facts, scope_of(facts, fit), loader.value, before=fit)
        value = found[0].value if len(found) == 1 else None
        if not (isinstance(value, cst.Call) and facts.qualname(value.func) in DATALOADERS):
            return fit, f"{loader.value} is not one DataLoader(...) of this function: its batch size is not known"
        micro = argument(value, 1, "batch_size")
        if not is_reference(micro):
            return value, "the DataLoader's batch size is not a variable or option of the script's own"
        return micro, value, facts.statement_of(value)
    holder = datamodule if datamodule is not None else (loader if loader is not None else argument(fit, 0, "model"))
    if not isinstance(holder, cst.Name):
        return fit, "the training data are not given by name to fit(): their batch size is not known"
    found = assignments(facts, scope_of(facts, fit), holder.value, before=fit)
    built = found[0].value if len(found) == 1 else None
    if not isinstance(built, cst.Call):
        return fit, f"{holder.value} is not built once in this function: its batch size is not known"
    cls = _local_class(project, facts, built.func)
    if cls is None:
        return built, f"{facts.code(built.func)} is not a class of the script's: how it batches is not known"
    method = next((m for m in cls.body.body if isinstance(m, cst.FunctionDef) and m.name.value == "train_dataloader"),
                  None)
    init = next((m for m in cls.body.body if isinstance(m, cst.FunctionDef) and m.name.value == "__init__"), None)
    owner = next(f for f in project.modules if f.contains(f.module, cls))
    loaders = [c for c in owner.nodes_in(method, cst.Call) if owner.qualname(c.func) in DATALOADERS] if method else []
    if len(loaders) != 1 or init is None:
        return built, f"{cls.name.value}.train_dataloader does not build one DataLoader: its batch size is not known"
    size = argument(loaders[0], 1, "batch_size")
    attr = _self_attribute(owner, size)
    if attr is None:
        return loaders[0], (f"{cls.name.value}'s DataLoader batch size {owner.code(size) if size else '(1)'} is not "
                            "self.<name> or self.hparams.<name>: where it comes from is not known")
    params = [p.name.value for p in init.params.params]
    if attr not in params:
        return loaders[0], f"{attr} is not a parameter of {cls.name.value}.__init__: where it comes from is not known"
    micro = argument(built, params.index(attr) - 1, attr)
    if not is_reference(micro):
        shown = facts.code(micro) if micro is not None else f"{cls.name.value}'s default"
        return built, f"the batch size {shown} is not a variable or option of the script's own"
    return micro, loaders[0] if owner is facts else built, facts.statement_of(built)


def _local_class(project, facts: ModuleFacts, func: cst.BaseExpression) -> cst.ClassDef | None:
    """The class of the project that ``func`` names (in this module, by its name)."""
    if not isinstance(func, cst.Name):
        return None
    for owner in project.modules:
        for node in owner.module.body:
            if isinstance(node, cst.ClassDef) and node.name.value == func.value and (owner is facts or facts.qualname(
                    func) not in (None, func.value)):
                return node
    return None


def _self_attribute(facts: ModuleFacts, size: cst.BaseExpression | None) -> str | None:
    """``name`` of ``self.name``, ``self.hparams.name`` or ``self.hparams["name"]``."""
    if isinstance(size, cst.Attribute) and isinstance(size.value, cst.Name) and size.value.value == "self":
        return size.attr.value
    if isinstance(size, cst.Attribute) and facts.code(size.value) == "self.hparams":
        return size.attr.value
    if isinstance(size, cst.Subscript) and facts.code(size.value) == "self.hparams" and len(size.slice) == 1:
        index = size.slice[0].slice
        if isinstance(index, cst.Index) and isinstance(index.value, cst.SimpleString):
            return index.value.evaluated_value
    return None


def _enumerated(loop: cst.For) -> tuple[str | None, cst.BaseExpression | None]:
    """(counter, what it enumerates) of ``for i, batch in enumerate(loader)``."""
    it, target = loop.iter, loop.target
    if not (isinstance(it, cst.Call) and isinstance(it.func, cst.Name) and it.func.value == "enumerate" and it.args):
        return None, None
    if not (isinstance(target, cst.Tuple) and len(target.elements) == 2 and isinstance(target.elements[0].value, cst.Name)):
        return None, None
    return target.elements[0].value.value, it.args[0].value


def _slice_starts(source: cst.BaseExpression | None) -> bool:
    """``range(0, n, batch_size)``: where each micro-batch starts, batch_size a variable of the script's."""
    return (isinstance(source, cst.Call) and isinstance(source.func, cst.Name) and source.func.value == "range"
            and len(source.args) == 3 and all(a.keyword is None and not a.star for a in source.args)
            and isinstance(source.args[0].value, cst.Integer) and source.args[0].value.value == "0"
            and is_reference(source.args[2].value))


def _sliced(facts: ModuleFacts, loop: cst.For, source: cst.Call):
    """(the micro-batch size, its reads in the slices) for ``for i, start in enumerate(range(0, n, batch_size))``
    whose body reads ``start`` only as ``x[start:start + batch_size]`` (a slice of the first dimension): the slices of
    k times batch_size are the k slices they replace, one after another (the last one of an epoch ends at n either
    way); or (where, why not)."""
    micro = source.args[2].value
    code = facts.code(micro)
    target = loop.target.elements[1].value  # type: ignore[attr-defined]
    if not isinstance(target, cst.Name):
        return loop, f"the loop's target {facts.code(target)} is not a name: where its micro-batches start is not known"
    start = target.value
    stop = source.args[1].value
    if any(facts.code(n) == code for n in walk(stop, itself=True)):
        return source, f"the range's end {facts.code(stop)} reads {code}: a bigger micro-batch would end an epoch elsewhere"
    uppers: list[cst.CSTNode] = []
    for n in facts.nodes_in(loop.body, cst.Name):
        if n.value != start or not names_variable(facts, n):
            continue
        parent = facts.parent(n)
        upper = parent if isinstance(parent, cst.BinaryOperation) else None
        bounds = facts.parent(upper) if upper is not None else parent
        if upper is not None and not (isinstance(upper.operator, cst.Add) and upper.left is n
                                      and facts.code(upper.right) == code):
            bounds = None
        if isinstance(bounds, cst.Slice) and bounds.step is None and isinstance(bounds.lower, cst.Name) and \
                bounds.lower.value == start and isinstance(bounds.upper, cst.BinaryOperation) and \
                isinstance(bounds.upper.operator, cst.Add) and facts.code(bounds.upper.left) == start and \
                facts.code(bounds.upper.right) == code and _first_dimension(facts, bounds):
            if upper is not None:
                uppers.append(upper.right)
            continue
        return n, (f"{start} is read at line {_line(facts, n)} other than as a slice [{start}:{start} + {code}] of a "
                   "tensor's first dimension: what a bigger micro-batch would read there is not known")
    if not uppers:
        return loop, f"no slice [{start}:{start} + {code}] in the loop: where its micro-batches come from is not known"
    return micro, frozenset(uppers)


def _first_dimension(facts: ModuleFacts, bounds: cst.Slice) -> bool:
    """Whether the slice ``bounds`` is the first (or only) index of its subscript: ``x[a:b]``, ``x[a:b, :]``."""
    element = facts.parent(bounds)
    subscript = facts.parent(element)
    return isinstance(subscript, cst.Subscript) and subscript.slice[0] is element


def _start(loop: cst.For) -> int | None:
    """enumerate's start: 0, 1, or None where it is something else."""
    args = loop.iter.args  # type: ignore[attr-defined]
    if len(args) == 1:
        return 0
    value = args[1].value
    return int(value.value) if isinstance(value, cst.Integer) and value.value in ("0", "1") else None


def _accumulation(facts: ModuleFacts, test: cst.BaseExpression, counter: str, start: int | None,
                  loader: str | None = None):
    """``A`` of ``(i + 1) % A == 0`` (``i % A == 0`` where enumerate counts from 1), where A is a variable; also with
    ``or i + 1 == len(loader)`` after it (a last, shorter step at the end of each epoch: ceil(n / A) steps, which
    the split keeps)."""
    if isinstance(test, cst.BooleanOperation) and isinstance(test.operator, cst.Or) and loader is not None and \
            _last_of_epoch(facts, test.right, counter, start, loader):
        test = test.left
    if not (isinstance(test, cst.Comparison) and len(test.comparisons) == 1):
        return None
    target = test.comparisons[0]
    if not (isinstance(target.operator, cst.Equal) and isinstance(target.comparator, cst.Integer)
            and target.comparator.value == "0"):
        return None
    mod = test.left
    if not (isinstance(mod, cst.BinaryOperation) and isinstance(mod.operator, cst.Modulo)):
        return None
    left, right = mod.left, mod.right
    counted = (start == 0 and isinstance(left, cst.BinaryOperation) and isinstance(left.operator, cst.Add)
               and isinstance(left.left, cst.Name) and left.left.value == counter
               and isinstance(left.right, cst.Integer) and left.right.value == "1")
    counted = counted or (start == 1 and isinstance(left, cst.Name) and left.value == counter)
    if not counted or not is_reference(right):
        return None
    return right


def _last_of_epoch(facts: ModuleFacts, test: cst.BaseExpression, counter: str, start: int | None, loader: str) -> bool:
    """``i + 1 == len(loader)`` (or ``i == len(loader) - 1``; ``i == len(loader)`` where enumerate counts from 1):
    the last micro-batch of the epoch."""
    spelled = re.sub(r"[\s()]", "", facts.code(test))
    last = {0: {f"{counter}+1==len{loader}", f"len{loader}=={counter}+1", f"{counter}==len{loader}-1"},
            1: {f"{counter}==len{loader}", f"len{loader}=={counter}"}}.get(start, set())
    return spelled in last


# calls that only report: print(...), logger.info(...), writer.add_scalar(...), wandb.log(...), pbar.set_postfix(...)
_LOG_CALLS = {"print", "info", "debug", "warning", "log", "add_scalar", "add_scalars", "set_postfix",
              "set_description", "write"}


def _logging_if(facts: ModuleFacts, name: cst.Name, loop: cst.CSTNode) -> cst.If | None:
    """The ``if`` that holds ``name`` (in its test or its body) and only reports (``if i % log_every == 0:
    print(i, ...)``); None where ``name`` is read anywhere else or the body does more than report."""
    test_of = next((a for a in facts.ancestors(name) if isinstance(a, cst.If) or a is loop), None)
    if not isinstance(test_of, cst.If) or test_of.orelse is not None:  # (the nearest if, inside the loop)
        return None
    if isinstance(test_of.body, cst.SimpleStatementSuite):  # ``if i % 10 == 0: print(...)`` on one line
        smalls = list(test_of.body.body)
    elif all(isinstance(st, cst.SimpleStatementLine) for st in test_of.body.body):
        smalls = [small for st in test_of.body.body for small in st.body]
    else:
        return None
    local: set[str] = set()
    for small in smalls:
        if isinstance(small, cst.Expr) and isinstance(small.value, cst.Call):
            func = small.value.func
            called = func.value if isinstance(func, cst.Name) else func.attr.value if isinstance(func, cst.Attribute) else None
            if called not in _LOG_CALLS:
                return None
        elif isinstance(small, cst.Assign) and all(isinstance(t.target, cst.Name) for t in small.targets):
            local.update(t.target.value for t in small.targets)  # a value for the message: read nowhere else
        else:
            return None
    for other in facts.nodes_in(loop, cst.Name):
        if other.value in local and not facts.contains(test_of.body, other):
            return None
    return test_of


def _line(facts: ModuleFacts, node: cst.CSTNode) -> int:
    """The line of the statement that holds ``node``."""
    return _at(facts, facts.statement_of(node))[0]


def _at(facts: ModuleFacts, statement: cst.BaseStatement) -> tuple[int, int]:
    """Where a statement is (a simple statement line has no position of its own: its first statement's)."""
    return facts.position(statement.body[0] if isinstance(statement, cst.SimpleStatementLine) and statement.body
                          else statement)


def _divides(facts: ModuleFacts, node: cst.CSTNode, code: str) -> bool:
    """``x / A`` or ``x /= A``."""
    if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.Divide):
        return facts.code(node.right) == code
    if isinstance(node, cst.AugAssign) and isinstance(node.operator, cst.DivideAssign):
        return facts.code(node.value) == code
    return False


def _loader_size(facts: ModuleFacts, loop: cst.For, loader: str):
    """(the ``DataLoader(...)`` call ``loader`` is bound to, its batch size's expression), or (where, why not)."""
    built = _loader_call(facts, loop, loader)
    if isinstance(built, str):
        return loop, built
    return built, _batch_size_of(facts, built)


def _loader_call(facts: ModuleFacts, loop: cst.For, loader: str) -> cst.Call | str:
    """The ``DataLoader(...)`` call ``loader`` is bound to, once, in the loop's scope."""
    scope = scope_of(facts, loop)
    found = assignments(facts, scope, loader, before=loop)
    if len(found) != 1:
        return f"{loader} is bound {len(found)} times before the loop: which DataLoader it is, is not known"
    value = found[0].value
    if not (isinstance(value, cst.Call) and facts.qualname(value.func) in DATALOADERS):
        return f"{loader} is not built by DataLoader(...) in this function: its batch size is not known"
    return value


def _accumulation_keyword(facts: ModuleFacts, call: cst.Call, keyword: str):
    """The accumulation count a framework's constructor is given (``accumulate_grad_batches=args.accum``), where it
    is a variable or option of the script's; None where it is not given or 1 (nothing accumulates); else (where,
    why not)."""
    accumulation = argument(call, None, keyword)
    if accumulation is None or is_literal(accumulation, 1):
        return None
    if any(facts.is_runtime_call(c, "batch_split") for c in facts.calls):
        return call, "the batch split is already a knob"
    if not is_reference(accumulation):
        return call, f"{keyword}={facts.code(accumulation)} is not a variable or option of the script's own"
    return accumulation


def _read_elsewhere(facts: ModuleFacts, micro: cst.BaseExpression, accumulation: cst.BaseExpression,
                    loop: cst.CSTNode, losses: set[str] = frozenset(), products: bool = False,
                    within: cst.CSTNode | None = None, loader: str | None = None,
                    allowed: frozenset[cst.CSTNode] = frozenset()) -> tuple[cst.CSTNode, str] | None:
    """(where, why) for a read of the micro-batch size or the accumulation count that the split would change (see
    ``_other_use``; ``products``: their product, the samples per step, does not change; ``loader``: the training
    DataLoader, whose ``math.ceil(len(loader) / accumulation)`` does not change either; ``allowed``: reads of the
    micro-batch size that the split changes as it should, the ends of the slices it sizes), or None."""
    micro_code, code = facts.code(micro), facts.code(accumulation)
    for expr_code, own, partner in ((micro_code, micro, code), (code, accumulation, micro_code)):
        other = _other_use(facts, expr_code, own, loop, losses if own is accumulation else set(),
                           partner if products else None, within, loader if own is accumulation else None,
                           allowed if own is micro else frozenset())
        if other is not None:
            return other, f"{expr_code} is also read at line {_line(facts, other)}: the split would change it"
    return None


def _length_read(facts: ModuleFacts, loader: str, accumulation: str, loop: cst.CSTNode,
                 test: cst.CSTNode | None = None) -> tuple[cst.CSTNode, str] | None:
    """(where, why) for ``len(loader)`` in the loop's function: the micro-batches of an epoch, which the split divides
    by k (a scheduler's length, an epoch's steps, a resume position); None where there is none, or where each is the
    optimizer steps of an epoch, ``math.ceil(len(loader) / accumulation)``, which the split leaves as it is
    (ceil(ceil(n / k) / (a / k)) = ceil(n / a)), or in ``test``, the optimizer step's condition (its last
    micro-batch, which stays the last one)."""
    for call in facts.nodes_in(scope_of(facts, loop), cst.Call):
        if test is not None and facts.contains(test, call):
            continue
        if not _len_of(facts, call, loader):
            continue
        if _epoch_steps(facts, facts.parent(call), loader, accumulation):
            continue
        return call, (f"len({loader}) at line {_line(facts, call)} counts micro-batches: the split would change it (only "
                      f"math.ceil(len({loader}) / {accumulation}), an epoch's optimizer steps, stays the same)")
    return None


def _epoch_steps(facts: ModuleFacts, divided: cst.CSTNode, loader: str | None, accumulation: str) -> bool:
    """Whether ``divided`` is ``len(loader) / accumulation`` inside ``math.ceil(...)``: an epoch's optimizer steps."""
    arg = facts.parent(divided)
    ceil = facts.parent(arg) if isinstance(arg, cst.Arg) else None
    if not (loader is not None and isinstance(divided, cst.BinaryOperation) and isinstance(divided.operator, cst.Divide)):
        return False
    return (_len_of(facts, divided.left, loader) and facts.code(divided.right) == accumulation
            and isinstance(ceil, cst.Call) and facts.qualname(ceil.func) == "math.ceil")


def _len_of(facts: ModuleFacts, node: cst.CSTNode, loader: str) -> bool:
    """Whether ``node`` is ``len(loader)``."""
    return (isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and node.func.value == "len"
            and facts.qualname(node.func) in ("len", "builtins.len", None) and len(node.args) == 1
            and isinstance(node.args[0].value, cst.Name) and node.args[0].value.value == loader)


def _placed(facts: ModuleFacts, micro: str, accumulation: str, before: cst.BaseStatement, at: cst.CSTNode,
            when: str) -> _Split | tuple[cst.CSTNode, str]:
    """The split of ``micro`` and ``accumulation`` before ``before``: on entry of the function whose parameters they
    are, else after the statement that binds them; or (``at``, why not)."""
    entry = _parameters(facts, [micro, accumulation], before)
    if entry is not None:
        return _Split(micro, accumulation, entry, first=True)
    after = _bound_once(facts, [micro, accumulation], before, when)
    return (at, after) if isinstance(after, str) else _Split(micro, accumulation, after)


def _other_use(facts: ModuleFacts, code: str, own: cst.CSTNode, loop: cst.For, losses: set[str],
               partner: str | None = None, within: cst.CSTNode | None = None,
               loader: str | None = None, allowed: frozenset[cst.CSTNode] = frozenset()) -> cst.CSTNode | None:
    """A read of ``code`` other than ``own``, the loss division in ``loop``, the loss scaled back for a log line
    (``loss.item() * accum``: the last micro-batch's mean loss, whatever its size), a product with ``partner`` (the
    samples per step, ``batch_size * accum * block_size``: unchanged) and the last micro-step's test, or None."""
    kind = cst.Attribute if "." in code else cst.Name
    for n in facts.nodes_in(within or facts.module, kind):
        if n is own or n in allowed or facts.code(n) != code or (isinstance(n, cst.Name) and not names_variable(facts, n)):
            continue
        parent = facts.parent(n)
        if isinstance(parent, (cst.AssignTarget, cst.Param)) or (isinstance(n, cst.Name) and is_assigned(facts, n)):
            continue  # the binding, alone or unpacked
        if isinstance(parent, cst.BinaryOperation) and isinstance(parent.operator, cst.Divide) and parent.right is n \
                and facts.contains(loop, n):
            continue
        if isinstance(parent, cst.AugAssign) and parent.value is n and facts.contains(loop, n):
            continue
        if isinstance(parent, cst.BinaryOperation) and parent.right is n and _epoch_steps(facts, parent, loader, code):
            continue
        if isinstance(parent, cst.BinaryOperation) and isinstance(parent.operator, cst.Multiply):
            other = parent.left if parent.right is n else parent.right
            if any(isinstance(m, cst.Name) and m.value in losses for m in walk(other, itself=True)):
                continue
            if partner is not None and partner in _factors(facts, _product(facts, n)):
                continue
        target = facts.parent(parent)
        test = facts.parent(target) if isinstance(target, cst.ComparisonTarget) else None
        if isinstance(parent, cst.BinaryOperation) and isinstance(parent.operator, cst.Subtract) and \
                isinstance(test, cst.Comparison) and isinstance(test.left, cst.Name) and facts.contains(loop, n) and \
                _last_micro_test(facts, test.left, code):
            continue
        return n
    return None


def _product(facts: ModuleFacts, node: cst.CSTNode) -> cst.CSTNode:
    """The outermost product ``node`` is a factor of."""
    while isinstance(parent := facts.parent(node), cst.BinaryOperation) and isinstance(parent.operator, cst.Multiply):
        node = parent
    return node


def _factors(facts: ModuleFacts, node: cst.CSTNode) -> set[str]:
    """The code of each factor of a product (``a * b * c``: a, b, c)."""
    if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.Multiply):
        return _factors(facts, node.left) | _factors(facts, node.right)
    return {facts.code(node)}


def _bound_once(facts: ModuleFacts, codes: list[str], before: cst.BaseStatement, when: str) -> cst.BaseStatement | str:
    """The statement after which every one of ``codes`` is bound, each by one statement of one block, or why not
    (``when``: what happens at ``before``, as the reason says it: "the DataLoader is built")."""
    statements = []
    for code in codes:
        base = code.split(".", 1)[0]
        scope = scope_of(facts, before)
        found = assignments(facts, scope, base, before=before, unpacking=True)
        if not found and scope is not facts.module:
            found = assignments(facts, facts.module, base, unpacking=True)
        if len(found) != 1:
            return f"{base} is bound {len(found)} times before {when}: its value there is not known"
        statements.append(facts.statement_of(found[0]))
    last = max(statements, key=lambda s: _at(facts, s))
    block = facts.block_of(last)
    if any(facts.block_of(s) is not block for s in statements):
        return f"{' and '.join(codes)} are bound in different blocks"
    if any(unbound(facts, before, code) for code in codes) and facts.function_of(last) is facts.function_of(before):
        return f"{' and '.join(codes)} may be unbound where {when}"
    return last


def _parameters(facts: ModuleFacts, codes: list[str], before: cst.BaseStatement) -> cst.BaseStatement | None:
    """The first statement of the function holding ``before`` (after its docstring), where every one of ``codes``
    is a plain parameter of it that the function never rebinds: split there, each call splits its own values."""
    function = facts.function_of(before)
    if function is None:
        return None
    params = {p.name.value for p in function.params.params} | {p.name.value for p in function.params.kwonly_params}
    bases = {code.split(".", 1)[0] for code in codes}
    if not all(base in params and not assignments(facts, function, base) for base in bases):
        return None
    if any(isinstance(n, (cst.AugAssign, cst.AnnAssign, cst.AssignTarget)) and
           (facts.code(n.target) in codes or facts.code(n.target).split(".", 1)[0] in bases and "." in facts.code(n.target))
           for n in walk(function.body)):
        return None  # the function rebinds them (or attributes of the options object) itself
    if any("." in code for code in codes) and not _called_once(facts, function):
        return None  # an options object split at each call would be split again by a second call
    body = list(function.body.body)
    if len(body) > 1 and isinstance(body[0], cst.SimpleStatementLine) and isinstance(body[0].body[0], cst.Expr) \
            and isinstance(body[0].body[0].value, (cst.SimpleString, cst.ConcatenatedString)):
        return body[1]
    return body[0]


def _called_once(facts: ModuleFacts, function: cst.FunctionDef) -> bool:
    """Whether the module calls ``function`` (by its name) exactly once, outside any loop."""
    calls = [c for c in facts.calls if isinstance(c.func, cst.Name) and c.func.value == function.name.value]
    return len(calls) == 1 and not any(isinstance(a, (cst.For, cst.While)) for a in facts.ancestors(calls[0]))


def _zero(node: cst.BaseExpression) -> bool:
    return isinstance(node, (cst.Integer, cst.Float)) and float(node.value) == 0.0


# === runtime: what the patched script runs (python -m autotune.catalog copies it into autotune/runtime_helpers.py) ===

from typing import Any

from autotune.knob_values import knob, took_effect


def batch_split(micro: Any, accumulation: Any) -> tuple[Any, Any]:
    """(micro-batch size, accumulation steps) as ``batch_split.factor`` splits them: k times the micro-batch, the
    accumulation steps divided by k (k below 1: the micro-batch divided by 1/k, the steps times it), so that each
    optimizer step trains on the same samples; as given where the split does not divide exactly (or the sizes are
    not whole numbers)."""
    k = knob("batch_split.factor", record=False)
    if k == 1 or not isinstance(micro, int) or not isinstance(accumulation, int):
        return micro, accumulation
    split = split_sizes(micro, accumulation, k)
    if split is None:
        return micro, accumulation
    took_effect("batch_split.factor")
    return split


def split_sizes(micro: int, accumulation: int, k: int | float) -> tuple[int, int] | None:
    """(micro * k, accumulation / k) where k divides the accumulation steps; for k below 1, (micro / d,
    accumulation * d) with d = 1/k where d divides the micro-batch; None where the split is not exact."""
    if k >= 1:
        k = int(k)
        return None if accumulation % k else (micro * k, accumulation // k)
    d = round(1 / k)
    return None if micro % d else (micro // d, accumulation * d)
