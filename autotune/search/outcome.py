"""What a finished search found: its confirmations and outcome, and the measures read off its runs (a value each)."""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.project import Project
from autotune.patch import PatchResult
from autotune.search.gate import Noise
from autotune.search.options import SearchOptions
from autotune.search.space import SearchSpace
from autotune.search.stats import median_interval, sign_test
from autotune.search.strategy import Plan
from autotune.search.study import ROLE_BASELINE, ROLE_CONFIRM, ROLE_PERTURBED
from autotune.search.trial import TrialResult


# a confirmation whose interval holds 1.0 but lies within this of it either way is a tie: more pairs could at most
# show a gain this small, which is not worth the pairs (the baseline, the simpler configuration, is kept)
TIE = 0.05

# a winner whose whole run is slower than the baseline's by more than this (the median of its pairs, and slower in
# most of them) is not kept: "never slower, within noise" (autotune.search.whole)
SLOWER = 1.05


@dataclass(frozen=True)
class WholeRuns:
    """What the whole-run pairs of one candidate measured (or why none ran)."""

    steps: int | None  # the run's length in optimizer steps, as the search found it
    pairs: tuple[tuple[float, float], ...] = ()  # (baseline seconds, candidate seconds), process start to exit
    failed: TrialResult | None = None  # a candidate run that failed: the tuned script's run would fail too
    skipped: str | None = None  # why none (or not all) ran
    # runs that died in the interpreter's teardown after their script ended (TrialResult.exit_note): time counted
    teardown: int = 0

    @property
    def ratios(self) -> tuple[float, ...]:
        return tuple(b / c for b, c in self.pairs)

    @property
    def speedup(self) -> float | None:
        return statistics.median(self.ratios) if self.pairs else None

    @property
    def slower(self) -> bool:
        """Slower than the baseline beyond the noise SLOWER allows, in the median and in most pairs."""
        r = self.ratios
        return bool(r) and statistics.median(r) < 1 / SLOWER and sum(x < 1.0 for x in r) * 2 > len(r)

    def text(self) -> str:
        """``your 240-step run, whole (process start to exit, 3 A/B pairs): 24.1s -> 19.8s (1.22x, 1.18x to
        1.25x)``; or why it was not measured."""
        if not self.pairs:
            return f"whole runs not measured: {self.skipped}" if self.skipped else "whole runs not measured"
        before = statistics.median(b for b, _ in self.pairs)
        after = statistics.median(c for _, c in self.pairs)
        r = self.ratios
        spread = f", {min(r):.2f}x to {max(r):.2f}x" if len(r) > 1 else ""
        cut = f"; {self.skipped}" if self.skipped else ""
        if self.teardown:
            cut += (f"; {self.teardown} run{'s' if self.teardown != 1 else ''} aborted in torch's teardown after "
                    "the script ended (counted to the abort)")
        return (f"your {self.steps}-step run measured whole (process start to exit, {len(r)} A/B pair"
                f"{'s' if len(r) != 1 else ''}): {before:.1f}s -> {after:.1f}s ({self.speedup:.2f}x{spread}){cut}")


@dataclass(frozen=True)
class CacheSaving:
    """What the carried compile cache saves a first run: the winner run with new, empty compiler caches, without
    and with the file loaded first, in interleaved pairs (autotune.search.carried)."""

    pairs: tuple[tuple[float, float], ...] = ()  # (seconds without the file, seconds with it), process start to result
    not_loaded: bool = False  # a run given the file could not load it (another torch): it saves nothing here
    skipped: str | None = None  # why none (or not all) ran

    @property
    def saved(self) -> tuple[float, ...]:
        return tuple(without - with_ for without, with_ in self.pairs)

    def text(self) -> str:
        """``a first run with empty compiler caches took 21.1s without it and 17.4s with it (saves 3.7s, 3.1s to
        4.0s; 2 interleaved pairs)``; or why that was not measured."""
        if self.not_loaded:
            return "torch did not load it in the search's runs (another torch or machine made it): it saves nothing here"
        if not self.pairs:
            return f"what it saves was not measured: {self.skipped}" if self.skipped else "what it saves was not measured"
        without = statistics.median(w for w, _ in self.pairs)
        with_ = statistics.median(c for _, c in self.pairs)
        saved = self.saved
        spread = f", {min(saved):.1f}s to {max(saved):.1f}s" if len(saved) > 1 else ""
        cut = f"; {self.skipped}" if self.skipped else ""
        return (f"a first run with empty compiler caches took {without:.1f}s without it and {with_:.1f}s with it "
                f"(saves {statistics.median(saved):.1f}s{spread}; {len(saved)} interleaved pair"
                f"{'s' if len(saved) != 1 else ''}, each run to the end of its measured steps){cut}")

    def as_dict(self) -> dict[str, Any]:
        return {"pairs": [{"without_s": round(w, 2), "with_s": round(c, 2)} for w, c in self.pairs],
                "saved_s": round(statistics.median(self.saved), 2) if self.pairs else None,
                "loaded": not self.not_loaded, "skipped": self.skipped}


@dataclass(frozen=True)
class Confirmation:
    """A candidate re-measured against the baseline in interleaved A/B pairs."""

    config: Mapping[str, Any]
    ratios: tuple[float, ...]  # candidate throughput / baseline throughput, one per pair where both ran
    accepted: bool
    reason: str
    baseline: tuple[TrialResult, ...] = ()
    candidate: tuple[TrialResult, ...] = ()
    search_speedup: float | None = None
    machine: str = ""  # every pair ran on this machine
    evidence: bool = False  # a candidate run failed (not a timeout): the candidate does not reproduce
    whole: WholeRuns | None = None  # its whole runs against the baseline's, process start to exit (whole.py)

    @property
    def speedup(self) -> float | None:
        return statistics.median(self.ratios) if self.ratios else None

    @property
    def spread(self) -> tuple[float, float] | None:
        return (min(self.ratios), max(self.ratios)) if self.ratios else None

    @property
    def wins(self) -> int:
        return sum(r > 1.0 for r in self.ratios)

    @property
    def p_value(self) -> float:
        """The sign test's one-sided p-value that the candidate is not faster (wins as often as not)."""
        return sign_test(self.wins, len(self.ratios))

    @property
    def interval(self) -> tuple[float, float, float] | None:
        """A distribution-free interval for the median speedup: (low, high, coverage)."""
        return median_interval(self.ratios)

    @property
    def settled(self) -> bool:
        """Whether the interval is clear of 1.0 (more pairs would not change the verdict's direction), or is a tie:
        inside TIE of 1.0 either way (more pairs could show at most a gain not worth keeping)."""
        iv = self.interval
        return iv is not None and (iv[0] > 1.0 or iv[1] < 1.0 or is_tie(iv[0], iv[1]))


def is_tie(low: float, high: float) -> bool:
    """An interval of the median speedup that holds 1.0 and lies within TIE of it either way."""
    return 1.0 / (1.0 + TIE) <= low <= 1.0 <= high <= 1.0 + TIE


@dataclass(frozen=True)
class SearchOutcome:
    """What a finished search found: every trial, the noise, the confirmations and the chosen configuration."""

    options: SearchOptions
    project: Project
    patch: PatchResult
    space: SearchSpace
    device: str
    results: tuple[TrialResult, ...]
    reference: TrialResult
    noise: Noise
    confirmations: tuple[Confirmation, ...]
    winner: Confirmation | None  # None: the baseline wins
    stopped: str
    wall_s: float
    study_name: str
    storage: str
    mode: str  # "enumerated" or "sampled"
    speedups: Mapping[int, float]  # trial number -> throughput relative to the same machine's baseline runs around it
    machine: str = ""  # the machine whose baseline runs, noise and confirmation the summary reports
    # True for ``autotune report``: wall_s is then the study's span, first trial start to last trial end
    from_study: bool = False
    plan: Plan | None = None  # the strategy's path: start, blames, accepted steps
    interactions: tuple[str, ...] = ()  # what each knob of the chosen configuration is worth, alone and in it
    startup: str | None = None  # the chosen configuration's extra start-up (compile) time and its break-even
    labels: Mapping[int, str] = field(default_factory=dict)  # trial number -> the knobs that change its program
    hidden: int = 0  # sampler proposals of configurations already measured, told the earlier result, not shown
    reserved_s: float | None = None  # the time the search set aside for confirmation
    warning: str | None = None  # the machine's timing noise makes the verdict unreliable: why, and what to do
    lengths: tuple[int, int] | None = None  # warm-up and measured steps of the runs (fitted to the budget)
    fit_note: str | None = None  # how fitting the budget shortened the runs
    # runs of the study left out because a knob value stored with them is not one of its choices: trial -> values
    foreign: Mapping[int | None, list[tuple[str, Any]]] = field(default_factory=dict)
    isolation: str | None = None  # how the trials were kept off the user's files (None: reported from a study)
    run_length: str | None = None  # what the search ranked by: the user's whole run (its length, where from), or why not
    whole_run: str | None = None  # the winner's steady-state ratio and the user's run's time before and after
    compile_cache: Path | None = None  # where the winner's runs left what they compiled, if it compiles (may be absent)
    cache_saving: CacheSaving | None = None  # what that file saves a first run, where it was measured or tried

    @property
    def noisy(self) -> str | None:
        """A plain warning when this machine's timing noise makes the verdict unreliable, else None."""
        return self.warning

    @property
    def machines(self) -> tuple[str, ...]:
        """Every machine that ran trials of the study, in order of its first trial."""
        return tuple(dict.fromkeys(r.machine for r in self.results))

    @property
    def chosen(self) -> dict[str, Any]:
        return dict(self.winner.config) if self.winner else self.space.baseline()


def is_baseline_run(r: TrialResult) -> bool:
    """A run of the baseline: the search's own baseline runs and the baseline arms of confirmation pairs."""
    return r.role == ROLE_BASELINE or (r.role == ROLE_CONFIRM and r.attrs.get("arm") == "baseline")


def train_time(r: TrialResult, steps: int, warmup: int) -> float:
    """Seconds ``r``'s configuration would take to train ``steps`` steps: its one-time start-up (the warm-up's time
    beyond its steps: compilation, autotuning) plus ``steps`` steps at its measured speed."""
    step = r.step_time or 0.0
    startup = max((r.warmup_s or 0.0) - warmup * step, 0.0)
    return startup + steps * step


def time_spread(runs: list[TrialResult]) -> float | None:
    """(slowest - fastest) / median of the runs' step times; None for fewer than two."""
    times = [r.step_time for r in runs if r.step_time]
    return (max(times) - min(times)) / statistics.median(times) if len(times) > 1 else None


def neighbour_noise(runs: list[TrialResult]) -> float | None:
    """How far a baseline run's step time is from the mean of the baseline runs just before and after it, as the root
    mean square of the log ratios: the noise a comparison the search makes carries (``local_speedups``), with the
    machine's drift over minutes left out of it as the comparison leaves it out. None for fewer than two runs."""
    times = [r.step_time for r in runs if r.step_time]
    if len(times) < 2:
        return None
    errors = [math.log(statistics.fmean(times[max(i - 1, 0):i] + times[i + 1:i + 2]) / t) for i, t in enumerate(times)]
    return math.sqrt(statistics.fmean(e * e for e in errors))


def noise_warning(spread: float, runs: list[TrialResult], threads: tuple[int, int] | None) -> str:
    """What a noisy machine means for the verdict, with the load average the runs saw and its likely cause."""
    loads = [r.load for r in runs if r.load is not None]
    local = neighbour_noise(runs)
    beside = f" (one against those beside it: {100 * local:.0f}% rms)" if local is not None else ""
    text = (
        f"this machine's timing is noisy: {len(runs)} runs of the baseline differ by {100 * spread:.0f}% in step time"
        f"{beside}, so one run's speedup below that is no evidence: the search keeps a change only where it beats "
        "the noise twice over, and gives a verdict only on interleaved A/B pairs"
    )
    others = [r.others for r in runs if r.others is not None]
    if others:  # measured during the steps themselves (autotune.contention), not inferred from the load average
        busy = [x for x in others if x >= 0.5]
        if busy:
            return (f"{text}; other work on the machine took up to {max(busy):.1f} processors from the steps of "
                    f"{len(busy)} of these {len(others)} runs: stop it, or raise --confirm")
        return (f"{text}; no other work took processors from their steps (at most {max(others):.1f}), so the script's "
                "own timing varies (data loading, memory allocation, CPU frequency, a neighbour on the host); raise "
                "--confirm, or --steps for longer runs")
    if not loads:
        return text + "; run the search on a quieter machine, or raise --confirm"
    cores = os.cpu_count() or 1
    own = threads[0] if threads else 1
    low, high = min(loads), max(loads)
    seen = f"{low:.1f}" if high - low < 0.05 else f"{low:.1f} to {high:.1f}"
    if high > own + 0.5:
        cause = (f"load average {seen} on {cores} cores while a run uses about {own}: other processes compete for "
                 "the CPU; stop them, or raise --confirm")
    else:
        cause = (f"load average {seen} on {cores} cores: nothing much else runs, so the script's own timing varies "
                 "(data loading, memory allocation, CPU frequency); raise --confirm, or --steps for longer runs")
    return f"{text}; {cause}"


def local_speedups(results, time: Callable[[TrialResult], float] | None = None) -> dict[int, float]:
    """Each measured run's speedup against its machine's baseline runs nearest it in time: the mean ``time`` (a
    step's, unless given: with --train-steps, the whole run's) of the one just before it and the one just after,
    where there is one. The machine's speed drifts over minutes (docs/benchmarks.md, issue 33): a comparison made
    close in time leaves less of the drift in the figure than one against baseline runs minutes old."""
    time = time or (lambda r: r.step_time)
    machines: dict[str, list[TrialResult]] = {}
    for r in results:
        machines.setdefault(r.machine, []).append(r)
    out = {}
    for order in machines.values():
        base_pos = [i for i, r in enumerate(order) if is_baseline_run(r) and r.measured and r.step_time]
        for i, r in enumerate(order):
            if is_baseline_run(r) or r.role == ROLE_PERTURBED or not r.measured or r.number is None:
                continue
            before = [p for p in base_pos if p < i][-1:]
            after = [p for p in base_pos if p > i][:1]
            near = [time(order[p]) for p in before + after]
            if near and r.step_time:
                out[r.number] = statistics.fmean(near) / time(r)
    return out
