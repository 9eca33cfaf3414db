"""fused_optimizer: pick the fused or foreach implementation of Adam, AdamW and SGD."""

from __future__ import annotations

import libcst as cst

from autotune.analysis import ModuleFacts
from autotune.knobs import Knob, Numerics
from autotune.transform import Edits, Status, Transform
from autotune.syntax import add_args, argument, is_literal, keyword, kwarg, star_kwargs
from autotune.transforms._settings import lightning_precision_on
from autotune.transforms.lightning_trainer import TRAINERS

# The optimizers whose constructors take both fused= and foreach= in torch 2.4+; fused runs on CPU and CUDA.
FUSABLE = {f"torch.optim.{n}" for n in ("Adam", "AdamW", "SGD")} | {
    f"torch.optim.{m}.{n}" for m, n in (("adam", "Adam"), ("adamw", "AdamW"), ("sgd", "SGD"))
}


class FusedOptimizer(Transform):
    """Use the fused (one kernel for all parameters) or foreach (batched) optimizer implementation."""

    name = "fused_optimizer"
    knobs = (
        Knob(
            "fused_optimizer.impl",
            ("default", "foreach", "fused"),
            "default",
            Numerics.REORDER,
            help="default: torch's choice (for-loop on CPU, foreach on CUDA); foreach or fused kernels",
        ),
    )

    def apply(self, facts: ModuleFacts, edits: Edits) -> None:
        clipping = self._lightning_clipping()
        for call in self.project.optimizer_ctors(facts):
            qual = facts.qualname(call.func)
            short = qual.rsplit(".", 1)[-1]
            if qual not in FUSABLE:
                self.report(facts, call, Status.NOT_APPLICABLE, f"{short} has no fused implementation")
                continue
            written = [a for a in call.args if a.keyword is not None and a.keyword.value in ("fused", "foreach")]
            if any(facts.is_runtime_call(a.value, "optimizer_impl") for a in call.args if a.star == "**"):
                self.report(facts, call, Status.PRESENT, f"{short}: implementation already a knob")
                continue
            if written:
                arg = written[0]
                choice = f"{arg.keyword.value}={facts.code(arg.value)}"
                fused_on = keyword(call, "fused") is not None and facts.code(keyword(call, "fused").value) == "True"
                if fused_on:
                    self.report(facts, call, Status.PRESENT, f"{short}({choice})")
                else:
                    self.report(facts, call, Status.USER, f"{short}({choice}) is the script's choice")
                continue
            if any(a.star == "**" for a in call.args):
                self.report(facts, call, Status.NOT_APPLICABLE, f"{short}(**kwargs) may already set fused/foreach")
                continue
            note = ""
            if clipping is not None:
                where, mixed = clipping
                when = "never (the script's precision is mixed)" if mixed else "only at full precision"
                note = (f"; fused {when}: Lightning refuses to clip a fused optimizer's gradients under mixed "
                        f"precision ({where})")
            self.report(facts, call, Status.APPLICABLE, f"{short} uses the default implementation{note}")
            flag = None if clipping is None else ("mixed" if clipping[1] else "knob")
            if self.mode.gated:
                arg = f'lightning_clipping="{flag}"' if flag else ""
                extra = star_kwargs(f"{edits.runtime('optimizer_impl')}({arg})")
            else:  # the trial's decision (optimizer_impl), from the same function
                impl = impl_chosen(self.mode.value(self.knobs[0]), flag,
                                   str(self.mode.values.get("lightning_trainer.precision", "default")))
                if impl == "default":
                    continue
                extra = kwarg(impl, "True")
            edits.rewrite(call, lambda node, extra=extra: add_args(node, extra))

    def _lightning_clipping(self) -> tuple[str, bool] | None:
        """(where, whether its precision is mixed as written) for a Lightning Trainer of the project built with
        gradient_clip_val (not None or 0): Lightning's mixed precision refuses to clip the gradients of an optimizer
        that unscales them itself, which a fused one does (its precision plugin raises "does not allow for gradient
        clipping because it performs unscaling of gradients internally")."""
        for facts in self.project.modules:
            for call in facts.calls:
                if not self.project.derives(facts, call.func, TRAINERS):
                    continue
                clip = argument(call, None, "gradient_clip_val")
                if clip is None or is_literal(clip, None) or (
                        isinstance(clip, (cst.Integer, cst.Float)) and float(clip.value) == 0):
                    continue
                precision = argument(call, None, "precision")
                mixed = precision is not None and lightning_precision_on(precision)
                where = f"Trainer(gradient_clip_val={facts.code(clip)}) at {facts.display}:{facts.position(call)[0]}"
                return where, mixed
        return None


# === runtime: what the patched script runs (python -m autotune.catalog copies it into autotune/runtime_helpers.py) ===

from autotune.knob_values import knob, took_effect


def impl_chosen(impl: str, lightning_clipping: str | None, precision: str) -> str:
    """The implementation the optimizer gets for knob value ``impl`` ("default": left as written): one decision for
    the trial (optimizer_impl) and the tuned script (the transform's bake). ``lightning_clipping``: a Lightning
    Trainer clips the gradients, with its precision mixed as the script wrote it ("mixed") or as the
    lightning_trainer.precision knob makes it ("knob", with that knob at ``precision``); Lightning refuses to clip a
    fused optimizer's gradients under mixed precision, so there fused leaves the optimizer as written."""
    if impl == "fused" and (lightning_clipping == "mixed" or (lightning_clipping == "knob" and precision != "default")):
        return "default"
    return impl


def optimizer_impl(lightning_clipping: str | None = None) -> dict[str, bool]:
    """Keyword arguments that select the optimizer implementation: {}, {'foreach': True} or {'fused': True}, as
    impl_chosen decides (not applied where it leaves the optimizer as written)."""
    precision = knob("lightning_trainer.precision", record=False) if lightning_clipping == "knob" else "default"
    impl = impl_chosen(knob("fused_optimizer.impl", record=False), lightning_clipping, precision)
    if impl == "default":
        return {}
    took_effect("fused_optimizer.impl")
    return {impl: True}
