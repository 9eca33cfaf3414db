"""Where a search runs and what makes its measurements comparable: the device, the program's fingerprint, the
CPU threads a run computes with."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
from collections.abc import Mapping
from typing import Any

from autotune.bake import bake
from autotune.errors import UsageError
from autotune.patch import PatchResult
from autotune.project import Project
from autotune.search.options import SearchOptions
from autotune.search.space import SearchSpace, config_key


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
    if options.lengthen:  # runs may be longer than the asked lengths: the first baseline decides
        doc["lengthen"] = True
    if options.train_steps:  # the objective: time to train this many steps, compile included
        doc["train_steps"] = options.train_steps
    h.update(json.dumps(doc, sort_keys=True, default=str).encode())
    return h.hexdigest()


class Programs:
    """Which configurations are one program: those that bake into the same code.

    A knob that only matters with another one (the compile mode's ``dynamic`` while compile is off, persistent
    loader workers without workers) changes nothing in the baked code, so such a configuration is not run again.
    Each configuration is baked once.
    """

    def __init__(self, project: Project, device: str, space: SearchSpace) -> None:
        self.project, self.device, self.space = project, device, space
        self._codes: dict[str, str | None] = {}
        self.bake_errors: dict[str, str] = {}  # config key -> why it cannot be baked

    def code_key(self, config: Mapping[str, Any]) -> str | None:
        """The hash of the code ``config`` bakes into; None when it cannot be baked."""
        key = config_key(config)
        if key not in self._codes:
            try:
                baked = bake(self.project, config, self.device)
            except Exception as exc:  # a transform bug: the configuration cannot be delivered, so it is not tried
                self.bake_errors[key] = f"{type(exc).__name__}: {exc}"
                self._codes[key] = None
            else:
                h = hashlib.sha256()
                for f in baked.files:
                    h.update(f.rel.as_posix().encode() + b"\0" + f.new_text.encode() + b"\0")
                self._codes[key] = h.hexdigest()
        return self._codes[key]

    def program(self, config: Mapping[str, Any]) -> str:
        """The key that says two configurations are one program (their code, or the configuration itself)."""
        return self.code_key(config) or config_key(config)

    def canonical(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """``config`` with every change that bakes to no different code put back to its default.

        (``compile.scope=blocks`` while compile is off, persistent workers without workers: no part of the result.)
        """
        out = dict(config)
        code = self.code_key(out)
        for knob in self.space.changed(out):
            trial = {**out, knob.name: knob.default}
            if self.code_key(trial) == code:
                out = trial
        return out


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
