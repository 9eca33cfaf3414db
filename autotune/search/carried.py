"""What the compile cache carried to the tuned script saves, measured: the winner run with new, empty compiler caches
(a first run on a fresh machine), without and with ``compile_cache.bin`` loaded first, as the tuned script's loader
does, in interleaved pairs. Each run goes to the end of its measured steps: compilation falls in its first steps,
so what the file saves is the difference of the two runs' times (evaluation recompiles later in the run are not
in it).

Where there is nothing to carry (the winner compiles nothing, ``--no-compile-cache``) nothing runs; where the time
left does not cover a pair, the report says what was not measured and why.
"""

from __future__ import annotations

from collections.abc import Mapping

from autotune.search.confirm import arms as confirm_arms
from autotune.search.live import duration
from autotune.search.ports import Confirming
from autotune.search.outcome import CacheSaving, Confirmation
from autotune.search.space import config_key
from autotune.search.study import ROLE_CACHE
from autotune.search.trial import Outcome, TrialResult
from autotune.search.whole import run_pairs

PAIRS = 2  # compilation takes seconds where it takes anything: two pairs tell it from the noise of one run
WITHOUT, WITH = "without", "with"


def arms(results: list[TrialResult], key: str, machine: str) -> dict[tuple[int, str], TrialResult]:
    """The cache-saving runs of candidate ``key`` on ``machine``: (pair, arm) -> result."""
    return confirm_arms(results, key, machine, ROLE_CACHE)


def judge(got: Mapping[tuple[int, str], TrialResult], skipped: str | None = None) -> CacheSaving:
    """What the pairs ``got`` show: each pair where both runs ended ok, and whether a run given the file loaded it."""
    pairs = []
    for j in sorted({j for j, _ in got}):
        a, b = got.get((j, WITHOUT)), got.get((j, WITH))
        if a is not None and b is not None and a.status is Outcome.OK and b.status is Outcome.OK:
            pairs.append((a.wall_s, b.wall_s))
    not_loaded = any(r.compile_cache_loaded is False for (_, arm), r in got.items() if arm == WITH)
    return CacheSaving(tuple(pairs), not_loaded, skipped)


def measure(search: Confirming, winner: Confirmation | None) -> CacheSaving | None:
    """Run the winner's cache-saving pairs as far as the time left allows (None: it carries no cache)."""
    s = search
    if winner is None or not winner.accepted:
        return None
    cache = s.cache_path(winner.config)
    if cache is None or not cache.is_file():
        return None
    key, me = config_key(winner.config), s.machine.key
    # a run from empty caches compiles all again: at most about twice the slowest of its warm runs
    walls = [r.wall_s for r in winner.candidate if r.measured]
    pair_s = 4 * max(walls) if walls else None
    if pair_s is None:
        return None
    s.display.note(f"the compile cache for the tuned script: what it saves a first run, {PAIRS} pairs with empty "
                   f"compiler caches, about {duration(PAIRS * pair_s)}")
    stopped = run_pairs(s, ROLE_CACHE, key, {WITHOUT: winner.config, WITH: winner.config}, PAIRS, pair_s,
                        lambda got: judge(got).not_loaded)  # (a torch that does not take the file: nothing to measure)
    return judge(arms(s.results, key, me), stopped)
