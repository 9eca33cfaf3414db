"""A crowded machine: other work that takes processors from a run's steps, and what that does to a run on more
threads. Read from a search's first runs (its baselines, and the baseline on another thread count): where other
work took processors and fewer threads ran much faster, OpenMP's threads are waiting for whichever one is
descheduled, and runs on the script's thread count measure the machine's load more than the configuration. And a
single run that other work (or the hypervisor) disturbed beyond what this machine's runs usually see: measured
again rather than compared."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from autotune import contention
from autotune.contention import BUSY_OTHERS, Reading
from autotune.search.trial import TrialResult

# fewer threads this much faster than the script's count, beside other work: the runs on the script's count wait on
# descheduled threads (makemore beside one busy process: 1 thread 21x faster than 2; idle, 0.85x to 1.26x as fast)
FEWER_FASTER = 1.5
# how close one run on fewer threads must come to the baseline's runs for the start to take the fewer threads (on an
# idle machine): one process against others, a comparison whose noise the back-to-back baselines understate (they
# agree within 1-2% where makemore's runs of one program differ by 10-18%, 2 sd, from process to process:
# docs/benchmarks.md, session 35). makemore's MLP on 1 thread ran 0.95x, 1.00x and 1.07x its speed on 2 in three
# searches, and only on 1 thread did the start's compile pay (1.3x against 0.95x on 2): under a 2% margin the 0.95x
# search started on 2 threads, never reached the thread knob, and ended "the baseline wins". The descent measures
# the thread count again with the other knobs, so a start on fewer threads that cost a few percent is undone there.
LEAD_MARGIN = 0.10


@dataclass(frozen=True)
class Crowd:
    """Other work seen in the first runs' steps, and the baseline's speed on the two thread counts it ran on."""

    others: float  # the most processors' worth other work took from the first runs' steps
    cores: float
    many: int  # the thread count the runs compute with
    few: int  # the other count the perturbed baseline ran on
    ratio: float | None  # the perturbed run's speed over the baselines' (None: not measured)

    @property
    def favours_few(self) -> bool:
        """Whether fewer threads ran much faster: the runs on ``many`` threads measure the load."""
        return self.few < self.many and self.ratio is not None and self.ratio > FEWER_FASTER

    def warning(self, knob: str | None = None) -> str:
        """What other work did to the first runs; ``knob``: the space's thread knob, named as the one whose measure
        holds least elsewhere."""
        text = (f"other work on this machine took up to {self.others:.1f} of its {self.cores:.0f} processors from "
                "the first runs' steps")
        if self.favours_few:
            text += (f"; the baseline on {self.few} thread(s) ran {self.ratio:.1f}x faster than on {self.many}, its "
                     "threads waiting for whichever one is descheduled: this machine's speeds under that load, not "
                     "yours on a machine of your own" + (f" ({knob} above all)" if knob else ""))
        return f"warning: {text}; stop the other work, or search where the script runs alone"

    def lead_note(self, knob: str) -> str:
        return (f"the search starts from {knob}={self.few} as well: on this machine now, {self.few} thread(s) ran "
                f"{self.ratio:.1f}x faster than {self.many}; what it finds holds for this machine under this load")

    def verdict_note(self, knob: str, value: object) -> str:
        return (f"{knob}={value} was measured while other work took up to {self.others:.1f} of this machine's "
                f"{self.cores:.0f} processors, where {self.few} thread(s) ran {self.ratio:.1f}x faster than "
                f"{self.many}: on a machine where the script runs alone, fewer threads are usually slower; search "
                "again there before keeping it")


def crowd(baselines: Sequence[TrialResult], perturbed: Sequence[TrialResult],
          threads: tuple[int, int] | None) -> Crowd | None:
    """What other work did to the first runs (the baselines and the perturbed baseline on ``threads[1]`` threads),
    or None where no run lost BUSY_OTHERS processors or more to it."""
    runs = [*baselines, *perturbed]
    seen = [r.others for r in runs if r.others is not None]
    if not seen or max(seen) < BUSY_OTHERS:
        return None
    cores = next((r.contention["cores"] for r in runs if r.contention), 1.0)
    many, few = threads if threads is not None else (0, 0)
    ratio = _other_count_speed(baselines, perturbed) if threads is not None else None
    return Crowd(max(seen), cores, many, few, ratio)


def _other_count_speed(baselines: Sequence[TrialResult], perturbed: Sequence[TrialResult]) -> float | None:
    """The perturbed baseline's speed (on the other thread count) over the baselines', by their median step times;
    None where either was not measured."""
    base = [r.step_time for r in baselines if r.step_time]
    other = [r.step_time for r in perturbed if r.step_time]
    return statistics.median(base) / statistics.median(other) if base and other else None


def fewer_as_fast(baselines: Sequence[TrialResult], perturbed: Sequence[TrialResult],
                  threads: tuple[int, int] | None, margin: float) -> float | None:
    """The baseline's speed on fewer threads over its speed on the script's count, where the fewer ran as fast
    within ``margin`` (the noise of a comparison on this machine) or faster; None where they ran slower, or where
    the other count is not fewer or was not measured.

    Threads that do not make the baseline faster cost the rest of the program: every parallel region keeps them in
    step. makemore's MLP on 2 idle cores (docs/benchmarks.md, session 38): 1 thread ran its steps 1.07x as fast as
    2, compile on 2 threads 0.95x, compile on 1 thread 1.3x; the descent, which tries the thread knob after the
    start's knobs, ran out of time before it got there in every 300 s search."""
    if threads is None or threads[1] >= threads[0]:
        return None
    ratio = _other_count_speed(baselines, perturbed)
    return ratio if ratio is not None and ratio * (1.0 + margin) >= 1.0 else None


def near_miss(baselines: Sequence[TrialResult], perturbed: Sequence[TrialResult],
              threads: tuple[int, int] | None, margin: float) -> float | None:
    """The one run on fewer threads's speed over the baselines', where it came out slower than ``margin`` allows
    but by less than twice that: one process against two, whose noise decides such a comparison as often as the
    thread count does. None where it ran as fast, much slower, or more than one such run was measured.

    makemore's MLP on 1 thread ran 0.90x-1.16x its speed on 2 in fourteen 300 s searches, and 0.85x in a fifteenth
    (mm19 in docs/benchmarks.md, session 44): that search started on 2 threads, where compile does not pay on this
    machine, and ended with another configuration than the other fourteen's."""
    if threads is None or threads[1] >= threads[0] or len([r for r in perturbed if r.step_time]) != 1:
        return None
    ratio = _other_count_speed(baselines, perturbed)
    if ratio is None or ratio * (1.0 + margin) >= 1.0 or ratio * (1.0 + 2 * margin) < 1.0:
        return None
    return ratio


# how far into the search's first run it looks for other work: beside it that run can take minutes where it takes
# seconds alone (word_language_model's first run beside one busy process: 82-93 s, its steps 16x slower than idle),
# and the search should say why within its first minute, not when the run ends
WATCH_S = 20.0


class FirstRunWatch:
    """Other work on the machine while the search's first run goes, read from outside the run once ``after``
    seconds in (the run's processes are those below the search: ``root``): where it took BUSY_OTHERS processors or
    more, ``note`` says so at once. Called at every poll of the run's wait; reads /proc twice in all."""

    def __init__(self, note: Callable[[str], None], after: float = WATCH_S, root: int | None = None,
                 read: Callable[[int], Reading | None] | None = None, clock: Callable[[], float] = time.monotonic):
        self.note, self.after, self.clock = note, after, clock
        self.root = os.getpid() if root is None else root
        self.read = read or (lambda root: contention.read(root=root))
        self.began: float | None = None
        self.first: Reading | None = None
        self.done = False
        self.seen: dict[str, float] | None = None  # what it read (None: not yet, or nothing to read)

    def __call__(self) -> None:
        if self.done:
            return
        now = self.clock()
        if self.began is None:
            self.began, self.first = now, self.read(self.root)
            return
        if now - self.began < self.after:
            return
        self.done = True
        self.seen = contention.between(self.first, self.read(self.root))
        if self.seen is not None and self.seen["others"] >= BUSY_OTHERS:
            self.note(
                f"warning: other work on this machine is taking {self.seen['others']:.1f} of its "
                f"{self.seen['cores']:.0f} processors while the first run goes ({now - self.began:.0f}s in): runs "
                "beside it measure the machine's load, not the script's speed (a run on more threads than the "
                "processors left free waits for whichever thread is descheduled); stop the other work, or let the "
                "search go on: after its first runs it says what that work did to them")


# a confirmation run whose measured steps lost more than this many processors to other work (or this share of the
# machine's time to the hypervisor) beyond what the machine's runs usually lose is measured again (``disturbed``)
DISTURBED_CORES = 0.5
DISTURBED_STEAL = 0.1


def disturbed(results: Sequence[TrialResult], result: TrialResult) -> str | None:
    """Why ``result``'s time is the machine's more than its configuration's, or None: other work took more than
    DISTURBED_CORES processors (or DISTURBED_STEAL of the hypervisor's time) from its measured steps beyond what
    this machine's runs usually see (their median: a machine that is always this busy disturbs no run more than
    another, and its pairs are compared as they are)."""
    c = result.contention
    seen = [r.contention for r in results if r.contention and r.machine == result.machine and r.measured]
    if not c or len(seen) < 3:
        return None
    others = statistics.median(x["others"] for x in seen)
    steal = statistics.median(x["steal"] for x in seen)
    if c["others"] - others > DISTURBED_CORES:
        return (f"other work on the machine used {c['others']:.1f} of its {c['cores']:.0f} processors during the "
                f"measured steps (its runs usually see {others:.1f}): measured again")
    if c["steal"] - steal > DISTURBED_STEAL:
        return (f"the hypervisor gave {100 * c['steal']:.0f}% of the processors' time to other machines during the "
                f"measured steps (its runs usually see {100 * steal:.0f}%): measured again")
    return None
