"""Facts several transforms share: where training code runs, which names hold modules, host-to-device copies."""

from __future__ import annotations

import weakref

import libcst as cst

from autotune.analysis import ModuleFacts
from autotune.project import Project

# Module methods that return the module itself: `Net().to(device).train()` still builds a Net.
_MODULE_CHAIN = {"to", "cuda", "cpu", "train", "eval", "float", "half", "double", "bfloat16", "requires_grad_"}
# torch.nn names that build tensors, not modules.
_NN_TENSORS = {"torch.nn.Parameter", "torch.nn.parameter.Parameter", "torch.nn.Buffer", "torch.nn.parameter.Buffer"}
_DTYPES = {
    "float16", "half", "bfloat16", "float32", "float", "float64", "double", "int8", "uint8", "int16", "short",
    "int32", "int", "int64", "long", "bool", "complex64", "cfloat", "complex128", "cdouble",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
}  # fmt: skip
Region = tuple[ModuleFacts, cst.CSTNode]


def training_regions(project: Project) -> list[Region]:
    """The code that runs once per training step: each training loop's body, its step scopes, and the local
    functions they call (``get_batch()``, ``train_step()``), three calls deep."""
    out: list[Region] = []
    seen: set[cst.CSTNode] = set()

    def add(facts: ModuleFacts, node: cst.CSTNode, depth: int) -> None:
        if node in seen:
            return
        seen.add(node)
        out.append((facts, node))
        if depth >= 3:
            return
        for call in facts.calls_in(node):
            target = project.local_target(facts, call)
            if target is not None:
                add(target[0], target[1], depth + 1)

    for loop in project.loops:
        add(loop.module, loop.node, 0)
        for scope in loop.scopes:
            add(scope.module, scope.owner, 1)
    return out


def in_regions(regions: list[Region], facts: ModuleFacts, node: cst.CSTNode) -> bool:
    return any(f is facts and f.contains(owner, node) for f, owner in regions)


def strip_module_chain(expr: cst.BaseExpression) -> cst.BaseExpression:
    """``Net().to(device).train()`` -> ``Net()``."""
    while (
        isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute) and expr.func.attr.value in _MODULE_CHAIN
    ):
        expr = expr.func.value
    return expr


_CLASSES: weakref.WeakKeyDictionary[Project, dict[str, tuple[ModuleFacts, cst.ClassDef]]] = weakref.WeakKeyDictionary()



def local_classes(project: Project) -> dict[str, tuple[ModuleFacts, cst.ClassDef]]:
    """Local nn.Module subclasses by qualified name, including subclasses of local subclasses."""
    if project in _CLASSES:
        return _CLASSES[project]
    found: dict[str, tuple[ModuleFacts, cst.ClassDef]] = {}
    _CLASSES[project] = found
    for qual in project.module_classes:
        modname, _, name = qual.rpartition(".")
        facts = project.by_modname(modname)
        if facts is not None and name in facts.classes:
            found[qual] = (facts, facts.classes[name])
    grew = True
    while grew:
        grew = False
        for facts in project.modules:
            for name, cls in facts.classes.items():
                qual = f"{facts.modname}.{name}"
                if qual not in found and any(facts.qualname(b.value) in found for b in cls.bases):
                    found[qual] = (facts, cls)
                    grew = True
    return found


# diffusers' models are nn.Modules (ModelMixin), built by class, from a config or from a saved folder
DIFFUSERS_LOADERS = ("from_pretrained", "from_config")


def diffusers_model(qual: str | None) -> str | None:
    """``diffusers.UNet2DModel`` for ``diffusers.UNet2DModel(...)`` and its ``from_pretrained``/``from_config``: a
    model class (``...Model``, ``Autoencoder...``), not a pipeline, scheduler or ``load_config``."""
    if not qual or not qual.startswith("diffusers."):
        return None
    parts = qual.split(".")
    if parts[-1] in DIFFUSERS_LOADERS:
        parts = parts[:-1]
    cls = parts[-1]
    if "training_utils" in parts or cls == "EMAModel":  # the weights' moving average: a helper, not a module
        return None
    return ".".join(parts) if cls.endswith("Model") or cls.startswith("Autoencoder") else None


def is_module_ctor(project: Project, facts: ModuleFacts, call: cst.Call) -> bool:
    """Whether ``call`` builds an nn.Module: a local subclass, a torch.nn class, a torchvision or diffusers model."""
    qual = facts.qualname(call.func)
    if not qual:
        return False
    if qual in local_classes(project):
        return True
    last = qual.rsplit(".", 1)[-1]
    if qual.startswith("torch.nn.") and qual not in _NN_TENSORS and last[:1].isupper():
        return not qual.startswith("torch.nn.functional.")
    return qual.startswith("torchvision.models.") or diffusers_model(qual) is not None


def module_names(project: Project) -> set[str]:
    """The spellings of expressions that hold modules: assigned a module, or asked for their ``.parameters()``.

    Only spellings can be compared across functions (a model passed as ``model`` to ``train(model, ...)``).
    """
    names: set[str] = set()
    for facts in project.modules:
        for call in facts.calls:
            func = call.func
            if isinstance(func, cst.Attribute) and func.attr.value in ("parameters", "named_parameters"):
                names.add(facts.code(func.value))
            parent = facts.parent(call)
            if isinstance(parent, cst.Assign) and parent.value is call:
                base = strip_module_chain(call)
                if isinstance(base, cst.Call) and is_module_ctor(project, facts, base):
                    names.update(facts.code(t.target) for t in parent.targets)
    return names


def is_module_expr(project: Project, facts: ModuleFacts, expr: cst.BaseExpression, names: set[str]) -> bool:
    """Whether ``expr`` holds or builds a module: ``model``, ``self.net``, ``Net()``, ``Net().to(device)``."""
    if facts.code(expr) in names:
        return True
    base = strip_module_chain(expr)
    return isinstance(base, cst.Call) and is_module_ctor(project, facts, base)


def is_dtype(facts: ModuleFacts, node: cst.BaseExpression) -> bool:
    qual = facts.qualname(node)
    if qual and qual.startswith("torch.") and qual.rsplit(".", 1)[-1] in _DTYPES:
        return True
    return isinstance(node, (cst.Name, cst.Attribute)) and "dtype" in facts.code(node).rsplit(".", 1)[-1].lower()


def is_host_device(facts: ModuleFacts, node: cst.BaseExpression) -> bool:
    """``"cpu"`` or ``torch.device("cpu")``."""
    if isinstance(node, cst.SimpleString):
        return node.evaluated_value.split(":")[0] == "cpu"
    if isinstance(node, cst.Call) and facts.qualname(node.func) == "torch.device" and node.args:
        return is_host_device(facts, node.args[0].value)
    return False


def device_arg(facts: ModuleFacts, call: cst.Call) -> cst.BaseExpression | None:
    """The target device of ``x.to(...)`` / ``x.cuda(...)``: None for ``.to(dtype)`` and ``.to("cpu")``.

    ``x.cuda()`` returns the call itself (its device is implicit).
    """
    func = call.func
    if not isinstance(func, cst.Attribute):
        return None
    if func.attr.value == "cuda":
        return call
    if func.attr.value != "to":
        return None
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value == "device":
            return None if is_host_device(facts, arg.value) else arg.value
    positional = [a.value for a in call.args if a.keyword is None and not a.star]
    if not positional or is_dtype(facts, positional[0]) or is_host_device(facts, positional[0]):
        return None
    return positional[0]


def h2d_copy(facts: ModuleFacts, call: cst.CSTNode) -> bool:
    """Whether ``call`` is a copy to a device: ``x.to(device)``, ``x.to(device, dtype)``, ``x.cuda()``."""
    return isinstance(call, cst.Call) and device_arg(facts, call) is not None



def short(facts: ModuleFacts, expr: cst.BaseExpression, limit: int = 40) -> str:
    """``expr`` as a report names it: calls without their arguments (``Net(...)``), long code cut short."""
    if isinstance(expr, cst.Call):
        return f"{short(facts, expr.func, limit)}(...)"
    code = " ".join(facts.code(expr).split())
    return code if len(code) <= limit else code[: limit - 3].rstrip() + "..."
