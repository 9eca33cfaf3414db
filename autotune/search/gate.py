"""The equivalence gate: a trial's per-step losses against the baseline's, within a tolerance set by numerics."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from autotune.knobs import NUMERICS_ORDER, Knob, Numerics
from autotune.search.trial import Outcome, TrialResult

# Relative tolerance per numerics class: (at the first step, added per step, at most). Differences from
# floating-point reordering start near float32 rounding (~1e-7) and grow as training amplifies them; reduced
# precision moves a loss by about 1e-3..2e-2 from the first step on (measured on the fixture scripts:
# bf16 autocast on the char GPT reaches 2e-2 after 20 steps, foreach/fused optimizers stay below 1e-6).
RTOL: dict[Numerics, tuple[float, float, float]] = {
    Numerics.EXACT: (0.0, 0.0, 0.0),
    Numerics.REORDER: (1e-4, 2e-5, 1e-3),
    Numerics.LOWP: (2e-2, 1e-3, 6e-2),
}
# The baseline's own run-to-run deviation is a sample of its noise, not its bound: the gate allows twice it.
NOISE_FACTOR = 2.0
# Training carries a rounding difference further with every step, and when it shows up is chance: a knob's own
# rounding differences are larger than a thread change's (SDPA's first ones 1e-6 on CPU, a thread change's 1e-7), so
# it reaches the same level a little earlier (on a 4-layer GPT on CPU, SDPA passed 1e-3 one step before the thread
# change jumped to 1.6e-2); on CUDA, float32 runs of a 6-layer GPT agreed bit for bit up to a step between 18 and 20
# and drifted apart from there. The noise floor at a step is what the baseline runs (and the perturbed ones) reached
# up to this many steps later.
NOISE_LEAD = 2
# Reduced precision changes every rounding from the first step on, and where training is chaotic early (a high
# learning rate, no warm-up) the loss curve wanders by several percent before it settles: bf16 autocast on a 6-layer
# GPT on an H100 was 9.7e-2 off at step 11, 1.6e-2 off on average over steps 14..25, and inside the float32 runs'
# own spread by step 100 (docs/benchmarks.md). A knob that lowers precision is judged on where training got to: the
# mean deviation over this last fraction of the steps, with a finite loss wherever the baseline's is.
LOWP_WINDOW = 0.5


def numerics_of(knobs: Iterable[Knob]) -> Numerics | None:
    """The loosest numerics class among ``knobs``; None when there are none (the baseline itself)."""
    classes = [k.numerics for k in knobs]
    return max(classes, key=NUMERICS_ORDER.index) if classes else None


def step_deviations(losses: Sequence[Sequence[float]], reference: Sequence[Sequence[float]]) -> list[float]:
    """Per step, the largest relative difference of ``losses`` from ``reference`` (inf where they cannot match)."""
    magnitudes = [abs(v) for row in reference for v in row if math.isfinite(v)]
    floor = max(1e-3 * statistics.median(magnitudes), 1e-12) if magnitudes else 1e-12
    out = []
    for i in range(max(len(losses), len(reference))):
        if i >= len(losses) or i >= len(reference) or len(losses[i]) != len(reference[i]):
            out.append(math.inf)
            continue
        worst = 0.0
        for a, b in zip(losses[i], reference[i]):
            if a == b:
                continue
            d = abs(a - b) / max(abs(b), floor)
            worst = max(worst, d if math.isfinite(d) else math.inf)
        out.append(worst)
    return out


@dataclass(frozen=True)
class Noise:
    """How much the baseline differs from itself, run to run: per step in loss, overall in time."""

    runs: int
    loss: tuple[float, ...]  # per step: the largest deviation seen so far between baseline runs
    time: float | None  # (slowest - fastest) / median of the baseline runs' step times
    # per step: the largest deviation seen so far of a perturbed baseline run (the same program on another number of
    # threads: only the order of floating-point sums changes) from the reference. How far this script's training
    # carries a rounding difference; the floor of the tolerance of knobs that reorder or lower precision.
    reorder: tuple[float, ...] = ()
    perturbed: int = 0  # perturbed runs measured
    # a baseline run against the baseline runs just before and after it: the root mean square of the log ratios
    # (outcome.neighbour_noise), the noise a comparison the search makes carries, without the machine's drift
    time_local: float | None = None

    @property
    def deterministic(self) -> bool:
        return all(v == 0.0 for v in self.loss)

    @property
    def max_loss(self) -> float:
        return max(self.loss, default=0.0)

    @property
    def max_reorder(self) -> float:
        return max(self.reorder, default=0.0)


def measure_noise(baselines: Sequence[TrialResult], perturbed: Sequence[TrialResult] = ()) -> Noise:
    """The noise of the measured baseline runs; the first one is the reference the others (and the perturbed runs,
    for ``reorder``) are compared with."""
    runs = [b for b in baselines if b.measured]
    if not runs:
        return Noise(0, (), None)
    ref = runs[0].losses
    shaken = [p for p in perturbed if p.measured]
    times = [b.step_time for b in runs if b.step_time]
    spread = (max(times) - min(times)) / statistics.median(times) if len(times) > 1 else None
    return Noise(len(runs), _running_max(runs[1:], ref), spread, _running_max(shaken, ref) if shaken else (),
                 len(shaken))


def _running_max(runs: Sequence[TrialResult], ref: Sequence[Sequence[float]]) -> tuple[float, ...]:
    per_step = [0.0] * len(ref)
    for other in runs:
        for i, d in enumerate(step_deviations(other.losses, ref)[: len(ref)]):
            per_step[i] = max(per_step[i], d)
    running, worst = [], 0.0
    for d in per_step:  # noise that showed up at a step can show up at any later one
        worst = max(worst, d)
        running.append(worst)
    return tuple(running)


def tolerances(numerics: Numerics | None, steps: int, noise: Noise, rtol: float | None = None) -> list[float]:
    """The gate's relative tolerance at each step: the class's (or ``rtol``), never below the measured noise.

    Knobs that reorder sums or lower precision are never held tighter than a reordering of the baseline itself
    moved its losses; an exact knob only to the baseline's run-to-run noise.
    """
    out = []
    for i in range(steps):
        if numerics is None:
            allowed = 0.0
        elif rtol is not None:
            allowed = rtol
        else:
            start, growth, cap = RTOL[numerics]
            allowed = min(cap, start + growth * i)
        measured = _at(noise.loss, i + NOISE_LEAD)
        if numerics in (Numerics.REORDER, Numerics.LOWP):
            measured = max(measured, _at(noise.reorder, i + NOISE_LEAD))
        out.append(max(allowed, NOISE_FACTOR * measured))
    return out


def _at(per_step: Sequence[float], i: int) -> float:
    return per_step[min(i, len(per_step) - 1)] if per_step else 0.0


@dataclass(frozen=True)
class Verdict:
    """What the gate decided about one trial."""

    passed: bool
    deviation: float  # the largest relative loss deviation over all steps; the mean over ``window`` where one is set
    tolerance: float  # the tolerance at the step that came closest to (or went past) it
    step: int | None  # the first step (1-based) outside tolerance
    window: tuple[int, int] | None = None  # the steps (1-based, inclusive) a reduced-precision knob was judged on


def judge(
    trial: TrialResult, reference: TrialResult, changed: Sequence[Knob], noise: Noise, rtol: float | None = None
) -> Verdict:
    """Compare ``trial``'s per-step losses with the reference baseline's."""
    if not reference.losses:
        # the step hook sees no loss it can read again (it is computed inside a call): only knobs that
        # change nothing numerically can be trusted
        exact = numerics_of(changed) in (None, Numerics.EXACT)
        return Verdict(exact, math.nan, 0.0, None if exact else 1)
    devs = step_deviations(trial.losses, reference.losses)
    numerics = numerics_of(changed)
    tols = tolerances(numerics, len(devs), noise, rtol)
    if numerics is Numerics.LOWP and devs:
        return _judge_window(devs, tols)
    first_bad = next((i + 1 for i, (d, t) in enumerate(zip(devs, tols)) if d > t), None)

    def closeness(i: int) -> float:
        return devs[i] / tols[i] if tols[i] > 0 else (math.inf if devs[i] > 0 else 0.0)

    worst = max(range(len(devs)), key=closeness, default=None)
    if worst is None:
        return Verdict(False, math.inf, 0.0, None)
    return Verdict(first_bad is None, max(devs), tols[worst], first_bad)


def _judge_window(devs: Sequence[float], tols: Sequence[float]) -> Verdict:
    """A reduced-precision trial: finite wherever the baseline is, and close on average over the last steps."""
    broken = next((i for i, d in enumerate(devs) if not math.isfinite(d)), None)
    if broken is not None:
        return Verdict(False, math.inf, tols[broken], broken + 1)
    first = len(devs) - max(1, round(len(devs) * LOWP_WINDOW))
    mean = statistics.fmean(devs[first:])
    passed = mean <= tols[-1]
    return Verdict(passed, mean, tols[-1], None if passed else first + 1, (first + 1, len(devs)))


def gated(
    result: TrialResult, reference: TrialResult, changed: Sequence[Knob], noise: Noise, rtol: float | None,
    judged: bool = True,
) -> TrialResult:
    """``result`` with the gate's verdict against ``reference``: its deviation, and where ``judged`` (a run of the
    baseline is noise, not judged: it has no tolerance) its status, tolerance and why it failed."""
    verdict = judge(result.with_(status=Outcome.OK), reference, changed, noise, rtol)
    if not judged:
        return result.with_(deviation=verdict.deviation)
    if result.batch_size and reference.batch_size and result.batch_size != reference.batch_size:
        # a batch split that reached the accumulation but not the micro-batch (or the other way round): each step
        # trains on other samples, and steps/s would credit it for doing less
        return result.with_(status=Outcome.DIVERGED, deviation=verdict.deviation, tolerance=verdict.tolerance, error=(
            f"{result.batch_size} samples per optimizer step, the baseline's {reference.batch_size}: the knobs "
            "changed what a step trains on"))
    status = Outcome.OK if verdict.passed else Outcome.DIVERGED
    error = None
    if not verdict.passed and math.isnan(verdict.deviation):
        status = Outcome.UNVERIFIED
        error = (
            "the script's loss is not visible to autotune, so its losses cannot be compared: only knobs that "
            "change no numerics can be taken"
        )
    elif not verdict.passed and verdict.window and math.isfinite(verdict.deviation):
        first, last = verdict.window
        error = (
            f"loss off by {verdict.deviation:.2e} relative on average over steps {first}..{last} "
            f"(tolerance {verdict.tolerance:.1e})"
        )
    elif not verdict.passed:
        error = (
            f"loss off by {verdict.deviation:.2e} relative (tolerance {verdict.tolerance:.1e}), "
            f"first at step {verdict.step}"
        )
    return result.with_(status=status, deviation=verdict.deviation, tolerance=verdict.tolerance, error=error)
