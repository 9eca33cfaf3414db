"""threads: the number of CPU threads torch computes with (intra-op), set once after the entry script's imports."""

from __future__ import annotations

import libcst as cst

from autotune.analysis import ModuleFacts
from autotune.knobs import Knob, Numerics, Role
from autotune.transform import Edits, Status, Transform
from autotune.syntax import stmt
from autotune.transforms.backend_flags import _last_import, _torch_name

SETTERS = ("torch.set_num_threads",)


class Threads(Transform):
    """Set how many CPU threads torch's operators run on (torch.set_num_threads)."""

    name = "threads"
    entry_only = True
    devices = frozenset({"cpu"})
    knobs = (
        Knob(
            "threads.intra_op",
            ("default", 1, 2, 4, 8, 16, 32),
            "default",
            Numerics.REORDER,
            frozenset({"cpu"}),
            role=Role.THREADS,
            help="torch.set_num_threads: CPU threads per operator (default: torch's choice, OMP_NUM_THREADS or the "
            "cores); fewer can be faster on a busy or small machine; sums split over threads round differently",
        ),
    )

    def apply(self, facts: ModuleFacts, edits: Edits) -> None:
        patched = next((c for c in facts.calls if facts.is_runtime_call(c, "threads")), None)
        if patched is not None:
            self.report(facts, patched, Status.PRESENT, "the thread count is already a knob")
            return
        if not self.project.trains:
            self.report(facts, facts.module, Status.NOT_APPLICABLE, "no training loop: threads would speed up nothing")
            return
        own = [(m, c) for m in self.project.modules for c in m.calls if m.qualname(c.func) in SETTERS]
        for module, call in own:
            self.report(module, call, Status.USER, f"the script calls {module.code(call)}: its choice is kept")
        if own:
            return
        anchor = _last_import(facts)
        self.report(facts, anchor, Status.APPLICABLE, "sets the CPU thread count once after the imports")
        if self.mode.gated:
            code = f"{edits.runtime('threads')}()"
        else:
            value = self.mode.value(self.knob("intra_op"))
            if value == "default":
                return
            code = thread_statement(value, _torch_name(facts, edits))
        edits.after_imports(stmt(code + "\n").with_changes(leading_lines=[cst.EmptyLine()]))


# === runtime: what the patched script runs (python -m autotune.catalog copies it into autotune/runtime_helpers.py) ===

from typing import Any

from autotune.knob_values import knob


def thread_statement(value: Any, torch: str = "torch") -> str:
    """The statement that sets a thread count other than the default: the baked script's, run by the patched one."""
    return f"{torch}.set_num_threads({int(value)})"


def threads() -> None:
    """Set the CPU threads torch's operators run on, as the knob asks; touch nothing by default."""
    n = knob("threads.intra_op")
    if n == "default":
        return
    import torch

    exec(thread_statement(n), {"torch": torch})  # the very statement a baked script runs
