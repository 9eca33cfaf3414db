"""The study as the strategy sees it (what strategy.py's ``View`` protocol asks), and the noise margin a change must
beat to count."""

from __future__ import annotations

from typing import Any

from autotune.search.outcome import neighbour_noise
from autotune.search.ports import Viewed
from autotune.search.strategy import Observation
from autotune.search.study import ROLE_BASELINE, ROLE_DUEL, ROLE_SEARCH
from autotune.search.trial import Outcome, TrialResult, unreached


MIN_MARGIN = 0.02  # the descent keeps a change only when it is faster by more than this, or by the noise if larger
MAX_MARGIN = 0.5


class StudyView:
    """The study as the strategy sees it: each program's first measurement, gated against the whole study's noise."""

    def __init__(self, search: Viewed) -> None:
        self.s = search
        self.space = search.space
        base_key = search.programs.program(search.space.baseline())
        settled = search.settled()  # each run against the baseline runs nearest it in time
        self._obs: dict[str, Observation] = {}
        self._configs: dict[str, dict[str, Any]] = {}
        for r in search.regate(search.results):
            if r.role not in (ROLE_BASELINE, ROLE_SEARCH) or r.status is Outcome.INTERRUPTED:
                continue  # (a run the end of the budget stopped measured nothing)
            key = search.programs.program(r.config)
            if key in self._obs:
                continue
            self._configs[key] = search.programs.canonical(r.config)
            if key == base_key:
                self._obs[key] = Observation(True, 1.0)
            else:
                ok = r.status is Outcome.OK
                idle = tuple(unreached(r.with_(status=Outcome.OK), search.space.changed(r.config))) \
                    if r.status is Outcome.UNREACHED else ()
                speed = settled.get(r.number, search.value_of(r)) if ok else None
                if ok and key in search.rejected:  # its A/B pairs measured it since: they say more than one run
                    speed = search.rejected[key]
                self._obs[key] = Observation(ok, speed, str(r.status), r.error, idle)
        self._threshold = margin(search.baselines())

    def observed(self, config):
        return self._obs.get(self.s.programs.program(config))

    def canonical(self, config):
        return self.s.programs.canonical(config)

    def same(self, a, b) -> bool:
        return self.s.programs.program(a) == self.s.programs.program(b)

    def threshold(self) -> float:
        return self._threshold

    def affordable(self, config) -> bool:
        return self.s.costs.affordable(config)

    def costly(self, config) -> bool:
        return self.s.compiles(config)

    def measured(self):
        return [(self._configs[k], o) for k, o in self._obs.items()]

    def duel(self, a, b):
        keys = [self.s.programs.program(a), self.s.programs.program(b)]
        me = self.s.mine()
        out: dict[tuple[int, str], float | None] = {}
        for r in self.s.results:
            if r.role == ROLE_DUEL and r.machine == me and r.attrs.get("duel") == keys:
                ok = r.status is Outcome.OK and r.measured
                out[(int(r.attrs.get("pair", 0)), str(r.attrs.get("arm")))] = self.s.speed_of(r) if ok else None
        return out


def margin(baselines: list[TrialResult]) -> float:
    """How much faster a change must be to count: the noise of the comparison the search makes, measured on a change
    of nothing. Each baseline run is compared as a search run is (``outcome.local_speedups``), with the mean of the
    baseline runs just before and after it; the margin is twice the root mean square of those log ratios, within
    [MIN_MARGIN, MAX_MARGIN]. The machine's drift over minutes stays out of it as it stays out of the comparison."""
    rms = neighbour_noise(baselines)
    return MIN_MARGIN if rms is None else min(max(2 * rms, MIN_MARGIN), MAX_MARGIN)
