"""backend_flags: TF32, float32 matmul precision and cuDNN autotuning, set once after the entry script's imports."""

from __future__ import annotations

import libcst as cst

from autotune.analysis import ModuleFacts
from autotune.knobs import Knob, Numerics
from autotune.transform import Edits, Status, Transform
from autotune.syntax import enclosing_if, is_setting, stmt

# What each spelling decides: setting the matmul precision also decides TF32 for CUDA matmuls, and the reverse.
ASSIGNED = {
    "torch.backends.cuda.matmul.allow_tf32": ("tf32", "matmul_precision"),
    "torch.backends.cuda.matmul.fp32_precision": ("tf32", "matmul_precision"),
    "torch.backends.fp32_precision": ("tf32", "matmul_precision"),
    "torch.backends.cudnn.allow_tf32": ("tf32",),
    "torch.backends.cudnn.fp32_precision": ("tf32",),
    "torch.backends.cudnn.conv.fp32_precision": ("tf32",),
    "torch.backends.cudnn.rnn.fp32_precision": ("tf32",),
    "torch.backends.mkldnn.matmul.fp32_precision": ("matmul_precision",),
    "torch.backends.mkldnn.fp32_precision": ("matmul_precision",),
    "torch.backends.cudnn.benchmark": ("cudnn_benchmark",),
}
CALLED = {"torch.set_float32_matmul_precision": ("tf32", "matmul_precision")}
# literal values that turn the faster mode on (PRESENT); any other value is the user's choice (USER)
FASTER = {"True", "high", "medium", "tf32", "bf16"}


class BackendFlags(Transform):
    """Allow TF32, lower the float32 matmul precision and let cuDNN benchmark its algorithms."""

    name = "backend_flags"
    entry_only = True
    knobs = (
        Knob(
            "backend_flags.tf32",
            (False, True),
            False,
            Numerics.LOWP,
            frozenset({"cuda"}),
            help="TF32 tensor cores for float32 matmuls and convolutions (10-bit mantissa inputs)",
        ),
        Knob(
            "backend_flags.matmul_precision",
            ("highest", "high", "medium"),
            "highest",
            Numerics.LOWP,
            frozenset({"cpu", "cuda"}),
            help="torch.set_float32_matmul_precision: high allows TF32, medium bf16 (also on CPUs whose oneDNN "
            "has bf16 matmuls)",
        ),
        Knob(
            "backend_flags.cudnn_benchmark",
            (False, True),
            False,
            Numerics.REORDER,
            frozenset({"cuda"}),
            help="cudnn.benchmark: time the convolution algorithms for each input shape and keep the fastest",
        ),
    )

    def __init__(self, project, mode) -> None:
        super().__init__(project, mode)
        self._script_sets: set[str] = set()

    def knobs_read(self) -> tuple[Knob, ...]:
        return tuple(k for k in self.knobs if k.name.split(".", 1)[1] not in self._script_sets)

    def apply(self, facts: ModuleFacts, edits: Edits) -> None:
        patched = next((c for c in facts.calls if facts.is_runtime_call(c, "backend_flags")), None)
        if patched is not None:
            self.report(facts, patched, Status.PRESENT, "backend flags are already knobs")
            return
        if not self.project.trains:
            reason = "no training loop: the flags would speed up nothing"
            self.report(facts, facts.module, Status.NOT_APPLICABLE, reason)
            return
        for module in self.project.modules:
            self._script_flags(module)
        hf = any(f.framework.hugging_face for f in self.project.tuned_frameworks())
        if hf and not self.project.loops and "tf32" not in self._script_sets:
            # the Trainer's own tf32 setting is that knob there (hf_trainer.tf32): one knob, one place
            self._script_sets.add("tf32")
            self.report(facts, facts.module, Status.NOT_APPLICABLE, "TF32: the Trainer's own tf32 setting is the knob here (hf_trainer.tf32)")
        missing = [f for f in FLAGS if f not in self._script_sets]
        if not missing:
            return
        anchor = _last_import(facts)
        self.report(facts, anchor, Status.APPLICABLE, f"sets {', '.join(missing)} once after the imports")
        if self.mode.gated:
            skip = tuple(f for f in FLAGS if f in self._script_sets)
            args = f"script_sets=({', '.join(map(_quoted, skip))}{',' if len(skip) == 1 else ''})" if skip else ""
            code = [f"{edits.runtime('backend_flags')}({args})"]
        else:
            values = {setting: self.mode.value(self.knob(setting)) for setting in missing}
            code = flag_statements(values, _torch_name(facts, edits)) if any(
                v != self.knob(s).default for s, v in values.items()) else []
        if code:
            lines = [stmt(c + "\n") for c in code]
            lines[0] = lines[0].with_changes(leading_lines=[cst.EmptyLine()])
            edits.after_imports(*lines)

    def _script_flags(self, facts: ModuleFacts) -> None:
        """Report each flag the script sets itself, in source order; those stay out of the knobs."""
        found = []
        for call in facts.calls:
            qual = facts.qualname(call.func)
            if qual in CALLED and call.args:
                code = f"{facts.code(call.func)}({facts.code(call.args[0].value)})"
                found.append((call, code, call.args[0].value, CALLED[qual]))
        for assign in facts.assigns:
            for target in assign.targets:
                qual = facts.qualname(target.target)
                if qual in ASSIGNED:
                    code = f"{facts.code(target.target)} = {facts.code(assign.value)}"
                    found.append((assign, code, assign.value, ASSIGNED[qual]))
        for node, code, value, flags in sorted(found, key=lambda f: facts.position(f[0])):
            self._found(facts, node, code, value, flags)

    def _found(self, facts: ModuleFacts, node: cst.CSTNode, code: str, value: cst.BaseExpression, flags) -> None:
        literal = value.value if isinstance(value, cst.Name) else getattr(value, "raw_value", None)
        switch = enclosing_if(facts, node)
        if literal in FASTER and switch is not None and is_setting(switch.test) and self._runs_after_ours(facts, node):
            # ``if args.tensorcores: torch.set_float32_matmul_precision("high")``: a switch of the script's own, off
            # unless its flag is given. The knobs set the flags after the imports; where the flag is on, the
            # script's statement runs after them and its choice stands, as without autotune
            flag = facts.code(switch.test)
            self.report(facts, node, Status.APPLICABLE, (
                f"the script sets {code} where {flag}: its own switch (present, switched off where {flag} is "
                f"false), so {', '.join(flags)} stay knobs, which the switch overrides where it is on"))
            return
        self._script_sets.update(flags)
        if literal in FASTER:
            self.report(facts, node, Status.PRESENT, f"the script sets {code}")
        else:
            self.report(facts, node, Status.USER, f"the script sets {code}: its choice is kept")


    def _runs_after_ours(self, facts: ModuleFacts, node: cst.CSTNode) -> bool:
        """Whether ``node`` runs after the knobs set the flags (after the entry script's imports): in a function, or
        in the entry script's own top level below its imports (a local module's top level runs as it is imported,
        before them)."""
        if facts.function_of(node) is not None:
            return True
        entry = self.project.entry
        anchor = _last_import(entry)
        return facts is entry and anchor is not entry.module and facts.position(node) > facts.position(anchor)


def _last_import(facts: ModuleFacts) -> cst.CSTNode:
    """The last import of the module's top-level import block (where the flags go after), or the module."""
    last: cst.CSTNode = facts.module
    for s in facts.module.body:
        if isinstance(s, cst.SimpleStatementLine) and all(isinstance(x, (cst.Import, cst.ImportFrom)) for x in s.body):
            last = s.body[-1]
        elif isinstance(s, cst.BaseCompoundStatement) and not isinstance(s, (cst.Try, cst.If)):
            break
    return last


def _quoted(text: str) -> str:
    return f'"{text}"'


def _torch_name(facts: ModuleFacts, edits: Edits) -> str:
    for alias, qual in facts.imports.items():
        if qual == "torch":
            return alias
    edits.require_import("torch")
    return "torch"


# === runtime: what the patched script runs (python -m autotune.catalog copies it into autotune/runtime_helpers.py) ===

from typing import Any

from autotune.knob_values import default, knob

FLAGS = ("tf32", "matmul_precision", "cudnn_benchmark")


def flag_statements(values: dict[str, Any], torch: str = "torch") -> list[str]:
    """The statements that set ``values`` (flag -> choice), one per line: what the baked script holds, and what
    the patched script executes. A flag at its default sets nothing."""
    code = []
    for flag, value in values.items():
        if value == default(f"backend_flags.{flag}"):
            continue
        if flag == "tf32":
            code += [f"{torch}.backends.cuda.matmul.allow_tf32 = True", f"{torch}.backends.cudnn.allow_tf32 = True"]
        elif flag == "matmul_precision":
            code.append(f'{torch}.set_float32_matmul_precision("{value}")')
        else:
            code.append(f"{torch}.backends.cudnn.benchmark = True")
    return code


def backend_flags(script_sets: tuple[str, ...] = ()) -> None:
    """Set the TF32, matmul-precision and cuDNN flags the knobs ask for; touch nothing by default.

    ``script_sets`` names the flags the script sets itself ("tf32", "matmul_precision", "cudnn_benchmark"):
    those stay as the script wrote them, whatever the config says.
    """
    code = flag_statements({flag: knob(f"backend_flags.{flag}") for flag in FLAGS if flag not in script_sets})
    if code:
        import torch

        exec("\n".join(code), {"torch": torch})  # the very statements a baked script runs
