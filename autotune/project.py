"""The project: an entry script and the local modules it imports, its training loops and their optimizer steps.

Built from each file's facts (``autotune.analysis``); nothing here imports or runs user code.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import libcst as cst

from autotune.analysis import _UNKNOWN, ModuleFacts
from autotune.source import deep, no_gc, read_source
from autotune.syntax import assignments, is_param, stores

# torch.optim classes that are not optimizers.
_NOT_OPTIMIZERS = ("torch.optim.lr_scheduler.", "torch.optim.swa_utils.", "torch.optim.Optimizer")


def _is_optimizer_ctor(qualname: str | None) -> bool:
    if not qualname or not qualname.startswith("torch.optim."):
        return False
    if qualname.startswith(_NOT_OPTIMIZERS):
        return False
    last = qualname.rsplit(".", 1)[-1]
    return last[:1].isupper()


def is_scheduler_ctor(qualname: str | None) -> bool:
    return bool(qualname) and qualname.startswith("torch.optim.lr_scheduler.")


@dataclass(frozen=True, eq=False)
class StepScope:
    """Where a training step happens: the block owner (a loop or a function) holding backward and step calls."""

    module: ModuleFacts
    owner: cst.CSTNode
    backward: tuple[cst.Call, ...]
    steps: tuple[cst.Call, ...]
    zero_grads: tuple[cst.Call, ...]
    # hand-written optimizer steps, each a write of a tensor from its own gradient (``p -= lr * p.grad``)
    updates: tuple[cst.CSTNode, ...] = ()

    @property
    def stepping(self) -> tuple[cst.CSTNode, ...]:
        """What ends a training step here: the optimizer steps and the hand-written updates."""
        return (*self.steps, *self.updates)

    def loss_exprs(self) -> list[cst.BaseExpression]:
        """The tensors the step's backward calls run on (see ``loss_expr``)."""
        return [e for call in self.backward if (e := loss_expr(self.module, call)) is not None]


def loss_expr(facts: ModuleFacts, call: cst.Call) -> cst.BaseExpression | None:
    """The tensor a backward call runs on: ``loss`` of ``loss.backward()``, unwrapped from ``scaler.scale(...)``;
    the argument of ``accelerator.backward(loss)``, ``fabric.backward(loss)`` and ``torch.autograd.backward(loss)``."""
    recv = call.func.value  # type: ignore[attr-defined]
    if is_framework_backward(facts, call):
        if call.args and call.args[0].keyword is None and not call.args[0].star:
            return call.args[0].value
        return None
    if isinstance(recv, cst.Call) and isinstance(recv.func, cst.Attribute) and recv.func.attr.value == "scale":
        if recv.args:
            recv = recv.args[0].value
    return recv


# Libraries whose objects run backward() on the loss they are given (and scale it under their own precision).
_BACKWARD_OWNERS = ("accelerate.", "lightning.", "lightning_fabric.", "pytorch_lightning.", "deepspeed.")


def is_framework_backward(facts: ModuleFacts, call: cst.Call) -> bool:
    """``accelerator.backward(loss)``, ``fabric.backward(loss)``, ``engine.backward(loss)``,
    ``torch.autograd.backward(loss)``: the loss is the argument, not the receiver."""
    if facts.qualname(call.func) == "torch.autograd.backward":
        return True
    recv = call.func.value  # type: ignore[attr-defined]
    if not isinstance(recv, (cst.Name, cst.Attribute)):
        return False
    # only the spelling can be seen where the object arrives as a parameter or an attribute
    last = facts.code(recv).rsplit(".", 1)[-1].lower()
    if any(word in last for word in ("accelerator", "fabric", "engine")):
        return True
    code = facts.code(recv)
    for assign in facts.assigns:
        if isinstance(assign.value, cst.Call) and any(facts.code(t.target) == code for t in assign.targets):
            if (facts.qualname(assign.value.func) or "").startswith(_BACKWARD_OWNERS):
                return True
    return False


NO_LOOP = (
    "no training loop found: looked for a for/while loop whose body, directly or through a local function, "
    "calls .backward() and an optimizer's .step() (or updates parameters from their .grad by hand)"
)


# in-place tensor methods a hand-written update writes a parameter with (``p.data.add_(p.grad, alpha=-lr)``)
_IN_PLACE = {"add_", "sub_", "addcdiv_", "addcmul_", "copy_", "mul_", "lerp_"}


def without_data(target: cst.BaseExpression) -> cst.BaseExpression:
    """``p`` of ``p.data``; anything else as it is."""
    return target.value if isinstance(target, cst.Attribute) and target.attr.value == "data" else target


def _written_tensor(facts: ModuleFacts, target: cst.BaseExpression) -> str | None:
    """The code of the tensor a write goes to, ``.data`` taken off; None for anything but a name or an attribute."""
    target = without_data(target)
    return facts.code(target) if isinstance(target, (cst.Name, cst.Attribute)) else None


def _reads_grad_of(facts: ModuleFacts, node: cst.CSTNode, tensor: str) -> bool:
    return any(a.attr.value == "grad" and _written_tensor(facts, a.value) == tensor
               for a in facts.nodes_in(node, cst.Attribute))


def updated_tensor(update: cst.CSTNode) -> cst.BaseExpression:
    """The tensor a hand-written update (one of ``manual_updates``) writes, ``.data`` taken off."""
    if isinstance(update, cst.AugAssign):
        target = update.target
    elif isinstance(update, cst.Assign):
        target = update.targets[0].target
    else:
        target = update.func.value  # type: ignore[attr-defined]
    return without_data(target)


def manual_updates(facts: ModuleFacts, owner: cst.CSTNode) -> tuple[cst.CSTNode, ...]:
    """The hand-written optimizer steps in ``owner``: writes of a tensor in place from its own gradient, as plain
    SGD is written out (``param -= lr * param.grad``, ``p.data += -lr * p.grad``, ``p.data = p.data - lr *
    p.grad``, ``p.data.add_(p.grad, alpha=-lr)``), in source order; none in a module that does not import torch
    (micrograd's ``Value`` objects are written the same way)."""
    out: list[cst.CSTNode] = []
    if not any(q == "torch" or q.startswith("torch.") for q in facts.imports.values()):
        return ()
    for node in facts.nodes_in(owner, cst.AugAssign):
        tensor = _written_tensor(facts, node.target)
        if tensor is not None and isinstance(node.operator, (cst.SubtractAssign, cst.AddAssign)) \
                and _reads_grad_of(facts, node.value, tensor):
            out.append(node)
    for node in facts.nodes_in(owner, cst.Assign):
        if len(node.targets) == 1 and isinstance(node.targets[0].target, cst.Attribute) \
                and node.targets[0].target.attr.value == "data":
            tensor = _written_tensor(facts, node.targets[0].target)
            if tensor is not None and _reads_grad_of(facts, node.value, tensor):
                out.append(node)
    for call in facts.calls_in(owner):
        func = call.func
        if isinstance(func, cst.Attribute) and func.attr.value in _IN_PLACE:
            tensor = _written_tensor(facts, func.value)
            if tensor is not None and any(_reads_grad_of(facts, a, tensor) for a in call.args):
                out.append(call)
    return tuple(sorted(out, key=facts._enter.__getitem__))


class Framework(Enum):
    """A library whose Trainer runs the training loop; its value is how users name it."""

    HF_TRAINER = "the Hugging Face Trainer"
    TRL_TRAINER = "the Hugging Face Trainer (TRL)"
    LIGHTNING_TRAINER = "the Lightning Trainer"

    @property
    def hugging_face(self) -> bool:
        """The Hugging Face Trainer, TRL's subclasses of it included: TrainingArguments are its settings."""
        return self in (Framework.HF_TRAINER, Framework.TRL_TRAINER)

    def __str__(self) -> str:
        return self.value


# Trainer classes that run the training loop inside the library: constructor -> the framework.
FRAMEWORK_TRAINERS = {
    "transformers.Trainer": Framework.HF_TRAINER,
    "transformers.trainer.Trainer": Framework.HF_TRAINER,
    "transformers.Seq2SeqTrainer": Framework.HF_TRAINER,
    "transformers.trainer_seq2seq.Seq2SeqTrainer": Framework.HF_TRAINER,
    "trl.SFTTrainer": Framework.TRL_TRAINER,
    "trl.DPOTrainer": Framework.TRL_TRAINER,
    "lightning.Trainer": Framework.LIGHTNING_TRAINER,
    "lightning.pytorch.Trainer": Framework.LIGHTNING_TRAINER,
    "lightning.pytorch.trainer.trainer.Trainer": Framework.LIGHTNING_TRAINER,
    "pytorch_lightning.Trainer": Framework.LIGHTNING_TRAINER,
}
_TRAINS = {"train", "fit"}  # Trainer.train(), Trainer.fit(model)


@dataclass(frozen=True, eq=False)
class FrameworkTraining:
    """A call that trains inside a library's own loop: ``trainer.train()``, ``trainer.fit(model, dm)``."""

    framework: Framework
    module: ModuleFacts
    call: cst.Call

    def where(self) -> str:
        line, _ = self.module.position(self.call)
        return f"{self.module.display}:{line}: {self.module.code(self.call.func)}()"


@dataclass(frozen=True, eq=False)
class TrainingLoop:
    """A loop whose body, directly or through local functions, calls ``backward()`` and an optimizer's ``step()``."""

    module: ModuleFacts
    node: cst.For | cst.While  # the innermost such loop: one iteration per step
    outer: cst.For | cst.While  # the outermost such loop in the same function (epochs around steps)
    scopes: tuple[StepScope, ...]
    # loops of other functions that call the one holding ``outer`` (a trainer's epoch loop calling _run_epoch())
    callers: tuple[tuple[ModuleFacts, cst.For | cst.While], ...] = ()


@dataclass(eq=False)
class Project:
    """The entry script and the local modules it imports, with the facts that span files."""

    root: Path
    entry: ModuleFacts
    modules: list[ModuleFacts]
    optimizer_names: set[str] = field(default_factory=set)  # code of the targets optimizers are assigned to
    scheduler_names: set[str] = field(default_factory=set)
    loops: list[TrainingLoop] = field(default_factory=list)
    module_classes: set[str] = field(default_factory=set)  # qualified names of local nn.Module subclasses
    frameworks: list[FrameworkTraining] = field(default_factory=list)  # training inside a library's loop
    _targets: dict[cst.Call, tuple[ModuleFacts, cst.FunctionDef] | None] = field(default_factory=dict, repr=False)

    def tuned_frameworks(self) -> list[FrameworkTraining]:
        """The framework training calls whose steps a trial can time: ``trainer.train()`` of the Hugging Face
        Trainer, ``trainer.fit(...)`` of the Lightning Trainer, on a name the patched script can hand to the trial
        hook just before it."""
        return [f for f in self.frameworks if isinstance(f.call.func, cst.Attribute) and isinstance(f.call.func.value, cst.Name)]

    @property
    def trains(self) -> bool:
        """Whether a trial can time this script's training steps: a loop of its own, or a framework's it hooks."""
        return bool(self.loops or self.tuned_frameworks())

    def no_loop_reason(self) -> str:
        """Why no training autotune can time was found, as the user reads it."""
        if self.frameworks:
            f = self.frameworks[0]
            return (
                f"training runs inside {f.framework} ({f.where()}): the Trainer is built inside the call that trains, "
                "where autotune cannot hand it to its trial hook (assign it to a name first), and found no training "
                "loop of the script's own"
            )
        return NO_LOOP

    def by_modname(self, name: str) -> ModuleFacts | None:
        return next((m for m in self.modules if m.modname == name), None)

    def optimizer_ctors(self, facts: ModuleFacts) -> list[cst.Call]:
        return [c for c in facts.calls if _is_optimizer_ctor(facts.qualname(c.func))]

    def is_optimizer_expr(self, facts: ModuleFacts, expr: cst.BaseExpression) -> bool:
        """Whether ``expr`` names an optimizer.

        Only its spelling can be seen where an optimizer arrives as a parameter (``def train(model, opt)``), so
        a name that was never assigned an optimizer counts when it says ``opt`` and is not a known scheduler.
        """
        code = facts.code(expr)
        if code in self.optimizer_names:
            return True
        if code in self.scheduler_names:
            return False
        last = code.rsplit(".", 1)[-1].lower()
        return "opt" in last and "sched" not in last and isinstance(expr, (cst.Name, cst.Attribute))

    def is_step_call(self, facts: ModuleFacts, call: cst.Call) -> bool:
        """``opt.step()``, ``scaler.step(opt)`` or autotune's own ``_autotune.optimizer_step(opt)``."""
        func = call.func
        if facts.is_runtime_call(call, "optimizer_step"):
            return True
        if not (isinstance(func, cst.Attribute) and func.attr.value == "step"):
            return False
        if self.is_optimizer_expr(facts, func.value):
            return True
        recv = facts.code(func.value).lower()
        return "scaler" in recv and bool(call.args) and self.is_optimizer_expr(facts, call.args[0].value)

    def is_backward_call(self, facts: ModuleFacts, call: cst.Call) -> bool:
        """``loss.backward()``, ``scaler.scale(loss).backward()``, ``accelerator.backward(loss)``; not a method of
        the script's own named ``backward`` (a from-scratch class's ``net.backward()``, whose body calls the real one)."""
        if not (isinstance(call.func, cst.Attribute) and call.func.attr.value == "backward"):
            return False
        target = self.local_target(facts, call)
        return target is None or not any(
            isinstance(c.func, cst.Attribute) and c.func.attr.value == "backward" for c in target[0].calls_in(target[1]))

    @staticmethod
    def is_zero_grad_call(call: cst.Call) -> bool:
        return isinstance(call.func, cst.Attribute) and call.func.attr.value == "zero_grad"

    def is_zero_grad_statement(self, facts: ModuleFacts, stmt: cst.BaseStatement) -> bool:
        """Whether every call in ``stmt`` is a ``zero_grad()`` (and there is one)."""
        calls = facts.calls_in(stmt)
        return bool(calls) and all(self.is_zero_grad_call(c) for c in calls)

    def local_target(self, facts: ModuleFacts, call: cst.Call) -> tuple[ModuleFacts, cst.FunctionDef] | None:
        """The local function or method a call runs, when it can be resolved without running anything."""
        # asked about every call by the loop search and several transforms: remembered per call
        found = self._targets.get(call, _UNKNOWN)
        if found is _UNKNOWN:
            found = self._targets[call] = self._local_target(facts, call)
        return found

    def _local_target(self, facts: ModuleFacts, call: cst.Call) -> tuple[ModuleFacts, cst.FunctionDef] | None:
        func = call.func
        if isinstance(func, cst.Attribute) and isinstance(func.value, cst.Name) and func.value.value == "self":
            cls = facts.class_of(call)
            target = facts.method_named(cls, func.attr.value) if cls is not None else None
            return (facts, target) if target is not None else None
        if isinstance(func, cst.Attribute) and isinstance(func.value, cst.Name):
            found = self._instance_method(facts, call, func.value.value, func.attr.value)
            if found is not None:
                return found
        qual = facts.qualname(func)
        if qual is None:
            return None
        modname, _, name = qual.rpartition(".")
        owner = self.by_modname(modname)
        if owner is None:
            return None
        target = owner.function_named(name)
        return (owner, target) if target is not None else None

    def constructed(self, facts: ModuleFacts, at: cst.CSTNode, name: str) -> list[cst.Call] | None:
        """The calls that build what ``name`` holds where ``at`` reads it: the values of its ``name = X(...)``
        assignments in the enclosing function (else at module level), where those are its only bindings there.

        None where ``name`` is bound any other way there (a parameter, a loop target, ``with ... as``), to anything
        but a call, or nowhere: what it holds cannot be known without running the script.
        """
        function = facts.function_of(at)
        for scope in (function, facts.module) if function is not None else (facts.module,):
            binds = assignments(facts, scope, name)
            targets = {id(t.target) for a in binds for t in a.targets}
            if isinstance(scope, cst.FunctionDef) and is_param(scope, name):
                return None
            if any(id(n) not in targets for n in stores(facts, scope, name)):
                return None
            if binds:
                values = [a.value for a in binds]
                return values if all(isinstance(v, cst.Call) for v in values) else None
        return None

    def _instance_method(
        self, facts: ModuleFacts, call: cst.Call, name: str, method: str
    ) -> tuple[ModuleFacts, cst.FunctionDef] | None:
        """``learner.train_step(x, y)`` where ``learner`` is built only by ``Learner(...)`` of one local class (see
        ``constructed``): that class's method, or a local base class's."""
        ctors = self.constructed(facts, call, name) or []
        classes = {self._class_named(facts.qualname(c.func)) for c in ctors}
        if len(classes) != 1 or None in classes:
            return None
        for _, found in self._lineage(facts, ctors[0].func):
            if found is not None and (target := found[0].method_named(found[1], method)) is not None:
                return found[0], target
        return None

    def framework_of(self, facts: ModuleFacts, ctor: cst.BaseExpression) -> Framework | None:
        """The framework whose Trainer ``ctor`` builds: one of FRAMEWORK_TRAINERS, or a local subclass of one."""
        return next((FRAMEWORK_TRAINERS[q] for q, _ in self._lineage(facts, ctor) if q in FRAMEWORK_TRAINERS), None)

    def derives(self, facts: ModuleFacts, expr: cst.BaseExpression, classes: set[str]) -> bool:
        """Whether ``expr`` names one of ``classes`` (qualified names) or a local subclass of one."""
        return any(q in classes for q, _ in self._lineage(facts, expr))

    def _lineage(
        self, facts: ModuleFacts, expr: cst.BaseExpression, depth: int = 0
    ) -> Iterator[tuple[str | None, tuple[ModuleFacts, cst.ClassDef] | None]]:
        """The class ``expr`` names, then its bases depth first, three levels deep: each as its qualified name and,
        where the project defines it, the module and the class."""
        qual = facts.qualname(expr)
        found = self._class_named(qual)
        yield qual, found
        if found is not None and depth < 3:
            owner, cls = found
            for base in cls.bases:
                yield from self._lineage(owner, base.value, depth + 1)

    def _class_named(self, qual: str | None) -> tuple[ModuleFacts, cst.ClassDef] | None:
        modname, _, name = (qual or "").rpartition(".")
        owner = self.by_modname(modname)
        cls = owner.classes.get(name) if owner is not None else None
        return (owner, cls) if cls is not None else None


def _module_path(root: Path, dotted: str) -> Path | None:
    """The file of local module ``dotted`` under ``root``: a link to a file outside it is not local (it is read,
    like an installed package, by Python alone: autotune neither reads it nor writes through it)."""
    parts = dotted.split(".")
    if not all(parts):
        return None
    base = root.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate if candidate.resolve().is_relative_to(root) else None
    return None


def _modname(root: Path, path: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _outer_base(folder: Path) -> tuple[Path, bool] | None:
    """Where local imports resolve besides the entry's folder, and whether only packages count there.

    An entry inside a package (``scripts/__init__.py``) runs as ``python -m scripts.train`` from above every
    enclosing package, where any module imports. Otherwise the parent folder counts for packages only (a
    folder with ``__init__.py``): ``scripts/train.py`` importing ``mypkg`` from the repository root, run with
    the root on the path; a lone module there is too weak a sign that the script means it.
    """
    top = folder
    while (top / "__init__.py").is_file():
        top = top.parent
    if top != folder:
        return top, False
    return (folder.parent, True) if folder.parent != folder else None


def _find_module(bases: list[tuple[Path, bool]], dotted: str) -> tuple[Path, Path] | None:
    """The first base where ``dotted`` is a local module, and its file."""
    for base, packages_only in bases:
        if packages_only and not (base / dotted.split(".")[0] / "__init__.py").is_file():
            continue
        path = _module_path(base, dotted)
        if path is not None:
            return base, path
    return None


def load_project(entry: Path) -> Project:
    """Parse ``entry`` and every local module it imports, transitively: files under the entry's folder, and
    packages beside it (see ``_outer_base``)."""
    return deep(_load_project, Path(entry))


def _load_project(entry: Path) -> Project:
    with no_gc():
        return _read_project(entry)


def _read_project(entry: Path) -> Project:
    display = str(entry)
    text = read_source(entry, display)  # one clear error for a missing, binary, empty or undecodable entry
    folder = entry.resolve().parent
    outer = _outer_base(folder)
    bases = [(folder, False), *([outer] if outer else [])]
    in_package = outer is not None and not outer[1]
    entry_facts = ModuleFacts.load(entry.resolve(), display, _modname(outer[0], entry.resolve()) if in_package else entry.stem, text)
    modules = [entry_facts]
    seen = {entry.resolve()}
    root = folder
    if in_package:  # `python -m scripts.train` runs scripts/__init__.py first
        package = folder
        while package != outer[0]:  # type: ignore[index]
            init = package / "__init__.py"
            if init.read_text(encoding="utf-8", errors="replace").strip():
                seen.add(init)
                shown = os.path.normpath(Path(display).parent / os.path.relpath(init, folder))
                modules.append(ModuleFacts.load(init, shown, _modname(outer[0], init)))  # type: ignore[index]
                root = outer[0]  # type: ignore[index]
            package = package.parent
    queue = list(modules)
    while queue:
        facts = queue.pop(0)
        for dotted, level in facts.imported_modules:
            name = facts.resolve_relative("." * level + dotted) if level else dotted
            if name.startswith("."):
                continue  # beyond the top-level package: Python refuses it too
            parts = name.split(".")
            # importing a.b.c runs a/__init__.py and a/b/__init__.py too
            for i in range(1, len(parts) + 1):
                found = _find_module(bases, ".".join(parts[:i]))
                if found is None or found[1].resolve() in seen:
                    continue
                base, path = found
                seen.add(path.resolve())
                if base != folder:
                    root = base  # the project's files are laid out from the outer folder
                shown = os.path.normpath(Path(display).parent / os.path.relpath(path, folder))
                child = ModuleFacts.load(path, shown, _modname(base, path))
                modules.append(child)
                queue.append(child)
    project = Project(root, entry_facts, modules)
    _resolve_star_imports(project)
    _collect_names(project)
    _find_loops(project)
    _find_frameworks(project)
    return project


def _public_names(facts: ModuleFacts) -> list[str]:
    """What ``from facts import *`` binds: ``__all__`` when it is a literal list or tuple, else every top-level
    name without a leading underscore."""
    top = facts.module.body
    for stmt in top:
        if isinstance(stmt, cst.SimpleStatementLine) and isinstance(stmt.body[0], cst.Assign):
            assign = stmt.body[0]
            if any(isinstance(t.target, cst.Name) and t.target.value == "__all__" for t in assign.targets):
                if isinstance(assign.value, (cst.List, cst.Tuple)):
                    values = [e.value for e in assign.value.elements]
                    if all(isinstance(v, cst.SimpleString) for v in values):
                        return [v.evaluated_value for v in values]
    names = [*facts.imports]
    for stmt in top:
        if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            names.append(stmt.name.value)
        elif isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                if isinstance(small, cst.Assign):
                    names.extend(t.target.value for t in small.targets if isinstance(t.target, cst.Name))
    return [n for n in names if not n.startswith("_")]


def _resolve_star_imports(project: Project) -> None:
    """``from models import *`` (and ``from .resnet import *`` inside models/__init__.py): the names a local module
    exports become imports of the importing file, so ``ResNet18()`` resolves to ``models.resnet.ResNet18``."""
    for _ in range(4):  # stars of stars: a package re-exporting its modules
        grew = False
        for facts in project.modules:
            for modname in facts.star_imports:
                source = project.by_modname(modname)
                if source is None or source is facts:
                    continue
                for name in _public_names(source):
                    if name in facts.imports or name in facts.classes or facts.function_named(name) is not None:
                        continue
                    facts.imports[name] = source.imports.get(name, f"{source.modname}.{name}")
                    grew = True
        if not grew:
            return


# classes whose subclasses are nn.Modules: torch's own, and Lightning's LightningModule (one, that trains itself)
MODULE_BASES = frozenset({
    "torch.nn.Module", "torch.nn.modules.module.Module",
    "lightning.LightningModule", "lightning.pytorch.LightningModule", "lightning.pytorch.core.module.LightningModule",
    "pytorch_lightning.LightningModule", "pytorch_lightning.core.module.LightningModule",
})


def _collect_names(project: Project) -> None:
    for facts in project.modules:
        for call in facts.calls:
            qual = facts.qualname(call.func)
            parent = facts.parent(call)
            if not isinstance(parent, cst.Assign):
                continue
            if _is_optimizer_ctor(qual):
                project.optimizer_names |= {facts.code(t.target) for t in parent.targets}
            elif is_scheduler_ctor(qual):
                project.scheduler_names |= {facts.code(t.target) for t in parent.targets}
        for cls in facts.classes.values():
            for base in cls.bases:
                qual = facts.qualname(base.value)
                if qual in MODULE_BASES:
                    project.module_classes.add(f"{facts.modname}.{cls.name.value}")


def _scope_calls(
    project: Project, facts: ModuleFacts, owner: cst.CSTNode, depth: int, seen: set
) -> list[StepScope]:
    """The step scopes reachable from ``owner``'s calls: itself and the local functions it calls."""
    calls = facts.calls_in(owner)
    backward = tuple(c for c in calls if project.is_backward_call(facts, c))
    steps = tuple(c for c in calls if project.is_step_call(facts, c))
    zero = tuple(c for c in calls if project.is_zero_grad_call(c))
    updates = manual_updates(facts, owner)
    scopes = []
    if backward or steps or updates:
        scopes.append(StepScope(facts, owner, backward, steps, zero, updates))
    if depth < 3:
        for call in calls:
            target = project.local_target(facts, call)
            if target is None or target[1] in seen:
                continue
            seen.add(target[1])
            scopes.extend(_scope_calls(project, target[0], target[1], depth + 1, seen))
    return scopes


def _find_frameworks(project: Project) -> None:
    """The calls that train inside a framework's Trainer: ``trainer.train()`` where every binding of ``trainer`` in
    its function (else the module) builds one (see ``Project.constructed``), and ``Trainer(...).fit(model)``."""
    for facts in project.modules:
        for call in facts.calls:
            func = call.func
            if not (isinstance(func, cst.Attribute) and func.attr.value in _TRAINS):
                continue
            recv = func.value
            framework = None
            if isinstance(recv, cst.Call):
                framework = project.framework_of(facts, recv.func)
            elif isinstance(recv, cst.Name):
                found = {project.framework_of(facts, c.func) for c in project.constructed(facts, call, recv.value) or ()}
                framework = found.pop() if len(found) == 1 else None
            if framework is not None:
                project.frameworks.append(FrameworkTraining(framework, facts, call))


def _find_loops(project: Project) -> None:
    candidates: list[tuple[ModuleFacts, cst.CSTNode, tuple[StepScope, ...]]] = []
    reached: dict[cst.CSTNode, set] = {}  # loop -> the local functions its body calls, three calls deep
    for facts in project.modules:
        for loop in facts.loops:
            seen = reached[loop] = set()
            scopes = _scope_calls(project, facts, loop, 0, seen)
            if any(s.backward for s in scopes) and any(s.stepping for s in scopes):
                candidates.append((facts, loop, tuple(scopes)))
    def inside(call_facts: ModuleFacts, call: cst.Call, other: tuple) -> bool:
        return other[0] is call_facts and call_facts.contains(other[1], call)

    for facts, loop, scopes in candidates:
        steps = [(s.module, c) for s in scopes for c in s.stepping]
        others = [c for c in candidates if c[1] is not loop and not (c[0] is facts and facts.contains(c[1], loop))]
        nested = any(c[0] is facts and facts.contains(loop, c[1]) for c in others)
        # a trainer's train() loops over epochs and calls _run_epoch(), which holds the loop over batches
        calls_a_loop = any(c[0].function_of(c[1]) in reached[loop] for c in others)
        if nested or calls_a_loop or any(all(inside(m, c, other) for m, c in steps) for other in others):
            continue  # an epoch loop: its steps belong to an inner loop, here or in a function it calls
        outer = loop
        for other_facts, other, _ in candidates:
            if other_facts is facts and facts.contains(other, loop) and facts.function_of(other) is facts.function_of(loop):
                if facts.contains(other, outer):
                    outer = other
        home = facts.function_of(outer)
        callers = tuple((f, other) for f, other, _ in candidates
                        if home is not None and home in reached[other] and f.function_of(other) is not home)
        project.loops.append(TrainingLoop(facts, loop, outer, scopes, callers))
