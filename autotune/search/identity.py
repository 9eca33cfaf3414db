"""Where a search runs and what makes its measurements comparable: the device, the program's fingerprint, the
CPU threads a run computes with."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
from collections.abc import Mapping

from autotune.errors import UsageError
from autotune.patch import PatchResult
from autotune.search.options import SearchOptions
from autotune.search.space import SearchSpace


def resolve_device(device: str) -> str:
    if device not in ("auto", "cpu", "cuda"):
        raise UsageError(f"--device must be auto, cpu or cuda, not {device!r}")
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: torch sees no CUDA device here")
    return device


def fingerprint(patch: PatchResult, options: SearchOptions, device: str, space: SearchSpace) -> str:
    """What makes measurements comparable: the patched code, the script's arguments, device, steps, space."""
    h = hashlib.sha256()
    for f in patch.files:
        h.update(f.rel.as_posix().encode() + b"\0" + f.new_text.encode() + b"\0")
    doc = {
        "args": list(options.args),
        "device": device,
        "steps": options.steps,
        "warmup": options.warmup,
        "space": space.describe(),
        "env": dict(sorted(options.env.items())),
    }
    if options.launcher:  # (only then, so that studies made before launchers existed still resume)
        doc["launcher"] = shlex.split(options.launcher)
    if options.train_steps:  # the objective: time to train this many steps, compile included
        doc["train_steps"] = options.train_steps
    h.update(json.dumps(doc, sort_keys=True, default=str).encode())
    return h.hexdigest()


def thread_counts(env: Mapping[str, str | None], launched: bool) -> tuple[int, int]:
    """The CPU threads a run computes with, and the other count a perturbed baseline run gets."""
    given = env["OMP_NUM_THREADS"] if "OMP_NUM_THREADS" in env else os.environ.get("OMP_NUM_THREADS")
    try:
        base = int(given or "")
    except ValueError:
        base = 0
    if base < 1:
        if launched:
            base = 1  # torchrun's default for each process it starts
        else:
            import torch

            base = torch.get_num_threads()  # what a new process gets here: its default is this one's
    return base, base - 1 if base > 1 else 2
