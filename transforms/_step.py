"""The parts of a training step that transforms wrap or follow: the statements that compute the forward pass and
the loss before a backward(), the host-to-device copies that end them, and the device the step computes on."""

from __future__ import annotations

import libcst as cst

from autotune.analysis import ModuleFacts
from autotune.bound import unbound
from autotune.project import Project, manual_updates, updated_tensor, without_data
from autotune.syntax import assigned_names, is_docstring, walk
from autotune.transforms._sites import h2d_copy

CLIP = {
    f"torch.nn.utils{module}.{name}"
    for module in ("", ".clip_grad")
    for name in ("clip_grad_norm_", "clip_grad_value_", "clip_grad_norm")
}


def is_copy(node: cst.BaseExpression) -> bool:
    """``x.to(device)``, ``batch["x"].cuda()``, tuples and comprehensions of them, casts chained on them."""
    if isinstance(node, (cst.Tuple, cst.List)):
        return bool(node.elements) and all(is_copy(e.value) for e in node.elements)
    if isinstance(node, cst.DictComp):
        return is_copy(node.value)
    if isinstance(node, (cst.ListComp, cst.GeneratorExp)):
        return is_copy(node.elt)
    if isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute):
        recv = node.func.value
        if node.func.attr.value in ("to", "cuda"):
            return not any(isinstance(n, cst.Call) for n in walk(recv, itself=True)) or is_copy(recv)
        return isinstance(recv, cst.Call) and is_copy(recv)
    return False


def is_copy_statement(facts: ModuleFacts, s: cst.BaseStatement) -> bool:
    if not isinstance(s, cst.SimpleStatementLine):
        return False
    for small in s.body:
        value = getattr(small, "value", None)
        if isinstance(value, cst.Call) and facts.is_runtime_call(value) and len(value.args) == 1:
            value = value.args[0].value  # _autotune.channels_last(x.to(device)) is still a copy
        if value is None or not is_copy(value):
            return False
    return True


def clears_grads(s: cst.BaseStatement) -> bool:
    """Whether ``s`` only clears gradients by hand: ``p.grad = None``, ``p.grad.zero_()`` (``.data`` between), or a
    loop over parameters doing that (``for p in parameters: p.grad = None``)."""
    if isinstance(s, cst.For) and isinstance(s.body, cst.IndentedBlock) and s.orelse is None:
        return bool(s.body.body) and all(clears_grads(b) for b in s.body.body)
    if not isinstance(s, cst.SimpleStatementLine):
        return False

    def grad(node: cst.BaseExpression) -> bool:
        node = without_data(node)
        return isinstance(node, cst.Attribute) and node.attr.value == "grad"

    for small in s.body:
        if isinstance(small, cst.Assign):
            if not (all(grad(t.target) for t in small.targets) and isinstance(small.value, cst.Name)
                    and small.value.value == "None"):
                return False
        elif isinstance(small, cst.Expr) and isinstance(small.value, cst.Call):
            func = small.value.func
            if not (isinstance(func, cst.Attribute) and func.attr.value == "zero_" and grad(func.value)
                    and not small.value.args):
                return False
        else:
            return False
    return True


def is_separator(project: Project, facts: ModuleFacts, s: cst.BaseStatement) -> bool:
    """Statements that end a step's forward and loss: zero_grad (or gradients cleared by hand), step (or a
    hand-written update), backward, clipping, host-to-device copies."""
    if clears_grads(s) or manual_updates(facts, s):
        return True
    for call in facts.calls_in(s):
        if project.is_zero_grad_call(call) or project.is_backward_call(facts, call) or project.is_step_call(facts, call):
            return True
        if facts.qualname(call.func) in CLIP or facts.is_runtime_call(call, "unscale_"):
            return True
    return is_copy_statement(facts, s)


def device_type_code(facts: ModuleFacts, scope, backward: cst.Call, group: list[cst.BaseStatement]) -> str | None:
    """Code that reads, where ``group`` starts, the type of the device the step computes on: that of the tensor the
    loop last copied to the device, else that of the stepped optimizer's first parameter (or of the tensor a
    hand-written update writes); None if neither is sure."""
    body = list(facts.block_of(group[0]).body)
    start = body.index(group[0])
    for i in range(start - 1, -1, -1):
        name = copied_name(facts, body[i])
        if name is not None:
            if not any(name in assigned_names(facts, s) for s in body[i + 1 : start]):
                return f"{name}.device.type"
            break
    order = facts._enter
    home = facts.function_of(backward)
    for step in sorted(scope.steps, key=order.__getitem__):
        recv = step.func.value  # type: ignore[attr-defined]
        if order[step] > order[backward] and facts.function_of(step) is home:
            if any(isinstance(n, cst.Call) for n in walk(recv, itself=True)):
                return None  # evaluating it again could have side effects
            if unbound(facts, group[0], facts.code(recv)):
                return None  # (an optimizer made on one path only: torch's device is the guess then)
            return f'{facts.code(recv)}.param_groups[0]["params"][0].device.type'
    for update in scope.updates:
        if order[update] > order[backward] and facts.function_of(update) is home:
            return _updated_device(facts, update, group[0])
    return None


def _updated_device(facts: ModuleFacts, update: cst.CSTNode, at: cst.BaseStatement) -> str | None:
    """Code for the device of the tensor a hand-written update writes, read at ``at``: ``W.device.type``, or of the
    first parameter a loop over them updates (``parameters[0]``, ``next(model.parameters())``)."""
    tensor = updated_tensor(update)
    if not isinstance(tensor, cst.Name):
        return None
    loop = next((a for a in facts.ancestors(update) if isinstance(a, cst.For) and isinstance(a.target, cst.Name)
                 and a.target.value == tensor.value), None)
    if loop is None:
        return None if unbound(facts, at, tensor.value) else f"{tensor.value}.device.type"
    source = loop.iter
    if isinstance(source, cst.Name) and not unbound(facts, at, source.value):
        return f"{source.value}[0].device.type"
    if (isinstance(source, cst.Call) and not source.args and isinstance(source.func, cst.Attribute)
            and source.func.attr.value == "parameters" and isinstance(source.func.value, cst.Name)
            and not unbound(facts, at, source.func.value.value)):
        return f"next({facts.code(source)}).device.type"
    return None


def copied_name(facts: ModuleFacts, s: cst.BaseStatement) -> str | None:
    """The first name ``s`` binds to a tensor copied to a device: ``x`` in ``x, y = x.to(device), y.to(device)``."""
    if not isinstance(s, cst.SimpleStatementLine):
        return None
    for small in s.body:
        if not isinstance(small, cst.Assign) or len(small.targets) != 1:
            continue
        target, value = small.targets[0].target, small.value
        pairs = [(target, value)]
        if isinstance(target, (cst.Tuple, cst.List)) and isinstance(value, (cst.Tuple, cst.List)):
            if len(target.elements) == len(value.elements):
                pairs = [(t.value, v.value) for t, v in zip(target.elements, value.elements)]
        for t, v in pairs:
            if isinstance(t, cst.Name) and is_device_copy(facts, v):
                return t.value
    return None


def is_device_copy(facts: ModuleFacts, node: cst.BaseExpression) -> bool:
    """``x.to(device)``, ``x.cuda()``, or casts chained on one (``x.to(device).float()``)."""
    while isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute):
        if h2d_copy(facts, node):
            return True
        node = node.func.value
    return False


def forward_statements(
    project: Project, facts: ModuleFacts, backward: cst.Call
) -> tuple[list[cst.BaseStatement] | None, str]:
    """The statements before ``backward``'s in its block, back to the previous step boundary or the block start."""
    line = facts.statement_of(backward)
    if not isinstance(line, cst.SimpleStatementLine):
        return None, "backward() shares a one-line block with other statements"
    if len(line.body) > 1:
        return None, "backward() shares its line with other statements"
    block = facts.block_of(line)
    body = list(block.body)
    end = body.index(line)
    while end > 0 and (project.is_zero_grad_statement(facts, body[end - 1]) or clears_grads(body[end - 1])):
        end -= 1  # forward, loss, zero_grad(), backward(): the forward and loss still count
    start = end
    while start > 0 and not is_separator(project, facts, body[start - 1]):
        start -= 1
    if start == 0 and body and is_docstring(body[0]) and isinstance(facts.parent(block), cst.FunctionDef):
        start = 1
    group = body[start:end]
    if not group:
        return None, "no statement computes the loss right before backward() in its block"
    return group, ""


def last_steps(facts: ModuleFacts, scope, steps: list[cst.Call]) -> list[cst.Call]:
    """The steps no other step follows before the next backward: one scaler.update() after each (as the runtime)."""
    events = sorted([*scope.backward, *scope.steps], key=facts._enter.__getitem__)  # source order
    last = []
    for step in steps:
        following = events[events.index(step) + 1 :]
        if not following or following[0] not in steps:
            last.append(step)
    return last
