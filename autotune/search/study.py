"""The Optuna side of a search: the study in its storage, asking for configurations and recording trials."""

from __future__ import annotations

import os
import socket
import uuid
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from autotune.errors import UsageError
from autotune.search.space import SearchSpace
from autotune.search.trial import Outcome, TrialResult

ROLE_BASELINE = "baseline"
ROLE_SEARCH = "search"
ROLE_CONFIRM = "confirm"
ROLE_DUPLICATE = "duplicate"  # the sampler proposed a configuration already measured: its result is reused

ATTR_ROLE = "role"
ATTR_RESULT = "result"
ATTR_WORKER = "worker"
ATTR_PID = "trial_pid"
ATTR_FEASIBLE = "feasible"
ATTR_TOKEN = "token"


def _feasibility(trial) -> tuple[float]:
    """Optuna constraint: <= 0 is feasible. Failed and diverged trials are infeasible, with their data kept."""
    return (0.0 if trial.user_attrs.get(ATTR_FEASIBLE) else 1.0,)


def storage_from(url: str | None, default_db: Path):
    """An Optuna storage: SQLite in the output folder by default, any RDB URL, or a journal file path."""
    import optuna

    if url is None:
        return f"sqlite:///{default_db.resolve()}"
    if "://" in url:
        return url
    # a plain path: an Optuna journal file (several processes or machines on a shared file system)
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    return JournalStorage(JournalFileBackend(str(Path(url).resolve())))


def _worker() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class StudyStore:
    """One Optuna study holding every trial of a search, so an interrupted search resumes where it stopped."""

    def __init__(self, storage: Any, name: str, fingerprint: str, space: SearchSpace, seed: int = 0) -> None:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.space = space
        # Optuna 5 reads constraints set on the trial; older versions ask a constraints_func after each trial
        self._set_constraint = hasattr(optuna.trial.Trial, "set_constraint")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            if self._set_constraint:
                sampler = optuna.samplers.TPESampler(seed=seed)
            else:
                sampler = optuna.samplers.TPESampler(seed=seed, constraints_func=_feasibility)
        try:
            self.study = optuna.create_study(
                storage=storage, study_name=name, direction="maximize", sampler=sampler, load_if_exists=True
            )
        except Exception as exc:  # drivers raise their own types (sqlalchemy, redis, a bad URL's ValueError)
            raise UsageError(f"cannot open the study storage: {type(exc).__name__}: {str(exc).splitlines()[0]}") from None
        existing = self.study.user_attrs.get("fingerprint")
        if existing is None:
            self.study.set_user_attr("fingerprint", fingerprint)
            self.study.set_user_attr("space", space.describe())
        elif existing != fingerprint:
            raise UsageError(
                f"study '{name}' was made for another script, arguments or settings; "
                "pass another --study-name (or --out) to start a new one"
            )
        self.name = name
        self._distributions = space.distributions()

    # --- reading ---------------------------------------------------------------------------------------------

    def results(self) -> list[TrialResult]:
        """Every finished trial's result, in trial order (reused duplicates left out)."""
        from optuna.trial import TrialState

        out = []
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            if t.user_attrs.get(ATTR_ROLE) == ROLE_DUPLICATE or ATTR_RESULT not in t.user_attrs:
                continue
            out.append(TrialResult.from_attrs({**t.user_attrs[ATTR_RESULT], "number": t.number}))
        return out

    def counts(self) -> dict[str, int]:
        from optuna.trial import TrialState

        states: dict[str, int] = {}
        for t in self.study.get_trials(deepcopy=False):
            key = t.state.name.lower() if t.state is not TrialState.COMPLETE else t.user_attrs.get(ATTR_ROLE, "search")
            states[key] = states.get(key, 0) + 1
        return states

    # --- writing ---------------------------------------------------------------------------------------------

    def recover(self) -> int:
        """Close the trials a killed search of this machine left running (their results never came): FAIL."""
        from optuna.trial import TrialState

        host = socket.gethostname()
        closed = 0
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            worker = str(t.user_attrs.get(ATTR_WORKER, ""))
            whost, _, wpid = worker.rpartition(":")
            # (the trial process itself is gone too: the runtime ends a trial whose search died)
            if whost == host and wpid.isdigit() and int(wpid) != os.getpid() and not _alive(int(wpid)):
                self.study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)
                closed += 1
        return closed

    def ask(self, config: Mapping[str, Any] | None, role: str, attrs: Mapping[str, Any] | None = None):
        """A new trial: ``config`` when given (enqueued first), else the sampler's choice.

        Returns (trial, config, role, attrs). A configuration enqueued by an earlier run that was stopped before
        asking for it comes back first, with the role it was enqueued with: it is run as that.
        """
        token = uuid.uuid4().hex
        if config is not None:
            self.study.enqueue_trial(
                dict(config), user_attrs={ATTR_ROLE: role, ATTR_TOKEN: token, **dict(attrs or {})}, skip_if_exists=False
            )
        trial = self.study.ask(self._distributions)
        trial.set_user_attr(ATTR_WORKER, _worker())
        got = dict(trial.user_attrs)
        role = got.get(ATTR_ROLE, ROLE_SEARCH)
        extra = {k: v for k, v in got.items() if k not in (ATTR_ROLE, ATTR_TOKEN, ATTR_WORKER)}
        params = {k.name: trial.params.get(k.name, k.default) for k in self.space.knobs}
        return trial, params, role, extra

    def started(self, trial, pid: int) -> None:
        trial.set_user_attr(ATTR_PID, pid)

    def record(self, trial, result: TrialResult) -> None:
        """Tell Optuna a trial's outcome: its throughput (0 when it failed), feasible only when it passed."""
        trial.set_user_attr(ATTR_ROLE, result.role)
        trial.set_user_attr(ATTR_RESULT, result.to_attrs())
        self._feasible(trial, result.status is Outcome.OK)
        self.study.tell(trial, float(result.throughput or 0.0) if result.measured else 0.0)

    def reuse(self, trial, earlier: TrialResult) -> None:
        """The sampler proposed a configuration already measured: tell it the earlier result (Optuna's FAQ way)."""
        trial.set_user_attr(ATTR_ROLE, ROLE_DUPLICATE)
        trial.set_user_attr("duplicate_of", earlier.number)
        self._feasible(trial, earlier.status is Outcome.OK)
        self.study.tell(trial, float(earlier.throughput or 0.0) if earlier.measured else 0.0)

    def _feasible(self, trial, feasible: bool) -> None:
        trial.set_user_attr(ATTR_FEASIBLE, feasible)
        if self._set_constraint:
            trial.set_constraint("feasible", 0.0 if feasible else 1.0)

    def abandon(self, trial) -> None:
        """The search was stopped during this trial: FAIL, so a resumed search measures it again."""
        from optuna.trial import TrialState

        self.study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
