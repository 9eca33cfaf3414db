"""dataloader: tune DataLoader worker processes, pinned memory, persistent workers and prefetching."""

from __future__ import annotations

import libcst as cst

from autotune.analysis import ModuleFacts
from autotune.knobs import Knob, Numerics
from autotune.transform import Edits, Status, Transform
from autotune.syntax import (
    add_args, argument, assignments, expr, is_constant, is_name, kwarg, move_into_helper, names_variable,
    scope_of, string_key,
)
from autotune.transforms._model import ClassRef, find_class, model_class, training
from autotune.transforms._sites import h2d_copy, short

DATALOADERS = {"torch.utils.data.DataLoader", "torch.utils.data.dataloader.DataLoader"}
SETTINGS = ("num_workers", "pin_memory", "persistent_workers", "prefetch_factor")
# DataLoader(dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, ...): the sixth positional argument
# and those after it would be settings passed by position.
_POSITIONAL_SETTINGS = 5
# settings a script may switch itself (num_workers=args.workers, pin_memory=args.pin): where its switch is off in a
# run (0, False), the knob turns the setting on; where it is on, the script's value stands. (persistent_workers is not
# one: switched on without workers, DataLoader refuses it. Nor is a worker count beside persistent_workers or
# prefetch_factor: the script means its workers to run.)
SWITCHES = ("num_workers", "pin_memory")


class Dataloader(Transform):
    """Load batches in worker processes, into pinned memory, with persistent workers and deeper prefetching."""

    name = "dataloader"
    tracks_settings = True
    knobs = (
        Knob(
            "dataloader.num_workers",
            (0, 1, 2, 4, 8, 16),
            0,
            Numerics.EXACT,
            help="worker processes that load batches (0: in the training process); random augmentations in "
            "workers draw from per-worker seeds",
        ),
        Knob(
            "dataloader.pin_memory",
            (False, True),
            False,
            Numerics.EXACT,
            devices=frozenset({"cuda"}),
            help="batches in page-locked memory: faster, asynchronous host-to-device copies",
        ),
        Knob(
            "dataloader.persistent_workers",
            (False, True),
            False,
            Numerics.EXACT,
            help="keep the workers alive between epochs (only with workers); the loader then draws its seed once, not once per epoch, so from the second epoch on the shuffle differs: not searched by default",
        ),
        Knob(
            "dataloader.prefetch_factor",
            (2, 4, 8),
            2,
            Numerics.EXACT,
            help="batches each worker loads ahead (only with workers; 2 is DataLoader's own default)",
        ),
    )


    def apply(self, facts: ModuleFacts, edits: Edits) -> None:
        for call in facts.calls:
            if facts.qualname(call.func) not in DATALOADERS:
                continue
            if not self.project.trains:
                self.report(facts, call, Status.NOT_APPLICABLE, "no training loop in this script")
                continue
            if any(facts.is_runtime_call(a.value, "dataloader_kwargs") for a in call.args if a.star == "**"):
                self.report(facts, call, Status.PRESENT, "DataLoader settings are already knobs")
                continue
            splats = [a for a in call.args if a.star]
            # each splatted dict's keys, with their values (read once: a **kwargs asks every caller in the project)
            keys = {id(a): self._keys(facts, call, a.value) for a in splats if a.star == "**"}
            unknown = next((a for a in splats if a.star == "*" or keys[id(a)] is None), None)
            if unknown is not None:
                self.report(
                    facts, call, Status.NOT_APPLICABLE, f"{unknown.star}{facts.code(unknown.value)} may set the loader settings"
                )
                continue
            if len([a for a in call.args if a.keyword is None and not a.star]) > _POSITIONAL_SETTINGS:
                self.report(facts, call, Status.NOT_APPLICABLE, "DataLoader settings passed by position")
                continue
            on_device = self._dataset_on_device(facts, call)
            if on_device is not None:
                self.report(facts, call, Status.NOT_APPLICABLE, on_device)
                continue
            written = {a.keyword.value: a.value for a in call.args if a.keyword is not None and a.keyword.value in SETTINGS}
            switches = {n: v for n, v in written.items() if n in SWITCHES and not is_constant(v)}
            if {"persistent_workers", "prefetch_factor"} & set(written):
                switches.pop("num_workers", None)  # settings for workers: the script means its count to be used
            kept = ", ".join(f"{n}={facts.code(v)}" for n, v in written.items() if n not in switches)
            # settings a splatted dict sets on some path: kept as the script sets them, on every path
            in_dicts: dict[str, list[cst.BaseExpression]] = {}
            for a in splats:
                for key, values in keys[id(a)].items():  # type: ignore[union-attr]
                    if key in SETTINGS:
                        in_dicts.setdefault(key, []).extend(values)
            kept = ", ".join(filter(None, [kept, *(f"{k} in **{facts.code(a.value)}" for a in splats
                                                     for k in keys[id(a)] if k in SETTINGS)]))  # type: ignore[union-attr]
            if len(written) - len(switches) + len(in_dicts) == len(SETTINGS):
                self.report(facts, call, Status.USER, f"DataLoader({kept}) is the script's choice")
                continue
            workers = [written["num_workers"]] if "num_workers" in written else in_dicts.get("num_workers")
            free = [n for n in SETTINGS if n not in written and n not in in_dicts and self._matters(n, workers)]
            verb = "becomes a knob" if len(free) == 1 else "become knobs"
            parts = [f"{', '.join(free)} {verb}"] if free else []
            if switches:
                own = ", ".join(f"{n}={facts.code(v)}" for n, v in switches.items())
                parts.append(f"{own}: the script's own switch{'es' if len(switches) > 1 else ''} (present, switched "
                             "off where 0 or False), which the knobs turn on there")
            if kept:
                parts.append(f"{kept} kept as written")
            self.report(facts, call, Status.APPLICABLE, "DataLoader: " + "; ".join(parts))
            if self.mode.gated:
                self.settings_read.update([*free, *switches])
                helper = edits.runtime("dataloader_kwargs")
                switch = edits.runtime("dataloader_switch")
                moved = set(written)

                def gated(node, moved=moved, helper=helper, switch=switch, names=set(switches)):
                    node = node.with_changes(args=[_switched(a, switch) if a.keyword is not None and
                                                   a.keyword.value in names else a for a in node.args])
                    # the dicts go through the helper too: it adds a knob's setting only where the script set none
                    return move_into_helper(node, moved, helper, splats=True)

                edits.rewrite(call, gated)
            else:
                on = self._switched_on(switches)
                in_splats = {k for found in keys.values() for k in found or ()}
                extra = self._baked(facts, written, workers, splats, in_splats, "num_workers" in on)
                if extra or on:
                    def baked(node, extra=extra, on=on):
                        node = node.with_changes(args=[a.with_changes(value=on[a.keyword.value](a.value))
                                                       if a.keyword is not None and a.keyword.value in on else a
                                                       for a in node.args])
                        return add_args(node, *extra) if extra else node

                    edits.rewrite(call, baked)

    def _dataset_on_device(self, facts: ModuleFacts, call: cst.Call) -> str | None:
        """Why the loader's workers and pinned memory cannot be used: its Dataset moves items to the device.

        A worker process cannot use CUDA (forked after CUDA started, it fails), and a CUDA tensor cannot be pinned.
        """
        dataset = next((a.value for a in call.args if a.keyword is None and not a.star), None)
        dataset = dataset or next((a.value for a in call.args if a.keyword and a.keyword.value == "dataset"), None)
        if dataset is None:
            return None
        for cls in self._classes(facts, dataset):
            why = self._moves_items(cls)
            if why is not None:
                return why
        return None

    def _classes(self, facts: ModuleFacts, expr: cst.BaseExpression) -> list[ClassRef]:
        """The local classes ``expr`` may be an instance of: built there, or passed in by the function's callers."""
        scope = scope_of(facts, expr)
        cls = model_class(self.project, facts, scope, expr)
        if isinstance(cls, ClassRef):
            return [cls]
        if not (isinstance(expr, cst.Name) and isinstance(scope, cst.FunctionDef)):
            return []
        params = [p.name.value for p in scope.params.params]
        if expr.value not in params:
            return []
        index = params.index(expr.value) - (1 if facts.class_of(scope) is not None else 0)
        found = []
        for other, caller in self._callers(facts, scope):
            arg = argument(caller, index, expr.value)
            cls = model_class(self.project, other, scope_of(other, caller), arg) if arg is not None else None
            if isinstance(cls, ClassRef):
                found.append(cls)
        return found

    def _callers(self, facts: ModuleFacts, function: cst.FunctionDef) -> list[tuple[ModuleFacts, cst.Call]]:
        """The calls in the project that run ``function`` (a class's ``__init__``: the calls that build the class)."""
        owner = facts.class_of(function)
        target = owner if owner is not None and function.name.value == "__init__" else function
        finder = training(self.project)
        return [(other, caller) for other in self.project.modules for caller in other.calls
                if finder.callee(other, caller) is target]

    def _moves_items(self, cls: ClassRef) -> str | None:
        for ref in (cls, *(find_class(self.project, cls.facts.qualname(b.value)) for b in cls.node.bases)):
            if ref is None:
                continue
            for method in ("__getitem__", "__getitems__", "__iter__"):
                fn = ref.method(method)
                copy = next((c for c in ref.facts.calls_in(fn) if h2d_copy(ref.facts, c)), None) if fn else None
                if copy is not None:
                    line = ref.facts.position(copy)[0]
                    return (
                        f"{ref.name}.{method} moves items to the device ({short(ref.facts, copy)}, line {line}): "
                        "worker processes cannot use CUDA and CUDA tensors cannot be pinned"
                    )
        return None

    @staticmethod
    def _matters(name: str, workers: list[cst.BaseExpression] | None) -> bool:
        """Whether the knob for ``name`` can change this call: workers-only settings need workers (``workers``:
        the script's worker counts, on each path that sets one)."""
        if name in ("persistent_workers", "prefetch_factor") and workers:
            return not all(isinstance(v, cst.Integer) and int(v.value) == 0 for v in workers)
        return True

    def _switched_on(self, switches: dict[str, cst.BaseExpression]) -> dict[str, object]:
        """The baked value of each switch of the script's that the knobs turn on: ``args.workers or 2`` (the
        script's count where it gives one, else the knob's), ``True`` for pinned memory."""
        on: dict[str, object] = {}
        workers, pin = self.mode.value(self.knobs[0]), self.mode.value(self.knobs[1])
        if "num_workers" in switches and workers:
            on["num_workers"] = lambda v: cst.BooleanOperation(
                left=_parenthesized(v), operator=cst.Or(), right=cst.Integer(str(workers)))
        if "pin_memory" in switches and pin:
            on["pin_memory"] = lambda v: cst.Name("True")
        return on

    def _keys(self, facts: ModuleFacts, at: cst.CSTNode, value: cst.BaseExpression) -> dict[str, list[cst.BaseExpression]] | None:
        """The keys a splatted dict may hold at ``at`` with their values (``_dict_keys``), or those of a ``**kwargs``
        its function's callers pass (``_passed_keywords``); None where they cannot be known."""
        found = _dict_keys(facts, at, value)
        return found if found is not None else self._passed_keywords(facts, at, value)

    def _passed_keywords(self, facts: ModuleFacts, at: cst.CSTNode, value: cst.BaseExpression) -> dict[str, list[cst.BaseExpression]] | None:
        """``DataLoader(dataset, sampler=sampler, **kwargs)`` in a function whose ``**kwargs`` only reach this loader
        (makemore's ``InfiniteDataLoader.__init__(self, dataset, **kwargs)``): the keywords its callers in the
        project pass, each by name; None where a caller splats a dict, or none is found."""
        if not is_name(value):
            return None
        name = value.value  # type: ignore[attr-defined]
        scope = scope_of(facts, at)
        star = scope.params.star_kwarg if isinstance(scope, cst.FunctionDef) else None
        if star is None or not isinstance(star, cst.Param) or star.name.value != name:
            return None
        uses = [n for n in facts.nodes_in(scope.body, cst.Name) if n.value == name and names_variable(facts, n)]
        if len(uses) != 1:
            return None  # read or changed besides the splat into this loader
        params = scope.params
        named = {p.name.value for p in (*params.posonly_params, *params.params, *params.kwonly_params)}
        callers = self._callers(facts, scope)
        keys: dict[str, list[cst.BaseExpression]] = {}
        for _, caller in callers:
            for arg in caller.args:
                if arg.star == "**":
                    return None
                if arg.keyword is not None and arg.keyword.value not in named:
                    keys.setdefault(arg.keyword.value, []).append(arg.value)
        return keys if callers else None

    def _baked(
        self, facts: ModuleFacts, written: dict[str, cst.BaseExpression], workers: list[cst.BaseExpression] | None,
        splats: list[cst.Arg], in_splats: set[str], workers_on: bool,
    ) -> list[cst.Arg]:
        """Plain keyword arguments for the values that differ from DataLoader's defaults, and legal together
        (``in_splats``: the keys the splatted dicts hold; ``workers_on``: the script's own worker count, a switch, is
        baked on: workers always)."""
        n_workers, pin, persistent, prefetch = (self.mode.value(k) for k in self.knobs)
        out = []
        # `when`: None if the loader never has workers, "" if it always does, else the script's worker count
        if "num_workers" in written:
            value = written["num_workers"]
            if workers_on:
                when = ""
            elif isinstance(value, cst.Integer):
                when = "" if int(value.value) > 0 else None
            else:
                when = facts.code(value)
        elif workers:  # set in a splatted dict, perhaps on some paths only: read it there
            if all(isinstance(v, cst.Integer) and int(v.value) == 0 for v in workers):
                when = None
            else:
                when = " or ".join(f"{facts.code(a.value)}.get('num_workers', 0)" for a in splats)
                when = f"({when})" if len(splats) > 1 else when
        else:
            when = "" if n_workers else None
            if n_workers:
                out.append(kwarg("num_workers", str(n_workers)))
        names = set(written) | in_splats
        if pin and "pin_memory" not in names:
            out.append(kwarg("pin_memory", "True"))
        if persistent and "persistent_workers" not in names and when is not None:
            out.append(kwarg("persistent_workers", f"bool({when})" if when else "True"))
        if prefetch != 2 and "prefetch_factor" not in names and when is not None:
            out.append(kwarg("prefetch_factor", f"{prefetch} if {when} else None" if when else str(prefetch)))
        return out


def _literal_dict(node: cst.BaseExpression) -> dict[str, list[cst.BaseExpression]] | None:
    """The keys of ``{"k": v}`` / ``dict(k=v)`` with their values, or of each branch of ``A if c else B``."""
    if isinstance(node, cst.IfExp):
        a, b = _literal_dict(node.body), _literal_dict(node.orelse)
        if a is None or b is None:
            return None
        return {k: a.get(k, []) + b.get(k, []) for k in {**a, **b}}
    if isinstance(node, cst.Dict):
        out: dict[str, list[cst.BaseExpression]] = {}
        for el in node.elements:
            if not isinstance(el, cst.DictElement) or not isinstance(el.key, cst.SimpleString):
                return None
            out.setdefault(el.key.evaluated_value, []).append(el.value)  # type: ignore[arg-type]
        return out
    if isinstance(node, cst.Call) and is_name(node.func, "dict") and all(a.keyword is not None for a in node.args):
        return {a.keyword.value: [a.value] for a in node.args}  # type: ignore[union-attr]
    return None


def _is_update(node: cst.CSTNode | None) -> bool:
    return isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and node.func.attr.value == "update"


def _dict_keys(facts: ModuleFacts, at: cst.CSTNode, value: cst.BaseExpression) -> dict[str, list[cst.BaseExpression]] | None:
    """Every key a splatted dict may hold at ``at``, with the values it may take, when the script builds it in
    plain sight: literal dicts assigned to one name in one scope, ``.update()``d with literal dicts or keywords,
    or items stored under literal keys. None when anything else may touch it (passed to a call, a parameter...)."""
    if not is_name(value):
        return _literal_dict(value)
    name = value.value  # type: ignore[attr-defined]
    scope = scope_of(facts, at)
    if not assignments(facts, scope, name) and scope is not facts.module:
        scope = facts.module  # a module-level dict read inside a function
    keys: dict[str, list[cst.BaseExpression]] = {}

    def add(found: dict[str, list[cst.BaseExpression]] | None) -> bool:
        if found is None:
            return False
        for k, v in found.items():
            keys.setdefault(k, []).extend(v)
        return True

    for use in facts.nodes_in(scope, cst.Name):
        if use.value != name:
            continue
        parent = facts.parent(use)
        grand = facts.parent(parent) if parent is not None else None
        if isinstance(parent, cst.AssignTarget) and isinstance(grand, cst.Assign) and len(grand.targets) == 1:
            if not add(_literal_dict(grand.value)):
                return None
        elif isinstance(parent, cst.Attribute) and parent.value is use and parent.attr.value == "update":
            call = grand
            if not isinstance(call, cst.Call) or call.func is not parent:
                return None
            for arg in call.args:
                if arg.keyword is not None:
                    add({arg.keyword.value: [arg.value]})
                elif arg.star or not add(_dict_keys(facts, call, arg.value)):
                    return None
        elif isinstance(parent, cst.Attribute) and parent.value is use and parent.attr.value in ("get", "copy", "keys", "items"):
            continue  # reads
        elif isinstance(parent, cst.Arg) and parent.star == "**":
            continue  # splatted into a call: read
        elif isinstance(parent, cst.Arg) and not parent.star and parent.keyword is None and _is_update(grand):
            continue  # copied into another dict: read
        elif isinstance(parent, cst.Subscript) and parent.value is use:
            target = facts.parent(parent)
            if isinstance(target, cst.AssignTarget):
                key = string_key(parent)
                if key is None:
                    return None
                add({key: [facts.parent(target).value]})  # type: ignore[union-attr]
        elif isinstance(parent, (cst.Param, cst.AnnAssign, cst.AugAssign, cst.For, cst.AsName, cst.Del)):
            return None
        elif isinstance(parent, cst.Attribute) and parent.attr is use:
            continue  # ``x.train_kwargs``: another name
        elif isinstance(parent, cst.Arg) and parent.keyword is use:
            continue
        else:
            return None  # passed somewhere that may change it
    return keys if keys or assignments(facts, scope, name) else None


def _switched(arg: cst.Arg, helper: str) -> cst.Arg:
    """``num_workers=args.workers`` -> ``num_workers=helper("num_workers", args.workers)``."""
    name = arg.keyword.value  # type: ignore[union-attr]
    return arg.with_changes(value=cst.Call(func=expr(helper), args=[
        cst.Arg(cst.SimpleString(f'"{name}"'), comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))),
        cst.Arg(arg.value),
    ]))


def _parenthesized(value: cst.BaseExpression) -> cst.BaseExpression:
    """``value`` as the left operand of ``or``: in parentheses where it binds looser (a conditional, a lambda)."""
    if isinstance(value, (cst.IfExp, cst.Lambda, cst.BooleanOperation, cst.NamedExpr)) and not value.lpar:
        return value.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
    return value


# === runtime: what the patched script runs (python -m autotune.catalog copies it into autotune/runtime_helpers.py) ===

from typing import Any
from autotune.knob_values import default, knob, took_effect


def dataloader_switch(setting: str, script_value: Any) -> Any:
    """A DataLoader setting the script switches itself (``num_workers=args.workers``): its value where it is on;
    where it is off in this run (0, False), the knob's."""
    if script_value:
        return script_value
    value = knob(f"dataloader.{setting}", record=False)
    if not value:
        return script_value
    took_effect(f"dataloader.{setting}")
    return value


def dataloader_kwargs(**script: Any) -> dict[str, Any]:
    """DataLoader keyword arguments: those the script wrote, plus the knobs' for the ones it left out.

    Never returns ``prefetch_factor`` or ``persistent_workers=True`` with zero workers, which DataLoader rejects.
    """
    out = dict(script)
    # a knob for a keyword the script wrote itself changes nothing: recorded only where it is used
    workers = out.setdefault("num_workers", knob("dataloader.num_workers", record=False))
    if workers and "num_workers" not in script:
        took_effect("dataloader.num_workers")
    pin = knob("dataloader.pin_memory", record=False)
    if pin and "pin_memory" not in script:
        out["pin_memory"] = True
        took_effect("dataloader.pin_memory")
    if workers:
        if "persistent_workers" not in script and knob("dataloader.persistent_workers", record=False):
            out["persistent_workers"] = True
            took_effect("dataloader.persistent_workers")
        prefetch = knob("dataloader.prefetch_factor", record=False)
        if "prefetch_factor" not in script and prefetch != default("dataloader.prefetch_factor"):
            out["prefetch_factor"] = prefetch
            took_effect("dataloader.prefetch_factor")
    if out["num_workers"] == 0 and "num_workers" not in script:
        del out["num_workers"]  # leave DataLoader's own default in place, as the script did
    return out

