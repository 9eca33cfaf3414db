"""accelerator: Hugging Face Accelerate's own mixed precision, where the script builds its Accelerator."""

from __future__ import annotations

import libcst as cst

from autotune.analysis import ModuleFacts
from autotune.knobs import Knob, Numerics, Role
from autotune.transform import Edits, Status, Transform
from autotune.transforms._dist import literal_string
from autotune.transforms._settings import code_of, keyword_settings

ACCELERATORS = {"accelerate.Accelerator", "accelerate.accelerator.Accelerator"}


class Accelerator(Transform):
    """Mixed precision as Accelerate's own Accelerator(mixed_precision=...), which runs autocast and scales the loss."""

    name = "accelerator"
    tracks_settings = True
    knobs = (
        Knob(
            "accelerator.mixed_precision",
            ("default", "bf16", "fp16"),
            "default",
            Numerics.LOWP,
            role=Role.PRECISION,
            help="Accelerator(mixed_precision=...): bf16 or fp16 autocast in the prepared model's forward (fp16 with "
            "a gradient scaler in accelerator.backward); an `accelerate launch --mixed_precision` choice wins",
        ),
    )

    def apply(self, facts: ModuleFacts, edits: Edits) -> None:
        for call in facts.calls:
            if not self.project.derives(facts, call.func, ACCELERATORS):
                continue
            if not self.project.trains:
                self.report(facts, call, Status.NOT_APPLICABLE, self.project.no_loop_reason())
                continue
            keyword_settings(self, facts, call, edits, ACCELERATOR_SETTINGS, "accelerator_args", "Accelerator", _on,
                             self._baked, {"mixed_precision": ("accelerator_switch", OFF)})

    def _baked(self, settings: list[str]) -> dict[str, str]:
        value = self.mode.value(self.knob("mixed_precision"))
        return {"mixed_precision": code_of(value)} if value != "default" else {}


def _on(keyword: str, value: cst.BaseExpression) -> bool:
    return literal_string(value) in ("bf16", "fp16", "fp8")


# === runtime: what the patched script runs (python -m autotune.catalog copies it into autotune/runtime_helpers.py) ===

import os
from typing import Any

from autotune.knob_values import knob, took_effect

ACCELERATOR_SETTINGS = {"mixed_precision": ("mixed_precision",)}
OFF = (None, "no")  # the script's own mixed_precision switch is off (None: Accelerate's config decides)


def accelerator_args(script_sets: tuple[str, ...] = ()) -> dict[str, Any]:
    """Accelerator keywords for the knob: nothing at its default, where the script gives mixed_precision itself, or
    where ``accelerate launch --mixed_precision`` (or its config) chose one for this run (its environment variable)."""
    value = knob("accelerator.mixed_precision", record=False)
    if value == "default" or "mixed_precision" in script_sets or os.environ.get("ACCELERATE_MIXED_PRECISION"):
        return {}
    took_effect("accelerator.mixed_precision")
    return {"mixed_precision": value}


def accelerator_switch(setting: str, script_value: Any) -> Any:
    """``mixed_precision=args.mixed_precision``: the script's value where its switch is on; where it is off
    (None, "no"), the knob's, unless ``accelerate launch`` chose one for this run (None defers to it)."""
    value = knob(f"accelerator.{setting}", record=False)
    if script_value not in OFF or value == "default" or (script_value is None and os.environ.get("ACCELERATE_MIXED_PRECISION")):
        return script_value
    took_effect(f"accelerator.{setting}")
    return value
