"""ddp: tune DistributedDataParallel's gradient buckets and graph assumptions."""

from __future__ import annotations

from autotune.analysis import ModuleFacts
from autotune.knobs import Knob, Numerics
from autotune.transform import Edits, Mode, Status, Transform
from autotune.syntax import add_args, kwarg, move_into_helper
from autotune.transforms._dist import DDP, calls_to, wrapper_settings

SETTINGS = ("bucket_cap_mb", "gradient_as_bucket_view", "static_graph")
# DistributedDataParallel(module, device_ids, output_device, dim, broadcast_buffers, init_sync, process_group,
# bucket_cap_mb, ...): from the seventh positional argument on (sixth before torch 2.4) settings could be positional.
_POSITIONAL_SETTINGS = 6
# With three or more ranks the all-reduce sums each gradient element in an order that depends on where it sits in
# its bucket (ring chunks): measured with gloo and 3 ranks, each of these settings moves gradients by 1e-8.
# static_graph=True with no_sync() accumulation hits "expect_autograd_hooks_ INTERNAL ASSERT" on the first backward
# (torch 2.13, measured here) and, once that is worked around, stops all-reducing from the second step on.
_STATIC_NO_SYNC = "it breaks no_sync() gradient accumulation (pytorch/pytorch#187732)"
_REORDER = "bucket layout changes the all-reduce's summation order with 3+ ranks (last-bit differences)"


class Ddp(Transform):
    """Tune DistributedDataParallel: gradient bucket size, gradients as bucket views, static graph."""

    name = "ddp"
    tracks_settings = True
    knobs = (
        Knob(
            "ddp.bucket_cap_mb",
            (10, 25, 50, 100),
            25,
            Numerics.REORDER,
            help="MiB of gradients per all-reduce bucket (25 is torch's default): larger buckets mean fewer "
            f"collectives, smaller ones start overlapping with backward sooner; {_REORDER}",
        ),
        Knob(
            "ddp.gradient_as_bucket_view",
            (False, True),
            False,
            Numerics.REORDER,
            help="gradients are views into the all-reduce buckets: saves one gradient-sized copy and its memory; "
            f"{_REORDER}",
        ),
        Knob(
            "ddp.static_graph",
            (False, True),
            False,
            Numerics.REORDER,
            help="promise that the set of used parameters and the graph never change between steps: DDP then skips "
            "its per-step bookkeeping (a dynamic graph fails or diverges, which a trial shows); never offered where "
            f"gradients accumulate under no_sync(): {_STATIC_NO_SYNC}; {_REORDER}",
        ),
    )

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._no_sync: bool | None = None


    def _skips_sync(self) -> bool:
        """Whether gradients may accumulate under no_sync() here: the script's own, or the no_sync knob's."""
        if self._no_sync is None:
            from autotune.transforms.no_sync import NoSync

            probe = NoSync(self.project, Mode())
            for module in self.project.modules:
                probe.apply(module, Edits())
            self._no_sync = any(s.status in (Status.APPLICABLE, Status.PRESENT) for s in probe.sites)
        return self._no_sync

    def apply(self, facts: ModuleFacts, edits: Edits) -> None:
        for call in calls_to(facts, DDP):
            written = {a.keyword.value for a in call.args if a.keyword is not None}
            leave_out = (("static_graph", _STATIC_NO_SYNC),) if "static_graph" not in written and self._skips_sync() else ()
            found = wrapper_settings(self, facts, call, "DDP", SETTINGS, "ddp_kwargs", _POSITIONAL_SETTINGS, leave_out)
            if found is None:
                continue
            free, names = found
            if self.mode.gated:
                self.settings_read.update(free)
                helper = edits.runtime("ddp_kwargs")
                edits.rewrite(call, lambda node, names=names, helper=helper: move_into_helper(node, names, helper))
                continue
            extra = [
                kwarg(k.name.split(".", 1)[1], repr(self.mode.value(k)))
                for k in self.knobs
                if k.name.split(".", 1)[1] in free and self.mode.value(k) != k.default
            ]
            if extra:
                edits.rewrite(call, lambda node, extra=extra: add_args(node, *extra))


# === runtime: what the patched script runs (python -m autotune.catalog copies it into autotune/runtime_helpers.py) ===

from typing import Any
from autotune.knob_values import default, knob


def ddp_kwargs(**script: Any) -> dict[str, Any]:
    """DistributedDataParallel keyword arguments: those the script wrote, plus the knobs' where they differ from
    torch's defaults."""
    out = dict(script)
    for name in ("bucket_cap_mb", "gradient_as_bucket_view", "static_graph"):  # each knob's default is torch's
        value = knob(f"ddp.{name}")
        if name not in script and value != default(f"ddp.{name}"):
            out[name] = value
    return out
