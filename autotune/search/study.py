"""The Optuna side of a search: the study in its storage, asking for configurations and recording trials.

Several workers (processes on one machine, or machines) can share one study. They coordinate through the storage
only: each trial says who runs it, on which machine and, for a search trial, which program it measures (its
claim); the earliest trial of a claim measures it and a later one steps aside. A worker that died leaves a trial
running: it is closed as failed by the process check on its own host, by Optuna's heartbeat on a database, or
once it has run far past its own timeout, so that its configuration is measured again.
"""

from __future__ import annotations

import json
import os
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from autotune.errors import UsageError
from autotune.runtime import pid_alive
from autotune.search.machine import host_name
from autotune.inputs import shown
from autotune.search.storage import Storage, StudyDamaged, _first_line, heartbeat_interval, retrying
from autotune.search.space import SearchSpace
from autotune.search.trial import Outcome, TrialResult

ROLE_BASELINE = "baseline"
ROLE_SEARCH = "search"
ROLE_CONFIRM = "confirm"
# the baseline on another number of CPU threads (only the order of floating-point sums changes): how far this
# script's training carries a rounding difference; its losses set the gate's floor, its speed counts nowhere
ROLE_PERTURBED = "perturbed"
# one run of a duel: two configurations whose search runs differ by less than the noise, re-measured in A/B pairs
ROLE_DUEL = "duel"
# a second run of the best candidate so far, whose only run compiled from cold: what each run of its confirmation
# costs with the compiler's caches warm (its speed counts nowhere; its wall sizes the time set aside)
ROLE_REPEAT = "repeat"
# one run of a whole-run pair: the baseline or the confirmed winner run from process start to its own end, with the
# script's own arguments (start-up, compile, evaluation passes and their recompiles all in its wall time)
ROLE_WHOLE = "whole"
# one run of a cache-saving pair: the winner with new, empty compiler caches, without or with the compile cache carried
# to the tuned script loaded first (autotune.search.carried)
ROLE_CACHE = "cache"
ROLE_DUPLICATE = "duplicate"  # the sampler proposed a configuration already measured: its result is reused
ROLE_YIELDED = "yielded"  # another worker claimed the same program first: ended FAIL without running

ATTR_ROLE = "role"
ATTR_RESULT = "result"
ATTR_WORKER = "worker"
ATTR_MACHINE = "machine"
ATTR_CLAIM = "claim"
ATTR_PID = "trial_pid"
ATTR_PROCESSES = "processes"  # the worker's boot and pid namespace: where its process id means something
ATTR_TIMEOUT = "timeout_s"
ATTR_FEASIBLE = "feasible"
ATTR_NOTE = "note"

STUDY_FINGERPRINT = "fingerprint"
STUDY_ABOUT = "search"  # what the study was made from: script, arguments, device, space (autotune report reads it)
# the run lengths [warmup, steps] the first worker fitted to its time budget: every run after the first baselines
STUDY_LENGTHS = "lengths"

STALE_MARGIN_S = 120.0  # without heartbeats: a trial seen running this long past its own timeout lost its worker
UNSTARTED_S = 600.0  # the timeout assumed for a trial whose worker died before starting its process
SETUP_WAIT_S = 10.0  # how long a claim waits for an earlier trial whose worker is still labelling it


def _feasibility(trial) -> tuple[float]:
    """Optuna constraint: <= 0 is feasible. Failed and diverged trials are infeasible, with their data kept."""
    return (0.0 if trial.user_attrs.get(ATTR_FEASIBLE) else 1.0,)


# --- the study -----------------------------------------------------------------------------------------------


def _process_space() -> str:
    """This boot of this kernel and this pid namespace: a worker's pid can be checked only from the same one."""
    parts = []
    for path, read in (("/proc/sys/kernel/random/boot_id", Path.read_text), ("/proc/self/ns/pid", os.readlink)):
        try:
            parts.append(str(read(Path(path))).strip())
        except OSError:
            parts.append("")
    return "/".join(parts)


class StudyStore:
    """One Optuna study holding every trial of a search, shared by every worker that runs the same search."""

    def __init__(self, storage: Storage, name: str, create: bool = True, seed: int = 0, machine: str = "") -> None:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        # Optuna 5 reads constraints set on the trial; older versions ask a constraints_func after each trial
        self._set_constraint = hasattr(optuna.trial.Trial, "set_constraint")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            # constant_liar: a worker's sampler treats the trials other workers are running as poor, not as free
            if self._set_constraint:
                sampler = optuna.samplers.TPESampler(seed=seed, constant_liar=True)
            else:
                sampler = optuna.samplers.TPESampler(seed=seed, constant_liar=True, constraints_func=_feasibility)
        try:
            if create:
                self.study = optuna.create_study(
                    storage=storage.optuna, study_name=name, direction="maximize", sampler=sampler, load_if_exists=True
                )
            else:
                self.study = optuna.load_study(study_name=name, storage=storage.optuna, sampler=sampler)
        except KeyError:
            raise UsageError(f"no study named '{name}' in {storage.description}{_known_studies(storage)}") from None
        except Exception as exc:  # drivers raise their own types (sqlalchemy, a journal file that is not one)
            raise UsageError(f"cannot open study '{name}' in {storage.description}: {_first_line(exc)}") from None
        self.storage = storage
        self.name = name
        self.machine = machine
        self.host = host_name()
        self.worker = f"{self.host}:{os.getpid()}"
        self._processes = _process_space()
        self.space: SearchSpace | None = None
        self._distributions: dict[str, Any] = {}
        self._seen_running: dict[int, float] = {}  # trial number -> when this worker first saw it running
        self._waited: set[int] = set()  # unlabelled trials already waited for once
        self._interval = heartbeat_interval() if storage.heartbeat is not None else None
        self._study_id = storage.heartbeat.get_study_id_from_name(name) if storage.heartbeat is not None else None

    # --- what the study is -------------------------------------------------------------------------------------

    @retrying
    def adopt(self, fingerprint: str, space: SearchSpace, about: Mapping[str, Any]) -> None:
        """Make the study this search's, or check that it is: one script, arguments and settings per study."""
        self.space = space
        self._distributions = space.distributions()
        attrs = self.study.user_attrs
        if attrs.get(STUDY_FINGERPRINT) is None:
            self.study.set_user_attr(STUDY_ABOUT, dict(about))
            self.study.set_user_attr(STUDY_FINGERPRINT, fingerprint)  # last: its presence says the rest is there
            attrs = self.study.user_attrs  # read again: another worker may have made the study at the same moment
        if attrs.get(STUDY_FINGERPRINT) != fingerprint:
            raise UsageError(
                f"study '{self.name}' was made for another script, arguments or settings; "
                "pass another --study-name (or --out) to start a new one"
            )
        if STUDY_ABOUT not in attrs:  # made by an autotune that did not record it yet
            self.study.set_user_attr(STUDY_ABOUT, dict(about))

    @retrying
    def about(self) -> dict[str, Any]:
        """What the study was made from (script, arguments, device, steps...), as ``adopt`` stored it."""
        about = self.study.user_attrs.get(STUDY_ABOUT)
        if not isinstance(about, dict) or STUDY_FINGERPRINT not in self.study.user_attrs:
            raise UsageError(
                f"study '{self.name}' in {self.storage.description} was not made by autotune search "
                "(or by a version that did not record what it searched)"
            )
        return about

    @property
    def fingerprint(self) -> str | None:
        return self.study.user_attrs.get(STUDY_FINGERPRINT)

    @retrying
    def lengths(self) -> tuple[int, int] | None:
        """The run lengths (warmup, steps) the study's runs were fitted to, if a worker fitted them."""
        got = self.study.user_attrs.get(STUDY_LENGTHS)
        if isinstance(got, list) and len(got) == 2 and all(type(x) is int and x > 0 for x in got):
            return got[0], got[1]
        return None

    @retrying
    def fit_lengths(self, warmup: int, steps: int, force: bool = False) -> tuple[int, int]:
        """Record the run lengths fitted to the budget, unless a worker already did (or ``force``): the lengths
        in force."""
        if force or self.lengths() is None:
            self.study.set_user_attr(STUDY_LENGTHS, [warmup, steps])
        return self.lengths() or (warmup, steps)

    # --- reading -----------------------------------------------------------------------------------------------

    @retrying
    def refresh(self) -> tuple[list[TrialResult], set[str]]:
        """Close the trials of dead workers, then: every finished result, and the claims other workers hold now."""
        trials = self.study.get_trials(deepcopy=False)
        if self.recover(trials):
            trials = self.study.get_trials(deepcopy=False)
        return self.results(trials), self._claims(trials)

    @retrying
    def results(self, trials=None) -> list[TrialResult]:
        """Every finished trial's result, in trial order (reused duplicates left out)."""
        from optuna.trial import TrialState

        if trials is None:
            trials = self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        out = []
        for t in trials:
            if t.state is not TrialState.COMPLETE:
                continue
            if t.user_attrs.get(ATTR_ROLE) == ROLE_DUPLICATE or ATTR_RESULT not in t.user_attrs:
                continue
            stored = t.user_attrs[ATTR_RESULT]
            try:
                out.append(TrialResult.from_attrs({**stored, "number": t.number}))
            except (TypeError, ValueError, KeyError, AttributeError) as exc:
                raise StudyDamaged(
                    f"{self.storage.description}: trial {t.number} of study '{self.name}' holds a result autotune cannot "
                    f"read ({type(exc).__name__}: {shown(str(exc))}): the study is damaged; start another with "
                    "--study-name NAME or --out DIR"
                ) from None
        return out

    @retrying
    def hidden(self) -> int:
        """How many sampler proposals repeated a measured program: told the earlier result, not run, not shown."""
        from optuna.trial import TrialState

        trials = self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        return sum(t.user_attrs.get(ATTR_ROLE) == ROLE_DUPLICATE for t in trials)

    @retrying
    def span_s(self) -> float:
        """Seconds from the first finished trial's start to the last one's end, on whichever machines: how long
        the study took, with workers that ran side by side counted once."""
        from optuna.trial import TrialState

        trials = self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL))
        starts = [t.datetime_start for t in trials if t.datetime_start is not None]
        ends = [t.datetime_complete for t in trials if t.datetime_complete is not None]
        return (max(ends) - min(starts)).total_seconds() if starts and ends else 0.0

    def _claims(self, trials) -> set[str]:
        from optuna.trial import TrialState

        return {
            t.user_attrs[ATTR_CLAIM]
            for t in trials
            if t.state is TrialState.RUNNING and ATTR_CLAIM in t.user_attrs and t.user_attrs.get(ATTR_WORKER) != self.worker
        }

    # --- workers that died ---------------------------------------------------------------------------------------

    def recover(self, trials=None) -> int:
        """Close as failed the running trials whose worker is gone, so that their configurations are run again.

        On this host a worker is gone when its process is; elsewhere when its heartbeats stopped (databases), or
        when its trial has been running far longer than its own timeout allows (journal files keep no heartbeat).
        """
        import optuna
        from optuna.trial import TrialState

        if trials is None:
            trials = self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        now = time.monotonic()
        closed = 0
        for t in trials:
            if t.state is not TrialState.RUNNING:
                continue
            worker = str(t.user_attrs.get(ATTR_WORKER, ""))
            if worker == self.worker:
                continue
            whost, _, wpid = worker.rpartition(":")
            # (containers that share the host name, a reboot: the same pid is another process there)
            here = t.user_attrs.get(ATTR_PROCESSES, self._processes) == self._processes
            if whost == self.host and wpid.isdigit() and here:
                # (the trial process itself is gone too: the runtime ends a trial whose search died)
                dead = not pid_alive(int(wpid))
            else:
                seen = self._seen_running.setdefault(t.number, now)
                limit = float(t.user_attrs.get(ATTR_TIMEOUT, UNSTARTED_S))
                dead = now - seen > limit + STALE_MARGIN_S
            if dead:
                closed += self._close(t.number)
        if self.storage.heartbeat is not None:
            before = sum(t.state is TrialState.RUNNING for t in trials)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                optuna.storages.fail_stale_trials(self.study)
            if before:
                closed += before - len(self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)))
        return max(closed, 0)

    def _close(self, number: int) -> int:
        import optuna
        from optuna.trial import TrialState

        try:
            self.study.tell(number, state=TrialState.FAIL, skip_if_finished=True)
        except (optuna.exceptions.UpdateFinishedTrialError, ValueError):
            return 0  # its worker finished it after all, or another worker closed it first
        return 1

    @contextmanager
    def beating(self, trial) -> Iterator[None]:
        """Record ``trial``'s heartbeat while it runs (database storages), so other workers see if this one dies."""
        hb = self.storage.heartbeat
        if hb is None:
            yield
            return
        trial_id = hb.get_trial_id_from_study_id_trial_number(self._study_id, trial.number)
        stop = threading.Event()

        def beat() -> None:
            while True:
                try:
                    hb.record_heartbeat(trial_id)
                except Exception:  # the database is away for a moment: the next beat tries again
                    pass
                if stop.wait(self._interval):
                    return

        thread = threading.Thread(target=beat, name="autotune-heartbeat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    # --- writing -----------------------------------------------------------------------------------------------

    @retrying
    def ask(self, config: Mapping[str, Any] | None):
        """A new running trial of ``config``, or of the sampler's choice when None."""
        import optuna
        from optuna.trial import TrialState

        while True:
            with warnings.catch_warnings():
                # Optuna warns that its heartbeat is meant for Study.optimize: here beating() records it instead
                warnings.simplefilter("ignore")
                if config is None:
                    trial = self.study.ask(self._distributions)
                else:
                    # A sampler that returns the configuration, not enqueue_trial: a queued trial is taken by
                    # whichever worker asks next, so a baseline or confirmation run meant for this machine could
                    # run on another one.
                    base = self.study.sampler
                    self.study.sampler = optuna.samplers.PartialFixedSampler(dict(config), base)
                    try:
                        trial = self.study.ask(self._distributions)
                    finally:
                        self.study.sampler = base
            if ATTR_ROLE not in trial.user_attrs and (config is None or self.params(trial) == dict(config)):
                return trial
            # a trial queued with enqueue_trial (by an autotune before 0.2, or by hand) came back instead of a new
            # one: its role and machine are unknown here, so it is closed unrun
            trial.set_user_attr(ATTR_NOTE, "a queued trial: autotune runs only the trials it asks for")
            self.study.tell(trial, state=TrialState.FAIL)

    def params(self, trial) -> dict[str, Any]:
        assert self.space is not None
        return {k.name: trial.params.get(k.name, k.default) for k in self.space.knobs}

    @retrying
    def label(self, trial, role: str, claim: str | None = None) -> None:
        """Say who runs ``trial``, where, and what it claims; the role last: a trial with a role is labelled."""
        trial.set_user_attr(ATTR_PROCESSES, self._processes)  # before the worker: a pid is never read without it
        trial.set_user_attr(ATTR_WORKER, self.worker)
        trial.set_user_attr(ATTR_MACHINE, self.machine)
        if claim is not None:
            trial.set_user_attr(ATTR_CLAIM, claim)
        trial.set_user_attr(ATTR_ROLE, role)

    @retrying
    def holds(self, trial, claim: str) -> bool:
        """Whether ``trial`` holds ``claim``: no earlier trial, running or finished, claims the same.

        Trial numbers are handed out by the storage one by one, so of two workers that claim the same program at
        once exactly one holds it. An earlier trial that is not labelled yet may be about to claim it: wait.
        """
        from optuna.trial import TrialState

        deadline = time.monotonic() + SETUP_WAIT_S
        while True:
            unlabelled = []
            for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.COMPLETE)):
                if t.number >= trial.number:
                    continue
                if t.user_attrs.get(ATTR_CLAIM) == claim:
                    return False
                if t.state is TrialState.RUNNING and ATTR_ROLE not in t.user_attrs and t.number not in self._waited:
                    unlabelled.append(t.number)
            if not unlabelled:
                return True
            if time.monotonic() > deadline:  # its worker died while labelling it: it claims nothing
                self._waited.update(unlabelled)
                return True
            time.sleep(0.05)

    @retrying
    def step_aside(self, trial) -> None:
        """Another worker claimed the same program first: end this trial unrun."""
        from optuna.trial import TrialState

        trial.set_user_attr(ATTR_ROLE, ROLE_YIELDED)
        self.study.tell(trial, state=TrialState.FAIL)

    @retrying
    def started(self, trial, pid: int, timeout: float) -> None:
        trial.set_user_attr(ATTR_PID, pid)
        trial.set_user_attr(ATTR_TIMEOUT, timeout)

    @retrying
    def record(self, trial, result: TrialResult, value: float) -> int:
        """Tell Optuna a trial's outcome (``value``, feasible only when it passed); the number it is stored under."""
        import optuna

        try:
            self._tell(trial, result, value)
            return trial.number
        except (optuna.exceptions.UpdateFinishedTrialError, ValueError):
            stored = self.study.get_trials(deepcopy=False)[trial.number]
            if not stored.state.is_finished():
                raise
            mine = json.loads(json.dumps(result.to_attrs()))  # as the storage gives it back: lists, not tuples
            if stored.state.name == "COMPLETE" and stored.user_attrs.get(ATTR_RESULT) == mine:
                return trial.number  # this very tell went through before a failed call was made again
        # another worker took this one for dead (a pause longer than the heartbeat grace) and closed the trial:
        # the measurement is still good, so it is kept in a new trial
        again = self.ask(result.config)
        self.label(again, result.role)
        self._tell(again, result, value)
        return again.number

    def _tell(self, trial, result: TrialResult, value: float) -> None:
        trial.set_user_attr(ATTR_ROLE, result.role)
        trial.set_user_attr(ATTR_RESULT, result.to_attrs())
        self._feasible(trial, result.status is Outcome.OK)
        self.study.tell(trial, value)

    @retrying
    def reuse(self, trial, earlier: TrialResult, value: float) -> None:
        """The sampler proposed a configuration already measured: tell it the earlier result (Optuna's FAQ way)."""
        trial.set_user_attr(ATTR_ROLE, ROLE_DUPLICATE)
        trial.set_user_attr("duplicate_of", earlier.number)
        self._feasible(trial, earlier.status is Outcome.OK)
        self.study.tell(trial, value)

    def _feasible(self, trial, feasible: bool) -> None:
        trial.set_user_attr(ATTR_FEASIBLE, feasible)
        if self._set_constraint:
            trial.set_constraint("feasible", 0.0 if feasible else 1.0)

    @retrying
    def abandon(self, trial) -> None:
        """The search was stopped during this trial: FAIL, so a resumed search measures it again."""
        from optuna.trial import TrialState

        self.study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)


def _known_studies(storage: Storage) -> str:
    import optuna

    try:
        names = optuna.get_all_study_names(storage.optuna)
    except Exception:
        return ""
    return f" (it has: {', '.join(sorted(names))})" if names else " (it has no studies)"


def claim_key(*parts: Any) -> str:
    """What a trial claims, as text: (search, program) or (confirm, machine, candidate, pair, arm)."""
    return json.dumps(list(parts))
