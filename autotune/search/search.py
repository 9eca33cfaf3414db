"""The search loop: the baseline first and interleaved, configurations from the study, the winner confirmed."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import signal
import statistics
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from autotune.errors import UsageError
from autotune.bake import bake
from autotune.files import claim_out_dir
from autotune.search.budget import (
    MIN_PAIRS,
    OUTPUT_S,
    RUN_MARGIN,
    SLACK,
    Least,
    first_run_too_long,
    fit,
    run_cost,
)
from autotune.search.gate import Noise, judge, measure_noise
from autotune.search.identity import thread_counts
from autotune.search.live import QuietDisplay
from autotune.search.options import SearchFailed, SearchInterrupted, SearchOptions
from autotune.search.confirm import arms, verdict
from autotune.search.prepare import prepare
from autotune.search.outcome import (
    Confirmation,
    SearchOutcome,
    is_baseline_run,
    local_speedups,
    noise_warning,
    time_spread,
    train_time,
)
from autotune.search.machine import Machine, this_machine
from autotune.search.space import (
    config_key,
)
from autotune.search.strategy import Observation, Plan, label
from autotune.search.storage import open_storage
from autotune.search.study import (
    ROLE_BASELINE,
    ROLE_CONFIRM,
    ROLE_DUEL,
    ROLE_PERTURBED,
    ROLE_SEARCH,
    StudyStore,
)
from autotune.search.trial import Outcome, Runner, TrialResult, TrialSettings, unreached

WORK_NAME = ".work"
LOCK_NAME = ".autotune.lock"
DB_NAME = "study.db"
FIRST_TIMEOUT_S = 600.0  # the first baseline: nothing is known yet about how long the script takes
MIN_TIMEOUT_S = 120.0  # later trials: at least this, and at least TIMEOUT_FACTOR x the slowest baseline
TIMEOUT_FACTOR = 5.0
# a configuration that compiles: inductor's autotuning (max-autotune) ran past 120 s on a small GPT on an H100
COMPILE_MIN_TIMEOUT_S = 900.0
MAX_HOPEFUL = 50  # hopeful configurations looked at (baked) for one not measured yet
MAX_DUPLICATES = 5  # sampler proposals of measured configurations in a row before enumerating instead
MAX_CANDIDATES = 2  # configurations confirmed against the baseline, best first, until one holds
MORE_PAIRS = 3  # while the interval straddles 1.0, pairs are added up to this many times --confirm
NOISY = 0.25  # baseline runs whose step times differ by more than this (relative) make a verdict unreliable
MIN_MARGIN = 0.02  # the descent keeps a change only when it is faster by more than this, or by the noise if larger
MAX_MARGIN = 0.5
COMPILE_GUESS_S = 60.0  # the compile time expected of a first compiling trial, before any was measured
EXPENSIVE_FACTOR = 10.0  # an expensive choice (max-autotune) is expected to compile this many times longer
EXPENSIVE_MIN_S = 300.0
# runs that measured nothing through no fault of the configuration: no evidence either way
WAIT_S = 1.0  # how often a worker looks at the study while other workers finish trials it needs


# --- setting up ----------------------------------------------------------------------------------------------


class _Lock:
    """An exclusive lock on the output folder; the OS drops it when the process dies, so none goes stale."""

    def __init__(self, out: Path) -> None:
        self.path = out / LOCK_NAME
        self.file = open(self.path, "w")
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows: no advisory locks, run one search per folder
            return
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.close()
            raise UsageError(f"{out}: another autotune search is using this output folder") from None

    def release(self) -> None:
        try:
            self.path.unlink()
        except OSError:
            pass
        self.file.close()


# --- the search ------------------------------------------------------------------------------------------------


class Search:
    """One ``autotune search`` run: set up, search, confirm; ``display`` shows progress (see live.py).

    Given ``about`` (what a study was made from), it is set up from that instead, to report on the study.
    """

    def __init__(self, options: SearchOptions, display, about: Mapping[str, Any] | None = None) -> None:
        self.o = options
        self.display = display
        ready = prepare(options, about)
        self.project, self.device, self.launcher, self.patch = ready.project, ready.device, ready.launcher, ready.patch
        self.space, self.strategy, self.out = ready.space, ready.strategy, ready.out
        self.fingerprint, self.study_name = ready.fingerprint, ready.study_name
        self.storage_desc = options.storage or str(self.out / DB_NAME)
        self.mode = "descent"
        self.machine: Machine | None = None  # where this worker runs trials (set when it starts)
        self.results: list[TrialResult] = []
        self.foreign: dict[int | None, list[tuple[str, Any]]] = {}  # study runs left out: trial -> odd knob values
        self._warned = 0.0  # the baseline's time spread the last noise warning said
        self._reported = ""  # the machine ``autotune report`` reports on
        self.threads: tuple[int, int] | None = None  # CPU threads of a run and of the perturbed one (set on CPU)
        self._claims: set[str] = set()  # what other workers are measuring now
        self._taken: set[str] = set()  # of that, the programs (code keys) of search trials
        self._waiting: frozenset[str] = frozenset()
        self._codes: dict[str, str | None] = {}
        self._bake_errors: dict[str, str] = {}
        self.clock = time.monotonic  # (tests put a fake clock and runner here)
        self.runner_factory = Runner
        self.started = self.clock()
        self.deadline = math.inf  # set when the search runs
        self.hard_end = math.inf  # no run goes past this: the deadline and SLACK of the budget, less the outputs' time
        self.lengths = (options.warmup, options.steps)  # of the runs after the first baseline (fitted to the budget)
        self.fit_note: str | None = None  # what fitting the budget gave up
        self.reserved_s: float | None = None
        self.plan: Plan | None = None

    def about(self) -> dict[str, Any]:
        """What the study is made from, stored in it so that ``autotune report`` can rebuild this search."""
        return {
            "script": str(self.o.script.resolve()),
            "args": list(self.o.args),
            "device": self.device,
            "steps": self.o.steps,
            "warmup": self.o.warmup,
            "trials": self.o.trials,
            "time_budget": self.o.budget,
            "confirm": self.o.confirm,
            "rtol": self.o.rtol,
            "seed": self.o.seed,
            "env": dict(self.o.env),
            "launcher": self.o.launcher,
            "space": self.space.describe(),
            "left_out": dict(self.space.left_out),
            "start": {n: self.strategy.start[n] for n in self.strategy.start_order},
            "expensive": {n: [v for m, v in self.strategy.expensive if m == n] for n, _ in self.strategy.expensive},
            "train_steps": self.o.train_steps,
        }

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
        claim_out_dir(self.out)
        lock = _Lock(self.out)
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
            self.store.adopt(self.fingerprint, self.space, self.about())
            self.lengths = self.store.lengths() or self.lengths
            self.runner = self.runner_factory(
                self.patch,
                self.out / WORK_NAME,
                TrialSettings(
                    tuple(self.o.args), Path.cwd(), self.device, self.o.warmup, self.o.steps, env, self.launcher
                ),
            )
            self.runner.resize(*self.lengths)
            self._refresh()
            self.display.begin(self)
            try:
                stopped = self._explore()
                self.reserved_s = self._reserve() if math.isfinite(self.deadline) else None
                confirmations = self._confirm()
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
        self._refresh()  # the other workers' trials that finished meanwhile belong in the outputs too
        winner = next((c for c in confirmations if c.accepted), None)
        return self._outcome(stopped, confirmations, winner, self.machine.key, self.clock() - self.started)

    def report(self, store: StudyStore) -> SearchOutcome:
        """What ``store``'s study found, as a search's outcome, without running anything (``autotune report``)."""
        if store.fingerprint != self.fingerprint:
            raise UsageError(
                f"{self.o.script}: the script (or a module it imports, or autotune itself) changed since study "
                f"'{store.name}' was made; the report needs the code that was searched"
            )
        self.store = store
        self.storage_desc = store.storage.description
        self.lengths = store.lengths() or self.lengths
        self.results = self._admit(store.results())
        if not self.results:
            raise UsageError(f"study '{store.name}' has no finished trials yet")
        self.plan = self.strategy.plan(self.view())
        speeds = {config_key(c): s for c, s in self.candidates()}
        arms: dict[tuple[str, str], dict[tuple[int, str], TrialResult]] = {}
        for r in self.results:
            if r.role == ROLE_CONFIRM:
                key = str(r.attrs.get("candidate"))
                arms.setdefault((r.machine, key), {})[(int(r.attrs.get("pair", -1)), str(r.attrs.get("arm")))] = r
        confirmations = []
        for (machine, key), got in arms.items():
            config = next((r.config for (_, arm), r in got.items() if arm == "candidate"), None)
            if config is not None:  # (a pair stopped before its candidate ran confirms nothing)
                confirmations.append(self._verdict(dict(config), got, None, speeds.get(key), machine))
        accepted = [c for c in confirmations if c.accepted]
        winner = max(accepted, key=lambda c: c.speedup) if accepted else None
        if winner:
            machine = winner.machine
        elif confirmations:
            machine = confirmations[0].machine
        else:  # the machine with the most baseline runs: its noise is the best known
            machine = max(
                (r.machine for r in self.results), key=lambda m: len(self._baselines(m)), default=""
            )
        self._reported = machine
        machines = len({r.machine for r in self.results})
        stopped = f"reported from the study ({len(self.results)} runs on {machines} machine(s); no trial run)"
        return self._outcome(stopped, confirmations, winner, machine, store.span_s(), from_study=True)

    def _outcome(
        self, stopped, confirmations, winner, machine: str, wall_s: float, from_study: bool = False
    ) -> SearchOutcome:
        results = tuple(self._regate(self.results))
        return SearchOutcome(
            options=self.o,
            project=self.project,
            patch=self.patch,
            space=self.space,
            device=self.device,
            results=results,
            reference=self._reference(machine),
            noise=self._noise(machine),
            confirmations=tuple(confirmations),
            winner=winner,
            stopped=stopped,
            wall_s=wall_s,
            study_name=self.study_name,
            storage=self.storage_desc,
            mode=self.mode,
            speedups={**local_speedups(results), **{r.number: r.speedup for r in results if r.speedup and r.measured}},
            machine=machine,
            from_study=from_study,
            plan=self.plan,
            labels={r.number: label(self.canonical(r.config), self.space) for r in results if r.number is not None},
            interactions=self._interactions(winner.config) if winner else (),
            startup=self._startup(winner) if winner else None,
            hidden=self.store.hidden() if hasattr(self, "store") else 0,
            reserved_s=self.reserved_s,
            foreign=dict(self.foreign),
            warning=self._warning(machine),
            lengths=self.lengths,
            fit_note=self.fit_note,
        )

    def _warning(self, machine: str) -> str | None:
        spread = self._noise(machine).time
        if spread is None or spread <= NOISY:
            return None
        return noise_warning(spread, self._all_baselines(machine), self.threads)

    def _interactions(self, config: Mapping[str, Any]) -> tuple[str, ...]:
        """What each knob ``config`` changes is worth to it: what taking the knob out costs, from the A/B pairs that
        compared the two where the search ran them, else from their single runs, with the noise they carry
        (``sdpa.attention=sdpa: worth 1.41x (3 A/B pairs, 1.32x to 1.50x)``)."""
        view = self.view()
        mine = view.observed(config)
        out = []
        for knob in self.space.changed(config):
            without = self.canonical({**config, knob.name: knob.default})
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
                noise = _margin(self._baselines())
                text = (f"worth about {mine.speedup / other.speedup:.2f}x (one run each, with and without it; "
                        f"runs here differ by up to {100 * noise:.0f}%)")
            elif other is not None and not other.ok:
                text = f"needed: without it the run {other.status}"
            else:
                text = "not measured without it (the time ran out before the descent got to it)"
            out.append(f"{knob.name}={config[knob.name]}: {text}")
        return tuple(out)

    def _startup(self, winner: Confirmation) -> str | None:
        """The chosen configuration's one-time start-up beyond the baseline's (compilation) and when it pays off,
        from its A/B pairs: the runs the verdict rests on."""
        runs = [r for r in winner.candidate if r.measured]
        base = [r for r in winner.baseline if r.measured]
        if not runs or not base or not self._compiles(winner.config):
            return None
        w = self.o.warmup
        extra = statistics.median(train_time(r, 0, w) for r in runs) - statistics.median(train_time(b, 0, w) for b in base)
        gain = statistics.median(b.step_time for b in base) - statistics.median(r.step_time for r in runs)
        if extra <= 0:
            return None
        if gain <= 0:
            return f"start-up {extra:.0f}s longer than the baseline's (compilation), and no faster per step"
        steps = math.ceil(extra / gain)
        return (
            f"start-up {extra:.0f}s longer than the baseline's (compilation): it pays for itself after {steps} steps"
            + (f" (your run: {self.o.train_steps})" if self.o.train_steps else "")
        )

    def _refresh(self) -> None:
        """The study as it is now: every worker's finished trials, and what the other workers are measuring."""
        results, self._claims = self.store.refresh()
        self.results = self._admit(results)
        self._taken = {parts[1] for parts in map(json.loads, self._claims) if parts[0] == ROLE_SEARCH}

    def _admit(self, results: list[TrialResult]) -> list[TrialResult]:
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

    def _mine(self, machine: str | None = None) -> str:
        """``machine``, else the one this worker runs on (or, for ``autotune report``, the one it reports on)."""
        if machine is not None:
            return machine
        return self.machine.key if self.machine else self._reported

    def _estimate(self) -> float:
        """Seconds one run of the baseline takes on this machine at the current run lengths (0 before any ran)."""
        walls = [self._scaled(r) for r in self._baselines()] or [self._scaled(r) for r in self.results if r.measured]
        return statistics.median(walls) if walls else 0.0

    def _scaled(self, r: TrialResult) -> float:
        """Seconds ``r``'s run would take at the current run lengths (it may have run before they were fitted)."""
        if not r.measured or not r.step_time or not r.steps_done:
            return r.wall_s
        return run_cost(r.wall_s, r.step_time, r.steps_done).of(*self.lengths)

    def _compiles(self, config: Mapping[str, Any]) -> bool:
        return any(k.compiles and config.get(k.name, k.default) != k.default for k in self.patch.knobs)

    def _cost(self, config: Mapping[str, Any]) -> float:
        """Seconds a run of ``config`` is expected to take: the baseline's, plus its compile time if it compiles."""
        base = self._estimate()
        measured = self.measured().get(self.program(config))
        if measured is not None and measured.wall_s:
            return self._scaled(measured)
        if not self._compiles(config):
            return base
        extra = [self._scaled(r) - base for r in self.results if r.measured and self._compiles(r.config)]
        compile_s = max(max(extra, default=COMPILE_GUESS_S), 0.0)
        if any(self.strategy.is_expensive(n, v) for n, v in config.items()):
            compile_s = max(EXPENSIVE_FACTOR * compile_s, EXPENSIVE_MIN_S)
        return base + compile_s

    def _reserve(self, config: Mapping[str, Any] | None = None) -> float:
        """The time set aside for confirming ``config`` (or the best candidate so far): --confirm A/B pairs, with the
        margin a single run gets (runs vary: makemore's fifth pair was cut by the budget with four of four faster)."""
        if config is None:
            ranked = self.candidates()
            config = ranked[0][0] if ranked else None
        cost = self._cost(config) if config is not None else self._estimate()
        return RUN_MARGIN * self.o.confirm * (self._estimate() + cost)

    def _time_left(self) -> float:
        return self.deadline - self.clock()

    def _timeout(self, config: Mapping[str, Any], reserve: float = 0.0) -> tuple[float, bool]:
        """A run's timeout, and whether the budget set it (shorter than the run's own: --timeout, else 5 times the
        slowest baseline run, at least 120 s, 900 s where it compiles, 600 s for the first run)."""
        if self.o.timeout is not None:
            timeout = self.o.timeout
        else:
            walls = [r.wall_s for r in self._baselines()]
            timeout = max(MIN_TIMEOUT_S, TIMEOUT_FACTOR * max(walls)) if walls else FIRST_TIMEOUT_S
            if self._compiles(config):
                timeout = max(timeout, COMPILE_MIN_TIMEOUT_S)
        if math.isfinite(self.hard_end):  # a run never eats the time set aside for what comes after it
            left = max(self.hard_end - self.clock() - reserve, 1.0)
            if left < timeout:
                return left, True
        return timeout, False

    def affordable(self, config: Mapping[str, Any]) -> bool:
        """Whether the time left covers a run of ``config`` (with a margin: runs vary) and the confirmation."""
        return self._time_left() >= RUN_MARGIN * self._cost(config) + self._reserve()

    def target(self) -> int | None:
        """How many distinct configurations (the baseline included) the study measures at most, by all its workers."""
        return min(self.o.trials, self.space.size) if self.o.trials is not None else None

    def code_key(self, config: Mapping[str, Any]) -> str | None:
        """The hash of the code ``config`` bakes into: configurations that bake alike are one program.

        A knob that only matters with another one (the compile mode's ``dynamic`` while compile is off, persistent
        loader workers without workers) changes nothing in the baked code, so such a configuration is not run
        again. None when the configuration cannot be baked.
        """
        key = config_key(config)
        if key not in self._codes:
            try:
                baked = bake(self.project, config, self.device)
            except Exception as exc:  # a transform bug: the configuration cannot be delivered, so it is not tried
                self._bake_errors[key] = f"{type(exc).__name__}: {exc}"
                self._codes[key] = None
            else:
                h = hashlib.sha256()
                for f in baked.files:
                    h.update(f.rel.as_posix().encode() + b"\0" + f.new_text.encode() + b"\0")
                self._codes[key] = h.hexdigest()
        return self._codes[key]

    def program(self, config: Mapping[str, Any]) -> str:
        """The key that says two configurations are one program (their code, or the configuration itself)."""
        return self.code_key(config) or config_key(config)

    def measured(self) -> dict[str, TrialResult]:
        """The programs already measured on any machine (baseline and search trials): program -> first result."""
        out: dict[str, TrialResult] = {}
        for r in self.results:
            if r.role in (ROLE_BASELINE, ROLE_SEARCH) and r.status is not Outcome.INTERRUPTED:
                out.setdefault(self.program(r.config), r)
        return out

    # noise and the gate: each machine's runs against that machine's baseline runs only

    def _baselines(self, machine: str | None = None) -> list[TrialResult]:
        machine = self._mine(machine)
        return [r for r in self.results if r.role == ROLE_BASELINE and r.measured and r.machine == machine]

    def _reference(self, machine: str | None = None) -> TrialResult | None:
        base = self._baselines(machine)
        return base[0] if base else None

    def _perturbed(self, machine: str | None = None) -> list[TrialResult]:
        machine = self._mine(machine)
        return [r for r in self.results if r.role == ROLE_PERTURBED and r.measured and r.machine == machine]

    def _noise(self, machine: str | None = None) -> Noise:
        """The baseline's noise on ``machine``: in loss from its baseline runs, in time from every run of the
        baseline there (confirmation's baseline arms too)."""
        noise = measure_noise(self._baselines(machine), self._perturbed(machine))
        return replace(noise, time=time_spread([r for r in self._all_baselines(machine)]))

    def _all_baselines(self, machine: str | None = None) -> list[TrialResult]:
        machine = self._mine(machine)
        return [r for r in self.results if is_baseline_run(r) and r.measured and r.machine == machine]

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
        noise = noise or self._noise(result.machine)
        changed = self.space.changed(result.config)
        verdict = judge(result.with_(status=Outcome.OK), ref, changed, noise, self.o.rtol)
        if result.role in (ROLE_BASELINE, ROLE_PERTURBED) or (result.role == ROLE_CONFIRM and not changed):
            return result.with_(deviation=verdict.deviation)  # noise, not judged: no tolerance to show
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

    def _regate(self, results: list[TrialResult]) -> list[TrialResult]:
        """Every trial judged again with the noise measured over the whole study on its machine."""
        noise = {m: self._noise(m) for m in {r.machine for r in results}}
        return [self._gate(r, noise[r.machine]) for r in results]

    def _value(self, result: TrialResult) -> float:
        """What Optuna maximises, and the one speedup every output shows: the run's speed over the median of its
        machine's last 3 baseline runs when it finished (0 when it failed).

        A ratio, not steps/s: the sampler compares trials of every machine, and those differ in speed. With
        ``--train-steps N`` speed is 1 / (time to train N steps), its one-time start-up (compile) included.
        """
        if result.speedup is not None:
            return result.speedup if result.measured else 0.0
        if not result.measured or not result.throughput:
            return 0.0
        base = [r for r in self._baselines(result.machine) if r.throughput and r is not result][-3:]
        ref = statistics.median(self._speed(b) for b in base) if base else 0.0
        return self._speed(result) / ref if ref else 1.0

    def _speed(self, r: TrialResult) -> float:
        """Steps per second, or with --train-steps N, 1 / (start-up + N steps)."""
        if not self.o.train_steps:
            return r.throughput or 0.0
        return 1.0 / train_time(r, self.o.train_steps, self.o.warmup)

    # running one trial

    def _trial(
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
        code = self.code_key(config)
        if role == ROLE_SEARCH:
            claim = _claim(ROLE_SEARCH, self.program(config))
        self.store.label(trial, role, claim)
        if role == ROLE_SEARCH:
            earlier = self.measured().get(self.program(config))
            if earlier is not None:
                self.store.reuse(trial, earlier, self._value(earlier))
                return None
        if claim is not None and not self.store.holds(trial, claim):
            self.store.step_aside(trial)  # another worker measures this program, or already did
            return None
        first = self._reference() is None and role == ROLE_BASELINE
        self.display.trial_started(config, role)
        timeout, cut = self._timeout(config, self._reserve_now)
        if code is None:
            error = f"autotune cannot write this configuration as code: {self._bake_errors[config_key(config)]}"
            result = TrialResult(config=dict(config), role=role, status=Outcome.CRASH, device=self.device, error=error)
        else:
            result = self.runner.run(
                config, role, timeout, on_start=lambda pid: self.store.started(trial, pid, timeout), attrs=attrs
            )
        result = self._trim(result.with_(number=trial.number, host=self.machine.host, device_name=self.machine.device))
        if cut and result.status is Outcome.TIMEOUT:  # the budget ran out, not the run's own time: no measurement
            result = result.with_(
                status=Outcome.INTERRUPTED,
                error=f"stopped after {timeout:.0f}s, where the time budget ends: it measured nothing",
            )
        missed = unreached(result, self.space.changed(result.config)) if role == ROLE_SEARCH else []
        if missed:  # it timed a program without these knobs: reported, never ranked
            result = result.with_(
                status=Outcome.UNREACHED,
                error=f"{', '.join(missed)} never took effect in the run (the code it changes is on a path the "
                "script did not take, or found nothing to act on): it measured the original program",
            )
        if result.measured and result.throughput and role != ROLE_PERTURBED:  # another thread count: no speedup
            result = result.with_(speedup=self._value(result))
        self.results.append(result)  # first, so that a baseline run counts in the noise it is judged with
        result = self.results[-1] = self._gate(result)
        number = self.store.record(trial, result, self._value(result))
        if number != trial.number:
            result = self.results[-1] = result.with_(number=number)
        self.display.trial_finished(result, result.speedup)
        self._watch_noise(result)
        if first and result.status is not Outcome.OK:
            self._baseline_failed(result)
        return result

    def _baseline_failed(self, result: TrialResult) -> None:
        if result.status is Outcome.SHORT:
            raise UsageError(f"{self.o.script}: {result.error}")
        if result.status is Outcome.INTERRUPTED:  # the budget stopped it
            raise first_run_too_long(self.o.budget or 0.0, result.wall_s, self._least())
        tail = "\n".join(result.stderr_tail.strip().splitlines()[-15:])
        self.display.note(f"the unmodified script fails as a trial ({result.status}): {result.error}\n{tail}")
        raise SearchFailed(
            f"{self.o.script}: the baseline (every knob at its default) failed: {result.status}: {result.error}"
        )

    def _wait(self, what: str, keys: set[str]) -> None:
        """Let other workers finish trials this one needs: the study says when (or that their worker died)."""
        if frozenset(keys) != self._waiting:
            self._waiting = frozenset(keys)
            self.display.note(f"waiting for {len(keys)} {what}")
        time.sleep(WAIT_S)
        self._refresh()

    # exploring the space

    def view(self) -> "_View":
        """The study as the strategy sees it (rebuilt after each refresh)."""
        return _View(self)

    def _unmeasured(self) -> dict[str, Any] | None:
        """The first configuration, in the space's order, whose program nobody measured or is measuring."""
        measured = self.measured()
        for c in self.space.configs():
            key = self.program(c)
            if key not in measured and key not in self._taken:
                return c
        return None

    def _explore(self) -> str:
        self._duplicates = 0
        self._reserve_now = 0.0
        target = self.target()
        if self._baselines():  # a resumed study: nothing to do where it has already done what was asked
            if target is not None and len(self.measured()) >= target:
                return f"all {target} configurations already measured (resumed study)"
            self.plan = self.strategy.plan(self.view())
            if self.plan.done and target is None and not self._taken:
                return "the descent had converged (resumed study)"
        # two baselines back to back on a machine new to the study, so its noise is known from the first trial on;
        # one when resuming, as the machine may have changed since
        for _ in range(max(1, 2 - len(self._baselines()))):
            self._trial(self.space.baseline(), ROLE_BASELINE)
            self._fit_budget()
        # on a GPU, runs that agree bit for bit at first drift apart from a step that varies run to run (atomics): where
        # the first two differ, a third back to back, so that the noise floor is not one sample's chance
        if self.device == "cuda" and len(self._baselines()) == 2 and not self._noise().deterministic:
            self._trial(self.space.baseline(), ROLE_BASELINE,
                        {"why": "the first two baseline runs' losses differ: a third measures how far they drift"})
        # on a CPU, where baseline runs agree bit for bit, one more on another number of threads shows how far this
        # script's training carries a rounding difference: the floor of the tolerance of reordering knobs
        if self.threads is not None and not any(r.role == ROLE_PERTURBED and r.machine == self.machine.key
                                                for r in self.results):
            base, other = self.threads
            why = f"the baseline on {other} CPU thread(s) instead of {base}: only the order of sums changes"
            self._trial(self.space.baseline(), ROLE_PERTURBED, {"threads": other, "why": why})
        while True:
            self._refresh()
            measured = len(self.measured())
            if target is not None and measured >= target:
                if target == self.space.size:
                    return f"all {self.space.size} configurations measured"
                return f"trial budget reached ({target} configurations)"
            self.plan = self.strategy.plan(self.view())
            ready = [p for p in (self.plan.ready if self.plan else ()) if self.program(p.config) not in self._taken]
            attrs = {"phase": ready[0].phase, "why": ready[0].why} if ready else {"phase": "sample"}
            config = ready[0].config if ready else None
            if self.plan.done and not ready:
                if self._taken:  # the strategy's last steps are other workers' trials: their results decide
                    self._wait("configuration(s) other workers are measuring", self._taken)
                    continue
                if self.plan.untried:
                    return self._out_of_time(
                        f"{self.plan.untried} knob change(s) on the best configuration were not tried")
                if self.o.trials is None:  # the time left goes to untried configurations that could still win
                    hope = self._hopeful()
                    if hope is None:
                        return self._converged()
                    config, attrs = hope
                    self.mode = "descent, then the untried configurations that could still win"
                else:
                    self.mode = "descent, then sampled"  # --trials asks for more configurations: the sampler picks
            if not ready and not self.plan.done:
                self._wait("configuration(s) other workers are measuring", self._taken)
                continue
            if config is None and (self._duplicates >= MAX_DUPLICATES or self.space.size <= (self.o.trials or 0)):
                config = self._unmeasured()
                if config is None:
                    return f"all {self.space.size} configurations measured ({len(self.measured())} distinct programs)"
            self._reserve_now = self._reserve()
            cost = self._cost(config) if config is not None else self._estimate()
            if self._time_left() < RUN_MARGIN * cost + self._reserve_now:
                return self._out_of_time()
            since = 0
            for r in reversed(self.results):  # this machine's search trials since its last baseline run
                if r.machine != self.machine.key:
                    continue
                if r.role == ROLE_BASELINE:
                    break
                since += r.role == ROLE_SEARCH
            if since >= self.o.baseline_every:
                self._trial(self.space.baseline(), ROLE_BASELINE)
                continue
            if ready and ready[0].duel is not None:
                a, b, pair, arm = ready[0].duel
                keys = [self.program(a), self.program(b)]
                attrs = {"duel": keys, "pair": pair, "arm": arm, "why": ready[0].why}
                self._trial(config, ROLE_DUEL, attrs, _claim(ROLE_DUEL, self.machine.key, *keys, pair, arm))
                continue
            got = self._trial(config, ROLE_SEARCH, attrs)
            self._duplicates = self._duplicates + 1 if got is None and config is None else 0

    def _hopeful(self) -> tuple[dict[str, Any], dict[str, str]] | None:
        """The most hopeful untried configuration the time left covers (see ``StrongStart.hopeful``), with why."""
        measured = self.measured()
        for config in self.strategy.hopeful(self.view(), self.plan.blamed if self.plan else ())[:MAX_HOPEFUL]:
            key = self.program(config)
            if key not in measured and key not in self._taken and self.affordable(config):
                why = "after the descent: an untried configuration the measured knob changes leave hope for"
                return config, {"phase": "hope", "why": why}
        return None

    def _converged(self) -> str:
        left = self._time_left()
        spare = f" ({left:.0f}s of the budget left)" if math.isfinite(left) and left > 0 else ""
        return (
            "the descent converged, and no untried configuration could beat the best by more than the noise: each "
            f"combines knob changes that measured slower, or no faster, wherever they were tried{spare}"
        )

    def _nothing_to_confirm(self) -> bool:
        """Whether the descent stands at the baseline: its steps, ties re-measured in pairs, found nothing faster
        (a single fast run it did not keep is no candidate)."""
        plan = self.plan
        return plan is not None and self.program(plan.incumbent) == self.program(self.space.baseline())

    def _out_of_time(self, untried: str = "") -> str:
        said = f" ({untried})" if untried else ""
        if self.candidates() and not self._nothing_to_confirm():
            return f"time budget reached{said}: the rest is set aside for confirmation"
        return (
            f"time budget reached{said}: the last {max(self._time_left(), 0):.0f}s were kept to confirm a candidate, "
            "and none was faster than the baseline"
        )

    def _least(self) -> Least:
        """The least search that gives a verdict, after the first baseline: the second baseline, the perturbed one
        on a CPU (a third baseline on a GPU whose runs differ), one candidate and the minimum confirmation."""
        return Least(1 + (self.threads is not None or self.device == "cuda"), MIN_PAIRS)

    def _fit_budget(self) -> None:
        """After the first baseline of a new study: fit the run lengths to the time left (shorter runs where the
        least search and a few candidates would not fit), or refuse, before any more time is spent."""
        if not math.isfinite(self.deadline) or len(self._baselines()) != 1 or len(self.results) != 1:
            return
        first = self.results[0]
        cost = run_cost(first.wall_s, first.step_time or 0.0, first.steps_done or sum(self.lengths))
        fitted = fit(self._time_left(), self.clock() - self.started, self.o.budget, cost, *self.lengths, self._least())
        lengths = self.store.fit_lengths(fitted.warmup, fitted.steps)
        if lengths != self.lengths:
            self.lengths = lengths
            self.runner.resize(*lengths)
            self.results = [self._trim(r) for r in self.results]
            self.fit_note = fitted.note if lengths == (fitted.warmup, fitted.steps) else (
                f"runs of {lengths[0]} + {lengths[1]} steps, as the study's first worker fitted them to its budget")
            self.display.note(self.fit_note)

    # confirming the winner

    def candidates(self) -> list[tuple[dict[str, Any], float]]:
        """Configurations that passed the gate and beat the baseline, the strategy's incumbent first, then fastest first.

        Each speedup is against the baseline runs of the machine the configuration ran on; machines are not mixed.
        """
        results = self._regate(self.results)
        best: dict[str, tuple[dict[str, Any], float]] = {}
        baseline_code = self.code_key(self.space.baseline())
        for r in results:
            if r.role != ROLE_SEARCH or r.status is not Outcome.OK or r.number is None:
                continue
            speed = self._value(r)
            key = self.code_key(r.config)
            if key is None or key == baseline_code:
                continue
            if key not in best or speed > best[key][1]:
                best[key] = (self.canonical(r.config), speed)
        ranked = sorted(best.values(), key=lambda cs: -cs[1])
        plan = self.plan
        if plan is not None:  # the strategy's choice leads: the descent weighed the noise, a single fast run did not
            inc = self.code_key(plan.incumbent)
            ranked.sort(key=lambda cs: self.code_key(cs[0]) != inc)
        return [(c, s) for c, s in ranked if s > 1.0]

    def canonical(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """``config`` with every change that bakes to no different code put back to its default.

        (``compile.scope=blocks`` while compile is off, persistent workers without workers: no part of the result.)
        """
        out = dict(config)
        code = self.code_key(out)
        for knob in self.space.changed(out):
            trial = {**out, knob.name: knob.default}
            if self.code_key(trial) == code:
                out = trial
        return out

    def _confirm(self) -> list[Confirmation]:
        out = []
        if self._nothing_to_confirm():
            return out  # the descent, ties re-measured in pairs, found nothing faster: nothing to confirm
        ranked = self.candidates()[:MAX_CANDIDATES]
        for k, (config, search_speedup) in enumerate(ranked):
            if k and self._time_left() < self._reserve(config):
                break  # the time set aside was for the first candidate; a second one runs only if it fits
            c = self._confirm_one(config, search_speedup, (k + 1, len(ranked)), must=k == 0)
            out.append(c)
            if c.accepted:
                break
        return out

    def _arms(self, key: str, machine: str) -> dict[tuple[int, str], TrialResult]:
        return arms(self.results, key, machine)

    def _confirm_one(
        self, config: dict[str, Any], search_speedup: float, which: tuple[int, int] = (1, 1), must: bool = True
    ) -> Confirmation:
        """Measure ``config`` against the baseline in A/B pairs on this machine (a candidate of any machine).

        --confirm measured pairs first (time was set aside for them when ``must``); then, while the interval of the
        median speedup straddles 1.0, more, up to MORE_PAIRS times as many. A pair starts only where it can finish
        inside the budget; one that timed out measured nothing and is run again, as time allows.
        """
        key = config_key(config)
        baseline = self.space.baseline()
        me = self.machine.key
        stopped = None
        limit = self.o.confirm * MORE_PAIRS
        self._reserve_now = 0.0
        j = 0
        while True:
            so_far = self._verdict(config, self._arms(key, me), None, search_speedup, me)
            if so_far.evidence or (len(so_far.ratios) >= self.o.confirm and so_far.settled):
                break
            if j >= limit:
                if len(so_far.ratios) < self.o.confirm:
                    stopped = f"{j} pairs run, {j - len(so_far.ratios)} of them not measured"
                break
            pair_cost = self._estimate() + self._cost(config)
            # the pairs set aside for may use the budget's slack; more than those, or a second candidate, only what
            # is left of the budget itself
            end = self.hard_end if must and len(so_far.ratios) < self.o.confirm else self.deadline
            if self.clock() + pair_cost > end:
                stopped = "the time budget ran out during confirmation"
                break
            order = ("baseline", "candidate") if j % 2 == 0 else ("candidate", "baseline")
            for arm in order:
                self._refresh()
                claim = _claim(ROLE_CONFIRM, me, key, j, arm)
                if (j, arm) in self._arms(key, me) or claim in self._claims:
                    continue  # measured, or being measured by another worker on this machine
                attrs = {"candidate": key, "pair": j, "arm": arm, "of": list(which)}
                shown = max(self.o.confirm, len(so_far.ratios) + 1)
                self.display.confirming(which, min(len(so_far.ratios) + 1, shown), shown, arm)
                self._trial(baseline if arm == "baseline" else config, ROLE_CONFIRM, attrs, claim)
            j += 1
        while not stopped:  # runs of this confirmation that other workers on this machine are measuring
            busy = {c for c in self._claims if json.loads(c)[:3] == [ROLE_CONFIRM, me, key]}
            if not busy:
                break
            if self.clock() > self.hard_end:
                stopped = "the time budget ran out during confirmation"
                break
            self._wait("confirmation run(s) of another worker on this machine", busy)
        return self._verdict(config, self._arms(key, me), stopped, search_speedup, me)

    def _verdict(
        self,
        config: dict[str, Any],
        got: Mapping[tuple[int, str], TrialResult],
        stopped: str | None,
        search_speedup: float | None,
        machine: str,
    ) -> Confirmation:
        return verdict(config, got, stopped, search_speedup, machine, self.o.confirm, self._speed)


class _View:
    """The study as the strategy sees it: each program's first measurement, gated against the whole study's noise."""

    def __init__(self, search: Search) -> None:
        self.s = search
        self.space = search.space
        base_key = search.program(search.space.baseline())
        self._obs: dict[str, Observation] = {}
        self._configs: dict[str, dict[str, Any]] = {}
        for r in search._regate(search.results):
            if r.role not in (ROLE_BASELINE, ROLE_SEARCH) or r.status is Outcome.INTERRUPTED:
                continue  # (a run the end of the budget stopped measured nothing)
            key = search.program(r.config)
            if key in self._obs:
                continue
            self._configs[key] = search.canonical(r.config)
            if key == base_key:
                self._obs[key] = Observation(True, 1.0)
            else:
                ok = r.status is Outcome.OK
                idle = tuple(unreached(r.with_(status=Outcome.OK), search.space.changed(r.config))) \
                    if r.status is Outcome.UNREACHED else ()
                self._obs[key] = Observation(ok, search._value(r) if ok else None, str(r.status), r.error, idle)
        self._threshold = _margin(search._baselines())

    def observed(self, config):
        return self._obs.get(self.s.program(config))

    def canonical(self, config):
        return self.s.canonical(config)

    def same(self, a, b) -> bool:
        return self.s.program(a) == self.s.program(b)

    def threshold(self) -> float:
        return self._threshold

    def affordable(self, config) -> bool:
        return self.s.affordable(config)

    def costly(self, config) -> bool:
        return self.s._compiles(config)

    def measured(self):
        return [(self._configs[k], o) for k, o in self._obs.items()]

    def duel(self, a, b):
        keys = [self.s.program(a), self.s.program(b)]
        me = self.s._mine()
        out: dict[tuple[int, str], float | None] = {}
        for r in self.s.results:
            if r.role == ROLE_DUEL and r.machine == me and r.attrs.get("duel") == keys:
                ok = r.status is Outcome.OK and r.measured
                out[(int(r.attrs.get("pair", 0)), str(r.attrs.get("arm")))] = self.s._speed(r) if ok else None
        return out


def _margin(baselines: list[TrialResult]) -> float:
    """How much faster a change must be to count: twice the spread (standard deviation of log step time) of the
    baseline runs, within [MIN_MARGIN, MAX_MARGIN]."""
    times = [b.step_time for b in baselines if b.step_time]
    if len(times) < 2:
        return MIN_MARGIN
    sd = statistics.stdev(math.log(x) for x in times)
    return min(max(2 * sd, MIN_MARGIN), MAX_MARGIN)


def _claim(*parts: Any) -> str:
    """What a trial claims, as text: (search, program) or (confirm, machine, candidate, pair, arm)."""
    return json.dumps(list(parts))


def _raise_interrupt(signum, frame):  # SIGINT and SIGTERM end a search alike: trials stopped, study kept
    raise KeyboardInterrupt


def run_search(options: SearchOptions, display) -> SearchOutcome:
    """Run a search; the caller writes the outputs (report.write_outputs) from what it returns."""
    return Search(options, display).run()


def report_from_study(storage: str, study_name: str | None, out: Path, script: Path | None = None) -> SearchOutcome:
    """What a study holds, as the outcome of the search that made it, without running a trial (autotune report)."""
    opened = open_storage(storage, must_exist=True)
    name = study_name or _only_study(opened)
    store = StudyStore(opened, name, create=False)
    about = store.about()
    path = script or Path(about["script"])
    if not path.is_file():
        raise UsageError(f"{path}: study '{name}' was made from this script, which is not here (pass --script PATH)")
    options = SearchOptions(
        script=path,
        args=tuple(about["args"]),
        out=out,
        trials=int(about["trials"]) if about.get("trials") is not None else None,
        time_budget=about.get("time_budget"),
        train_steps=about.get("train_steps"),
        steps=int(about["steps"]),
        warmup=int(about["warmup"]),
        device=str(about["device"]),
        storage=storage,
        study_name=name,
        rtol=about.get("rtol"),
        confirm=int(about["confirm"]),
        seed=int(about.get("seed") or 0),
        env=dict(about.get("env") or {}),
        launcher=about.get("launcher"),
    )
    return Search(options, QuietDisplay(), about=about).report(store)


def _only_study(storage) -> str:
    import optuna

    names = optuna.get_all_study_names(storage.optuna)
    if len(names) == 1:
        return names[0]
    if not names:
        raise UsageError(f"{storage.description} holds no study")
    raise UsageError(f"{storage.description} holds several studies: pass --study-name ({', '.join(sorted(names))})")
