"""The search phase: the first baseline runs, then the strategy's proposals measured one after another until the
space, the trial budget or the time runs out (confirmation follows, in confirm.py)."""

from __future__ import annotations

import math
from typing import Any

from autotune.search.budget import RUN_MARGIN
from autotune.search.crowd import LEAD_MARGIN, fewer_as_fast, near_miss
from autotune.search.ports import Exploring
from autotune.search.space import has
from autotune.search.study import ROLE_BASELINE, ROLE_DUEL, ROLE_PERTURBED, ROLE_REPEAT, ROLE_SEARCH, claim_key
from autotune.search.view import margin
from autotune.search.trial import Outcome

MAX_HOPEFUL = 50  # hopeful configurations looked at (baked) for one not measured yet
MAX_DUPLICATES = 5  # sampler proposals of measured configurations in a row before enumerating instead


def _unmeasured(search: Exploring) -> dict[str, Any] | None:
    """The first configuration, in the space's order, whose program nobody measured or is measuring."""
    measured = search.measured()
    for c in search.space.configs():
        key = search.programs.program(c)
        if key not in measured and key not in search.taken:
            return c
    return None


def explore(search: Exploring) -> str:
    """The search phase: the first baselines (and the perturbed one on a CPU), then the strategy's proposals run
    one after another (a baseline every ``baseline_every`` search runs, ties as duels, untried hopeful configurations
    after the descent) until the space, the trial budget or the time runs out; why it stopped, in words."""
    search.reserve_now = 0.0
    target = search.target()
    if search.baselines():  # a resumed study: nothing to do where it has already done what was asked
        if target is not None and len(search.measured()) >= target:
            return f"all {target} configurations already measured (resumed study)"
        lead_with_fewer_threads(search)  # as the first session's search decided it, from the same first runs
        search.plan = search.strategy.plan(search.view())
        if search.plan.done and target is None and not search.taken:
            return "the descent had converged (resumed study)"
    # two baselines back to back on a machine new to the study, so its noise is known from the first trial on;
    # one when resuming, as the machine may have changed since
    need = max(1, 2 - len(search.baselines()))
    while need > 0:
        search.run_trial(search.space.baseline(), ROLE_BASELINE)
        need -= 1
        if search.fit_lengths():
            need += 1  # the first run is shorter than the runs are now: one more at their length
    # on a GPU, runs that agree bit for bit at first drift apart from a step that varies run to run (atomics): where
    # the first two differ, a third back to back, so that the noise floor is not one sample's chance
    if search.device == "cuda" and len(search.baselines()) == 2 and not search.noise().deterministic:
        search.run_trial(search.space.baseline(), ROLE_BASELINE,
                         {"why": "the first two baseline runs' losses differ: a third measures how far they drift"})
    # on a CPU, where baseline runs agree bit for bit, one more on another number of threads shows how far this
    # script's training carries a rounding difference: the floor of the tolerance of reordering knobs
    if search.threads is not None and not any(r.role == ROLE_PERTURBED and r.machine == search.machine.key
                                              for r in search.results):
        base, other = search.threads
        why = f"the baseline on {other} CPU thread(s) instead of {base}: only the order of sums changes"
        search.run_trial(search.space.baseline(), ROLE_PERTURBED, {"threads": other, "why": why})
        if (c := search.crowd()) is not None:
            search.display.note(c.warning(search.thread_knob()))
    second_run_on_fewer_threads(search)
    lead_with_fewer_threads(search)
    return _search_loop(search, target)


def explore_more(search: Exploring) -> str:
    """The search phase again, after confirmation found no candidate that holds: the strategy's proposals from where
    the study stands now (the candidates' A/B pairs in place of their single runs), until the space, the trial
    budget or the time runs out; why it stopped, in words."""
    search.reserve_now = 0.0
    return _search_loop(search, search.target())


def _search_loop(search: Exploring, target: int | None) -> str:
    """The strategy's proposals run one after another; why they stopped."""
    duplicates = 0
    while True:
        search.refresh()
        measured = len(search.measured())
        if target is not None and measured >= target:
            if target == search.space.size:
                return f"all {search.space.size} configurations measured"
            return f"trial budget reached ({target} configurations)"
        search.plan = search.strategy.plan(search.view())
        ready = [p for p in (search.plan.ready if search.plan else ())
                 if search.programs.program(p.config) not in search.taken]
        attrs = {"phase": ready[0].phase, "why": ready[0].why} if ready else {"phase": "sample"}
        config = ready[0].config if ready else None
        if search.plan.done and not ready:
            if search.taken:  # the strategy's last steps are other workers' trials: their results decide
                search.wait_for("configuration(s) other workers are measuring", search.taken)
                continue
            if search.plan.untried:
                if repeat(search):
                    continue
                return out_of_time(
                    search, f"{search.plan.untried} knob change(s) on the best configuration were not tried")
            if search.o.trials is None:  # the time left goes to untried configurations that could still win
                hope = _hopeful(search)
                if hope is None:
                    return _converged(search)
                config, attrs = hope
                search.mode = "descent, then the untried configurations that could still win"
            else:
                search.mode = "descent, then sampled"  # --trials asks for more configurations: the sampler picks
        if not ready and not search.plan.done:
            search.wait_for("configuration(s) other workers are measuring", search.taken)
            continue
        if config is None and (duplicates >= MAX_DUPLICATES or search.space.size <= (search.o.trials or 0)):
            config = _unmeasured(search)
            if config is None:
                return f"all {search.space.size} configurations measured ({len(search.measured())} distinct programs)"
        search.reserve_now = search.costs.reserve_for(config)
        cost = search.costs.cost_of(config) if config is not None else search.costs.baseline_cost()
        if search.costs.time_left() < RUN_MARGIN * cost + search.reserve_now:
            if repeat(search):
                continue
            return out_of_time(search, need=RUN_MARGIN * cost + search.reserve_now)
        since = 0
        for r in reversed(search.results):  # this machine's search trials since its last baseline run
            if r.machine != search.machine.key:
                continue
            if r.role == ROLE_BASELINE:
                break
            since += r.role == ROLE_SEARCH
        if since >= search.o.baseline_every:
            search.run_trial(search.space.baseline(), ROLE_BASELINE)
            continue
        if ready and ready[0].duel is not None:
            a, b, pair, arm = ready[0].duel
            keys = [search.programs.program(a), search.programs.program(b)]
            attrs = {"duel": keys, "pair": pair, "arm": arm, "why": ready[0].why}
            search.run_trial(config, ROLE_DUEL, attrs, claim_key(ROLE_DUEL, search.machine.key, *keys, pair, arm))
            continue
        got = search.run_trial(config, ROLE_SEARCH, attrs)
        duplicates = duplicates + 1 if got is None and config is None else 0


def _hopeful(search: Exploring) -> tuple[dict[str, Any], dict[str, str]] | None:
    """The most hopeful untried configuration the time left covers (see ``StrongStart.hopeful``), with why."""
    measured = search.measured()
    for config in search.strategy.hopeful(search.view(), search.plan.blamed if search.plan else ())[:MAX_HOPEFUL]:
        key = search.programs.program(config)
        if key not in measured and key not in search.taken and search.costs.affordable(config):
            why = "after the descent: an untried configuration the measured knob changes leave hope for"
            return config, {"phase": "hope", "why": why}
    return None


def _converged(search: Exploring) -> str:
    left = search.costs.time_left()
    spare = f" ({left:.0f}s of the budget left)" if math.isfinite(left) and left > 0 else ""
    return (
        "the descent converged, and no untried configuration could beat the best by more than the noise: each "
        f"combines knob changes that measured slower, or no faster, wherever they were tried{spare}"
    )


def out_of_time(search: Exploring, untried: str = "", need: float | None = None) -> str:
    said = f" ({untried})" if untried else ""
    left = max(search.costs.time_left(), 0)
    tried = [r for r in search.results if r.role == ROLE_SEARCH and r.machine == search.machine.key]
    if need is not None and search.o.budget and not any(r.status is Outcome.OK for r in tried):  # what one needs
        used = search.clock() - search.started
        failed = f" ({len(tried)} tried: {', '.join(sorted({str(r.status) for r in tried}))})" if tried else ""
        return (
            f"time budget reached before any candidate ran and passed the loss gate{failed}: the next one needs "
            f"about {need:.0f}s with its confirmation, and {left:.0f}s were left after {used:.0f}s; give "
            f"--time-budget {math.ceil((used + need) * 1.1 / 10) * 10:.0f} or more"
        )
    if search.candidates() and not search.nothing_to_confirm():
        return f"time budget reached{said}: the rest is set aside for confirmation"
    return (
        f"time budget reached{said}: the last {left:.0f}s were kept to confirm a candidate, "
        "and none was faster than the baseline"
    )


def _to_repeat(search: Exploring) -> dict[str, Any] | None:
    """A compiling program to run a second time, where the time set aside for confirmation stops the search and no
    second run of a compiling program has shown what a run costs with the compiler's caches warm (confirmation
    runs are such second runs): the best candidate if it compiles, else the latest compiling program measured;
    once per search, and only where that run fits beside a confirmation at the least it could cost (Accelerate's
    nlp_example at 300 s: sized by its cold compile, the reserve stopped the search at 173 s)."""
    me = search.machine.key
    if search.costs.compile_extras(warm=True) or any(r.role == ROLE_REPEAT and r.machine == me
                                                     for r in search.results):
        return None
    ranked = search.candidates()
    if ranked and search.compiles(ranked[0][0]):
        config = ranked[0][0]
    else:
        config = next((dict(r.config) for r in reversed(search.results)
                       if r.measured and r.machine == me and search.compiles(r.config)), None)
    if config is None or len(search.costs.program_runs(config)) != 1:
        return None
    need = RUN_MARGIN * search.costs.cost_of(config) + search.costs.least_reserve()
    return config if search.costs.time_left() >= need else None


def repeat(search: Exploring) -> bool:
    """Run a compiling program a second time where ``_to_repeat`` says so; whether it ran."""
    again = _to_repeat(search)
    if again is None:
        return False
    why = ("the time kept for confirmation, sized by compiling runs from cold, stops the search: a second run "
           "shows what a run costs with the compiler's caches warm")
    search.reserve_now = search.costs.least_reserve()
    search.run_trial(again, ROLE_REPEAT, {"why": why},
                     claim_key(ROLE_REPEAT, search.machine.key, search.programs.program(again)))
    return True


def _thread_knob_at_fewer(search: Exploring) -> str | None:
    """The thread knob, where the space searches it at the fewer count the perturbed baseline ran on (None: not)."""
    knob = search.thread_knob()
    if knob is None or search.threads is None or not has(search.space.choices[knob], search.threads[1]):
        return None
    return knob


def _lead_noise(search: Exploring) -> float:
    """How close a run on fewer threads must come to the baselines for the start to take them: one process against
    others (crowd.LEAD_MARGIN), or the baselines' own margin where that is larger."""
    return max(margin(search.baselines()), LEAD_MARGIN)


def second_run_on_fewer_threads(search: Exploring) -> None:
    """Where the one baseline run on fewer threads came out slower than the lead's margin allows, but within twice
    it (``crowd.near_miss``), a second run on that count, before the start is decided on both: a run of one process
    costs less than a start on the wrong count (where the descent reaches the thread knob last). Only where the
    thread knob is searched and what other work did is not the reason already."""
    if _thread_knob_at_fewer(search) is None:
        return
    if (c := search.crowd()) is not None and c.favours_few:
        return
    noise = _lead_noise(search)
    ratio = near_miss(search.baselines(), search.perturbed(), search.threads, noise)
    if ratio is None:
        return
    many, few = search.threads
    why = (f"the baseline on {few} thread(s) ran {ratio:.2f}x its speed on {many}, short of the {100 * noise:.0f}% "
           "margin by less than the margin: one process against two, so a second run on that count")
    search.run_trial(search.space.baseline(), ROLE_PERTURBED, {"threads": few, "why": why})


def lead_with_fewer_threads(search: Exploring) -> None:
    """Where fewer threads ran the baseline as fast as the script's count, or other work made them much faster,
    the start takes the thread knob at that count, first. Under other work the runs on the script's count would
    measure the load (makemore beside a busy process: 21x slower a step); on an idle machine the extra threads
    buy nothing and cost what runs with them (``crowd.fewer_as_fast``). Either way a descent that reaches the
    thread knob last runs out of time first. Decided from the first runs, which a resumed study keeps, so a
    resumed search starts from the same place."""
    knob = _thread_knob_at_fewer(search)
    if knob is None:
        return
    many, few = search.threads
    c = search.crowd()
    if c is not None and c.favours_few:
        if search.strategy.lead(knob, few):
            search.display.note(c.lead_note(knob))
        return
    noise = _lead_noise(search)
    ratio = fewer_as_fast(search.baselines(), search.perturbed(), search.threads, noise)
    if ratio is not None and search.strategy.lead(knob, few):
        search.display.note(
            f"the search starts from {knob}={few} as well: the baseline on {few} thread(s) ran {ratio:.2f}x its "
            f"speed on {many}, as fast within {100 * noise:.0f}% (one run's noise against the others'), so the "
            "extra threads buy this script little here; the descent measures them again with the other knobs")
