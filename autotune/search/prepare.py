"""A search set up, as one value: the options checked, the script loaded and patched, the space and the strategy
built, the output folder checked, and what identifies its runs."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.analysis import RUNTIME_ALIAS
from autotune.project import Project, load_project
from autotune.bake import check_out_dir
from autotune.errors import NoTrainingLoop, UsageError
from autotune.compile_cache import CACHE_NAME
from autotune.files import PLOT_NAME, REPORT_NAME
from autotune.patch import PatchResult, run, select
from autotune.search.budget import check_pairs
from autotune.search.identity import fingerprint, resolve_device, thread_counts
from autotune.search.machine import cpu_has_bf16
from autotune.search.options import SearchOptions
from autotune.knobs import Role
from autotune.search.space import (
    SearchSpace, SpaceFile, build_space, fit_threads, read_space, restore_space, with_role,
)
from autotune.search.strategy import StrongStart
from autotune.search.ranks import parse_launcher


@dataclass(frozen=True)
class Prepared:
    """What a search works on: the script and its patch, the space and strategy, where its outputs go, its study."""

    project: Project
    device: str
    launcher: tuple[str, ...]
    patch: PatchResult
    space: SearchSpace
    strategy: StrongStart
    out: Path
    fingerprint: str  # the patched code, arguments, device, run lengths and space: runs with one are comparable
    study_name: str

    def about(self, options: SearchOptions) -> dict[str, Any]:
        """What the study is made from, stored in it so that ``autotune report`` can set the search up again."""
        return {
            "script": str(options.script.resolve()),
            "args": list(options.args),
            "device": self.device,
            "steps": options.steps,
            "warmup": options.warmup,
            "lengthen": options.lengthen,
            "trials": options.trials,
            "time_budget": options.budget,
            "confirm": options.confirm,
            "whole_runs": options.whole_runs,
            "rtol": options.rtol,
            "seed": options.seed,
            "env": dict(options.env),
            "launcher": options.launcher,
            "space": self.space.describe(),
            "left_out": dict(self.space.left_out),
            "start": {n: self.strategy.start[n] for n in self.strategy.start_order},
            "expensive": {n: [v for m, v in self.strategy.expensive if m == n] for n, _ in self.strategy.expensive},
            "train_steps": options.train_steps,
        }


def check_options(options: SearchOptions) -> None:
    """Refuse, with one line each, the options no search can run with."""
    if options.warmup < 1 or options.steps < 2:
        raise UsageError("--warmup must be at least 1 and --steps at least 2")
    if options.trials is not None and options.trials < 1:
        raise UsageError("--trials must be at least 1")
    if options.train_steps is not None and options.train_steps < 1:
        raise UsageError("--train-steps must be at least 1")
    check_pairs(options.confirm)
    if options.whole_runs < 0:
        raise UsageError("--whole-runs must be 0 (none) or a number of A/B pairs")
    if options.time_budget is not None and not (0 < options.time_budget < math.inf):  # nan fails too
        raise UsageError("--time-budget must be a positive number of seconds")
    if options.timeout is not None and not (0 < options.timeout < math.inf):
        raise UsageError("--timeout must be a positive number of seconds")
    if options.rtol is not None and not (0 <= options.rtol < 1):
        raise UsageError("--rtol must be a relative tolerance in [0, 1)")


def prepare(options: SearchOptions, about: Mapping[str, Any] | None = None) -> Prepared:
    """Set a search up from ``options``; from ``about`` (what a study was made from) to report on that study."""
    check_options(options)
    launcher = parse_launcher(options.launcher) if options.launcher is not None else ()
    project = load_project(options.script)
    if not project.trains:
        raise NoTrainingLoop(
            f"{options.script}: {project.no_loop_reason()}; autotune search needs one to time training steps and "
            "compare losses"
        )
    device = str(about["device"]) if about else resolve_device(options.device)
    patch = run(project, select())
    hooks = (f"{RUNTIME_ALIAS}.step(", f"{RUNTIME_ALIAS}.framework_trial(")
    if not any(hook in f.new_text for f in patch.files for hook in hooks):
        raise NoTrainingLoop(f"{options.script}: autotune could not place its step hook in the training loop")
    if about:
        space = restore_space(patch.knobs, device, about["space"], about.get("left_out") or {})
        start, expensive = dict(about.get("start") or {}), dict(about.get("expensive") or {})
    else:
        wanted = read_space(device, options.space)
        space = build_space(patch.knobs, device, wanted)
        if device == "cpu" and options.space is None:  # (a space file of the user's is taken as written)
            space = fit_threads(space, thread_counts(options.env, bool(launcher))[0], os.cpu_count() or 1)
        start, expensive = start_of(device, wanted, options.space is not None)
    out = check_out_dir(options.out, project, (REPORT_NAME, PLOT_NAME, CACHE_NAME))
    identity = fingerprint(patch, options, device, space)
    return Prepared(
        project=project,
        device=device,
        launcher=launcher,
        patch=patch,
        space=space,
        strategy=StrongStart(space, start, expensive),
        out=out,
        fingerprint=identity,
        study_name=options.study_name or f"{options.script.stem}-{identity[:12]}",
    )


def start_of(device: str, wanted: SpaceFile, own: bool) -> tuple[dict[str, Any], dict[str, tuple[Any, ...]]]:
    """The start configuration and the expensive choices: the space file's, then (for a --space file of the user's)
    the bundled file's for the knobs it does not name; bf16 autocast only where the CPU has native bf16."""
    start, expensive = dict(wanted.start), dict(wanted.expensive)
    if own:
        bundled = read_space(device)
        start.update({k: v for k, v in bundled.start.items() if k not in start})
        expensive.update({k: v for k, v in bundled.expensive.items() if k not in expensive})
    if device == "cpu" and not cpu_has_bf16():
        for knob in with_role(Role.PRECISION):
            if start.get(knob.name) in ("bf16", "bf16-mixed"):
                del start[knob.name]
    return start, expensive
