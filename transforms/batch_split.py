"""batch_split: the same samples per optimizer step in fewer, bigger micro-batches, where the script accumulates
gradients over the batches of its DataLoader (``if (i + 1) % accum == 0: optimizer.step()``)."""

from __future__ import annotations

import dataclasses

import libcst as cst
import libcst.matchers as m

from autotune import loop_shapes
from autotune.analysis import ModuleFacts
from autotune.knobs import Knob, Numerics, Role
from autotune.project import TrainingLoop
from autotune.syntax import (
    argument, assignments, enclosing_if, is_literal, is_reference, names_variable, scope_of, stmt, string_key, unique_name,
    walk,
)
from autotune.transform import Edits, Status, Transform
from autotune.transforms._split_indexed import from_indexed, indexed_call
from autotune.transforms._split_loader import Loader, from_loader, loader_call
from autotune.transforms._split_reads import (
    ALREADY, Expected, Refusal, Split, accumulation_of, count_read_elsewhere, enumerate_start, first_dimension,
    last_micro_test, length_read, line_of, module_function, logging_if, parameters_of, placed_split, position_of,
    read_elsewhere,
)
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
            if isinstance(found, Refusal):
                self.report(facts, found.node, found.status, found.reason)
                continue
            self.report(facts, at, Status.APPLICABLE, (
                f"micro-batches of {found.micro} x {found.accumulation} accumulation steps: the split of each "
                "optimizer step's samples becomes a knob (bigger micro-batches, fewer accumulation steps, the same "
                f"samples in the same order){found.note}"))
            pair = f"{found.micro}, {found.accumulation}"
            # the names the split binds: the script's own, or (a loader object's argument) a name of its own for the
            # training loader's micro-batch, given to its constructor
            target = pair if found.bound is None else f"{found.bound}, {found.accumulation}"
            insert = edits.insert_before if found.first else edits.insert_after
            if self.mode.gated:
                insert(found.after, stmt(f"{target} = {edits.runtime('batch_split')}({pair})\n"))
                self._given(edits, found)
                continue
            k = self.mode.value(self.knobs[0])
            keep = [] if found.bound is None else [stmt(f"{found.bound} = {found.micro}\n")]
            if k > 1:
                insert(found.after, *keep, stmt(
                    f"if {found.accumulation} % {k} == 0:  # autotune: micro-batch x{k}, accumulation /{k}: same "
                    f"samples per step\n    {target} = {found.micro} * {k}, {found.accumulation} // {k}\n"))
                self._given(edits, found)
            elif k < 1:
                d = round(1 / k)
                insert(found.after, *keep, stmt(
                    f"if {found.micro} % {d} == 0:  # autotune: micro-batch /{d}, accumulation x{d}: same samples "
                    f"per step\n    {target} = {found.micro} // {d}, {found.accumulation} * {d}\n"))
                self._given(edits, found)

    @staticmethod
    def _given(edits: Edits, found: Split) -> None:
        """A loader object's split: its constructor is given the split's own name for the micro-batch size."""
        if found.argument is not None:
            name = found.bound
            edits.rewrite(found.argument.value, lambda node: cst.Name(name))

    def _split(self, facts: ModuleFacts, loop: TrainingLoop) -> Split | Refusal | None:
        """The split of ``loop``'s accumulation, or (where, why not), or None where the loop does not accumulate
        over the batches it iterates."""
        node = loop.node
        scopes = [s for s in loop.scopes if s.module is facts and s.steps]
        if not scopes:
            return None
        scope = scopes[-1]
        inner = loop_shapes.micro_loop(facts, node, scope)
        if inner is not None and is_reference(loop_shapes.micro_count(inner)):
            return self._inner_split(facts, loop, scope, inner)
        if not isinstance(node, cst.For):
            return None
        conditions = [a for call in scope.steps if (a := enclosing_if(facts, call, node)) is not None]
        if not conditions:
            return None  # the optimizer steps on every batch: nothing accumulates
        if_ = conditions[0]
        counted = loop_shapes.enumerated(node)
        counter, source = (counted.counter, counted.iterated) if counted is not None else (None, None)
        loader = source.value if isinstance(source, cst.Name) else None
        if counter is None or (loader is None and not _slice_starts(node)):
            return Refusal(if_, ("the loop is not `for i, batch in enumerate(loader)` nor `for i, start in enumerate(range(0, "
                                 "n, batch_size))`: its micro-batches cannot be told"))
        if any(facts.is_runtime_call(c, "batch_split") for c in facts.calls):
            return Refusal(if_, ALREADY, Status.PRESENT)
        logs: list[cst.If] = []
        for n in facts.nodes_in(node.body, cst.Name):
            if n.value == counter and names_variable(facts, n) and not facts.contains(if_.test, n):
                log = logging_if(facts, n, node)
                if log is None:
                    line = line_of(facts, n)
                    return Refusal(n, f"{counter} counts micro-batches (line {line}): the split changes it")
                logs.append(log)
        accumulation = accumulation_of(facts, if_.test, counter, enumerate_start(node), loader)
        if accumulation is None:
            return Refusal(if_, (f"the optimizer step's condition `{facts.code(if_.test)}` is not `({counter} + 1) % "
                                 f"accumulation == 0` (or that, `or {counter} + 1 == len(loader)`)"))
        code = facts.code(accumulation)
        if not any(_divides(facts, n, code) for n in walk(node.body, itself=True)):
            return Refusal(if_, f"the loss is not divided by {code}: the split would change the gradient's scale")
        losses = {facts.code(e) for e in scope.loss_exprs()}
        if loader is None:  # slices [start:start + batch_size] of the script's tensors
            sliced = _sliced(facts, node, source)
            if isinstance(sliced, Refusal):
                return sliced
            micro, uppers = sliced
            read = read_elsewhere(facts, micro, accumulation, Expected(node, frozenset(losses), allowed=uppers))
            built = before = facts.statement_of(node)
        else:
            found = _loader_size(facts, node, loader)
            if isinstance(found, Refusal):
                return found
            built, micro = found
            read = read_elsewhere(facts, micro, accumulation, Expected(node, frozenset(losses), loader=loader)) or \
                length_read(facts, loader, code, node, if_.test)
            before = facts.statement_of(built)
        if read is not None:
            return read
        refused = self._trained_otherwise(facts, node.body, if_, node)
        if refused is not None:
            return refused
        when = "the DataLoader is built" if loader is not None else "the slices are taken"
        placed = _at(built, placed_split(facts, facts.code(micro), code, before, when))
        if logs and isinstance(placed, Split):
            lines = ", ".join(str(line_of(facts, log)) for log in dict.fromkeys(logs))
            placed = dataclasses.replace(placed, note=(
                f"; {counter} only decides when to log (line {lines}): it counts micro-batches, so at a split of k "
                f"the script logs 1/k as often (x2: half as often), the training the same"))
        return placed

    def _inner_split(self, facts: ModuleFacts, loop: TrainingLoop, scope, inner: cst.For) -> Split | Refusal:
        """The split of an inner micro-batch loop, ``for micro in range(accum):`` holding the backward and not the
        optimizer step, whose micro-batches come from ``next(iterator)`` of a DataLoader, from a function of the
        script's own that draws ``torch.randint(..., (batch_size,))`` indices (nanoGPT's ``get_batch``), or from one
        given the micro-step counter that takes rows from ``micro * batch_size`` on (``_split_indexed``)."""
        accumulation = loop_shapes.micro_count(inner)
        code = facts.code(accumulation)
        if any(facts.is_runtime_call(c, "batch_split") for c in facts.calls):
            return Refusal(inner, ALREADY, Status.PRESENT)
        counter = inner.target.value if isinstance(inner.target, cst.Name) else None
        indexed = None  # ``get_batch(step, micro, batch_size)``: the counter picks the rows
        for n in facts.nodes_in(inner.body, cst.Name):
            if n.value != counter or not names_variable(facts, n) or last_micro_test(facts, n, code):
                continue
            if indexed is None and (indexed := indexed_call(facts, n)) is not None:
                continue
            return Refusal(n, f"{counter} counts micro-batches (line {line_of(facts, n)}): the split changes it")
        if not any(_divides(facts, n, code) for n in walk(inner.body, itself=True)):
            return Refusal(inner, f"the loss is not divided by {code}: the split would change the gradient's scale")
        source = from_indexed(facts, inner, indexed, accumulation) if indexed is not None else \
            _micro_source(facts, loop, inner, accumulation)
        if isinstance(source, Refusal):
            return source
        if isinstance(source, Loader):
            return self._loader_split(facts, scope, inner, accumulation, source)
        micro, before, *taken = source
        micro_code = facts.code(micro)
        refused = _rebinding_call(facts, micro_code, code)
        if refused is not None:
            return refused
        losses = {facts.code(e) for e in scope.loss_exprs()}
        first = parameters_of(facts, [micro_code, code], before)
        within = facts.function_of(before) if first is not None else None  # parameters: read in their function only
        read = read_elsewhere(facts, micro, accumulation,
                              Expected(inner, frozenset(losses), True, within, allowed=taken[0] if taken else frozenset()))
        if read is not None:
            return read
        refused = self._trained_otherwise(facts, inner.body, None, inner)
        if refused is not None:
            return refused
        return _at(inner, placed_split(facts, micro_code, code, before, "the micro-batches are drawn"))

    def _loader_split(self, facts: ModuleFacts, scope, inner: cst.For, accumulation: cst.BaseExpression,
                      found: Loader) -> Split | Refusal:
        """The split of micro-batches a loader object of the script's own class cuts (``_split_loader``): made in
        the training loader's constructor argument, the accumulation count rebound right before it is built."""
        code, micro = facts.code(accumulation), facts.code(found.argument.value)
        refused = _rebinding_call(facts, micro, code)
        if refused is not None:
            return refused
        binding = _bound_before(facts, code, found.built)
        if isinstance(binding, Refusal):
            return binding
        losses = {facts.code(e) for e in scope.loss_exprs()}
        before = frozenset(n for n in facts.nodes_in(facts.block_of(found.built), cst.Name)  # (see the count unsplit)
                           if n.value == code and facts.position(n) < position_of(facts, found.built)
                           and facts.function_of(n) is facts.function_of(found.built))
        read = count_read_elsewhere(facts, accumulation, Expected(inner, frozenset(losses), True, allowed=before),
                                    found.kept)
        if read is not None:
            return read
        refused = self._trained_otherwise(facts, inner.body, None, inner)
        if refused is not None:
            return refused
        bound = unique_name(facts, facts.module, f"{found.kept.replace('.', '_')}")
        note = "; the training loader alone is built with the bigger micro-batch (another built with the same size keeps it)"
        if found.moves_on:
            note += (f"; at the end of its data {found.kept.split('.')[0]} moves on as soon as a whole micro-batch no "
                     "longer fits: a bigger one moves on up to k - 1 of the original's micro-batches earlier there")
        return Split(micro, code, found.built, first=True, note=note, argument=found.argument, bound=bound)

    def _lightning_split(self, facts: ModuleFacts, call: cst.Call) -> Split | Refusal | None:
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
            return Refusal(call, "no trainer.fit(...) of this Trainer is found: which DataLoader it trains on is not known")
        source = _lightning_loader(self.project, facts, fit)
        if isinstance(source, Refusal):
            return source
        micro, built, before = source
        refused = _loader_refuses(built)
        if refused is not None:
            return Refusal(built, refused)
        loader = argument(fit, 1, "train_dataloaders")
        read = read_elsewhere(facts, micro, accumulation, Expected(call, products=True)) or (
            length_read(facts, loader.value, facts.code(accumulation), fit) if isinstance(loader, cst.Name) else None)
        if read is not None:
            return read
        changed = self._changes_the_math()
        if changed is not None:
            return Refusal(call, changed)
        first = min((before, facts.statement_of(call)), key=lambda st: position_of(facts, st))
        return _at(call, placed_split(facts, facts.code(micro), facts.code(accumulation), first,
                                      "the Trainer and its data are built"))

    def _accelerate_split(self, facts: ModuleFacts, call: cst.Call) -> Split | Refusal | None:
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
            return Refusal(call, "no loop runs its micro-batches `with accelerator.accumulate(model):`: Accelerate "
                                 "does not accumulate them")
        loop = inside[0].node
        it = loop.iter.args[0].value if isinstance(loop.iter, cst.Call) and isinstance(loop.iter.func, cst.Name) \
            and loop.iter.func.value == "enumerate" and loop.iter.args else loop.iter
        if not isinstance(it, cst.Name):
            return Refusal(loop, f"the loop iterates {facts.code(it)}, not a DataLoader by name: its batch size is not known")
        built = [a.value for a in assignments(facts, scope_of(facts, loop), it.value, before=loop)
                 if isinstance(a.value, cst.Call) and facts.qualname(a.value.func) in DATALOADERS]
        if len(built) != 1:
            return Refusal(loop, f"{it.value} is not built by one DataLoader(...) in this function: its batch size is not known")
        built = built[0]
        micro = _batch_size_of(facts, built)
        if isinstance(micro, str):
            return Refusal(built, micro)
        read = read_elsewhere(facts, micro, accumulation, Expected(call, products=True, loader=it.value)) or \
            length_read(facts, it.value, facts.code(accumulation), loop)
        if read is not None:
            return read
        refused = self._trained_otherwise(facts, loop.body, None, call, accelerated=True)
        if refused is not None:
            return refused
        first = min((facts.statement_of(built), facts.statement_of(call)), key=lambda st: position_of(facts, st))
        return _at(call, placed_split(facts, facts.code(micro), facts.code(accumulation), first,
                                      "the Accelerator and the DataLoader are built"))

    def _trained_otherwise(self, facts: ModuleFacts, body: cst.CSTNode, step_if: cst.If | None, at: cst.CSTNode,
                           accelerated: bool = False) -> Refusal | None:
        """Why the same samples in fewer, bigger micro-batches would train otherwise: something in the loop's
        ``body`` that runs once per micro-batch (``_per_micro_step``), or the model or loss (at ``at``)."""
        counted = self._per_micro_step(facts, body, step_if, accelerated)
        if counted is not None:
            return counted
        changed = self._changes_the_math()
        return Refusal(at, changed) if changed is not None else None

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
                return Refusal(call, (f"{facts.code(func.value)}.step() at line {line_of(facts, call)} runs once per "
                                      "micro-batch: the split would change the learning-rate schedule"))
            if qual in CLIP:
                return Refusal(call, (f"{qual.rsplit('.', 1)[-1]} at line {line_of(facts, call)} clips each micro-batch's "
                                      "gradients: the split would change what is clipped"))
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


def _at(node: cst.CSTNode, placed: Split | str) -> Split | Refusal:
    """The split, or (``node``, why it cannot be placed)."""
    return placed if isinstance(placed, Split) else Refusal(node, placed)


RANDINT = "torch.randint"
_NEXT_OF_NAME = m.Call(func=m.Name("next"), args=[m.Arg(m.Name()), m.ZeroOrMore()])  # ``next(it)``, ``next(it, None)``
# ``range(0, n, step)``, positional
_FROM_ZERO_BY = m.Call(func=m.Name("range"), args=[m.Arg(m.Integer("0"), keyword=None, star=""),
                                                    m.Arg(keyword=None, star=""), m.Arg(keyword=None, star="")])


def _rebinding_call(facts: ModuleFacts, micro: str, accumulation: str) -> Refusal | None:
    """exec() or globals() in the module: they may rebind the sizes where the split reads them."""
    for call in facts.calls:
        if isinstance(call.func, cst.Name) and call.func.value in ("exec", "globals") and \
                facts.qualname(call.func) in (call.func.value, f"builtins.{call.func.value}", None):
            return Refusal(call, (f"{call.func.value}() at line {line_of(facts, call)} may rebind {micro} and {accumulation}: "
                                  "their values where the split is made are not known"))
    return None


def _bound_before(facts: ModuleFacts, code: str, statement: cst.BaseStatement) -> cst.Assign | Refusal:
    """The one binding of the accumulation count ``code`` (a variable), in the block of ``statement`` and before it."""
    scope = scope_of(facts, statement)
    found = [a for a in assignments(facts, scope, code, unpacking=True)] if "." not in code else []
    if len(found) != 1 or facts.block_of(facts.statement_of(found[0])) is not facts.block_of(statement) or \
            position_of(facts, facts.statement_of(found[0])) >= position_of(facts, statement):
        return Refusal(statement, (f"{code} is not a variable bound once before the loader is built, in its block: "
                                   "its value where the split is made is not known"))
    return found[0]


def _micro_source(facts: ModuleFacts, loop: TrainingLoop, inner: cst.For, accumulation: cst.BaseExpression):
    """(the micro-batch size's expression, the statement before which it must be split) for the batches drawn in
    ``inner``, a Loader (a loader object of the script's own class cuts them), or (where, why not)."""
    for call in facts.nodes_in(inner.body, cst.Call):
        func = call.func
        if m.matches(call, _NEXT_OF_NAME):
            return _from_iterator(facts, inner, call.args[0].value.value, facts.code(accumulation))
        if isinstance(func, cst.Name):
            defined = module_function(facts, func.value)
            if defined is not None and any(facts.qualname(c.func) == RANDINT for c in facts.nodes_in(defined, cst.Call)):
                return _from_sampler(facts, loop, inner, defined)
    cut = loader_call(facts, inner)
    if cut is not None:
        return from_loader(facts, inner, cut, accumulation)
    return Refusal(inner, ("the micro-batches of the inner loop come neither from next() of a DataLoader's iterator, nor "
                           "from a function of the script's that draws torch.randint indices, nor from a loader object of "
                           "the script's own class: their size is not known"))


def _from_iterator(facts: ModuleFacts, inner: cst.For, name: str, accumulation: str):
    """``batch = next(it)`` where every binding of ``it`` is ``iter(loader)`` of one DataLoader."""
    scope = scope_of(facts, inner)
    bound = assignments(facts, scope, name) or assignments(facts, facts.module, name)
    loaders = set()
    for assign in bound:
        value = assign.value
        if not (isinstance(value, cst.Call) and isinstance(value.func, cst.Name) and value.func.value == "iter"
                and value.args and isinstance(value.args[0].value, cst.Name)):
            return Refusal(assign, f"{name} = {facts.code(value)}: not iter() of a DataLoader, its batches' size is not known")
        loaders.add(value.args[0].value.value)
    if len(loaders) != 1:
        return Refusal(inner, f"next({name}): {name} is not bound to iter() of one DataLoader")
    (loader,) = loaders
    found = _loader_size(facts, inner, loader)
    if isinstance(found, Refusal):
        return found
    built, micro = found
    return length_read(facts, loader, accumulation, inner) or (micro, facts.statement_of(built))


def _from_sampler(facts: ModuleFacts, loop: TrainingLoop, inner: cst.For, defined: cst.FunctionDef):
    """``get_batch()`` whose body draws ``torch.randint(n, (batch_size,))`` with a global ``batch_size``: one draw of
    k times as many indices on the CPU generator is the k draws it replaces, one after another. Every other call of
    the function must be a fetch ahead of the loop (nanoGPT's first batch), or it would draw differently."""
    name = defined.name.value
    draws = [c for c in facts.nodes_in(defined, cst.Call) if facts.qualname(c.func) == RANDINT]
    if len(draws) != 1:
        return Refusal(defined, f"{name}() draws torch.randint {len(draws)} times: which one is the micro-batch is not known")
    draw = draws[0]
    size = argument(draw, None, "size")
    if size is None:
        size = next((a.value for a in draw.args if a.keyword is None and isinstance(a.value, (cst.Tuple, cst.List))),
                    None)
    elements = size.elements if isinstance(size, (cst.Tuple, cst.List)) else ()
    micro = elements[0].value if len(elements) == 1 else None
    if not is_reference(micro):
        shown = facts.code(size) if size is not None else "no size"
        return Refusal(draw, f"torch.randint's size {shown} is not (batch_size,) of a variable of the script's own")
    base = micro.value if isinstance(micro, cst.Name) else facts.code(micro).split(".", 1)[0]
    if assignments(facts, defined, base) or any(p.name.value == base for p in defined.params.params):
        return Refusal(draw, f"{base} is {name}()'s own: the micro-batch size is not a setting of the script")
    device = argument(draw, None, "device")
    if device is not None and not (isinstance(device, cst.SimpleString) and device.evaluated_value == "cpu"):
        return Refusal(draw, (f"torch.randint(device={facts.code(device)}): a bigger draw on an accelerator's generator is "
                              "not the smaller draws it replaces"))
    calls = [c for c in facts.calls if isinstance(c.func, cst.Name) and c.func.value == name]
    outer_function = facts.function_of(loop.outer)
    for call in calls:
        if facts.contains(inner, call):
            continue
        ahead = facts.function_of(call) is outer_function and facts.block_of(facts.statement_of(call)) is \
            facts.block_of(loop.outer) and facts.position(call) < facts.position(loop.outer)
        if not ahead:
            return Refusal(call, (f"{name}() is also called at line {line_of(facts, call)}: a bigger {facts.code(micro)} would "
                                  "change what it draws there, and the draws after it"))
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
            return Refusal(fit, f"{loader.value} is not one DataLoader(...) of this function: its batch size is not known")
        micro = argument(value, 1, "batch_size")
        if not is_reference(micro):
            return Refusal(value, "the DataLoader's batch size is not a variable or option of the script's own")
        return micro, value, facts.statement_of(value)
    holder = datamodule if datamodule is not None else (loader if loader is not None else argument(fit, 0, "model"))
    if not isinstance(holder, cst.Name):
        return Refusal(fit, "the training data are not given by name to fit(): their batch size is not known")
    found = assignments(facts, scope_of(facts, fit), holder.value, before=fit)
    built = found[0].value if len(found) == 1 else None
    if not isinstance(built, cst.Call):
        return Refusal(fit, f"{holder.value} is not built once in this function: its batch size is not known")
    cls = _local_class(project, facts, built.func)
    if cls is None:
        return Refusal(built, f"{facts.code(built.func)} is not a class of the script's: how it batches is not known")
    method = next((m for m in cls.body.body if isinstance(m, cst.FunctionDef) and m.name.value == "train_dataloader"),
                  None)
    init = next((m for m in cls.body.body if isinstance(m, cst.FunctionDef) and m.name.value == "__init__"), None)
    owner = next(f for f in project.modules if f.contains(f.module, cls))
    loaders = [c for c in owner.nodes_in(method, cst.Call) if owner.qualname(c.func) in DATALOADERS] if method else []
    if len(loaders) != 1 or init is None:
        return Refusal(built, f"{cls.name.value}.train_dataloader does not build one DataLoader: its batch size is not known")
    size = argument(loaders[0], 1, "batch_size")
    attr = _self_attribute(owner, size)
    if attr is None:
        return Refusal(loaders[0], (f"{cls.name.value}'s DataLoader batch size {owner.code(size) if size else '(1)'} is not "
                                    "self.<name> or self.hparams.<name>: where it comes from is not known"))
    params = [p.name.value for p in init.params.params]
    if attr not in params:
        return Refusal(loaders[0], f"{attr} is not a parameter of {cls.name.value}.__init__: where it comes from is not known")
    micro = argument(built, params.index(attr) - 1, attr)
    if not is_reference(micro):
        shown = facts.code(micro) if micro is not None else f"{cls.name.value}'s default"
        return Refusal(built, f"the batch size {shown} is not a variable or option of the script's own")
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
    if isinstance(size, cst.Subscript) and facts.code(size.value) == "self.hparams":
        return string_key(size)
    return None


def _slice_starts(loop: cst.For) -> bool:
    """``for i, start in enumerate(range(0, n, batch_size))``: where each micro-batch starts, batch_size a variable of
    the script's."""
    starts = loop_shapes.slice_starts(loop)
    return starts is not None and m.matches(starts[1], _FROM_ZERO_BY) and is_reference(starts[1].args[2].value)


def _sliced(facts: ModuleFacts, loop: cst.For, source: cst.Call):
    """(the micro-batch size, its reads in the slices) for ``for i, start in enumerate(range(0, n, batch_size))``
    whose body reads ``start`` only as ``x[start:start + batch_size]`` (a slice of the first dimension): the slices of
    k times batch_size are the k slices they replace, one after another (the last one of an epoch ends at n either
    way); or (where, why not)."""
    micro = source.args[2].value
    code = facts.code(micro)
    start = loop_shapes.slice_starts(loop)[0]  # type: ignore[index]
    stop = source.args[1].value
    if any(facts.code(n) == code for n in walk(stop, itself=True)):
        return Refusal(source, f"the range's end {facts.code(stop)} reads {code}: a bigger micro-batch would end an epoch elsewhere")
    # ``[start:start + batch_size]``
    in_slice = m.Slice(lower=m.Name(start), step=None, upper=m.BinaryOperation(
        left=m.Name(start), operator=m.Add(), right=m.MatchIfTrue(lambda right: facts.code(right) == code)))
    uppers: list[cst.CSTNode] = []
    for n in facts.nodes_in(loop.body, cst.Name):
        if n.value != start or not names_variable(facts, n):
            continue
        parent = facts.parent(n)
        upper = parent if isinstance(parent, cst.BinaryOperation) else None  # ``start + batch_size``
        bounds = facts.parent(upper) if upper is not None else parent
        if m.matches(bounds, in_slice) and (upper is None or upper is bounds.upper) and first_dimension(facts, bounds):
            if upper is not None:
                uppers.append(upper.right)
            continue
        return Refusal(n, (f"{start} is read at line {line_of(facts, n)} other than as a slice [{start}:{start} + {code}] of a "
                           "tensor's first dimension: what a bigger micro-batch would read there is not known"))
    if not uppers:
        return Refusal(loop, f"no slice [{start}:{start} + {code}] in the loop: where its micro-batches come from is not known")
    return micro, frozenset(uppers)


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
        return Refusal(loop, built)
    size = _batch_size_of(facts, built)
    return Refusal(built, size) if isinstance(size, str) else (built, size)


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
        return Refusal(call, ALREADY, Status.PRESENT)
    if not is_reference(accumulation):
        return Refusal(call, f"{keyword}={facts.code(accumulation)} is not a variable or option of the script's own")
    return accumulation


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
