"""fabric: Lightning Fabric's own precision, where the script builds its Fabric."""

from __future__ import annotations

import libcst as cst

from autotune.analysis import ModuleFacts
from autotune.knobs import Knob, Numerics, Role
from autotune.transform import Edits, Status, Transform
from autotune.transforms._settings import code_of, keyword_settings, lightning_precision_on

FABRICS = {
    "lightning.Fabric",
    "lightning.fabric.Fabric",
    "lightning.fabric.fabric.Fabric",
    "lightning_fabric.Fabric",
    "lightning_fabric.fabric.Fabric",
}


class Fabric(Transform):
    """Mixed precision as Lightning Fabric's own Fabric(precision=...), which runs autocast and scales the loss."""

    name = "fabric"
    tracks_settings = True
    knobs = (
        Knob(
            "fabric.precision",
            ("default", "bf16-mixed", "16-mixed"),
            "default",
            Numerics.LOWP,
            role=Role.PRECISION,
            help="Fabric(precision=...): bf16 or fp16 autocast in the set-up model's forward (16-mixed with a "
            "gradient scaler in fabric.backward; on a CPU Fabric runs bf16 instead); a `fabric run --precision` "
            "choice wins",
        ),
    )

    def apply(self, facts: ModuleFacts, edits: Edits) -> None:
        for call in facts.calls:
            if not self.project.derives(facts, call.func, FABRICS):
                continue
            if not self.project.trains:
                self.report(facts, call, Status.NOT_APPLICABLE, self.project.no_loop_reason())
                continue
            keyword_settings(self, facts, call, edits, FABRIC_SETTINGS, "fabric_args", "Fabric", _on, self._baked,
                             {"precision": ("fabric_switch", FABRIC_OFF)})

    def _baked(self, settings: list[str]) -> dict[str, str]:
        value = self.mode.value(self.knob("precision"))
        return {"precision": code_of(value)} if value != "default" else {}


def _on(keyword: str, value: cst.BaseExpression) -> bool:
    return lightning_precision_on(value)


# === runtime: what the patched script runs (python -m autotune.catalog copies it into autotune/runtime_helpers.py) ===

import os
from typing import Any

from autotune.knob_values import knob, took_effect

FABRIC_SETTINGS = {"precision": ("precision",)}
FABRIC_OFF = (None, "32-true", "32", 32)  # the script's own precision switch is off: full precision


def fabric_args(script_sets: tuple[str, ...] = ()) -> dict[str, Any]:
    """Fabric keywords for the knob: nothing at its default, where the script gives precision itself, or where
    ``fabric run --precision`` chose one for this run (its environment variable)."""
    value = knob("fabric.precision", record=False)
    if value == "default" or "precision" in script_sets or os.environ.get("LT_PRECISION"):
        return {}
    took_effect("fabric.precision")
    return {"precision": value}


def fabric_switch(setting: str, script_value: Any) -> Any:
    """``precision=args.precision``: the script's value where its switch is on; where it is full precision, the
    knob's, unless ``fabric run --precision`` chose one for this run (None defers to it)."""
    value = knob(f"fabric.{setting}", record=False)
    if script_value not in FABRIC_OFF or value == "default" or (script_value is None and os.environ.get("LT_PRECISION")):
        return script_value
    took_effect(f"fabric.{setting}")
    return value
