"""The search loop: the baseline first and interleaved, configurations from the study, the winner confirmed."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import signal
import statistics
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from autotune.errors import UsageError
from autotune.knobs import Role
from autotune.knobs import compiles as knobs_compile
from autotune.files import OutDirLock, claim_out_dir
from autotune.contention import BUSY_OTHERS
from autotune.search.budget import (
    MIN_PAIRS,
    RUN_MARGIN,
    OUTPUT_S,
    SLACK,
    BudgetTooSmall,
    Least,
    first_run_too_long,
    run_cost,
    run_lengths,
)
from autotune.search.costs import NOISY, Costs
from autotune.search.crowd import Crowd, FirstRunWatch, crowd, disturbed
from autotune.search.credit import knob_worth, startup, whole_run
from autotune.search.gate import Noise, gated, measure_noise
from autotune.search.identity import Programs, thread_counts
from autotune.search.options import SearchFailed, SearchInterrupted, SearchOptions
from autotune.search.confirm import confirm_candidates, rejections, verdict
from autotune.search.explore import explore, explore_more
from autotune.search.prepare import prepare
from autotune.search.outcome import (
    CacheSaving,
    Confirmation,
    SearchOutcome,
    is_baseline_run,
    local_speedups,
    neighbour_noise,
    noise_warning,
    time_spread,
    train_time,
)
from autotune.search.machine import Machine, this_machine
from autotune.search.space import config_key, same_value
from autotune.search.strategy import Plan, label
from autotune.search.view import StudyView
from autotune.search.carried import WITH as CACHE_WITH, measure as measure_saving
from autotune.search.whole import measure as measure_whole
from autotune.compile_cache import CACHE_NAME, CACHES_NAME
from autotune.search.storage import open_storage
from autotune.search.study import (
    ROLE_BASELINE,
    ROLE_CACHE,
    ROLE_CONFIRM,
    ROLE_PERTURBED,
    ROLE_SEARCH,
    ROLE_WHOLE,
    StudyStore,
    claim_key,
)
from autotune.isolate import PYTHON, IsolationError
from autotune.search.trial import (
    Outcome,
    Runner,
    TrialResult,
    TrialSettings,
    probe_isolation,
    protected,
    unreached,
)

WORK_NAME = ".work"
LOCK_NAME = ".autotune.lock"
DB_NAME = "study.db"
# a configuration that compiles: inductor's autotuning (max-autotune) ran past 120 s on a small GPT on an H100
WAIT_S = 1.0  # how often a worker looks at the study while other workers finish trials it needs


# --- the search ------------------------------------------------------------------------------------------------




class Search:
    """One ``autotune search`` run: set up, search, confirm; ``display`` shows progress (see live.py).

    Given ``about`` (what a study was made from), it is set up from that instead, to report on the study.
    """

    def __init__(self, options: SearchOptions, display, about: Mapping[str, Any] | None = None) -> None:
        self.o = options
        self.display = display
        self.ready = ready = prepare(options, about)
        self.project, self.device, self.launcher, self.patch = ready.project, ready.device, ready.launcher, ready.patch
        self.space, self.strategy, self.out = ready.space, ready.strategy, ready.out
        self.fingerprint, self.study_name = ready.fingerprint, ready.study_name
        self.storage_desc = options.storage or str(self.out / DB_NAME)
        self.mode = "descent"
        self.isolation: str | None = None  # how trials are kept off the user's files, in words (set when it runs)
        self._refused = False  # the search refused after making its output folder: the folder goes
        self._length_run: TrialResult | None = None  # the baseline run that read the user's run's length
        self.machine: Machine | None = None  # where this worker runs trials (set when it starts)
        self.results: list[TrialResult] = []
        self.foreign: dict[int | None, list[tuple[str, Any]]] = {}  # study runs left out: trial -> odd knob values
        self._warned = 0.0  # the baseline's time spread the last noise warning said
        self.reported = ""  # the machine ``autotune report`` reports on
        self.threads: tuple[int, int] | None = None  # CPU threads of a run and of the perturbed one (set on CPU)
        self.claims: set[str] = set()  # what other workers are measuring now
        self.taken: set[str] = set()  # of that, the programs (code keys) of search trials
        self._waiting: frozenset[str] = frozenset()
        self.programs = Programs(self.project, self.device, self.space)  # which configurations bake alike
        self.clock = time.monotonic  # (tests put a fake clock and runner here)
        self.runner_factory = Runner
        self.started = self.clock()
        self.deadline = math.inf  # set when the search runs
        self.hard_end = math.inf  # no run goes past this: the deadline and SLACK of the budget, less the outputs' time
        self.lengths = (options.warmup, options.steps)  # of the runs after the first baseline (fitted to the budget)
        self.fit_note: str | None = None  # what fitting the budget gave up, or why runs were lengthened
        self._asked: tuple[int, int] | None = None  # the lengths asked for, while runs run lengthened beyond them
        self.reserved_s: float | None = None
        self.plan: Plan | None = None
        self.costs = Costs(self)  # time accounting: run costs, the time set aside, the time left, timeouts
        self.reserve_now = 0.0  # the time the run starting now must leave for what comes after it
        # programs this machine's A/B pairs did not confirm -> the speedup the pairs measured (confirm.rejections),
        # which the descent goes on from in place of their single search runs
        self.rejected: dict[str, float] = {}

    # --- the parts ---------------------------------------------------------------------------------------------

    def run(self) -> SearchOutcome:
        if self.space.size < 2:
            raise UsageError(
                f"{self.o.script}: nothing to search on {self.device}: no optimization applies to this script"
                + (f" (left out: {', '.join(sorted(self.space.left_out))})" if self.space.left_out else "")
            )
        self.started = self.clock()
        self.deadline = self.started + self.o.budget if self.o.budget else math.inf
        self.hard_end = self.deadline + SLACK * self.o.budget - OUTPUT_S if self.o.budget else math.inf
        # a storage of the user's is opened first: one it refuses leaves nothing behind, not even the output folder
        storage = open_storage(self.o.storage) if self.o.storage is not None else None
        settings = TrialSettings(tuple(self.o.args), Path.cwd(), self.device, self.o.warmup, self.o.steps, {},
                                 self.launcher, self.o.isolation, (self.project.root,))
        self.isolation = self._isolation(settings)  # before anything is written: a refusal leaves nothing
        # a folder this search makes (or finds empty) for its own study: where the search refuses, it goes again
        fresh = self.o.storage is None and (not self.out.exists() or not any(self.out.iterdir()))
        claim_out_dir(self.out)
        lock = OutDirLock(self.out, LOCK_NAME)
        env = dict(self.o.env)
        if self.device == "cpu":
            env.setdefault("CUDA_VISIBLE_DEVICES", "")  # tune for the CPU even where a GPU is present
        # Ctrl-C and SIGTERM stop the search with its study kept, even where SIGINT came in ignored (a shell's
        # background job): Python installs its own SIGINT handler only where the signal was not ignored
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            for sig in previous:
                signal.signal(sig, _raise_interrupt)
        except ValueError:  # not the main thread
            previous = {}
        self.runner = None
        self.threads = thread_counts(env, bool(self.launcher)) if self.device == "cpu" else None
        try:
            storage = storage or open_storage(None, self.out / DB_NAME)
            self.storage_desc = storage.description
            self.machine = this_machine(self.device, env)
            self.store = StudyStore(storage, self.study_name, seed=self.o.seed, machine=self.machine.key)
            self.store.adopt(self.fingerprint, self.space, self.ready.about(self.o))
            self.lengths = self.store.lengths() or self.lengths
            self.runner = self.runner_factory(self.patch, self.out / WORK_NAME, replace(settings, env=env))
            self.runner.resize(*self.lengths)
            self.refresh()
            self.rejected = rejections(self)  # a resumed study's: its search goes on from them
            self.display.begin(self)
            try:
                stopped = explore(self)
                confirmations: list[Confirmation] = []
                while True:
                    self.reserved_s = self.costs.confirm_reserve() if math.isfinite(self.deadline) else None
                    got = [measure_whole(self, c) if c.accepted else c for c in confirm_candidates(self)]
                    confirmations += got
                    if any(c.accepted for c in got) or not self._search_again(got):
                        break
                    stopped = explore_more(self)
                saving = measure_saving(self, next((c for c in confirmations if c.accepted), None))
            except UsageError:  # a refusal (the budget too small for one run, a script too short): nothing written
                self._refused = fresh
                raise
            except KeyboardInterrupt:
                done = len(self.store.results())
                raise SearchInterrupted(
                    f"interrupted: {done} finished trial(s) kept in {self.storage_desc} "
                    f"(study '{self.study_name}'); run the same command again to resume"
                ) from None
            finally:
                self.display.end()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if self.runner is not None:
                self.runner.cleanup()
            else:
                shutil.rmtree(self.out / WORK_NAME, ignore_errors=True)
            lock.release()
            if self._refused:
                shutil.rmtree(self.out, ignore_errors=True)
        self.refresh()  # the other workers' trials that finished meanwhile belong in the outputs too
        winner = next((c for c in confirmations if c.accepted), None)
        return self.outcome_of(stopped, confirmations, winner, self.machine.key, self.clock() - self.started,
                             saving=saving)

    def _isolation(self, settings: TrialSettings) -> str:
        """How trials are kept off the user's files, in words for the header; a UsageError where the overlay was
        asked for (the default) and this machine refuses it."""
        folders = ", ".join(dict.fromkeys(str(f.resolve()) for f in protected(settings)))
        if settings.isolation == PYTHON:
            return (f"Python's own writes only (--isolation python): a shell, a subprocess or C code a run starts "
                    f"writes straight into {folders}")
        try:
            cost = probe_isolation(protected(settings))
        except IsolationError as exc:
            raise UsageError(
                f"trials cannot be isolated from your files here ({exc.strerror or exc}): pass --isolation python to "
                "run them with only Python's own writes kept off your files"
            ) from None
        return f"each run sees {folders} as an overlay in a private mount namespace (+{cost:.2f}s a run)"

    def outcome_of(
        self, stopped, confirmations, winner, machine: str, wall_s: float, from_study: bool = False,
        saving: CacheSaving | None = None,
    ) -> SearchOutcome:
        results = tuple(self.regate(self.results))
        return SearchOutcome(
            options=self.o,
            project=self.project,
            patch=self.patch,
            space=self.space,
            device=self.device,
            results=results,
            reference=self._reference(machine),
            noise=self.noise(machine),
            confirmations=tuple(confirmations),
            winner=winner,
            stopped=stopped,
            wall_s=wall_s,
            study_name=self.study_name,
            storage=self.storage_desc,
            mode=self.mode,
            speedups={**{r.number: r.speedup for r in results if r.speedup and r.measured}, **self.settled()},
            machine=machine,
            from_study=from_study,
            isolation=self.isolation,
            plan=self.plan,
            labels={r.number: label(self.programs.canonical(r.config), self.space) for r in results if r.number is not None},
            interactions=knob_worth(self.view(), self.space, winner.config) if winner else (),
            startup=startup(winner, self.compiles(winner.config), self.o.warmup, self.train_steps) if winner else None,
            whole_run=whole_run(winner, self.train_steps, self.o.warmup) if winner else None,
            compile_cache=self.cache_path(winner.config) if winner else None,
            cache_saving=saving,
            run_length=self.run_length_note(),
            hidden=self.store.hidden() if hasattr(self, "store") else 0,
            reserved_s=self.reserved_s,
            foreign=dict(self.foreign),
            warning="; ".join(w for w in (self._warning(machine), self._crowd_note(winner)) if w) or None,
            lengths=self.lengths,
            fit_note=self.fit_note,
        )

    def _warning(self, machine: str) -> str | None:
        spread = self.noise(machine).time
        if spread is None or spread <= NOISY:
            return None
        return noise_warning(spread, self._all_baselines(machine), self.threads)

    def refresh(self) -> None:
        """The study as it is now: every worker's finished trials, and what the other workers are measuring."""
        results, self.claims = self.store.refresh()
        self.results = self.admit(results)
        self.taken = {parts[1] for parts in map(json.loads, self.claims) if parts[0] == ROLE_SEARCH}

    def admit(self, results: list[TrialResult]) -> list[TrialResult]:
        """The study's results whose configuration is one of this space's; the others (a value that is not one of
        a knob's choices: a study others can write to) are kept aside, for the report to name, and never ranked."""
        kept = []
        for r in results:
            odd = self.space.foreign(r.config)
            if odd:
                self.foreign[r.number] = odd
            else:
                kept.append(self._trim(r))
        return kept

    def _trim(self, r: TrialResult) -> TrialResult:
        """A run longer than the current run lengths (a first baseline, before they were fitted to the budget)
        compared on the steps every run has: its losses cut to that many. Step i is the same training step in every
        run, so the gate compares like with like."""
        total = sum(self.lengths)
        if r.steps_done > total and len(r.losses) == r.steps_done:
            return r.with_(losses=r.losses[:total])
        return r

    # timing and budgets

    def compiles(self, config: Mapping[str, Any]) -> bool:
        return knobs_compile(self.patch.knobs, config)

    def mine(self, machine: str | None = None) -> str:
        """``machine``, else the one this worker runs on (or, for ``autotune report``, the one it reports on)."""
        if machine is not None:
            return machine
        return self.machine.key if self.machine else self.reported

    def target(self) -> int | None:
        """How many distinct configurations (the baseline included) the study measures at most, by all its workers."""
        return min(self.o.trials, self.space.size) if self.o.trials is not None else None

    def measured(self) -> dict[str, TrialResult]:
        """The programs already measured on any machine (baseline and search trials): program -> first result."""
        out: dict[str, TrialResult] = {}
        for r in self.results:
            if r.role in (ROLE_BASELINE, ROLE_SEARCH) and r.status is not Outcome.INTERRUPTED:
                out.setdefault(self.programs.program(r.config), r)
        return out

    # noise and the gate: each machine's runs against that machine's baseline runs only

    def baselines(self, machine: str | None = None) -> list[TrialResult]:
        machine = self.mine(machine)
        return [r for r in self.results
                if r.role == ROLE_BASELINE and r.measured and r.machine == machine and self._whole(r)]

    def _whole(self, r: TrialResult) -> bool:
        """Whether ``r`` timed as many steps as the runs do now: in a study whose runs were lengthened beyond the
        asked ones (see ``_fit_lengths``), its first baseline run timed fewer, and is neither the gate's reference
        nor noise."""
        return self.lengths[1] <= self.o.steps or not r.step_times or len(r.step_times) >= self.lengths[1]

    def _reference(self, machine: str | None = None) -> TrialResult | None:
        base = self.baselines(machine)
        return base[0] if base else None

    def perturbed(self, machine: str | None = None) -> list[TrialResult]:
        machine = self.mine(machine)
        return [r for r in self.results
                if r.role == ROLE_PERTURBED and r.measured and r.machine == machine and self._whole(r)]

    def noise(self, machine: str | None = None) -> Noise:
        """The baseline's noise on ``machine``: in loss from its baseline runs, in time from every run of the
        baseline there (confirmation's baseline arms too)."""
        noise = measure_noise(self.baselines(machine), self.perturbed(machine))
        runs = self._all_baselines(machine)
        return replace(noise, time=time_spread(runs), time_local=neighbour_noise(runs))

    def _all_baselines(self, machine: str | None = None) -> list[TrialResult]:
        machine = self.mine(machine)
        return [r for r in self.results if is_baseline_run(r) and r.measured and r.machine == machine and self._whole(r)]

    def _watch_noise(self, result: TrialResult) -> None:
        """Say at once when this machine's baseline runs disagree in time beyond NOISY, with the likely cause."""
        if not is_baseline_run(result) or not result.measured:
            return
        runs = self._all_baselines()
        spread = time_spread(runs)
        if spread is None or spread <= NOISY or spread <= self._warned * 1.25:
            return
        self._warned = spread
        self.display.note(f"warning: {noise_warning(spread, runs, self.threads)}")

    def _gate(self, result: TrialResult, noise: Noise | None = None) -> TrialResult:
        ref = self._reference(result.machine)
        if ref is None or not result.measured or result is ref:
            return result
        changed = self.space.changed(result.config)
        judged = not (result.role in (ROLE_BASELINE, ROLE_PERTURBED) or (result.role == ROLE_CONFIRM and not changed))
        return gated(result, ref, changed, noise or self.noise(result.machine), self.o.rtol, judged)

    def regate(self, results: list[TrialResult]) -> list[TrialResult]:
        """Every trial judged again with the noise measured over the whole study on its machine."""
        noise = {m: self.noise(m) for m in {r.machine for r in results}}
        return [self._gate(r, noise[r.machine]) for r in results]

    def value_of(self, result: TrialResult) -> float:
        """What Optuna maximises and the live display shows: the run's speed over the median of its machine's last 3
        baseline runs when it finished (0 when it failed). The descent and the report use ``settled``, which also
        has the baseline run after it.

        A ratio, not steps/s: the sampler compares trials of every machine, and those differ in speed. With
        ``--train-steps N`` speed is 1 / (time to train N steps), its one-time start-up (compile) included.
        """
        if result.speedup is not None:
            return result.speedup if result.measured else 0.0
        if not result.measured or not result.throughput:
            return 0.0
        base = [r for r in self.baselines(result.machine) if r.throughput and r is not result][-3:]
        ref = statistics.median(self.speed_of(b) for b in base) if base else 0.0
        return self.speed_of(result) / ref if ref else 1.0

    def settled(self) -> dict[int, float]:
        """Each measured run's speedup against this machine's baseline runs nearest it in time, the one before it and
        the one after it where the search has run that (``outcome.local_speedups``), by the time of the user's run
        with --train-steps. What the descent decides by and the report shows; a run's own value (``value_of``) is
        what was known when it finished."""
        runs = [r for r in self.results if not is_baseline_run(r) or self._whole(r)]
        return local_speedups(runs, lambda r: 1.0 / max(self.speed_of(r), 1e-12))

    def speed_of(self, r: TrialResult) -> float:
        """Steps per second, or with --train-steps N, 1 / (start-up + N steps)."""
        steps = self.train_steps
        if not steps:
            return r.throughput or 0.0
        return 1.0 / train_time(r, steps, self.o.warmup)

    @property
    def train_steps(self) -> int | None:
        """The length of the user's whole run in optimizer steps: --train-steps, else as the first baseline run on
        this machine read it (the framework's own count, the loops' lengths as they started); None: unknown."""
        if self.o.train_steps:
            return self.o.train_steps
        found = self.found_length()
        return found.run_steps if found is not None else None

    def found_length(self) -> TrialResult | None:
        """The first baseline run on this machine that said how long the user's run is (or why it cannot)."""
        if self._length_run is None:
            key = self.machine.key if self.machine is not None else None  # (autotune report: any machine's)
            self._length_run = next((r for r in self.results if is_baseline_run(r) and key in (None, r.machine)
                                     and r.run_steps_from is not None), None)
        return self._length_run

    def run_length_note(self) -> str | None:
        """What the search ranked by, in words: the user's whole run (its length and where it comes from) or
        steady-state speed (and why)."""
        if self.o.train_steps:
            return f"your run: {self.o.train_steps} optimizer steps (--train-steps), ranked by its whole time, compile included"
        found = self.found_length()
        if found is None:
            return None
        if found.run_steps is None:
            return (f"your run's length is not known ({found.run_steps_from}): ranked by steady-state speed; "
                    "--train-steps N ranks by the time of an N-step run, compile included")
        return (f"your run: {found.run_steps} optimizer steps ({found.run_steps_from}), ranked by its whole time, "
                "compile included")

    # running one trial

    def run_trial(
        self,
        config: Mapping[str, Any] | None,
        role: str,
        attrs: Mapping[str, Any] | None = None,
        claim: str | None = None,
    ) -> TrialResult | None:
        """Run one trial (``config`` None: the sampler's choice); None when it was not run: measured or claimed."""
        trial = self.store.ask(config)
        try:
            with self.store.beating(trial):
                return self._run(trial, role, attrs, claim)
        except BaseException:
            self.store.abandon(trial)
            raise

    def _run(self, trial, role: str, attrs: Mapping[str, Any] | None, claim: str | None) -> TrialResult | None:
        config = self.store.params(trial)
        code = self.programs.code_key(config)
        if role == ROLE_SEARCH:
            claim = claim_key(ROLE_SEARCH, self.programs.program(config))
        self.store.label(trial, role, claim)
        if role == ROLE_SEARCH:
            earlier = self.measured().get(self.programs.program(config))
            if earlier is not None:
                self.store.reuse(trial, earlier, self.value_of(earlier))
                return None
        if claim is not None and not self.store.holds(trial, claim):
            self.store.step_aside(trial)  # another worker measures this program, or already did
            return None
        first = self._reference() is None and role == ROLE_BASELINE
        self.display.trial_started(config, role)
        timeout, cut = self.costs.timeout(config, self.reserve_now, to_end=role == ROLE_WHOLE)
        cache = self._cache_of(config, role, attrs)
        if code is None:
            error = f"autotune cannot write this configuration as code: {self.programs.bake_errors[config_key(config)]}"
            result = TrialResult(config=dict(config), role=role, status=Outcome.CRASH, device=self.device, error=error)
        else:
            more: dict[str, Any] = {"whole": True} if role == ROLE_WHOLE else {}
            if first:  # its length is not known yet: other work that starves it is said while it runs
                more["watch"] = FirstRunWatch(self.display.note)
            if role == ROLE_CACHE:  # a first run on a fresh machine, the tuned script's carried cache loaded or not
                more["fresh_caches"] = True
                if (attrs or {}).get("arm") == CACHE_WITH:
                    more["load_cache"] = self.cache_path(config)
            if cache is not None:
                more["compile_cache"] = (self.out / WORK_NAME / CACHE_NAME).resolve()
                more["compile_cache"].parent.mkdir(parents=True, exist_ok=True)
                more["compile_cache"].unlink(missing_ok=True)
            result = self.runner.run(
                config, role, timeout, on_start=lambda pid: self.store.started(trial, pid, timeout), attrs=attrs,
                **more,
            )
            if cache is not None and result.status is Outcome.OK and more["compile_cache"].is_file():
                cache.parent.mkdir(exist_ok=True)
                os.replace(more["compile_cache"], cache)  # the latest run's: the caches as warm as they get
        result = self._trim(result.with_(number=trial.number, host=self.machine.host, device_name=self.machine.device))
        if cut and result.status is Outcome.TIMEOUT:  # the budget ran out, not the run's own time: no measurement
            result = result.with_(
                status=Outcome.INTERRUPTED,
                error=f"stopped after {timeout:.0f}s, where the time budget ends: it measured nothing",
            )
        if role == ROLE_CONFIRM and result.status is Outcome.OK and (why := disturbed(self.results, result)):
            result = result.with_(status=Outcome.DISTURBED, error=why)  # its pair counts neither way: another runs
        missed = unreached(result, self.space.changed(result.config)) if role == ROLE_SEARCH else []
        if missed:  # it timed a program without these knobs: reported, never ranked
            result = result.with_(
                status=Outcome.UNREACHED,
                error=f"{', '.join(missed)} never took effect in the run (the code it changes is on a path the "
                "script did not take, or found nothing to act on): it measured the original program",
            )
        if result.measured and result.throughput and role != ROLE_PERTURBED:  # another thread count: no speedup
            result = result.with_(speedup=self.value_of(result))
        self.results.append(result)  # first, so that a baseline run counts in the noise it is judged with
        result = self.results[-1] = self._gate(result)
        number = self.store.record(trial, result, self.value_of(result))
        if number != trial.number:
            result = self.results[-1] = result.with_(number=number)
        self.display.trial_finished(result, result.speedup)
        if first and self._length_run is None and self.found_length() is not None and not self.o.train_steps:
            self.display.note(self.run_length_note())  # read by the first run: every value after it uses it
        self.costs.count_overhead(result)
        self._watch_noise(result)
        if first and result.status is not Outcome.OK:
            self._baseline_failed(result)
        return result

    def crowd(self) -> Crowd | None:
        """What other work did to this machine's first runs (None: nothing that took processors from their steps)."""
        return crowd(self.baselines(), self.perturbed(), self.threads)

    def thread_knob(self) -> str | None:
        """The name of the knob this space searches that sets the CPU thread count (its role), if any."""
        return next((k.name for k in self.space.knobs if k.role is Role.THREADS), None)

    def _crowd_note(self, winner: Confirmation | None) -> str | None:
        """Where the winner sets the thread knob to the count a crowded machine favoured: that it holds here."""
        c = self.crowd()
        if winner is None or c is None or not c.favours_few:
            return None
        knob = self.thread_knob()
        value = winner.config.get(knob) if knob else None
        if knob is None or same_value(value, self.space.baseline()[knob]):
            return None
        return c.verdict_note(knob, value)

    def _cache_of(self, config: Mapping[str, Any], role: str, attrs: Mapping[str, Any] | None) -> Path | None:
        """Where this run keeps what it compiled, for the tuned script (None: it keeps nothing): the confirmation's
        and the whole runs' candidate arms of a configuration that compiles."""
        if role not in (ROLE_CONFIRM, ROLE_WHOLE) or (attrs or {}).get("arm") != "candidate":
            return None
        return self.cache_path(config)

    def cache_path(self, config: Mapping[str, Any]) -> Path | None:
        """The file the candidate runs of ``config`` leave their compiled artifacts in (None: it compiles nothing,
        or carrying caches is off)."""
        if not self.o.compile_cache or not self.compiles(config):
            return None
        digest = hashlib.sha256(config_key(config).encode()).hexdigest()[:16]
        return self.out / CACHES_NAME / f"{digest}.bin"

    def _baseline_failed(self, result: TrialResult) -> None:
        if result.status is Outcome.SHORT and self._asked is not None:  # the script ends before the longer runs do
            self._set_lengths(self._asked, (
                f"runs kept at {self._asked[0]} + {self._asked[1]} steps: the script ended after {result.steps_done} "
                f"steps, before the {sum(self.lengths)} of the lengthened runs (more iterations after -- would let "
                "it time longer ones)"), force=True)
            self._asked = None
            return
        if result.status is Outcome.SHORT:
            raise UsageError(f"{self.o.script}: {result.error}")
        if result.status is Outcome.INTERRUPTED:  # the budget stopped it
            raise first_run_too_long(self.o.budget or 0.0, result.wall_s, self._least())
        tail = "\n".join(result.stderr_tail.strip().splitlines()[-15:])
        self.display.note(f"the unmodified script fails as a trial ({result.status}): {result.error}\n{tail}")
        raise SearchFailed(
            f"{self.o.script}: the baseline (every knob at its default) failed: {result.status}: {result.error}"
        )

    def wait_for(self, what: str, keys: set[str]) -> None:
        """Let other workers finish trials this one needs: the study says when (or that their worker died)."""
        self.costs.waited = True  # (time spent waiting for other workers is not this worker's overhead)
        if frozenset(keys) != self._waiting:
            self._waiting = frozenset(keys)
            self.display.note(f"waiting for {len(keys)} {what}")
        time.sleep(WAIT_S)
        self.refresh()

    # exploring the space

    def view(self) -> StudyView:
        """The study as the strategy sees it (rebuilt after each refresh)."""
        return StudyView(self)

    def nothing_to_confirm(self) -> bool:
        """Whether the descent stands at the baseline: its steps, ties re-measured in pairs, found nothing faster
        (a single fast run it did not keep is no candidate)."""
        plan = self.plan
        return plan is not None and self.programs.program(plan.incumbent) == self.programs.program(self.space.baseline())

    def _least(self) -> Least:
        """The least search that gives a verdict, after the first baseline: the second baseline, the perturbed one
        on a CPU (a third baseline on a GPU whose runs differ), one candidate and the minimum confirmation."""
        return Least(1 + (self.threads is not None or self.device == "cuda"), MIN_PAIRS)

    def fit_lengths(self) -> bool:
        """After the first baseline of a new study: the run lengths for the rest of it (``budget.run_lengths``;
        never longer where the user set --steps or --warmup). True where the runs grew: the first run is then too
        short to be the gate's reference."""
        if len(self.baselines()) != 1 or len(self.results) != 1:
            return False
        first = self.results[0]
        cost = run_cost(first.wall_s, first.step_time or 0.0, first.steps_done or sum(self.lengths))
        left = self.costs.time_left() if math.isfinite(self.deadline) else None
        asked = self.lengths
        try:
            got = run_lengths(cost, *asked, self.o.lengthen and not self.o.train_steps, self._least(), left,
                              self.clock() - self.started, self.o.budget or 0.0, first.run_steps)
        except BudgetTooSmall as exc:  # where other work slowed the first run, the refusal says so
            if first.others is None or first.others < BUSY_OTHERS:  # (others is read from its contention)
                raise
            raise BudgetTooSmall(
                f"{exc}; other work on this machine took {first.others:.1f} of its {first.contention['cores']:.0f} "
                "processors from that run's steps, so it ran at the machine's load, not the script's speed: stop "
                "the other work and search again (a run on more threads than the processors left free waits for "
                "whichever thread is descheduled)") from None
        self._set_lengths((got.warmup, got.steps), got.note)
        if sum(self.lengths) <= sum(asked):
            return False
        self._asked = asked
        return True

    def _set_lengths(self, lengths: tuple[int, int], note: str | None, force: bool = False) -> None:
        """Run the study's next runs at ``lengths`` (the ones another worker of the study fitted win, unless
        ``force``: this worker found the script too short for its own longer ones)."""
        got = self.store.fit_lengths(*lengths, force=force)
        if got == self.lengths:
            return
        self.lengths = got
        self.runner.resize(*got)
        self.results = [self._trim(r) for r in self.results]
        self.fit_note = note if got == lengths else (
            f"runs of {got[0]} + {got[1]} steps, as the study's first worker fitted them to its budget")
        if self.fit_note:
            self.display.note(self.fit_note)

    # confirming the winner

    def _search_again(self, got: list[Confirmation]) -> bool:
        """After candidates ``got`` were confirmed and none held, whether the search goes on: where their A/B pairs
        measured each of them no faster (``confirm.rejections``; not a failed run, nor a slower whole run, whose cost
        no search run sees), with the time left for a run and the least confirmation after it. The descent then goes
        on from what the pairs measured. A search stopped with time unspent where its one candidate lost its pairs:
        karpathy/ng-video-lecture's gpt.py at 300 s confirmed the descent's first step (1.18x in one run, 0.97x in 5
        pairs) and ended with 117 s left and 7 knob changes untried."""
        if not got or any(c.evidence or (c.whole is not None and c.whole.pairs) for c in got):
            return False
        self.rejected = rejections(self)
        if not all(self.programs.program(c.config) in self.rejected for c in got):
            return False
        need = RUN_MARGIN * self.costs.baseline_cost() + self.costs.least_reserve()
        if self.costs.time_left() < need:
            return False
        names = "; ".join(label(c.config, self.space) for c in got)
        self.display.note(f"not confirmed: {names}; the search goes on from what its A/B pairs measured, with the "
                          f"{self.costs.time_left():.0f}s left")
        return True

    def candidates(self) -> list[tuple[dict[str, Any], float]]:
        """Configurations that passed the gate and beat the baseline, the strategy's incumbent first, then fastest first.

        Each speedup is against the baseline runs of the machine the configuration ran on; machines are not mixed.
        """
        results = self.regate(self.results)
        settled = self.settled()
        best: dict[str, tuple[dict[str, Any], float]] = {}
        baseline_code = self.programs.code_key(self.space.baseline())
        for r in results:
            if r.role != ROLE_SEARCH or r.status is not Outcome.OK or r.number is None:
                continue
            speed = settled.get(r.number, self.value_of(r))
            key = self.programs.code_key(r.config)
            if key is None or key == baseline_code or self.programs.program(r.config) in self.rejected:
                continue  # (a candidate its pairs did not confirm is no candidate any more)
            if key not in best or speed > best[key][1]:
                best[key] = (self.programs.canonical(r.config), speed)
        ranked = sorted(best.values(), key=lambda cs: -cs[1])
        plan = self.plan
        if plan is not None:  # the strategy's choice leads: the descent weighed the noise, a single fast run did not
            inc = self.programs.code_key(plan.incumbent)
            ranked.sort(key=lambda cs: self.programs.code_key(cs[0]) != inc)
        return [(c, s) for c, s in ranked if s > 1.0]

    def verdict_of(
        self,
        config: dict[str, Any],
        got: Mapping[tuple[int, str], TrialResult],
        stopped: str | None,
        search_speedup: float | None,
        machine: str,
    ) -> Confirmation:
        return verdict(config, got, stopped, search_speedup, machine, self.o.confirm, self.speed_of)


def _raise_interrupt(signum, frame):  # SIGINT and SIGTERM end a search alike: trials stopped, study kept
    raise KeyboardInterrupt


def run_search(options: SearchOptions, display) -> SearchOutcome:
    """Run a search; the caller writes the outputs (report.write_outputs) from what it returns."""
    return Search(options, display).run()
