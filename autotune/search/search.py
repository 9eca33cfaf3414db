"""The search loop: the baseline first and interleaved, configurations from the study, the winner confirmed."""

from __future__ import annotations

import hashlib
import json
import math
import shlex
import shutil
import signal
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.analysis import RUNTIME_ALIAS, Project, load_project
from autotune.errors import AutotuneError, NoTrainingLoop, UsageError
from autotune.bake import bake, check_out_dir
from autotune.patch import PatchResult, run, select
from autotune.search.gate import Noise, judge, measure_noise
from autotune.search.live import QuietDisplay
from autotune.search.machine import Machine, this_machine
from autotune.search.space import SearchSpace, build_space, config_key, read_space, restore_space
from autotune.search.study import (
    ROLE_BASELINE,
    ROLE_CONFIRM,
    ROLE_SEARCH,
    StudyStore,
    open_storage,
)
from autotune.search.trial import Outcome, Runner, TrialResult, TrialSettings, parse_launcher

WORK_NAME = ".work"
LOCK_NAME = ".autotune.lock"
DB_NAME = "study.db"
FIRST_TIMEOUT_S = 600.0  # the first baseline: nothing is known yet about how long the script takes
MIN_TIMEOUT_S = 120.0  # later trials: at least this, and at least TIMEOUT_FACTOR x the slowest baseline
TIMEOUT_FACTOR = 5.0
# a configuration that compiles: inductor's autotuning (max-autotune) ran past 120 s on a small GPT on an H100
COMPILE_MIN_TIMEOUT_S = 900.0
MAX_DUPLICATES = 5  # sampler proposals of measured configurations in a row before enumerating instead
MAX_CANDIDATES = 2  # configurations confirmed against the baseline, best first, until one holds
WIN_SHARE = 0.8  # share of A/B pairs the winner must win
MIN_GAIN = 0.01  # and its median speedup must be above 1 + this
WAIT_S = 1.0  # how often a worker looks at the study while other workers finish trials it needs


class SearchFailed(AutotuneError):
    """The search could not run: the unmodified script itself fails as a trial."""

    exit_code = 1


class SearchInterrupted(AutotuneError):
    """The user stopped the search; every finished trial is kept in the study."""

    exit_code = 130


@dataclass(frozen=True)
class SearchOptions:
    """Everything ``autotune search`` was asked to do."""

    script: Path
    args: tuple[str, ...] = ()
    out: Path = Path("autotune-out")
    trials: int = 20
    time_budget: float | None = None
    steps: int = 20
    warmup: int = 5
    device: str = "auto"
    storage: str | None = None
    study_name: str | None = None
    space: Path | None = None
    rtol: float | None = None
    timeout: float | None = None
    confirm: int = 5
    baseline_every: int = 4
    seed: int = 0
    env: Mapping[str, str | None] = field(default_factory=dict)  # extra environment for every trial
    launcher: str | None = None  # a command that runs each trial as a distributed job ("torchrun --nproc_per_node=2")


@dataclass(frozen=True)
class Confirmation:
    """A candidate re-measured against the baseline in interleaved A/B pairs."""

    config: Mapping[str, Any]
    ratios: tuple[float, ...]  # candidate throughput / baseline throughput, one per pair where both ran
    accepted: bool
    reason: str
    baseline: tuple[TrialResult, ...] = ()
    candidate: tuple[TrialResult, ...] = ()
    search_speedup: float | None = None
    machine: str = ""  # every pair ran on this machine

    @property
    def speedup(self) -> float | None:
        return statistics.median(self.ratios) if self.ratios else None

    @property
    def spread(self) -> tuple[float, float] | None:
        return (min(self.ratios), max(self.ratios)) if self.ratios else None

    @property
    def wins(self) -> int:
        return sum(r > 1.0 for r in self.ratios)


@dataclass(frozen=True)
class SearchOutcome:
    """What a finished search found: every trial, the noise, the confirmations and the chosen configuration."""

    options: SearchOptions
    project: Project
    patch: PatchResult
    space: SearchSpace
    device: str
    results: tuple[TrialResult, ...]
    reference: TrialResult
    noise: Noise
    confirmations: tuple[Confirmation, ...]
    winner: Confirmation | None  # None: the baseline wins
    stopped: str
    wall_s: float
    study_name: str
    storage: str
    mode: str  # "enumerated" or "sampled"
    speedups: Mapping[int, float]  # trial number -> throughput relative to the same machine's baseline runs around it
    machine: str = ""  # the machine whose baseline runs, noise and confirmation the summary reports
    # True for ``autotune report``: wall_s is then the study's span, first trial start to last trial end
    from_study: bool = False

    @property
    def machines(self) -> tuple[str, ...]:
        """Every machine that ran trials of the study, in order of its first trial."""
        return tuple(dict.fromkeys(r.machine for r in self.results))

    @property
    def chosen(self) -> dict[str, Any]:
        return dict(self.winner.config) if self.winner else self.space.baseline()


# --- setting up ----------------------------------------------------------------------------------------------


def resolve_device(device: str) -> str:
    if device not in ("auto", "cpu", "cuda"):
        raise UsageError(f"--device must be auto, cpu or cuda, not {device!r}")
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: torch sees no CUDA device here")
    return device


def fingerprint(patch: PatchResult, options: SearchOptions, device: str, space: SearchSpace) -> str:
    """What makes measurements comparable: the patched code, the script's arguments, device, steps, space."""
    h = hashlib.sha256()
    for f in patch.files:
        h.update(f.rel.as_posix().encode() + b"\0" + f.new_text.encode() + b"\0")
    doc = {
        "args": list(options.args),
        "device": device,
        "steps": options.steps,
        "warmup": options.warmup,
        "space": space.describe(),
        "env": dict(sorted(options.env.items())),
    }
    if options.launcher:  # (only then, so that studies made before launchers existed still resume)
        doc["launcher"] = shlex.split(options.launcher)
    h.update(json.dumps(doc, sort_keys=True, default=str).encode())
    return h.hexdigest()


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
        if options.warmup < 1 or options.steps < 2:
            raise UsageError("--warmup must be at least 1 and --steps at least 2")
        if options.trials < 1:
            raise UsageError("--trials must be at least 1")
        if options.confirm < 1:
            raise UsageError("--confirm must be at least 1 (pairs of runs that check the winner)")
        if options.time_budget is not None and not (0 < options.time_budget < math.inf):  # nan fails too
            raise UsageError("--time-budget must be a positive number of seconds")
        if options.timeout is not None and not (0 < options.timeout < math.inf):
            raise UsageError("--timeout must be a positive number of seconds")
        if options.rtol is not None and not (0 <= options.rtol < 1):
            raise UsageError("--rtol must be a relative tolerance in [0, 1)")
        self.launcher = parse_launcher(options.launcher) if options.launcher is not None else ()
        self.project = load_project(options.script)
        if not self.project.loops:
            raise NoTrainingLoop(
                f"{options.script}: no training loop found (a loop that calls .backward() and an optimizer's .step()); "
                "autotune search needs one to time training steps and compare losses"
            )
        self.device = str(about["device"]) if about else resolve_device(options.device)
        self.patch = run(self.project, select())
        hook = f"{RUNTIME_ALIAS}.step("
        if not any(hook in f.new_text for f in self.patch.files):
            raise NoTrainingLoop(f"{options.script}: autotune could not place its step hook in the training loop")
        if about:
            self.space = restore_space(self.patch.knobs, self.device, about["space"], about.get("left_out") or {})
        else:
            self.space = build_space(self.patch.knobs, self.device, read_space(self.device, options.space))
        self.out = check_out_dir(options.out, self.project)
        self.fingerprint = fingerprint(self.patch, options, self.device, self.space)
        self.study_name = options.study_name or f"{options.script.stem}-{self.fingerprint[:12]}"
        self.storage_desc = options.storage or str(self.out / DB_NAME)
        self.mode = "enumerated" if self.space.size <= options.trials else "sampled"
        self.machine: Machine | None = None  # where this worker runs trials (set when it starts)
        self.results: list[TrialResult] = []
        self._claims: set[str] = set()  # what other workers are measuring now
        self._taken: set[str] = set()  # of that, the programs (code keys) of search trials
        self._waiting: frozenset[str] = frozenset()
        self._codes: dict[str, str | None] = {}
        self._bake_errors: dict[str, str] = {}
        self.started = time.monotonic()
        self.deadline = self.started + options.time_budget if options.time_budget else math.inf

    def about(self) -> dict[str, Any]:
        """What the study is made from, stored in it so that ``autotune report`` can rebuild this search."""
        return {
            "script": str(self.o.script.resolve()),
            "args": list(self.o.args),
            "device": self.device,
            "steps": self.o.steps,
            "warmup": self.o.warmup,
            "trials": self.o.trials,
            "confirm": self.o.confirm,
            "rtol": self.o.rtol,
            "seed": self.o.seed,
            "env": dict(self.o.env),
            "launcher": self.o.launcher,
            "space": self.space.describe(),
            "left_out": dict(self.space.left_out),
        }

    # --- the parts ---------------------------------------------------------------------------------------------

    def run(self) -> SearchOutcome:
        if self.space.size < 2:
            raise UsageError(
                f"{self.o.script}: nothing to search on {self.device}: no optimization applies to this script"
                + (f" (left out: {', '.join(sorted(self.space.left_out))})" if self.space.left_out else "")
            )
        self.out.mkdir(parents=True, exist_ok=True)
        lock = _Lock(self.out)
        env = dict(self.o.env)
        if self.device == "cpu":
            env.setdefault("CUDA_VISIBLE_DEVICES", "")  # tune for the CPU even where a GPU is present
        previous = signal.getsignal(signal.SIGTERM)
        try:
            signal.signal(signal.SIGTERM, _raise_interrupt)
        except ValueError:  # not the main thread
            previous = None
        self.runner = None
        try:
            storage = open_storage(self.o.storage, self.out / DB_NAME)
            self.storage_desc = storage.description
            self.machine = this_machine(self.device, env)
            self.store = StudyStore(storage, self.study_name, seed=self.o.seed, machine=self.machine.key)
            self.store.adopt(self.fingerprint, self.space, self.about())
            self.runner = Runner(
                self.patch,
                self.out / WORK_NAME,
                TrialSettings(
                    tuple(self.o.args), Path.cwd(), self.device, self.o.warmup, self.o.steps, env, self.launcher
                ),
            )
            self._refresh()
            self.display.begin(self)
            try:
                stopped = self._explore()
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
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            if self.runner is not None:
                self.runner.cleanup()
            else:
                shutil.rmtree(self.out / WORK_NAME, ignore_errors=True)
            lock.release()
        self._refresh()  # the other workers' trials that finished meanwhile belong in the outputs too
        winner = next((c for c in confirmations if c.accepted), None)
        return self._outcome(stopped, confirmations, winner, self.machine.key, time.monotonic() - self.started)

    def report(self, store: StudyStore) -> SearchOutcome:
        """What ``store``'s study found, as a search's outcome, without running anything (``autotune report``)."""
        if store.fingerprint != self.fingerprint:
            raise UsageError(
                f"{self.o.script}: the script (or a module it imports, or autotune itself) changed since study "
                f"'{store.name}' was made; the report needs the code that was searched"
            )
        self.store = store
        self.storage_desc = store.storage.description
        self.results = store.results()
        if not self.results:
            raise UsageError(f"study '{store.name}' has no finished trials yet")
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
            speedups=local_speedups(results),
            machine=machine,
            from_study=from_study,
        )

    def _refresh(self) -> None:
        """The study as it is now: every worker's finished trials, and what the other workers are measuring."""
        self.results, self._claims = self.store.refresh()
        self._taken = {parts[1] for parts in map(json.loads, self._claims) if parts[0] == ROLE_SEARCH}

    # timing and budgets

    def _mine(self, machine: str | None = None) -> str:
        return machine if machine is not None else (self.machine.key if self.machine else "")

    def _estimate(self) -> float:
        walls = [r.wall_s for r in self.results if r.measured and r.machine == self._mine()]
        walls = walls or [r.wall_s for r in self.results if r.measured]
        return statistics.median(walls) if walls else 0.0

    def _time_left(self) -> float:
        return self.deadline - time.monotonic()

    def _timeout(self, config: Mapping[str, Any]) -> float:
        if self.o.timeout is not None:
            return self.o.timeout
        walls = [r.wall_s for r in self._baselines()]
        timeout = max(MIN_TIMEOUT_S, TIMEOUT_FACTOR * max(walls)) if walls else FIRST_TIMEOUT_S
        if any(k.compiles and config.get(k.name, k.default) != k.default for k in self.patch.knobs):
            timeout = max(timeout, COMPILE_MIN_TIMEOUT_S)
        return timeout

    def target(self) -> int:
        """How many distinct configurations (the baseline included) the study measures, by all its workers."""
        return min(self.o.trials, self.space.size)

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
            if r.role in (ROLE_BASELINE, ROLE_SEARCH):
                out.setdefault(self.program(r.config), r)
        return out

    # noise and the gate: each machine's runs against that machine's baseline runs only

    def _baselines(self, machine: str | None = None) -> list[TrialResult]:
        machine = self._mine(machine)
        return [r for r in self.results if r.role == ROLE_BASELINE and r.measured and r.machine == machine]

    def _reference(self, machine: str | None = None) -> TrialResult | None:
        base = self._baselines(machine)
        return base[0] if base else None

    def _noise(self, machine: str | None = None) -> Noise:
        return measure_noise(self._baselines(machine))

    def _gate(self, result: TrialResult, noise: Noise | None = None) -> TrialResult:
        ref = self._reference(result.machine)
        if ref is None or not result.measured or result is ref:
            return result
        noise = noise or self._noise(result.machine)
        changed = self.space.changed(result.config)
        verdict = judge(result.with_(status=Outcome.OK), ref, changed, noise, self.o.rtol)
        if result.role == ROLE_BASELINE or (result.role == ROLE_CONFIRM and not changed):
            return result.with_(deviation=verdict.deviation, tolerance=verdict.tolerance)
        status = Outcome.OK if verdict.passed else Outcome.DIVERGED
        error = None
        if not verdict.passed and math.isnan(verdict.deviation):
            error = "the script's loss is not visible to autotune, so only knobs that change no numerics can be tried"
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
        """What Optuna maximises: throughput over that of the same machine's baseline runs (0 when it failed).

        A ratio, not steps/s: the sampler compares trials of every machine, and those differ in speed.
        """
        if not result.measured or not result.throughput:
            return 0.0
        base = [r.throughput for r in self._baselines(result.machine) if r.throughput]
        return result.throughput / statistics.median(base) if base else 1.0

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
        timeout = self._timeout(config)
        if code is None:
            error = f"autotune cannot write this configuration as code: {self._bake_errors[config_key(config)]}"
            result = TrialResult(config=dict(config), role=role, status=Outcome.CRASH, device=self.device, error=error)
        else:
            result = self.runner.run(
                config, role, timeout, on_start=lambda pid: self.store.started(trial, pid, timeout), attrs=attrs
            )
        result = result.with_(number=trial.number, host=self.machine.host, device_name=self.machine.device)
        self.results.append(result)  # first, so that a baseline run counts in the noise it is judged with
        result = self.results[-1] = self._gate(result)
        number = self.store.record(trial, result, self._value(result))
        if number != trial.number:
            result = self.results[-1] = result.with_(number=number)
        self.display.trial_finished(result, self._speedup_now(result))
        if first and result.status is not Outcome.OK:
            self._baseline_failed(result)
        return result

    def _speedup_now(self, result: TrialResult) -> float | None:
        base = [r.throughput for r in self._baselines(result.machine)[-3:] if r.throughput]
        if not result.measured or not base or not result.throughput:
            return None
        return result.throughput / statistics.median(base)

    def _baseline_failed(self, result: TrialResult) -> None:
        if result.status is Outcome.SHORT:
            raise UsageError(f"{self.o.script}: {result.error}")
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

    def _unmeasured(self, limit: int | None = None) -> dict[str, Any] | None:
        """The first configuration, in the space's order, whose program nobody measured or is measuring."""
        measured = self.measured()
        for i, c in enumerate(self.space.configs()):
            if limit is not None and i >= limit:
                return None
            key = self.program(c)
            if key not in measured and key not in self._taken:
                return c
        return None

    def _next_config(self) -> tuple[dict[str, Any] | None, bool]:
        """(configuration to run, or None to let the sampler choose; whether no configuration is left to run)."""
        if self.mode == "enumerated" or self._duplicates >= MAX_DUPLICATES:
            c = self._unmeasured()
            return c, c is None
        # sampled: each knob alone first (informative start-up trials for TPE), then the sampler
        singles = 1 + sum(len(self.space.choices[k.name]) - 1 for k in self.space.knobs)
        return self._unmeasured(limit=singles), False

    def _explore(self) -> str:
        self._duplicates = 0
        if len(self.measured()) >= self.target() and self._baselines():
            return f"all {self.target()} configurations already measured (resumed study)"
        # two baselines back to back on a machine new to the study, so its noise is known from the first trial on;
        # one when resuming, as the machine may have changed since
        for _ in range(max(1, 2 - len(self._baselines()))):
            self._trial(self.space.baseline(), ROLE_BASELINE)
        while True:
            self._refresh()
            measured = len(self.measured())
            if measured >= self.target():
                if self.target() == self.space.size:
                    return f"all {self.space.size} configurations measured"
                return f"trial budget reached ({self.target()} configurations)"
            reserve = self.o.confirm * 2 * self._estimate()
            if self._time_left() < self._estimate() + reserve:
                return "time budget reached"
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
            config, exhausted = self._next_config()
            if self._taken and (exhausted or measured + len(self._taken) >= self.target()):
                # the rest is being measured by other workers: wait, as a configuration whose worker dies is free again
                self._wait("configuration(s) other workers are measuring", self._taken)
                continue
            if exhausted:
                return (
                    f"all {self.space.size} configurations measured "
                    f"({len(self.measured())} distinct programs: the others bake to the same code)"
                )
            got = self._trial(config, ROLE_SEARCH)
            self._duplicates = self._duplicates + 1 if got is None else 0

    # confirming the winner

    def candidates(self) -> list[tuple[dict[str, Any], float]]:
        """Configurations that passed the gate and beat the baseline runs around them, fastest first.

        Each speedup is against the baseline runs of the machine the configuration ran on; machines are not mixed.
        """
        results = self._regate(self.results)
        speed = local_speedups(results)
        best: dict[str, tuple[dict[str, Any], float]] = {}
        baseline_code = self.code_key(self.space.baseline())
        for r in results:
            if r.role != ROLE_SEARCH or r.status is not Outcome.OK or r.number not in speed:
                continue
            key = self.code_key(r.config)
            if key is None or key == baseline_code:
                continue
            if key not in best or speed[r.number] > best[key][1]:
                best[key] = (self.canonical(r.config), speed[r.number])
        ranked = sorted(best.values(), key=lambda cs: -cs[1])
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
        for config, search_speedup in self.candidates()[:MAX_CANDIDATES]:
            c = self._confirm_one(config, search_speedup)
            out.append(c)
            if c.accepted:
                break
        return out

    def _arms(self, key: str, machine: str) -> dict[tuple[int, str], TrialResult]:
        """The confirmation runs of candidate ``key`` on ``machine``: (pair, arm) -> result."""
        got = {}
        for r in self.results:
            if r.role == ROLE_CONFIRM and r.attrs.get("candidate") == key and r.machine == machine:
                got[(int(r.attrs.get("pair", -1)), str(r.attrs.get("arm")))] = r
        return got

    def _confirm_one(self, config: dict[str, Any], search_speedup: float) -> Confirmation:
        """Measure ``config`` against the baseline in A/B pairs on this machine (a candidate of any machine)."""
        key = config_key(config)
        baseline = self.space.baseline()
        me = self.machine.key
        stopped = None
        for j in range(self.o.confirm):
            order = ("baseline", "candidate") if j % 2 == 0 else ("candidate", "baseline")
            for arm in order:
                self._refresh()
                claim = _claim(ROLE_CONFIRM, me, key, j, arm)
                if (j, arm) in self._arms(key, me) or claim in self._claims:
                    continue  # measured, or being measured by another worker on this machine
                if self._time_left() < self._estimate():
                    stopped = "the time budget ran out during confirmation"
                    break
                attrs = {"candidate": key, "pair": j, "arm": arm}
                self._trial(baseline if arm == "baseline" else config, ROLE_CONFIRM, attrs, claim)
            if stopped:
                break
        while not stopped:  # runs of this confirmation that other workers on this machine are measuring
            busy = {c for c in self._claims if json.loads(c)[:3] == [ROLE_CONFIRM, me, key]}
            if not busy:
                break
            if self._time_left() < 0:
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
        """Whether the A/B pairs ``got`` confirm ``config``: faster in most pairs, beyond the noise."""
        ratios, base_runs, cand_runs, failed = [], [], [], []
        for j in range(self.o.confirm):
            b, c = got.get((j, "baseline")), got.get((j, "candidate"))
            if c is not None:
                cand_runs.append(c)
                if c.status is not Outcome.OK:
                    failed.append(c)
            if b is not None:
                base_runs.append(b)
            if b is not None and c is not None and b.measured and c.status is Outcome.OK:
                ratios.append(c.throughput / b.throughput)
        pairs = self.o.confirm
        need = math.ceil(WIN_SHARE * pairs)
        median_ratio = statistics.median(ratios) if ratios else None
        if failed:
            accepted, reason = False, f"not reproducible: a confirmation run ended {failed[0].status} ({failed[0].error})"
        elif stopped and len(ratios) < pairs:
            accepted, reason = False, f"{stopped} ({len(ratios)} of {pairs} pairs measured)"
        elif len(ratios) < pairs:
            accepted, reason = False, f"only {len(ratios)} of {pairs} pairs could be measured"
        else:
            wins = sum(r > 1.0 for r in ratios)
            accepted = wins >= need and median_ratio > 1.0 + MIN_GAIN
            reason = (
                f"faster in {wins} of {pairs} A/B pairs, median speedup {median_ratio:.3f}x"
                + ("" if accepted else f" (needs {need} of {pairs} and above {1 + MIN_GAIN:.2f}x: within the noise)")
            )
        return Confirmation(
            config, tuple(ratios), accepted, reason, tuple(base_runs), tuple(cand_runs), search_speedup, machine
        )


def _claim(*parts: Any) -> str:
    """What a trial claims, as text: (search, program) or (confirm, machine, candidate, pair, arm)."""
    return json.dumps(list(parts))


def is_baseline_run(r: TrialResult) -> bool:
    """A run of the baseline: the search's own baseline runs and the baseline arms of confirmation pairs."""
    return r.role == ROLE_BASELINE or (r.role == ROLE_CONFIRM and r.attrs.get("arm") == "baseline")


def local_speedups(results) -> dict[int, float]:
    """Each measured non-baseline trial's throughput over that of its machine's baseline runs just before and after."""
    machines: dict[str, list[TrialResult]] = {}
    for r in results:
        machines.setdefault(r.machine, []).append(r)
    out = {}
    for order in machines.values():
        base_pos = [i for i, r in enumerate(order) if is_baseline_run(r) and r.measured]
        for i, r in enumerate(order):
            if is_baseline_run(r) or not r.measured or r.number is None:
                continue
            before = [p for p in base_pos if p < i][-1:]
            after = [p for p in base_pos if p > i][:1]
            near = [order[p].step_time for p in before + after]
            if near and r.step_time:
                out[r.number] = statistics.mean(near) / r.step_time
    return out


def _raise_interrupt(signum, frame):  # SIGTERM ends a search the way Ctrl-C does: trials stopped, study kept
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
        trials=int(about["trials"]),
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
