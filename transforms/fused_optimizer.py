"""fused_optimizer: pick the fused or foreach implementation of Adam, AdamW and SGD."""

from __future__ import annotations

from autotune.analysis import ModuleFacts
from autotune.knobs import Knob, Numerics
from autotune.transform import Edits, Status, Transform
from autotune.syntax import add_args, keyword, kwarg, star_kwargs

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
            self.report(facts, call, Status.APPLICABLE, f"{short} uses the default implementation")
            if self.mode.gated:
                extra = star_kwargs(f"{edits.runtime('optimizer_impl')}()")
            else:
                extra = kwarg(self.mode.value(self.knobs[0]), "True")
            edits.rewrite(call, lambda node, extra=extra: add_args(node, extra))


# === runtime: what the patched script runs (python -m autotune.catalog copies it into autotune/runtime_helpers.py) ===

from autotune.knob_values import knob


def optimizer_impl() -> dict[str, bool]:
    """Keyword arguments that select the optimizer implementation: {}, {'foreach': True} or {'fused': True}."""
    impl = knob("fused_optimizer.impl")
    return {} if impl == "default" else {impl: True}
