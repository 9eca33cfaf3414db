"""The search strategy: start from what the field switches on, blame what breaks, then descend knob by knob.

The strategy is a pure function of what has been measured: ``plan(view)`` replays the whole path from the study's
results each time it is asked, so a resumed search, or a second worker on the same study, continues exactly where
the study stands. Its seam is narrow: a :class:`View` answers "was this configuration measured, and how did it do?";
the plan says which configuration to measure next (``None``: the strategy is done) and how it got there.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Protocol

from autotune.knobs import Role
from autotune.search.space import SearchSpace, config_key, has, same_value, with_role

Config = Mapping[str, Any]
MAX_PASSES = 4  # coordinate-descent passes over the knobs; each pass that changes nothing ends the descent
MAX_RESTARTS = 2  # descents started again from a configuration measured faster than where the last one ended
MAX_ENUMERATED = 20_000  # configurations weighed after the descent, in the space's order
MAX_BASES = 5  # the fastest measured configurations an untried one is estimated from
# Two configurations whose single runs differ by less than the noise are a tie: the more complex one (more knobs
# changed) must show it is faster in this many A/B pairs, every one, by more than DUEL_GAIN in the median, or the
# simpler one is kept. Noise then costs these runs, not the win (on a GPT with 29% noise, compile on top of bf16
# measured 2.53x against 2.10x and was dropped as "as fast within the noise").
DUEL_PAIRS = 3
DUEL_GAIN = 0.02
# a duel the time left cuts short is decided by its pairs where this many were complete (makemore at 300 s dropped
# compile on its single run, 0.73x, after two pairs had measured it 1.36x and 1.59x faster): pairs run side by side
# say more than single runs minutes apart, which is all the duel's fallback has
CUT_DUEL_PAIRS = 2
# a duel whose 3 pairs disagree (one slower) but whose median says faster runs 2 pairs more, and the more complex
# one is kept if faster in 4 of the 5: about the evidence of 3 of 3 (sign test p = 0.19 against 0.125). makemore's
# runs differ by 10-18% from process to process, and bf16 was dropped on pairs of 0.95x, 1.34x and 1.37x
DUEL_MORE_PAIRS = 5
TIE_FLOOR = 0.01  # a more complex configuration measured less than this much faster is no tie: the simpler one wins
QUIET = 0.10  # below this noise a simpler configuration as fast in one run is kept without a duel


@dataclass(frozen=True)
class Observation:
    """One configuration as measured: whether it finished and passed the loss gate, and how fast it ran."""

    ok: bool
    speedup: float | None  # throughput over the same machine's baseline runs (the search's one definition)
    status: str = "ok"
    error: str | None = None
    unreached: tuple[str, ...] = ()  # knobs it changes whose code never ran (the run measured the program without them)


@dataclass(frozen=True)
class Proposal:
    """A configuration to measure next, and why."""

    config: dict[str, Any]
    phase: str  # start | blame | descent | duel | hope | expensive
    why: str
    # a duel's run: the two configurations (more complex first), the pair and the arm ("a" the first, "b" the other)
    duel: tuple[dict[str, Any], dict[str, Any], int, str] | None = None


@dataclass(frozen=True)
class Step:
    """One step of the path, for the report: what was measured or decided, and the speedup it showed."""

    phase: str  # start | blame | accept | hold (a duel kept the incumbent) | expensive | skip
    text: str
    config: Mapping[str, Any] = field(default_factory=dict)
    speedup: float | None = None


@dataclass(frozen=True)
class Blame:
    """A knob value the start configuration had to drop, and why (the failure that bisection pinned on it)."""

    knob: str
    value: Any
    reason: str
    every_value: bool = False  # the knob's code never ran: no value of it can change this script's run


@dataclass(frozen=True)
class Plan:
    """Where the strategy stands: what to measure next (in order; the first is the strategy's own next step, the
    rest may be measured by other workers meanwhile), the path so far, the blamed knobs and the incumbent."""

    ready: tuple[Proposal, ...]
    path: tuple[Step, ...]
    blamed: tuple[Blame, ...]
    incumbent: dict[str, Any]
    done: bool
    untried: int = 0  # descent steps from the incumbent the time left did not cover: done, but not converged

    @property
    def next(self) -> Proposal | None:
        return self.ready[0] if self.ready else None


class View(Protocol):
    """What the strategy may ask of the search."""

    space: SearchSpace

    def observed(self, config: Config) -> Observation | None:
        """The measurement of ``config``'s program (any configuration that bakes to the same code), or None."""

    def canonical(self, config: Config) -> dict[str, Any]:
        """``config`` with every change that bakes to no different code put back to its default."""

    def same(self, a: Config, b: Config) -> bool:
        """Whether two configurations bake to the same program."""

    def threshold(self) -> float:
        """The relative speed difference that counts as real: the timing noise of this machine's baseline runs."""

    def affordable(self, config: Config) -> bool:
        """Whether the time left covers measuring ``config`` (its compile time included)."""

    def costly(self, config: Config) -> bool:
        """Whether a run of ``config`` costs much more than the baseline's (it compiles)."""

    def duel(self, a: Config, b: Config) -> Mapping[tuple[int, str], float | None]:
        """The runs of the duel of two programs so far on this machine: (pair, arm "a" or "b") -> its speed (None:
        it measured nothing)."""

    def measured(self) -> Sequence[tuple[dict[str, Any], Observation]]:
        """Every distinct program measured so far (the baseline included): a configuration of it, and how it did."""


def label(config: Config, space: SearchSpace) -> str:
    """The knobs of ``config`` that differ from their defaults, as ``name=value`` (``baseline`` when none)."""
    parts = [f"{k.name}={_text(config[k.name])}" for k in space.knobs if config.get(k.name, k.default) != k.default]
    return ", ".join(parts) or "baseline"


def _text(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


@dataclass
class _Walk:
    """The path and the blamed knobs as one plan() builds them."""

    space: SearchSpace
    path: list[Step] = field(default_factory=list)
    blamed: list[Blame] = field(default_factory=list)

    def stop(self, p: Proposal | None, incumbent: Config, more: Sequence[Proposal] = ()) -> Plan:
        """The plan: ``p`` (and ``more``) to measure next, or done where ``p`` is None."""
        ready = tuple([p, *more]) if p is not None else ()
        on = f" on {label(incumbent, self.space)} not tried"
        untried = sum(step.phase == "skip" and on in step.text for step in self.path)
        return Plan(ready, tuple(self.path), tuple(self.blamed), dict(incumbent), p is None, untried)


class StrongStart:
    """Baselines, then the configuration the field switches on; blame by bisection if it fails; coordinate descent
    from the best configuration so far; expensive choices (long compiles) last, only when the budget covers them."""

    name = "strong start + descent"

    def __init__(self, space: SearchSpace, start: Mapping[str, Any], expensive: Mapping[str, Sequence[Any]]) -> None:
        self.space = space
        knobs = {k.name: k for k in space.knobs}
        # the start configuration, restricted to what this space searches, in order of expected effect; where the
        # space does not offer the start's choice (a --space file with fused_optimizer.impl: [default, foreach]), the
        # last choice it lists stands in for it
        values = {}
        for n, v in start.items():
            if n in knobs:
                values[n] = v if has(space.choices[n], v) else space.choices[n][-1]
        self.start_order = [n for n, v in values.items() if not same_value(v, knobs[n].default)]
        self.start = {**space.baseline(), **{n: values[n] for n in self.start_order}}
        self.expensive = [
            (n, v) for n, values in expensive.items() if n in knobs for v in values if has(space.choices[n], v)
        ]
        # descent order: the start's knobs by expected effect, then the others
        self.order = self.start_order + [k.name for k in space.knobs if k.name not in self.start_order]

    def lead(self, name: str, value: Any) -> bool:
        """Start from ``name=value`` as well, first in the start's order (what the machine's first runs showed pays
        most here); whether that changed the start."""
        if name not in self.space.choices or not has(self.space.choices[name], value):
            raise ValueError(f"{name}={value!r} is not one of the space's choices")
        if name in self.start_order and same_value(self.start[name], value):
            return False
        self.start_order = [name] + [n for n in self.start_order if n != name]
        self.start = {**self.start, name: value}
        self.order = self.start_order + [n for n in self.order if n not in self.start_order]
        return True

    def is_expensive(self, name: str, value: Any) -> bool:
        """Whether ``name=value`` is an expensive choice (tried last, when the budget covers its compile)."""
        return any(n == name and same_value(v, value) for n, v in self.expensive)

    def plan(self, view: View) -> Plan:
        """Where the strategy stands, from what ``view`` has measured: 1. the start configuration, 2. the knobs that
        break it blamed and dropped, 3. coordinate descent from there, 4. the expensive choices on top."""
        walk = _Walk(self.space)
        base = view.canonical(self.space.baseline())
        current = self._start(view, walk, base)
        if isinstance(current, Plan):
            return current
        incumbent = self._descend(view, walk, current, base)
        if isinstance(incumbent, Plan):
            return incumbent
        return self._expensive_steps(view, walk, incumbent)

    def _start(self, view: View, walk: _Walk, base: Config) -> Config | Plan:
        """The start configuration as measured, less the knobs that broke it (or what to measure to get there)."""
        path, stop = walk.path, walk.stop
        # 1. the start configuration; where the time left does not cover it, without the knobs whose runs cost much
        # more than the baseline's (compilation), which the descent tries later if the time allows
        current = view.canonical(self.start)
        if view.observed(current) is None and not view.affordable(current):
            costly = [n for n in self.start_order if view.costly(view.canonical(self._with([n])))]
            if costly:
                current = view.canonical(self._with([n for n in self.start_order if n not in costly]))
                left = ", ".join(f"{n}={_text(self.start[n])}" for n in costly)
                path.append(Step("skip", f"{left} left out of the start: the time left does not cover it"))
        if not view.same(current, base):
            got = view.observed(current)
            if got is None:
                return stop(Proposal(current, "start", "the configuration the field switches on for this device"), base)
            path.append(Step("start", f"start: {label(current, self.space)}", current, _speed(got)))
            return self._blame(view, walk, base, current, got)
        return current

    def _blame(self, view: View, walk: _Walk, base: Config, current: Config, got: Observation) -> Config | Plan:
        """While the start fails, bisect its changed knobs for the one that breaks it, drop it, measure again."""
        path, blamed, stop = walk.path, walk.blamed, walk.stop
        changed = [n for n in self.order if not same_value(current.get(n), self.space.baseline()[n])]
        while not got.ok:
            idle = [n for n in changed if n in got.unreached]
            if idle:  # knobs whose code never ran: no bisection needed, and no value of them can help
                for name in idle:
                    changed.remove(name)
                    reason = "its code never ran in this script's run (the path it changes was not taken)"
                    blamed.append(Blame(name, self.start[name], reason, every_value=True))
                    path.append(Step("blame", f"left out {name}: {reason}"))
                what = "start without them"
            else:
                lo, hi, failure = 0, len(changed), got  # prefix lo passes (the baseline does), prefix hi fails
                costly: list[str] = []
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    trial = view.canonical(self._with(changed[:mid]))
                    seen = view.observed(trial)
                    if seen is None and not view.affordable(trial):
                        # a bisection step the time left does not cover (its compilation): the knobs whose runs
                        # cost much more than the baseline's leave the start, and the rest is measured on its own
                        costly = [n for n in changed if view.costly(view.canonical(self._with([n])))]
                        if costly:
                            break
                    if seen is None:
                        why = f"blame: bisecting {len(changed)} knobs, the first {mid} on"
                        return stop(Proposal(trial, "blame", why), base)
                    if seen.ok:
                        lo = mid
                    else:
                        hi, failure = mid, seen
                if costly:
                    for name in costly:
                        changed.remove(name)
                    left = ", ".join(f"{n}={_text(self.start[n])}" for n in costly)
                    path.append(Step("skip", f"{left} left out of the start: the time left does not cover bisecting "
                                             "with it"))
                    what = "start without the knobs the time left does not cover"
                else:
                    culprit = changed.pop(hi - 1)
                    value = self.start[culprit]
                    reason = _failure_text(failure)
                    blamed.append(Blame(culprit, value, reason))
                    path.append(Step("blame", f"blamed {culprit}={_text(value)}: {reason}"))
                    what = "start without the blamed knobs"
            current = view.canonical(self._with(changed))
            if view.same(current, base):
                break
            got = view.observed(current)
            if got is None:
                why = "the start configuration without " + ", ".join(
                    [f"{b.knob}={_text(b.value)}" for b in blamed] + (["the knobs the time left does not cover"]
                                                                      if what.endswith("cover") else []))
                return stop(Proposal(current, "start", why), base)
            path.append(Step("start", f"{what}: {label(current, self.space)}", current, _speed(got)))
        return current

    def _descend(self, view: View, walk: _Walk, current: Config, base: Config) -> Config | Plan:
        """Coordinate descent from the start (or the baseline, where the start failed), restarted from a faster
        configuration measured on the way; the incumbent it ends at, or what to measure next."""
        path, blamed, stop = walk.path, walk.blamed, walk.stop
        # the descent starts from the start configuration (blamed knobs dropped) even where it is slower than the
        # baseline: taking knobs out of it one at a time keeps the ones that only pay together (bf16 with SDPA)
        incumbent = current if _ok(view, current) else base
        if path:
            path.append(Step("accept", f"descent starts from: {label(incumbent, self.space)}", incumbent,
                             _speed(view.observed(incumbent))))
        blamed_values = {(b.knob, _text(b.value)) for b in blamed}
        blamed_values |= {(b.knob, _text(v)) for b in blamed if b.every_value for v in self.space.choices[b.knob]}
        blamed_values |= self._idle(view)
        unaffordable: set[str] = set()  # descent steps the time left did not cover (said once each in the path)
        said: set[str] = set()  # ties a duel decided for the incumbent (said once each)

        # 3. coordinate descent from the incumbent; where it ends slower than a configuration measured on the way
        # (a strong start that only loses on this machine, one noisy run that kept a knob), it starts again from
        # that one, at most MAX_RESTARTS times
        visited = [incumbent]
        origins = [incumbent]
        for restart in range(MAX_RESTARTS + 1):
            for _ in range(MAX_PASSES):
                moved = False
                for pos, name in enumerate(self.order):
                    alternatives = self._alternatives(view, incumbent, name, blamed_values)
                    for a in alternatives:
                        if view.observed(a) is None and not view.affordable(a):
                            text = f"{name}={_text(a[name])} on {label(incumbent, self.space)}"
                            if text not in unaffordable:
                                unaffordable.add(text)
                                path.append(Step("skip", f"{text} not tried: the time left does not cover it"))
                    alternatives = [a for a in alternatives if view.observed(a) is not None or view.affordable(a)]
                    waiting = [a for a in alternatives if view.observed(a) is None]
                    if waiting:
                        more = [
                            Proposal(a, "descent", f"descent: {later}={_text(a[later])} on the incumbent")
                            for later in self.order[pos + 1:]
                            for a in self._alternatives(view, incumbent, later, blamed_values)
                            if view.observed(a) is None and view.affordable(a)
                        ]
                        first = Proposal(waiting[0], "descent", f"descent: {name}={_text(waiting[0][name])} on the incumbent")
                        rest = [Proposal(a, "descent", f"descent: {name}={_text(a[name])} on the incumbent") for a in waiting[1:]]
                        return stop(first, incumbent, rest + more)
                    decided = self._best(view, incumbent, alternatives)
                    if isinstance(decided, Proposal):
                        return stop(decided, incumbent)
                    best, note = decided
                    if best is incumbent and note and note not in said:
                        said.add(note)
                        path.append(Step("hold", note))
                    if best is not incumbent and not any(view.same(best, v) for v in visited):
                        before = _speed(view.observed(incumbent))
                        after = _speed(view.observed(best))
                        simpler = len(self.space.changed(best)) < len(self.space.changed(incumbent))
                        path.append(Step(
                            "accept",
                            f"{name}={_text(best[name])}: {_ratio(after, before)} the incumbent"
                            + (" (as fast within the noise, and simpler)" if simpler and (after or 0) <= (before or 0) * (1 + view.threshold()) else "")
                            + (f"; {note}" if note else ""),
                            best, after,
                        ))
                        incumbent = best
                        visited.append(best)
                        moved = True
                if not moved:
                    break
            ahead = [  # (expensive choices are weighed after the descent, on top of where it ends)
                c for c, o in view.measured()
                if o.ok and self._faster(view, c, incumbent) and not any(view.same(c, v) for v in origins)
                and not any(self.is_expensive(n, v) for n, v in c.items())
            ]
            if not ahead or restart == MAX_RESTARTS:
                break
            origin = max(ahead, key=lambda c: view.observed(c).speedup)
            path.append(Step(
                "accept",
                f"the descent ended at {_ratio(_speed(view.observed(incumbent)), 1.0)} the baseline, slower than "
                f"{label(origin, self.space)} measured on the way: it starts again from there",
                origin, _speed(view.observed(origin)),
            ))
            incumbent = origin
            origins.append(origin)
            visited.append(origin)

        return incumbent

    def _expensive_steps(self, view: View, walk: _Walk, incumbent: Config) -> Plan:
        """The expensive choices (max-autotune) on top of the incumbent, while the budget covers them."""
        path, stop = walk.path, walk.stop
        for name, value in self.expensive:
            trial = view.canonical({**incumbent, name: value})
            if view.same(trial, incumbent):
                continue
            seen = view.observed(trial)
            if seen is None:
                if view.affordable(trial):
                    return stop(Proposal(trial, "expensive", f"expensive: {name}={_text(value)} on the incumbent"),
                                incumbent)
                path.append(Step("skip", f"{name}={_text(value)} not tried: the time left does not cover its compile"))
                continue
            if self._better(view, trial, incumbent):
                path.append(Step("expensive", f"{name}={_text(value)}: {_ratio(_speed(seen), _speed(view.observed(incumbent)))} the incumbent", trial, _speed(seen)))
                incumbent = trial
            else:
                path.append(Step("expensive", f"{name}={_text(value)}: not faster ({_failure_text(seen) if not seen.ok else _ratio(_speed(seen), _speed(view.observed(incumbent))) + ' the incumbent'})", trial, _speed(seen)))
        return stop(None, incumbent)


    def hopeful(self, view: View, blamed: Sequence[Blame] = (), limit: int = MAX_ENUMERATED) -> list[dict[str, Any]]:
        """Untried configurations that could still beat the best measured one by more than the noise, most hopeful
        first (after the descent, while time is left).

        The estimate is optimistic: from each of the fastest measured configurations, each knob changed on the way
        to the untried one counts with the largest speedup that setting it to that value showed in any measured
        pair of configurations differing in that knob alone (a change never measured so counts as no change: it
        may be one that changes nothing, such as a compile scope without compilation). A blamed or expensive value
        counts as no hope (the descent and its last phase weigh those).
        """
        seen = [(dict(c), o.speedup) for c, o in view.measured() if o.ok and o.speedup]
        if not seen:
            return []
        best = max(speed for _, speed in seen)
        gains: dict[tuple[str, str], float] = {}
        for i, (a, sa) in enumerate(seen):
            for b, sb in seen[i + 1:]:
                diff = [n for n in a if not same_value(a.get(n), b.get(n))]
                if len(diff) == 1:
                    for (x, sx), (y, sy) in (((a, sa), (b, sb)), ((b, sb), (a, sa))):
                        key = (diff[0], _text(x[diff[0]]))
                        gains[key] = max(gains.get(key, 0.0), sx / sy)
        failed = {(b.knob, _text(b.value)) for b in blamed}
        failed |= {(b.knob, _text(v)) for b in blamed if b.every_value for v in self.space.choices[b.knob][1:]}
        failed |= self._idle(view)
        failed |= {(n, _text(v)) for n, v in self.expensive}
        bar = best * (1.0 + view.threshold())
        names = [k.name for k in self.space.knobs]
        measured = {config_key(c) for c, _ in view.measured()}
        bases = sorted(seen, key=lambda cs: -cs[1])[:MAX_BASES]
        scored = []
        for n_seen, values in enumerate(itertools.product(*(self.space.choices[n] for n in names))):
            if n_seen >= limit:
                break
            config = dict(zip(names, values))
            if any((n, _text(config[n])) in failed for n in names):
                continue
            estimate = 0.0
            for base, speed in bases:
                factor = speed
                for n in names:
                    if not same_value(config[n], base.get(n)):
                        factor *= gains.get((n, _text(config[n])), 1.0)
                        if factor == 0.0:
                            break
                estimate = max(estimate, factor)
            if estimate > bar and config_key(config) not in measured:
                scored.append((estimate, config))
        scored.sort(key=lambda item: -item[0])
        return [config for _, config in scored]

    def _idle(self, view: View) -> set[tuple[str, str]]:
        """The other values of knobs whose code never ran in some run: this script's run never takes their path."""
        names = {n for _, o in view.measured() for n in o.unreached}
        return {(n, _text(v)) for n in names for v in self.space.choices[n][1:]}

    def _with(self, names: Sequence[str]) -> dict[str, Any]:
        """The baseline with the start's values of ``names``."""
        return {**self.space.baseline(), **{n: self.start[n] for n in names}}

    def _alternatives(self, view: View, incumbent: Config, name: str, blamed: set) -> list[dict[str, Any]]:
        """``incumbent`` with each other choice of knob ``name`` (distinct programs; blamed and expensive ones out).
        Memory: micro-batches at least as big as one that ran out of memory are out, the smallest of them comes back
        once with a memory saver (activation checkpointing) on; smaller micro-batches than the script's only where a
        configuration at its own micro-batch ran out of memory; a memory saver is never turned on alone (it only
        costs time, and pays where it lets a bigger micro-batch fit)."""
        out: list[dict[str, Any]] = []

        def keep(trial: dict[str, Any]) -> None:
            if not view.same(trial, incumbent) and not any(view.same(trial, o) for o in out):
                out.append(trial)

        too_big, saving, unsaved, plain = None, False, {}, {}
        if name in splits() or name in memory_savers():  # what ran out of memory, asked only for the knobs it concerns
            too_big = _out_of_memory_splits(view, incumbent).get(name)
            baseline = self.space.baseline()
            plain = {s: baseline.get(s) for s in memory_savers() if s in baseline}  # every saver off
            saving = any(not same_value(incumbent.get(s), v) for s, v in plain.items())
            unsaved = _out_of_memory_splits(view, plain)  # what did not fit without a saver
        for choice in self.space.choices[name]:
            if same_value(choice, incumbent.get(name)) or self.is_expensive(name, choice):
                continue
            if name in memory_savers():
                if not same_value(choice, plain.get(name)) or any(
                        isinstance(incumbent.get(s), int) and incumbent[s] >= limit for s, limit in unsaved.items()):
                    continue  # never on alone; and not off where the incumbent's micro-batch needs it
            if name in splits() and saving and (_smaller(choice) or choice < unsaved.get(name, choice + 1)):
                keep(view.canonical({**incumbent, **plain, name: choice}))  # fits without the saver: without it
                continue
            if name in splits() and _smaller(choice):
                # only where memory is short at the script's own micro-batch: the configuration that ran out of
                # memory there, with the next smaller micro-batch
                for config in _short_of_memory(view, name):
                    below = [c for c in self.space.choices[name] if _smaller(c) and c < config.get(name, 1)]
                    if below and same_value(max(below), choice) and (name, _text(choice)) not in blamed:
                        keep(view.canonical({**config, name: choice}))
                continue
            if too_big is not None and isinstance(choice, int) and choice >= too_big:
                if choice == too_big:  # blamed, as a start that ran out of memory is: not with a saver on
                    for paired in self._with_saver(view, {**incumbent, name: choice}):
                        keep(paired)
                continue
            if (name, _text(choice)) in blamed:
                continue
            keep(view.canonical({**incumbent, name: choice}))
        return out

    def _with_saver(self, view: View, config: Config) -> list[dict[str, Any]]:
        """``config`` (a micro-batch that ran out of memory) with the first memory saver of the space turned on,
        where the incumbent has none on and that pairing has not run yet."""
        for saver, on in memory_savers().items():
            if saver not in self.space.choices or not has(self.space.choices[saver], on):
                continue
            if not same_value(config.get(saver), self.space.baseline().get(saver)):
                return []  # a saver is on already: the micro-batch did not fit even so
            return [view.canonical({**config, saver: on})]
        return []

    def _best(
        self, view: View, incumbent: Config, alternatives: Sequence[Config]
    ) -> tuple[Config, str | None] | Proposal:
        """The fastest alternative that is faster than ``incumbent`` beyond the noise; else the fastest that is as
        fast within the noise and simpler; else ``incumbent``; with what decided it. A tie (one of the two measured
        faster, within the noise) is decided by a duel of A/B pairs; while one is missing, the Proposal of its next
        run (where the time left covers the duel; else the single runs decide, simpler first)."""
        base = view.observed(incumbent)
        if base is None or not base.ok or not base.speedup:
            ok = [a for a in alternatives if _ok(view, a)]
            return (max(ok, key=lambda a: view.observed(a).speedup), None) if ok else (incumbent, None)
        margin = view.threshold()
        measured = [a for a in alternatives if _ok(view, a) and view.observed(a).speedup]
        clear = [a for a in measured if view.observed(a).speedup > base.speedup * (1.0 + margin)]
        if clear:  # one is faster beyond the noise: no tie among the others needs settling
            return max(clear, key=lambda a: view.observed(a).speedup), None
        faster: list[tuple[Config, str | None]] = []
        simpler: list[tuple[Config, str | None]] = []
        held: list[str] = []
        # the most promising tie first: the pick is the fastest of those a duel kept (a faster one before a simpler
        # one), so once one is kept, a tie that measured slower could not be picked and needs no duel (makemore at
        # 300 s dueled its slowest simpler alternative first, and 12 of its 38 runs went to ties that could not win)
        for a in sorted(measured, key=lambda c: -view.observed(c).speedup):
            if faster:
                break
            got = view.observed(a)
            ratio = got.speedup / base.speedup
            fewer = len(self.space.changed(a)) < len(self.space.changed(incumbent))
            if fewer and simpler:
                continue
            # a simpler one as fast is kept on its single run only where single runs can be trusted (the noise under
            # QUIET); on a noisier machine it is a tie whichever way its run fell: one run 6% faster says no more
            # than one 6% slower (the README's CNN lost bf16 to a 1.06x run at 83% noise), so the pairs decide
            if fewer and ratio >= 1.0 - TIE_FLOOR and margin <= QUIET:
                simpler.append((a, None))
                continue
            # a tie between two configurations both slower than the baseline beyond the noise does not decide what
            # wins: the simpler one goes on, without pairs (the README's CNN spent 12 of its 37 runs in 180 s on
            # ties at 0.45x and 0.92x, and never reached the DataLoader worker that made them slow)
            if max(got.speedup, base.speedup) * (1.0 + margin) < 1.0 and ratio >= 1.0 - margin:
                if fewer:
                    simpler.append((a, f"as fast within the noise ({_ratio(got.speedup, base.speedup)}) and both "
                                       "behind the baseline: the simpler one goes on without pairs"))
                continue
            if (fewer and ratio < 1.0 - margin) or (not fewer and ratio <= 1.0 + TIE_FLOOR):
                continue
            complex_, simple = (incumbent, a) if fewer else (a, incumbent)
            decided = self._duel(view, complex_, simple)
            if isinstance(decided, Proposal):
                return decided
            won, note = decided
            if fewer and not won:
                simpler.append((a, note))
            elif not fewer and won:
                faster.append((a, note))
            elif note:  # the duel kept the incumbent: said in the path
                held.append(f"{label(a, self.space)} not taken ({_ratio(got.speedup, base.speedup)} the incumbent, "
                            f"within the noise): {note}")
        for group in (faster, simpler):
            if group:
                return max(group, key=lambda an: view.observed(an[0]).speedup)
        return incumbent, "; ".join(held) or None

    def _duel(self, view: View, complex_: Config, simple: Config) -> tuple[bool, str | None] | Proposal:
        """Whether ``complex_`` is faster than ``simple`` in A/B pairs (``_duel_verdict``), and how it did; or the
        duel's next run. Where the time left does not cover the rest of the duel, the pairs already complete decide
        where there are CUT_DUEL_PAIRS of them; else the single runs do (the faster one; the simpler one within
        TIE_FLOOR)."""
        runs = view.duel(complex_, simple)
        ratios = [a / b for j in sorted({j for j, _ in runs})
                  if (a := runs.get((j, "a"))) and (b := runs.get((j, "b")))]
        pairs = sorted({j for j, _ in runs})
        needed = _duel_pairs(ratios)
        if len(ratios) < needed:
            if len(pairs) >= 2 * needed:
                return False, f"the pairs that should re-measure it failed ({len(ratios)} of {len(pairs)} measured)"
            current = pairs[-1] if pairs and any((pairs[-1], arm) not in runs for arm in "ab") else len(pairs)
            order = ("b", "a") if current % 2 == 0 else ("a", "b")  # each pair in the other order than the last
            arm = next(arm for arm in order if (current, arm) not in runs)
            if not (view.affordable(complex_) and view.affordable(simple)):
                if len(ratios) >= CUT_DUEL_PAIRS:  # the pairs run so far decide, by the same rule, not the single runs
                    return _duel_verdict(self.space, complex_, simple, ratios,
                                         f" (the time left did not cover the other {needed - len(ratios)})")
                # the single runs decide, the faster one kept: the plan is made again from the study at each step,
                # and a noise margin that grew since (one slow baseline run) must not turn a decision the runs made
                # into a tie that goes to the simpler one for want of time (makemore at 300 s dropped the thread
                # count and compile so, at the end, from a start measured faster without either taken out)
                ratio = view.observed(complex_).speedup / view.observed(simple).speedup
                return ratio > 1.0 + TIE_FLOOR, ("not re-measured in pairs: the time left does not cover it; the "
                                                 f"single runs decide ({ratio:.2f}x)")
            why = (f"duel: {label(complex_, self.space)} against {label(simple, self.space)}, pair {current + 1} of "
                   f"{needed}: " + ("their runs differ by less than the noise" if needed == DUEL_PAIRS else
                                    "its first pairs disagree, most of them faster"))
            config = complex_ if arm == "a" else simple
            return Proposal(dict(config), "duel", why, (dict(complex_), dict(simple), current, arm))
        return _duel_verdict(self.space, complex_, simple, ratios)

    def _faster(self, view: View, a: Config, b: Config) -> bool:
        """Whether ``a`` ran faster than ``b`` beyond the noise (both passed the gate)."""
        oa, ob = view.observed(a), view.observed(b)
        if oa is None or not oa.ok or not oa.speedup or ob is None or not ob.ok or not ob.speedup:
            return False
        return oa.speedup > ob.speedup * (1.0 + view.threshold())

    def _better(self, view: View, a: Config, b: Config) -> bool:
        """Whether ``a`` beats ``b``: faster beyond the noise, or as fast within it and simpler (fewer changes)."""
        oa, ob = view.observed(a), view.observed(b)
        if oa is None or not oa.ok or not oa.speedup:
            return False
        if ob is None or not ob.ok or not ob.speedup:
            return True
        ratio = oa.speedup / ob.speedup
        margin = view.threshold()
        if ratio > 1.0 + margin:
            return True
        return ratio >= 1.0 - margin and len(self.space.changed(a)) < len(self.space.changed(b))


@cache
def splits() -> tuple[str, ...]:
    """The knobs that multiply the micro-batch (the same samples per optimizer step in fewer, bigger micro-batches)."""
    return tuple(k.name for k in with_role(Role.SPLIT))


@cache
def memory_savers() -> dict[str, Any]:
    """Activation checkpointing, as each transform spells it on: it frees memory for a bigger micro-batch, at a
    cost (knob -> the choice that turns it on)."""
    return {k.name: k.on for k in with_role(Role.MEMORY_SAVER)}


def _smaller(choice: Any) -> bool:
    """A split that makes the micro-batch smaller than the script's (0.5, 0.25)."""
    return isinstance(choice, float) and choice < 1


def _short_of_memory(view: View, name: str) -> list[Config]:
    """The configurations that ran out of memory at the script's own micro-batch or a smaller one (the split knob
    ``name`` was not what made it bigger): only there may a smaller micro-batch let the other knobs fit."""
    out = []
    for config, o in view.measured():
        value = config.get(name, 1)
        if o.status == "oom" and isinstance(value, (int, float)) and value <= 1:
            out.append(dict(config))
    return out


def _out_of_memory_splits(view: View, incumbent: Config | None = None) -> dict[str, int]:
    """For each batch-split knob, the smallest factor that ran out of memory (with the memory savers as the
    ``incumbent`` has them: checkpointing changes what fits): a bigger micro-batch needs more."""
    out: dict[str, int] = {}
    for config, o in view.measured():
        if o.status != "oom":
            continue
        if incumbent is not None and any(not same_value(config.get(s), incumbent.get(s)) for s in memory_savers()):
            continue
        for name in splits():
            value = config.get(name)
            if isinstance(value, int) and value > 1 and value < out.get(name, value + 1):
                out[name] = value
    return out


def _duel_pairs(ratios: list[float]) -> int:
    """How many A/B pairs a duel needs, given those complete (``ratios``: the more complex one's speed over the
    simpler one's): DUEL_PAIRS, or DUEL_MORE_PAIRS where those disagree, one slower, with the median faster."""
    if len(ratios) >= DUEL_PAIRS and sum(r <= 1.0 for r in ratios[:DUEL_PAIRS]) == 1 and \
            statistics.median(ratios[:DUEL_PAIRS]) > 1.0 + DUEL_GAIN:
        return DUEL_MORE_PAIRS
    return DUEL_PAIRS


def _duel_verdict(space: SearchSpace, complex_: Config, simple: Config, ratios: list[float],
                  cut: str = "") -> tuple[bool, str]:
    """Whether ``complex_`` won its A/B pairs against ``simple`` (``ratios``: its speed over simple's): faster by
    more than DUEL_GAIN in the median, and in every pair, or in all but one of DUEL_MORE_PAIRS or more; and how it
    did."""
    median = statistics.median(ratios)
    slower = sum(r <= 1.0 for r in ratios)
    won = median > 1.0 + DUEL_GAIN and (slower == 0 or (len(ratios) >= DUEL_MORE_PAIRS and slower == 1))
    shown = ", ".join(f"{r:.2f}x" for r in ratios)
    return won, (f"re-measured in {len(ratios)} A/B pairs{cut}, {label(complex_, space)} against "
                 f"{label(simple, space)}: {shown}")


def _ok(view: View, config: Config) -> bool:
    got = view.observed(config)
    return got is not None and got.ok


def _speed(o: Observation | None) -> float | None:
    return o.speedup if o is not None and o.ok else None


def _ratio(a: float | None, b: float | None) -> str:
    if not a or not b:
        return "n/a"
    return f"{a / b:.2f}x"


def _failure_text(o: Observation) -> str:
    return f"{o.status}" + (f": {o.error}" if o.error else "")
