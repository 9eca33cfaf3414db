"""``autotune report``: what a study holds, as the outcome of the search that made it, without running a trial."""

from __future__ import annotations

from pathlib import Path

from autotune.errors import UsageError
from autotune.search.live import QuietDisplay
from autotune.search.options import SearchOptions
from autotune.search.outcome import SearchOutcome
from autotune.search.search import Search
from autotune.search.carried import arms as saving_arms, judge as judge_saving
from autotune.search.confirm import rejections
from autotune.search.whole import arms as whole_arms, judge as judge_whole, kept
from autotune.search.space import config_key
from autotune.search.storage import open_storage
from autotune.search.study import ROLE_CONFIRM, StudyStore
from autotune.search.trial import TrialResult


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
        lengthen=bool(about.get("lengthen", False)),
        device=str(about["device"]),
        storage=storage,
        study_name=name,
        rtol=about.get("rtol"),
        confirm=int(about["confirm"]),
        whole_runs=int(about.get("whole_runs") or 0),
        seed=int(about.get("seed") or 0),
        env=dict(about.get("env") or {}),
        launcher=about.get("launcher"),
    )
    return study_outcome(Search(options, QuietDisplay(), about=about), store)


def study_outcome(s: Search, store: StudyStore) -> SearchOutcome:
    """What ``store``'s study found, as a search's outcome, without running anything (``autotune report``)."""
    if store.fingerprint != s.fingerprint:
        raise UsageError(
            f"{s.o.script}: the script (or a module it imports, or autotune itself) changed since study "
            f"'{store.name}' was made; the report needs the code that was searched"
        )
    s.store = store
    s.storage_desc = store.storage.description
    s.lengths = store.lengths() or s.lengths
    s.results = s.admit(store.results())
    if not s.results:
        raise UsageError(f"study '{store.name}' has no finished trials yet")
    # the plan as the search that confirmed last saw it: its machine's duels and rejected candidates
    confirmed = [r.machine for r in s.results if r.role == ROLE_CONFIRM]
    s.reported = confirmed[-1] if confirmed else s.reported
    s.rejected = rejections(s)
    s.plan = s.strategy.plan(s.view())
    speeds = {config_key(c): speed for c, speed in s.candidates()}
    arms: dict[tuple[str, str], dict[tuple[int, str], TrialResult]] = {}
    for r in s.results:
        if r.role == ROLE_CONFIRM:
            key = str(r.attrs.get("candidate"))
            arms.setdefault((r.machine, key), {})[(int(r.attrs.get("pair", -1)), str(r.attrs.get("arm")))] = r
    confirmations = []
    for (machine, key), got in arms.items():
        config = next((r.config for (_, arm), r in got.items() if arm == "candidate"), None)
        if config is not None:  # (a pair stopped before its candidate ran confirms nothing)
            c = s.verdict_of(dict(config), got, None, speeds.get(key), machine)
            runs = whole_arms(s.results, key, machine)
            ran = len({j for j, _ in runs})
            fewer = f"{ran} of the {s.o.whole_runs} pairs asked" if 0 < ran < s.o.whole_runs else None
            confirmations.append(kept(c, judge_whole(runs, s.train_steps, fewer)) if runs else c)
    accepted = [c for c in confirmations if c.accepted]
    winner = max(accepted, key=lambda c: c.speedup) if accepted else None
    if winner:
        machine = winner.machine
    elif confirmations:
        machine = confirmations[0].machine
    else:  # the machine with the most baseline runs: its noise is the best known
        machine = max((r.machine for r in s.results), key=lambda m: len(s.baselines(m)), default="")
    s.reported = machine
    machines = len({r.machine for r in s.results})
    stopped = f"reported from the study ({len(s.results)} runs on {machines} machine(s); no trial run)"
    saving = judge_saving(runs) if winner and (runs := saving_arms(s.results, config_key(winner.config), machine)) else None
    return s.outcome_of(stopped, confirmations, winner, machine, store.span_s(), from_study=True, saving=saving)


def _only_study(storage) -> str:
    import optuna

    names = optuna.get_all_study_names(storage.optuna)
    if len(names) == 1:
        return names[0]
    if not names:
        raise UsageError(f"{storage.description} holds no study")
    raise UsageError(f"{storage.description} holds several studies: pass --study-name ({', '.join(sorted(names))})")
