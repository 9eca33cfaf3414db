"""dataloader: tune DataLoader worker processes, pinned memory, persistent workers and prefetching."""

from __future__ import annotations

import libcst as cst

from autotune.analysis import ModuleFacts
from autotune.knobs import Knob, Numerics
from autotune.transform import Edits, Status, Transform, add_args, kwarg, move_into_helper
from autotune.transforms._model import ClassRef, argument, find_class, model_class, scope_of, training
from autotune.transforms._sites import h2d_copy, short

_DATALOADER = {"torch.utils.data.DataLoader", "torch.utils.data.dataloader.DataLoader"}
SETTINGS = ("num_workers", "pin_memory", "persistent_workers", "prefetch_factor")
# DataLoader(dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, ...): the sixth positional argument
# and those after it would be settings passed by position.
_POSITIONAL_SETTINGS = 5


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
            help="keep the workers alive between epochs (only with workers)",
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
            if facts.qualname(call.func) not in _DATALOADER:
                continue
            if not self.project.loops:
                self.report(facts, call, Status.NOT_APPLICABLE, "no training loop in this script")
                continue
            if any(facts.is_runtime_call(a.value, "dataloader_kwargs") for a in call.args if a.star == "**"):
                self.report(facts, call, Status.PRESENT, "DataLoader settings are already knobs")
                continue
            splat = next((a for a in call.args if a.star), None)
            if splat is not None:
                self.report(
                    facts, call, Status.NOT_APPLICABLE, f"{splat.star}{facts.code(splat.value)} may set the loader settings"
                )
                continue
            if len([a for a in call.args if a.keyword is None]) > _POSITIONAL_SETTINGS:
                self.report(facts, call, Status.NOT_APPLICABLE, "DataLoader settings passed by position")
                continue
            on_device = self._dataset_on_device(facts, call)
            if on_device is not None:
                self.report(facts, call, Status.NOT_APPLICABLE, on_device)
                continue
            written = {a.keyword.value: a for a in call.args if a.keyword is not None and a.keyword.value in SETTINGS}
            kept = ", ".join(f"{n}={facts.code(a.value)}" for n, a in written.items())
            if len(written) == len(SETTINGS):
                self.report(facts, call, Status.USER, f"DataLoader({kept}) is the script's choice")
                continue
            free = [n for n in SETTINGS if n not in written and self._matters(n, written)]
            verb = "becomes a knob" if len(free) == 1 else "become knobs"
            reason = f"DataLoader: {', '.join(free)} {verb}" + (f"; {kept} kept as written" if kept else "")
            self.report(facts, call, Status.APPLICABLE, reason)
            if self.mode.gated:
                self.settings_read.update(free)
                helper = edits.runtime("dataloader_kwargs")
                moved = set(written)
                edits.rewrite(call, lambda node, moved=moved, helper=helper: move_into_helper(node, moved, helper))
            else:
                extra = self._baked(facts, written)
                if extra:
                    edits.rewrite(call, lambda node, extra=extra: add_args(node, *extra))

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
        owner = facts.class_of(scope)
        target = owner if owner is not None and scope.name.value == "__init__" else scope
        index = params.index(expr.value) - (1 if owner is not None else 0)
        found = []
        finder = training(self.project)
        for other in self.project.modules:
            for caller in other.calls:
                if finder.callee(other, caller) is not target:
                    continue
                arg = argument(caller, index, expr.value)
                cls = model_class(self.project, other, scope_of(other, caller), arg) if arg is not None else None
                if isinstance(cls, ClassRef):
                    found.append(cls)
        return found

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
    def _matters(name: str, written: dict[str, cst.Arg]) -> bool:
        """Whether the knob for ``name`` can change this call: workers-only settings need workers."""
        if name in ("persistent_workers", "prefetch_factor") and "num_workers" in written:
            value = written["num_workers"].value
            return not (isinstance(value, cst.Integer) and int(value.value) == 0)
        return True

    def _baked(self, facts: ModuleFacts, written: dict[str, cst.Arg]) -> list[cst.Arg]:
        """Plain keyword arguments for the values that differ from DataLoader's defaults, and legal together."""
        workers, pin, persistent, prefetch = (self.mode.value(k) for k in self.knobs)
        out = []
        # `when`: None if the loader never has workers, "" if it always does, else the script's worker count
        if "num_workers" in written:
            value = written["num_workers"].value
            if isinstance(value, cst.Integer):
                when = "" if int(value.value) > 0 else None
            else:
                when = facts.code(value)
        else:
            when = "" if workers else None
            if workers:
                out.append(kwarg("num_workers", str(workers)))
        if pin and "pin_memory" not in written:
            out.append(kwarg("pin_memory", "True"))
        if persistent and "persistent_workers" not in written and when is not None:
            out.append(kwarg("persistent_workers", f"bool({when})" if when else "True"))
        if prefetch != 2 and "prefetch_factor" not in written and when is not None:
            out.append(kwarg("prefetch_factor", f"{prefetch} if {when} else None" if when else str(prefetch)))
        return out

