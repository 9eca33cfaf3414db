"""batch_split: the same samples per optimizer step in fewer, bigger micro-batches, where the script accumulates
gradients over the batches of its DataLoader (``if (i + 1) % accum == 0: optimizer.step()``)."""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from autotune.analysis import ModuleFacts
from autotune.bound import unbound
from autotune.knobs import Knob, Numerics
from autotune.project import TrainingLoop
from autotune.syntax import argument, assignments, enclosing_if, names_variable, scope_of, stmt, walk
from autotune.transform import Edits, Status, Transform

DATALOADERS = {"torch.utils.data.DataLoader", "torch.utils.data.dataloader.DataLoader"}
# layers whose training depends on which samples share a micro-batch, or on the order of random draws per layer
BATCH_NORMS = {
    "torch.nn.BatchNorm1d", "torch.nn.BatchNorm2d", "torch.nn.BatchNorm3d", "torch.nn.SyncBatchNorm",
    "torch.nn.LazyBatchNorm1d", "torch.nn.LazyBatchNorm2d", "torch.nn.LazyBatchNorm3d",
    "torch.nn.functional.batch_norm",
}  # fmt: skip
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


class BatchSplit(Transform):
    """Split each optimizer step's samples into fewer, bigger micro-batches where the script accumulates gradients
    over its DataLoader's batches: the micro-batch size times k, the accumulation steps divided by k."""

    name = "batch_split"
    knobs = (
        Knob(
            "batch_split.factor",
            (1, 2, 4, 8, 16),
            1,
            Numerics.REORDER,
            help="the DataLoader's batch_size times this, the accumulation steps divided by it: the same samples in "
            "the same order in each optimizer step, the loss still their mean (only where it divides the "
            "accumulation steps; at an epoch's end a last, smaller micro-batch weighs as the script weighs it)",
        ),
    )

    def apply(self, facts: ModuleFacts, edits: Edits) -> None:
        for loop in self.project.loops:
            if loop.module is not facts:
                continue
            found = self._split(facts, loop)
            if found is None:
                continue
            if isinstance(found, tuple):
                node, reason = found
                status = Status.PRESENT if reason.startswith("the batch split is already") else Status.NOT_APPLICABLE
                self.report(facts, node, status, reason)
                continue
            self.report(facts, loop.node, Status.APPLICABLE, (
                f"micro-batches of {found.micro} x {found.accumulation} accumulation steps: the split of each "
                "optimizer step's samples becomes a knob (bigger micro-batches, fewer accumulation steps, the same "
                "samples in the same order)"))
            pair = f"{found.micro}, {found.accumulation}"
            if self.mode.gated:
                edits.insert_after(found.after, stmt(f"{pair} = {edits.runtime('batch_split')}({pair})\n"))
                continue
            k = self.mode.value(self.knobs[0])
            if k != 1:
                edits.insert_after(found.after, stmt(
                    f"if {found.accumulation} % {k} == 0:  # autotune: micro-batch x{k}, accumulation /{k}: same "
                    f"samples per step\n    {pair} = {found.micro} * {k}, {found.accumulation} // {k}\n"))

    def _split(self, facts: ModuleFacts, loop: TrainingLoop) -> _Split | tuple[cst.CSTNode, str] | None:
        """The split of ``loop``'s accumulation, or (where, why not), or None where the loop does not accumulate
        over the batches it iterates."""
        node = loop.node
        scopes = [s for s in loop.scopes if s.module is facts and s.steps]
        if not scopes or not isinstance(node, cst.For):
            return None
        scope = scopes[-1]
        conditions = [a for call in scope.steps if (a := enclosing_if(facts, call, node)) is not None]
        if not conditions:
            return None  # the optimizer steps on every batch: nothing accumulates
        if_ = conditions[0]
        counter, loader = _enumerated(node)
        if counter is None or loader is None:
            return if_, "the loop is not `for i, batch in enumerate(loader)`: its micro-batches cannot be told"
        if any(facts.is_runtime_call(c, "batch_split") for c in facts.calls):
            return if_, "the batch split is already a knob"
        for n in facts.nodes_in(node.body, cst.Name):
            if n.value == counter and names_variable(facts, n) and not facts.contains(if_.test, n):
                line = _line(facts, n)
                return n, f"{counter} counts micro-batches (line {line}): the split changes it"
        accumulation = _accumulation(facts, if_.test, counter, _start(node))
        if accumulation is None:
            return if_, (f"the optimizer step's condition `{facts.code(if_.test)}` is not `({counter} + 1) % "
                         "accumulation == 0`")
        code = facts.code(accumulation)
        if not any(_divides(facts, n, code) for n in walk(node.body, itself=True)):
            return if_, f"the loss is not divided by {code}: the split would change the gradient's scale"
        built = _loader_call(facts, node, loader)
        if isinstance(built, str):
            return node, built
        micro = argument(built, 1, "batch_size")
        if not isinstance(micro, (cst.Name, cst.Attribute)) or not _plain(micro):
            shown = facts.code(micro) if micro is not None else "DataLoader's default of 1"
            return built, f"the batch size {shown} is not a variable or option of the script's own"
        for keyword in ("batch_sampler", "sampler"):
            if argument(built, None, keyword) is not None:
                return built, f"{keyword}=: the samples of a micro-batch are the sampler's choice"
        drop_last = argument(built, None, "drop_last")
        if drop_last is not None and not (isinstance(drop_last, cst.Name) and drop_last.value == "False"):
            return built, "drop_last: a bigger batch would drop another tail of each epoch"
        micro_code = facts.code(micro)
        losses = {facts.code(e) for e in scope.loss_exprs()}
        for expr_code, own in ((micro_code, micro), (code, accumulation)):
            other = _other_use(facts, expr_code, own, node, losses if own is accumulation else set())
            if other is not None:
                line = _line(facts, other)
                return other, f"{expr_code} is also read at line {line}: the split would change it"
        layer = self._per_micro_batch()
        if layer is not None:
            return node, layer
        summed = _summed_loss(self.project)
        if summed is not None:
            return node, summed
        after = _bound_once(facts, [micro_code, code], facts.statement_of(built))
        if isinstance(after, str):
            return built, after
        return _Split(micro_code, code, after)

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


def _enumerated(loop: cst.For) -> tuple[str | None, str | None]:
    """(counter, loader) of ``for i, batch in enumerate(loader)``."""
    it, target = loop.iter, loop.target
    if not (isinstance(it, cst.Call) and isinstance(it.func, cst.Name) and it.func.value == "enumerate" and it.args):
        return None, None
    if not (isinstance(target, cst.Tuple) and len(target.elements) == 2 and isinstance(target.elements[0].value, cst.Name)):
        return None, None
    source = it.args[0].value
    return target.elements[0].value.value, source.value if isinstance(source, cst.Name) else None


def _start(loop: cst.For) -> int | None:
    """enumerate's start: 0, 1, or None where it is something else."""
    args = loop.iter.args  # type: ignore[attr-defined]
    if len(args) == 1:
        return 0
    value = args[1].value
    return int(value.value) if isinstance(value, cst.Integer) and value.value in ("0", "1") else None


def _accumulation(facts: ModuleFacts, test: cst.BaseExpression, counter: str, start: int | None):
    """``A`` of ``(i + 1) % A == 0`` (``i % A == 0`` where enumerate counts from 1), where A is a variable."""
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
    if not counted or not isinstance(right, (cst.Name, cst.Attribute)) or not _plain(right):
        return None
    return right


def _line(facts: ModuleFacts, node: cst.CSTNode) -> int:
    """The line of the statement that holds ``node``."""
    at = facts.statement_of(node)
    return facts.position(at.body[0] if isinstance(at, cst.SimpleStatementLine) and at.body else at)[0]


def _plain(node: cst.BaseExpression) -> bool:
    """A variable or an attribute chain on one (``accum``, ``args.accum``, ``cfg.train.accum``)."""
    while isinstance(node, cst.Attribute):
        node = node.value
    return isinstance(node, cst.Name)


def _divides(facts: ModuleFacts, node: cst.CSTNode, code: str) -> bool:
    """``x / A`` or ``x /= A``."""
    if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.Divide):
        return facts.code(node.right) == code
    if isinstance(node, cst.AugAssign) and isinstance(node.operator, cst.DivideAssign):
        return facts.code(node.value) == code
    return False


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


def _other_use(facts: ModuleFacts, code: str, own: cst.CSTNode, loop: cst.For, losses: set[str]) -> cst.CSTNode | None:
    """A read of ``code`` other than ``own``, the loss division in ``loop`` and the loss scaled back for a log line
    (``loss.item() * accum``: the last micro-batch's mean loss, whatever its size), or None."""
    kind = cst.Attribute if "." in code else cst.Name
    for n in facts.nodes_in(facts.module, kind):
        if n is own or facts.code(n) != code:
            continue
        parent = facts.parent(n)
        if isinstance(parent, cst.AssignTarget):
            continue  # the binding
        if isinstance(parent, cst.BinaryOperation) and isinstance(parent.operator, cst.Divide) and parent.right is n \
                and facts.contains(loop, n):
            continue
        if isinstance(parent, cst.AugAssign) and parent.value is n and facts.contains(loop, n):
            continue
        if isinstance(parent, cst.BinaryOperation) and isinstance(parent.operator, cst.Multiply):
            other = parent.left if parent.right is n else parent.right
            if any(isinstance(m, cst.Name) and m.value in losses for m in walk(other, itself=True)):
                continue
        return n
    return None


def _bound_once(facts: ModuleFacts, codes: list[str], before: cst.BaseStatement) -> cst.BaseStatement | str:
    """The statement after which every one of ``codes`` is bound, each by one statement of one block, or why not."""
    statements = []
    for code in codes:
        base = code.split(".", 1)[0]
        scope = scope_of(facts, before)
        found = assignments(facts, scope, base, before=before)
        if not found and scope is not facts.module:
            found = assignments(facts, facts.module, base)
        if len(found) != 1:
            return f"{base} is bound {len(found)} times before the DataLoader: its value there is not known"
        statements.append(facts.statement_of(found[0]))
    last = max(statements, key=lambda s: facts.position(s))
    block = facts.block_of(last)
    if any(facts.block_of(s) is not block for s in statements):
        return f"{' and '.join(codes)} are bound in different blocks"
    if any(unbound(facts, before, code) for code in codes) and facts.function_of(last) is facts.function_of(before):
        return f"{' and '.join(codes)} may be unbound where the DataLoader is built"
    return last


def _zero(node: cst.BaseExpression) -> bool:
    return isinstance(node, (cst.Integer, cst.Float)) and float(node.value) == 0.0


# === runtime: what the patched script runs (python -m autotune.catalog copies it into autotune/runtime_helpers.py) ===

from typing import Any

from autotune.knob_values import knob, took_effect


def batch_split(micro: Any, accumulation: Any) -> tuple[Any, Any]:
    """(micro-batch size, accumulation steps) as ``batch_split.factor`` splits them: k times the micro-batch, the
    accumulation steps divided by k, so that each optimizer step trains on the same samples; as given where k does
    not divide the accumulation steps (or they are not whole numbers)."""
    k = knob("batch_split.factor", record=False)
    if k == 1 or not isinstance(micro, int) or not isinstance(accumulation, int) or accumulation % k:
        return micro, accumulation
    took_effect("batch_split.factor")
    return micro * k, accumulation // k
