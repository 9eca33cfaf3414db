"""lightning_trainer: the Lightning Trainer's own settings (mixed precision, cuDNN benchmark) where the script builds it."""

from __future__ import annotations

import libcst as cst

from autotune.analysis import ModuleFacts
from autotune.knobs import Knob, Numerics, Role
from autotune.project import Framework
from autotune.transform import Edits, Status, Transform
from autotune.syntax import is_literal
from autotune.transforms._settings import code_of, keyword_settings, lightning_precision_on

TRAINERS = {
    "lightning.Trainer",
    "lightning.pytorch.Trainer",
    "lightning.pytorch.trainer.trainer.Trainer",
    "pytorch_lightning.Trainer",
    "pytorch_lightning.trainer.trainer.Trainer",
}


class LightningTrainer(Transform):
    """Mixed precision and cuDNN autotuning as the Lightning Trainer's own precision= and benchmark= settings."""

    name = "lightning_trainer"
    tracks_settings = True
    knobs = (
        Knob(
            "lightning_trainer.precision",
            ("default", "bf16-mixed", "16-mixed"),
            "default",
            Numerics.LOWP,
            role=Role.PRECISION,
            help="Trainer(precision=...): bf16 or fp16 autocast with float32 weights (16-mixed adds a gradient "
            "scaler; on a CPU Lightning runs bf16 instead)",
        ),
        Knob(
            "lightning_trainer.benchmark",
            (False, True),
            False,
            Numerics.REORDER,
            frozenset({"cuda"}),
            help="Trainer(benchmark=True): cuDNN times its convolution algorithms for each input shape",
        ),
    )

    def apply(self, facts: ModuleFacts, edits: Edits) -> None:
        trains = any(f.framework is Framework.LIGHTNING_TRAINER for f in self.project.tuned_frameworks())
        for call in facts.calls:
            if not self.project.derives(facts, call.func, TRAINERS):
                continue
            if not trains and not any(facts.is_runtime_call(a.value, "lightning_trainer_args") for a in call.args):
                why = self.project.no_loop_reason() if not self.project.trains else "this Trainer's fit() is not timed"
                self.report(facts, call, Status.NOT_APPLICABLE, why)
                continue
            keyword_settings(self, facts, call, edits, LIGHTNING_SETTINGS, "lightning_trainer_args", "Trainer", _on,
                             self._baked, {"precision": ("lightning_trainer_switch", LIGHTNING_OFF)})

    def _baked(self, settings: list[str]) -> dict[str, str]:
        values = lightning_settings({s: self.mode.value(self.knob(s)) for s in settings})
        return {k: code_of(v) for k, v in values.items()}


def _on(keyword: str, value: cst.BaseExpression) -> bool:
    if keyword == "precision":
        return lightning_precision_on(value)
    return is_literal(value, True)


# === runtime: what the patched script runs (python -m autotune.catalog copies it into autotune/runtime_helpers.py) ===

from typing import Any

from autotune.knob_values import default, knob, on_reset, took_effect

# each knob's setting -> the Trainer keywords that decide it (a script that writes one keeps its choice)
LIGHTNING_SETTINGS = {"precision": ("precision",), "benchmark": ("benchmark",)}
LIGHTNING_OFF = (None, "32-true", "32", 32)  # the script's own precision switch is off: full precision
_lightning_script_chose: set[str] = set()  # settings whose switch the script turned on itself in this run


def lightning_settings(values: dict[str, Any]) -> dict[str, Any]:
    """Trainer keyword arguments for knob settings (setting -> choice); a choice at its default sets nothing."""
    out: dict[str, Any] = {}
    if values.get("precision", "default") != "default":
        out["precision"] = values["precision"]
    if values.get("benchmark"):
        out["benchmark"] = True
    return out


def lightning_trainer_args(script_sets: tuple[str, ...] = ()) -> dict[str, Any]:
    """The Trainer keywords the knobs ask for, except for the settings the script gives itself: nothing at the
    defaults."""
    values = {s: knob(f"lightning_trainer.{s}", record=False) for s in LIGHTNING_SETTINGS if s not in script_sets}
    return lightning_settings({s: v for s, v in values.items() if v != default(f"lightning_trainer.{s}")})


def lightning_trainer_resolved(trainer: Any) -> None:
    """Record the knobs whose setting the Trainer resolved: its precision plugin's precision, and cuDNN's benchmark
    flag as the Trainer set it (read back from the framework, not from what autotune passed).

    The precision counts where the Trainer trains at a mixed precision the script did not choose itself: on a CPU,
    Lightning runs ``16-mixed`` as ``bf16-mixed`` (with a warning), which changes the program all the same."""
    precision = knob("lightning_trainer.precision", record=False)
    resolved = str(getattr(trainer, "precision", ""))
    if precision != "default" and resolved.endswith("-mixed") and "precision" not in _lightning_script_chose:
        took_effect("lightning_trainer.precision")
    if knob("lightning_trainer.benchmark", record=False):
        import torch

        if torch.backends.cudnn.benchmark:
            took_effect("lightning_trainer.benchmark")


def lightning_trainer_switch(setting: str, script_value: Any) -> Any:
    """``precision=args.precision``: the script's value where its switch is on; where it is full precision, the
    knob's (which the trial reads back from the Trainer, as for a precision the script leaves out)."""
    value = knob(f"lightning_trainer.{setting}", record=False)
    if script_value not in LIGHTNING_OFF:
        _lightning_script_chose.add(setting)
        return script_value
    return script_value if value == "default" else value


on_reset(_lightning_script_chose.clear)
