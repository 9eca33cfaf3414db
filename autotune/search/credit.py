"""What the chosen configuration's parts are worth: each knob's share of the win, and the start-up it costs."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from typing import Any

from autotune.search.outcome import Confirmation, train_time
from autotune.search.space import SearchSpace
from autotune.search.view import StudyView


def knob_worth(view: StudyView, space: SearchSpace, config: Mapping[str, Any]) -> tuple[str, ...]:
    """What each knob ``config`` changes is worth to it: what taking the knob out costs, from the A/B pairs that
    compared the two where the search ran them, else from their single runs, with the noise they carry
    (``sdpa.attention=sdpa: worth 1.41x (3 A/B pairs, 1.32x to 1.50x)``)."""
    mine = view.observed(config)
    out = []
    for knob in space.changed(config):
        without = view.canonical({**config, knob.name: knob.default})
        if view.same(without, config):
            continue
        runs = view.duel(config, without)
        ratios = [a / b for j in sorted({j for j, _ in runs}) if (a := runs.get((j, "a"))) and (b := runs.get((j, "b")))]
        if not ratios:  # a duel the other way round (the knob's removal was the more complex one: never)
            back = view.duel(without, config)
            ratios = [b / a for j in sorted({j for j, _ in back})
                      if (a := back.get((j, "a"))) and (b := back.get((j, "b")))]
        other = view.observed(without)
        if ratios:
            text = (f"worth {statistics.median(ratios):.2f}x ({len(ratios)} A/B pairs against it without, "
                    f"{min(ratios):.2f}x to {max(ratios):.2f}x)")
        elif other is not None and other.ok and other.speedup and mine is not None and mine.speedup:
            text = (f"worth about {mine.speedup / other.speedup:.2f}x (one run each, with and without it; "
                    f"runs here differ by up to {100 * view.threshold():.0f}%)")
        elif other is not None and not other.ok:
            text = f"needed: without it the run {other.status}"
        else:
            text = "not measured without it (the time ran out before the descent got to it)"
        out.append(f"{knob.name}={config[knob.name]}: {text}")
    return tuple(out)


def startup(winner: Confirmation, compiles: bool, warmup: int, train_steps: int | None) -> str | None:
    """The chosen configuration's one-time start-up beyond the baseline's (compilation) and when it pays off,
    from its A/B pairs: the runs the verdict rests on."""
    runs = [r for r in winner.candidate if r.measured]
    base = [r for r in winner.baseline if r.measured]
    if not runs or not base or not compiles:
        return None
    w = warmup
    extra = statistics.median(train_time(r, 0, w) for r in runs) - statistics.median(train_time(b, 0, w) for b in base)
    gain = statistics.median(b.step_time for b in base) - statistics.median(r.step_time for r in runs)
    if extra <= 0:
        return None
    if gain <= 0:
        return f"start-up {extra:.0f}s longer than the baseline's (compilation), and no faster per step"
    steps = math.ceil(extra / gain)
    text = f"start-up {extra:.0f}s longer than the baseline's (compilation): it pays for itself after {steps} steps"
    if train_steps:
        return text + f" (your run: {train_steps})"
    # the run's length unknown: the runs measured its first steps only. makemore's tuned script (docs/benchmarks.md,
    # session 38): 150-step runs compiled in 3 s more; its first 2000-step run took 108 s against 20 s, recompiling
    # for the sampling and evaluation its runs never reached. Evaluation under no_grad no longer compiles (session
    # 40: the model is compiled for its training steps); a training step of a new shape, or an evaluation with
    # gradients on, still does
    length = max(r.steps_done for r in runs)
    return (text + f", counted on runs of {length} steps: what they did not reach (a training step of a new shape, "
            "an evaluation with gradients on) compiles in your run too, and is not in it; give --train-steps N to "
            "rank by your whole run, or time one whole run of the tuned script")


def whole_run(winner: Confirmation, steps: int | None, warmup: int) -> str | None:
    """Both figures of the verdict where the run's length is known: the steady state's, and the time of the user's
    run: measured by its whole runs where they ran, else predicted from the A/B pairs (the median of each arm's
    one-time start-up plus ``steps`` of its step time)."""
    runs = [r for r in winner.candidate if r.measured]
    base = [r for r in winner.baseline if r.measured]
    if not steps or not runs or not base:
        return None
    steady = statistics.median(b.step_time for b in base) / statistics.median(r.step_time for r in runs)
    if winner.whole is not None and winner.whole.pairs:  # measured: the whole process, start to exit
        return f"steady state {steady:.2f}x; {winner.whole.text()}"
    before = statistics.median(train_time(b, steps, warmup) for b in base)
    after = statistics.median(train_time(r, steps, warmup) for r in runs)
    unmeasured = f"; {winner.whole.text()}" if winner.whole is not None else ""
    return (f"steady state {steady:.2f}x; your {steps}-step run {before:.1f}s -> {after:.1f}s of training "
            f"({before / after:.2f}x, one-time start-up included, predicted from the A/B pairs{unmeasured})")
