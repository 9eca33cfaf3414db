"""The trial hooks a patch puts in: after each optimizer step ``_autotune.step(loss)`` (the step's loss and end, a
no-op outside a trial), per micro-batch ``_autotune.accumulate(loss)`` where the step's loss is only seen inside an
inner loop, the run-length markers before the loops around the step, and ``_autotune.framework_trial(trainer)``
before a framework's Trainer trains."""

from __future__ import annotations

import libcst as cst

from autotune import loop_shapes, run_length
from autotune.analysis import ModuleFacts
from autotune.bound import unbound
from autotune.project import Project, StepScope, TrainingLoop, loss_expr
from autotune.syntax import enclosing_if, stmt, walk
from autotune.transform import Edits


def _hook_losses(facts: ModuleFacts, exprs: list[cst.BaseExpression]) -> list[str]:
    """Loss expressions that can be evaluated again after the step: names, attributes and arithmetic on them."""
    out = []
    for e in exprs:
        if not any(isinstance(n, cst.Call) for n in walk(e, itself=True)):
            code = facts.code(e)
            if code not in out:
                out.append(code)
    return out


def _micro_batch_name(facts: ModuleFacts, loop: TrainingLoop, scope: StepScope) -> str | None:
    """The micro-batch of an inner accumulation loop that holds every backward(), whose first dimension counts the
    step's samples; None where there is none."""
    if loop.module is not facts:
        return None
    inner = loop_shapes.micro_loop(facts, loop.node, scope)
    return loop_shapes.micro_batch(facts, inner) if inner is not None else None


def step_hooks(project: Project, facts: ModuleFacts, edits: Edits) -> None:
    """After the last optimizer step of each training step, ``_autotune.step(losses...)`` (a no-op outside trials),
    once on whichever path the step takes; a loss or batch not bound on every path there is left out. A helper
    that steps the optimizer for several loops (a warm-up loop and the training loop both calling
    ``manager.step_optimizers()``) gets one hook, not one per loop: each would count the same step again."""
    hooked: set[int] = set()  # the anchors given a hook in this pass
    for loop in project.loops:
        stepping = [s for s in loop.scopes if s.stepping]
        if stepping and not stepping[-1].backward:
            # the optimizer steps in a helper the loop calls after its own backward() (a training manager's
            # step_optimizers()): the step hook there sees no loss, so the loop's backward calls add theirs up
            for other in loop.scopes:
                if other.module is facts and other.backward and not other.stepping and not any(
                        facts.is_runtime_call(c, "accumulate") for c in facts.calls_in(other.owner)):
                    _accumulate_hooks(facts, other, edits, hooked=hooked)
        scopes = [s for s in stepping if s.module is facts]
        if not scopes:
            continue
        scope = scopes[-1]
        if any(facts.is_runtime_call(c, "step") for c in facts.calls_in(scope.owner)):
            continue  # already patched
        losses = _hook_losses(facts, scope.loss_exprs())
        # the optimizer steps under a condition its backward() is not under (``if (i + 1) % accum == 0``): the
        # step's loss is the sum of its micro-steps', which the accumulate hook adds up
        counted = loop.module is facts and _steps_on_condition(facts, loop.node, scope)
        hidden = counted  # a path on which the step hook sees no loss: bound only inside an inner loop
        for anchor in _hook_anchors(facts, scope):
            if id(anchor) in hooked:
                continue
            hooked.add(id(anchor))
            args = [] if counted else [code for code in losses if not unbound(facts, anchor, code, after=True)]
            hidden = hidden or (bool(losses) and not args)
            batch = loop_shapes.batch_of(loop.node) if loop.module is facts and facts.contains(loop.node, anchor) else None
            if batch is not None and batch not in args and not unbound(facts, anchor, batch, after=True):
                args.append(f"batch={batch}")
            edits.insert_after(anchor, stmt(f"{edits.runtime('step')}({', '.join(args)})\n"))
        if hidden:
            batch = loop_shapes.batch_of(loop.node) if counted else _micro_batch_name(facts, loop, scope)
            _accumulate_hooks(facts, scope, edits, batch, hooked)
        if loop.module is facts and not any(facts.is_runtime_call(c, "loop_length") for c in facts.calls):
            name = facts.path.relative_to(project.root).as_posix()
            group = f"{name}:{facts.position(loop.node)[0]}"
            for marker in reversed(run_length.markers(facts, loop, name)):  # each first before its loop: reversed
                line = run_length.length_marker(edits.runtime("loop_length"), marker, group,
                                                counted and marker.node is loop.node)
                edits.insert_first_before(marker.node, stmt(line))


def framework_hooks(project: Project, facts: ModuleFacts, edits: Edits) -> None:
    """Just before ``trainer.train()``, ``_autotune.framework_trial(trainer)`` (a no-op outside trials): in a trial it
    reaches the framework's own hooks for each step's loss and end."""
    if any(facts.is_runtime_call(c, "framework_trial") for c in facts.calls):
        return  # already patched
    for training in project.tuned_frameworks():
        if training.module is not facts:
            continue
        at = facts.statement_of(training.call)
        trainer = facts.code(training.call.func.value)
        if not unbound(facts, at, trainer):
            edits.insert_before(at, stmt(f"{edits.runtime('framework_trial')}({trainer})\n"))


def _steps_on_condition(facts: ModuleFacts, loop: cst.CSTNode, scope: StepScope) -> bool:
    """Whether every optimizer step of ``scope`` is in the body of an ``if`` inside ``loop`` that holds none of its
    backward() calls: gradient accumulation over the loop's own iterations."""
    if not scope.stepping or not scope.backward:
        return False
    for step in scope.stepping:
        condition = enclosing_if(facts, step, loop, scope.owner)
        if condition is None or any(facts.contains(condition, b) for b in scope.backward):
            return False
    return True


def _accumulate_hooks(
    facts: ModuleFacts, scope: StepScope, edits: Edits, batch: str | None = None, hooked: set[int] | None = None
) -> None:
    """Gradient accumulation over an inner loop (``for micro in range(accum): loss = ... / accum; loss.backward()``)
    binds the loss only inside that loop: after each backward, ``_autotune.accumulate(loss)`` (a no-op outside
    trials) adds it to the optimizer step's loss, which a step hook that sees no loss of its own records. Where the
    loop's own batches are the micro-batches, ``batch=`` counts their samples into the step's."""
    for call in scope.backward:
        expr = loss_expr(facts, call)
        codes = _hook_losses(facts, [expr] if expr is not None else [])
        at = facts.statement_of(call)
        if hooked is not None:
            if id(at) in hooked:
                continue  # (a loop body two loops share)
            hooked.add(id(at))
        codes = [code for code in codes if not unbound(facts, at, code, after=True)]
        if codes and batch is not None and batch not in codes and not unbound(facts, at, batch, after=True):
            codes.append(f"batch={batch}")
        if codes:
            edits.insert_after(at, stmt(f"{edits.runtime('accumulate')}({', '.join(codes)})\n"))


def _hook_anchors(facts: ModuleFacts, scope: StepScope) -> list[cst.BaseStatement]:
    """The statements after which a training step has ended, one on each path through the step."""
    stepping = []
    for step in scope.stepping:
        at = facts.statement_of(step)
        for node in facts.ancestors(step):
            if node is scope.owner:
                break
            if isinstance(node, (cst.For, cst.While)):
                at = node  # a loop over optimizers or parameters: the step ends with the loop
        stepping.append(at)
    return _anchors_among(facts, stepping)


def _anchors_among(facts: ModuleFacts, stepping: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
    """The last statement holding a step in the innermost block holding them all; an ``if`` whose every branch
    steps counts as one (``scaler.step(opt)`` else ``opt.step()``), else each branch that steps gets its own."""
    block = next(
        b for b in facts.ancestors(stepping[0])
        if isinstance(b, (cst.IndentedBlock, cst.SimpleStatementSuite, cst.Module)) and all(facts.contains(b, s) for s in stepping)
    )
    last = max((next(n for n in [s, *facts.ancestors(s)] if facts.parent(n) is block) for s in stepping), key=facts._enter.__getitem__)
    if isinstance(last, cst.If) and last not in stepping and not _all_branches_step(facts, last, stepping):
        return [a for b in _branches(last)[0] if (inside := [s for s in stepping if facts.contains(b, s)]) for a in _anchors_among(facts, inside)]
    # the step in one branch, a hand-written update in the others (``else: p.data.add_(p.grad, alpha=-lr)``)
    while True:
        top = _chain_of(facts, last)
        if top is None or not _all_branches_step(facts, top, [last]):
            return [last]
        last = top


def _chain_of(facts: ModuleFacts, stmt: cst.BaseStatement) -> cst.If | None:
    """The ``if`` statement (the head of its elif chain) one of whose branches holds ``stmt``."""
    node = facts.parent(facts.parent(stmt))  # the block's owner
    if isinstance(node, cst.Else):
        node = facts.parent(node)
    if not isinstance(node, cst.If):
        return None
    while isinstance(facts.parent(node), cst.If):
        node = facts.parent(node)
    return node


def _all_branches_step(facts: ModuleFacts, node: cst.If, stepping: list[cst.BaseStatement]) -> bool:
    branches, complete = _branches(node)
    return complete and all(any(facts.contains(b, s) for s in stepping) or _updates_by_hand(facts, b) for b in branches)


def _branches(node: cst.If) -> tuple[list[cst.BaseSuite], bool]:
    """The blocks of an if/elif/else chain, and whether it ends in an ``else`` (some branch always runs)."""
    out = [node.body]
    while isinstance(node.orelse, cst.If):
        node = node.orelse
        out.append(node.body)
    if node.orelse is None:
        return out, False
    return [*out, node.orelse.body], True


def _updates_by_hand(facts: ModuleFacts, block: cst.CSTNode) -> bool:
    """Whether a branch reads gradients (``p.data.add_(p.grad, alpha=-lr)``): a hand-written optimizer step."""
    return any(n.attr.value == "grad" for n in facts.nodes_in(block, cst.Attribute))
