"""The search strategy: start from what the field switches on, blame what breaks, then descend knob by knob.

The strategy is a pure function of what has been measured: ``plan(view)`` replays the whole path from the study's
results each time it is asked, so a resumed search, or a second worker on the same study, continues exactly where
the study stands. Its seam is narrow: a :class:`View` answers "was this configuration measured, and how did it do?";
the plan says which configuration to measure next (``None``: the strategy is done) and how it got there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from autotune.search.space import SearchSpace, has, same_value

Config = Mapping[str, Any]
MAX_PASSES = 4  # coordinate-descent passes over the knobs; each pass that changes nothing ends the descent
MAX_RESTARTS = 2  # descents started again from a configuration measured faster than where the last one ended


@dataclass(frozen=True)
class Observation:
    """One configuration as measured: whether it finished and passed the loss gate, and how fast it ran."""

    ok: bool
    speedup: float | None  # throughput over the same machine's baseline runs (the search's one definition)
    status: str = "ok"
    error: str | None = None


@dataclass(frozen=True)
class Proposal:
    """A configuration to measure next, and why."""

    config: dict[str, Any]
    phase: str  # start | blame | descent | expensive
    why: str


@dataclass(frozen=True)
class Step:
    """One step of the path, for the report: what was measured or decided, and the speedup it showed."""

    phase: str  # start | blame | accept | expensive | skip
    text: str
    config: Mapping[str, Any] = field(default_factory=dict)
    speedup: float | None = None


@dataclass(frozen=True)
class Blame:
    """A knob value the start configuration had to drop, and why (the failure that bisection pinned on it)."""

    knob: str
    value: Any
    reason: str


@dataclass(frozen=True)
class Plan:
    """Where the strategy stands: what to measure next (in order; the first is the strategy's own next step, the
    rest may be measured by other workers meanwhile), the path so far, the blamed knobs and the incumbent."""

    ready: tuple[Proposal, ...]
    path: tuple[Step, ...]
    blamed: tuple[Blame, ...]
    incumbent: dict[str, Any]
    done: bool

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

    def measured(self) -> Sequence[tuple[dict[str, Any], Observation]]:
        """Every distinct program measured so far (the baseline included): a configuration of it, and how it did."""


def label(config: Config, space: SearchSpace) -> str:
    """The knobs of ``config`` that differ from their defaults, as ``name=value`` (``baseline`` when none)."""
    parts = [f"{k.name}={_text(config[k.name])}" for k in space.knobs if config.get(k.name, k.default) != k.default]
    return ", ".join(parts) or "baseline"


def _text(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


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

    def is_expensive(self, name: str, value: Any) -> bool:
        """Whether ``name=value`` is an expensive choice (tried last, when the budget covers its compile)."""
        return any(n == name and same_value(v, value) for n, v in self.expensive)

    def plan(self, view: View) -> Plan:
        path: list[Step] = []
        blamed: list[Blame] = []
        base = view.canonical(self.space.baseline())

        def stop(p: Proposal | None, incumbent: Config, more: Sequence[Proposal] = ()) -> Plan:
            ready = tuple([p, *more]) if p is not None else ()
            return Plan(ready, tuple(path), tuple(blamed), dict(incumbent), p is None)

        # 1. the start configuration
        current = view.canonical(self.start)
        if not view.same(current, base):
            got = view.observed(current)
            if got is None:
                return stop(Proposal(current, "start", "the configuration the field switches on for this device"), base)
            path.append(Step("start", f"start: {label(current, self.space)}", current, _speed(got)))
            # 2. blame: while it fails, bisect the changed knobs for the one that breaks it, drop it, measure again
            changed = [n for n in self.order if not same_value(current.get(n), self.space.baseline()[n])]
            while not got.ok:
                lo, hi, failure = 0, len(changed), got  # prefix lo passes (the baseline does), prefix hi fails
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    trial = view.canonical(self._with(changed[:mid]))
                    seen = view.observed(trial)
                    if seen is None:
                        why = f"blame: bisecting {len(changed)} knobs, the first {mid} on"
                        return stop(Proposal(trial, "blame", why), base)
                    if seen.ok:
                        lo = mid
                    else:
                        hi, failure = mid, seen
                culprit = changed.pop(hi - 1)
                value = self.start[culprit]
                reason = _failure_text(failure)
                blamed.append(Blame(culprit, value, reason))
                path.append(Step("blame", f"blamed {culprit}={_text(value)}: {reason}"))
                current = view.canonical(self._with(changed))
                if view.same(current, base):
                    break
                got = view.observed(current)
                if got is None:
                    why = "the start configuration without " + ", ".join(f"{b.knob}={_text(b.value)}" for b in blamed)
                    return stop(Proposal(current, "start", why), base)
                path.append(Step("start", f"start without the blamed knobs: {label(current, self.space)}", current,
                                 _speed(got)))
        # the descent starts from the start configuration (blamed knobs dropped) even where it is slower than the
        # baseline: taking knobs out of it one at a time keeps the ones that only pay together (bf16 with SDPA)
        incumbent = current if _ok(view, current) else base
        if path:
            path.append(Step("accept", f"descent starts from: {label(incumbent, self.space)}", incumbent,
                             _speed(view.observed(incumbent))))
        blamed_values = {(b.knob, _text(b.value)) for b in blamed}

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
                    waiting = [a for a in alternatives if view.observed(a) is None]
                    if waiting:
                        more = [
                            Proposal(a, "descent", f"descent: {later}={_text(a[later])} on the incumbent")
                            for later in self.order[pos + 1:]
                            for a in self._alternatives(view, incumbent, later, blamed_values)
                            if view.observed(a) is None
                        ]
                        first = Proposal(waiting[0], "descent", f"descent: {name}={_text(waiting[0][name])} on the incumbent")
                        rest = [Proposal(a, "descent", f"descent: {name}={_text(a[name])} on the incumbent") for a in waiting[1:]]
                        return stop(first, incumbent, rest + more)
                    best = self._best(view, incumbent, alternatives)
                    if best is not incumbent and not any(view.same(best, v) for v in visited):
                        before = _speed(view.observed(incumbent))
                        after = _speed(view.observed(best))
                        path.append(Step(
                            "accept",
                            f"{name}={_text(best[name])}: {_ratio(after, before)} the incumbent"
                            + ("" if (after or 0) > (before or 0) else " (as fast within the noise, and simpler)"),
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

        # 4. expensive choices, on top of the incumbent, while the budget covers them
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

    def _with(self, names: Sequence[str]) -> dict[str, Any]:
        """The baseline with the start's values of ``names``."""
        return {**self.space.baseline(), **{n: self.start[n] for n in names}}

    def _alternatives(self, view: View, incumbent: Config, name: str, blamed: set) -> list[dict[str, Any]]:
        """``incumbent`` with each other choice of knob ``name`` (distinct programs; blamed and expensive ones out)."""
        out: list[dict[str, Any]] = []
        for choice in self.space.choices[name]:
            if same_value(choice, incumbent.get(name)) or self.is_expensive(name, choice):
                continue
            if (name, _text(choice)) in blamed:
                continue
            trial = view.canonical({**incumbent, name: choice})
            if view.same(trial, incumbent) or any(view.same(trial, o) for o in out):
                continue
            out.append(trial)
        return out

    def _best(self, view: View, incumbent: Config, alternatives: Sequence[Config]) -> Config:
        """The fastest alternative that is faster than ``incumbent`` beyond the noise; else the fastest that is as
        fast within the noise and simpler; else ``incumbent``."""
        faster, simpler = [], []
        base = view.observed(incumbent)
        for a in alternatives:
            if self._better(view, a, incumbent):
                got = view.observed(a)
                beyond = base is None or not base.ok or not base.speedup or got.speedup > base.speedup * (1 + view.threshold())
                (faster if beyond else simpler).append(a)
        for group in (faster, simpler):
            if group:
                return max(group, key=lambda a: view.observed(a).speedup)
        return incumbent

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




def sign_test(wins: int, n: int) -> float:
    """One-sided p-value of ``wins`` or more successes in ``n`` fair coin flips (the sign test of paired ratios)."""
    return sum(math.comb(n, k) for k in range(wins, n + 1)) / 2**n if n else 1.0


def median_interval(values: Sequence[float], coverage: float = 0.9) -> tuple[float, float, float] | None:
    """A distribution-free interval for the median of ``values`` from their order statistics: (low, high, its
    coverage), the narrowest that covers at least ``coverage``, else (min, max) with what it covers; None if empty."""
    xs = sorted(values)
    n = len(xs)
    if not n:
        return None
    best = (xs[0], xs[-1], _coverage(n, 1))
    for k in range(2, n // 2 + 1):
        if _coverage(n, k) < coverage:
            break
        best = (xs[k - 1], xs[n - k], _coverage(n, k))
    return best


def _coverage(n: int, k: int) -> float:
    """How often [x_(k), x_(n-k+1)] holds the median of ``n`` values: 1 - 2 P(Binomial(n, 1/2) < k)."""
    return 1 - 2 * sum(math.comb(n, j) for j in range(k)) / 2**n
