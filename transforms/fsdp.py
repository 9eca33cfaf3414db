"""fsdp: tune FSDP's prefetching, all-gather rate limit, parameter views, and FSDP2's resharding after forward."""

from __future__ import annotations

from autotune.analysis import ModuleFacts
from autotune.knobs import Knob, Numerics
from autotune.transform import Edits, Status, Transform
from autotune.syntax import add_args, kwarg, move_into_helper, star_kwargs
from autotune.transforms._dist import FSDP, FULLY_SHARD, calls_to, runtime_splat, short_name, wrapper_settings

SETTINGS = ("forward_prefetch", "backward_prefetch", "limit_all_gathers", "use_orig_params")
# FullyShardedDataParallel(module, process_group, sharding_strategy, cpu_offload, auto_wrap_policy,
# backward_prefetch, ...): from the sixth positional argument on, settings could be positional.
_POSITIONAL_SETTINGS = 5
# The all-gathers and reduce-scatters are the same whatever these settings say; only their timing (and for
# use_orig_params what the optimizer is handed) changes. Measured with gloo on 2 CPU ranks: identical losses.


class Fsdp(Transform):
    """Tune FSDP: forward/backward prefetch, all-gather rate limit, original parameters; FSDP2 resharding."""

    name = "fsdp"
    tracks_settings = True
    knobs = (
        Knob(
            "fsdp.forward_prefetch",
            (False, True),
            False,
            Numerics.EXACT,
            devices=frozenset({"cuda"}),
            help="issue the next all-gather before the current forward computation (static graphs only); overlaps "
            "communication with compute on GPU streams, nothing to overlap on CPU",
        ),
        Knob(
            "fsdp.backward_prefetch",
            ("pre", "post", "none"),
            "pre",
            Numerics.EXACT,
            devices=frozenset({"cuda"}),
            help="when backward all-gathers the next parameters: pre (torch's default, BACKWARD_PRE: most overlap, "
            "most memory), post (BACKWARD_POST), none (no prefetch, least memory)",
        ),
        Knob(
            "fsdp.limit_all_gathers",
            (True, False),
            True,
            Numerics.EXACT,
            devices=frozenset({"cuda"}),
            help="True (torch's default): the CPU waits so that at most two all-gathers are in flight, bounding GPU "
            "memory; False lets it run ahead",
        ),
        Knob(
            "fsdp.use_orig_params",
            (False, True),
            False,
            Numerics.EXACT,
            help="hand the optimizer the original parameters (views into the flat parameter) instead of flat "
            "parameters: needed by torch.compile and per-parameter optimizer settings; an optimizer with per-tensor "
            "statistics then sees different tensors, which a trial shows",
        ),
        Knob(
            "fsdp.reshard_after_forward",
            ("default", True, False),
            "default",
            Numerics.EXACT,
            help="FSDP2 fully_shard: default leaves torch's choice (True for inner modules, False for the root in "
            "torch 2.13); True frees gathered parameters after forward and gathers them again in backward, False "
            "keeps them (more memory, one all-gather less per module)",
        ),
    )


    def apply(self, facts: ModuleFacts, edits: Edits) -> None:
        for call in calls_to(facts, FSDP | FULLY_SHARD):
            if facts.qualname(call.func) in FSDP:
                self._wrapper(facts, edits, call)
            else:
                self._fully_shard(facts, edits, call)

    def _wrapper(self, facts: ModuleFacts, edits: Edits, call) -> None:
        """FSDP1: ``FullyShardedDataParallel(module, ...)``."""
        found = wrapper_settings(self, facts, call, "FSDP", SETTINGS, "fsdp_kwargs", _POSITIONAL_SETTINGS)
        if found is None:
            return
        free, names = found
        if self.mode.gated:
            self.settings_read.update(free)
            helper = edits.runtime("fsdp_kwargs")
            edits.rewrite(call, lambda node, names=names, helper=helper: move_into_helper(node, names, helper))
            return
        extra = []
        for declared in self.knobs:
            setting = declared.name.split(".", 1)[1]
            value = self.mode.value(declared)
            if setting not in free or value == declared.default:
                continue
            if setting == "backward_prefetch":
                code = "None" if value == "none" else f"{self._prefetch_enum(facts, edits)}.{PREFETCH_MEMBER[value]}"
                extra.append(kwarg(setting, code))
            else:
                extra.append(kwarg(setting, repr(value)))
        if extra:
            edits.rewrite(call, lambda node, extra=extra: add_args(node, *extra))

    def _fully_shard(self, facts: ModuleFacts, edits: Edits, call) -> None:
        """FSDP2: ``fully_shard(module, ...)``, called once per sharded module."""
        what = short_name(facts, call)
        if runtime_splat(facts, call, "fully_shard_kwargs"):
            self.report(facts, call, Status.PRESENT, f"{what}: reshard_after_forward is already a knob")
            return
        splat = next((a for a in call.args if a.star), None)
        if splat is not None:
            self.report(facts, call, Status.NOT_APPLICABLE, f"{splat.star}{facts.code(splat.value)} may set reshard_after_forward")
            return
        written = next((a for a in call.args if a.keyword is not None and a.keyword.value == "reshard_after_forward"), None)
        if written is not None:
            self.report(facts, call, Status.USER, f"{what}(reshard_after_forward={facts.code(written.value)}) is the script's choice")
            return
        self.report(facts, call, Status.APPLICABLE, f"{what}: reshard_after_forward becomes a knob")
        if self.mode.gated:
            self.settings_read.add("reshard_after_forward")
            extra = star_kwargs(f"{edits.runtime('fully_shard_kwargs')}()")
        else:
            value = self.mode.value(self.knob("reshard_after_forward"))
            if value == "default":
                return
            extra = kwarg("reshard_after_forward", repr(value))
        edits.rewrite(call, lambda node, extra=extra: add_args(node, extra))

    def _prefetch_enum(self, facts: ModuleFacts, edits: Edits) -> str:
        """How this file spells ``torch.distributed.fsdp.BackwardPrefetch`` (baked code names its members)."""
        for alias, qual in facts.imports.items():
            if qual in ("torch.distributed.fsdp.BackwardPrefetch", "torch.distributed.fsdp.api.BackwardPrefetch"):
                return alias
        for alias, qual in facts.imports.items():
            if qual == "torch.distributed.fsdp":
                return f"{alias}.BackwardPrefetch"
        if facts.imports.get("torch") != "torch":
            edits.require_import("torch")
        return "torch.distributed.fsdp.BackwardPrefetch"


# === runtime: what the patched script runs (python -m autotune.catalog copies it into autotune/runtime_helpers.py) ===

from typing import Any
from autotune.knob_values import default, knob


# knob choice -> torch.distributed.fsdp.BackwardPrefetch member: what the baked script spells, and the patched uses
PREFETCH_MEMBER = {"pre": "BACKWARD_PRE", "post": "BACKWARD_POST"}


def fsdp_kwargs(**script: Any) -> dict[str, Any]:
    """FullyShardedDataParallel keyword arguments: the script's, plus the knobs' where they differ from torch's."""
    out = dict(script)
    for name in ("forward_prefetch", "backward_prefetch", "limit_all_gathers", "use_orig_params"):  # defaults: torch's
        value = knob(f"fsdp.{name}")
        if name in script or value == default(f"fsdp.{name}"):
            continue
        if name == "backward_prefetch":
            from torch.distributed.fsdp import BackwardPrefetch

            value = getattr(BackwardPrefetch, PREFETCH_MEMBER[value]) if value != "none" else None
        out[name] = value
    return out


def fully_shard_kwargs(**script: Any) -> dict[str, Any]:
    """``fully_shard`` keyword arguments: the script's, plus ``reshard_after_forward`` when the knob sets one."""
    out = dict(script)
    value = knob("fsdp.reshard_after_forward")
    if "reshard_after_forward" not in script and value != "default":
        out["reshard_after_forward"] = value
    return out
