"""Every choice of every knob: the baked script trains exactly like the patched script set to that choice, and the
knobs the patched run reports as applied are exactly those whose value changes the baked text.

The two forms of a knob (the runtime helper a gated edit calls, and the plain code ``autotune bake`` writes) live in
the knob's transform module; this is what keeps them the same. Each choice is covered once, by the first fixture
script below that reads its knob. Within one fixture, round ``i`` sets every knob it covers to its ``i``-th choice
other than the default, so a fixture costs as many patched and baked runs as its knob with the most choices has.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from dist_probe import run_dist_probe
from loss_probe import probe, run_probe

from autotune.project import load_project
from autotune.bake import bake
from autotune.knob_table import KNOBS
from autotune.patch import run, select, write_outputs
from autotune.runtime import TRIAL_ENV

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "fixtures" / "scripts"
PROBE_ENV = {"OMP_NUM_THREADS": "1"}
STEPS = 4

# (fixture, its arguments, ranks, the knob prefixes it may cover: None for any). Compiling costs 10-60 s a run on
# CPU: compile's choices are covered on the smallest script only, and the distributed fixtures cover only the knobs
# of their wrappers. After these, every transform case whose .bake.yaml says it trains (``train: {args: [...]}``)
# covers its own transform's knobs: a new transform brings its own training case, and nothing here changes.
SCRIPT_FIXTURES = (
    (SCRIPTS / "cnn.py", ("--num-samples", "96", "--batch-size", "16"), 1, None),
    (SCRIPTS / "char_gpt.py", (), 1, None),
    (REPO / "fixtures" / "search" / "tiny.py", ("--iters", "8"), 1, ("compile.",)),
    (SCRIPTS / "ddp_accum.py", (), 2, ("ddp.", "no_sync.")),
    (SCRIPTS / "ddp_step.py", (), 2, ("ddp.",)),  # static_graph: left out where no_sync skips all-reduces
    (SCRIPTS / "fsdp_train.py", (), 2, ("fsdp.",)),
)


def _training_cases() -> tuple:
    cases = []
    for spec_path in sorted((REPO / "fixtures" / "transforms").glob("*/*.bake.yaml")):
        train = (yaml.safe_load(spec_path.read_text()) or {}).get("train")
        if train is not None:
            script = spec_path.with_name(spec_path.name.replace(".bake.yaml", ".in.py"))
            args, ranks = tuple(train.get("args", ())), int(train.get("ranks", 1))
            cases.append((script, args, ranks, (spec_path.parent.name + ".",)))
    return tuple(cases)


FIXTURES = SCRIPT_FIXTURES + _training_cases()
# Choices no CPU fixture can run, and why; every other choice of every knob is covered (a test checks it).
NOT_ON_CPU = {
    ("hf_trainer.tf32", True): "TrainingArguments refuses tf32=True without an Ampere or newer GPU",
}
# Knobs whose choices are compared elsewhere, and where.
ELSEWHERE = {
    "nccl_env.": "test_transform_nccl_env.py::test_the_patched_script_sets_what_the_baked_one_writes: the variables "
    "are compared, every choice (NCCL reads them only on CUDA, gloo never)",
}
ONE_CHOICE = {"zero_grad.set_to_none": "nothing to bake"}


def _later_choices(knob) -> list:
    return [c for c in knob.choices if c != knob.default and (knob.name, c) not in NOT_ON_CPU]


def _plan() -> list[tuple[Path, tuple[str, ...], int, list[dict]]]:
    """For each fixture: its rounds, each a config of the knobs it is the first to cover."""
    covered: set[str] = set()
    plan = []
    for script, args, ranks, prefixes in FIXTURES:
        names = [k.name for k in run(load_project(script), select()).knobs]
        mine = [KNOBS[n] for n in names if n not in covered and (prefixes is None or n.startswith(prefixes))]
        if prefixes is None:
            mine = [k for k in mine if not k.name.startswith("compile.")]
        covered.update(k.name for k in mine)
        choices = {k.name: _later_choices(k) for k in mine}
        count = max(map(len, choices.values()), default=0)
        rounds = [{n: cs[i] for n, cs in choices.items() if i < len(cs)} for i in range(count)]
        plan.append((script, args, ranks, rounds))
    return plan


PLAN = _plan()


def _id(script: Path) -> str:
    return script.name.removesuffix(".in.py").removesuffix(".py")


def test_every_choice_of_every_knob_is_covered():
    covered = {(name, value) for *_, rounds in PLAN for config in rounds for name, value in config.items()}
    missing = [
        (k.name, c)
        for k in KNOBS.values()
        for c in k.choices
        if c != k.default and (k.name, c) not in covered and (k.name, c) not in NOT_ON_CPU
        and not k.name.startswith(tuple(ELSEWHERE))
    ]
    assert missing == []
    assert all(len(KNOBS[name].choices) == 1 for name in ONE_CHOICE)


def _write_baked(script: Path, config: dict, dest: Path) -> Path:
    baked = bake(load_project(script), config, "cpu")
    assert baked.changed, config
    for f in baked.files:
        path = dest / f.rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f.new_text)
    return dest / baked.files[0].rel


def _config(path: Path, knobs: dict) -> Path:
    path.write_text(yaml.safe_dump({"device": "cpu", "knobs": knobs}))
    return path


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, args, rounds, i",
    [
        pytest.param(s, a, rounds, i, id=f"{_id(s)}-{i}")
        for s, a, ranks, rounds in PLAN
        if ranks == 1
        for i in range(len(rounds))
    ],
)
def test_baked_trains_like_patched_at_every_choice(script, args, rounds, i, tmp_path):
    config = rounds[i]
    patched = run(load_project(script), select())
    write_outputs(patched, tmp_path / "patched", script.name)
    entry = _write_baked(script, config, tmp_path / "baked")
    env = {**PROBE_ENV, "AUTOTUNE_CONFIG": str(_config(tmp_path / "config.yaml", config)), TRIAL_ENV: _trial(tmp_path)}
    ran = probe(tmp_path / "patched" / patched.files[0].rel, list(args), steps=STEPS, out=tmp_path / "p.json", env=env,
                cwd=tmp_path, timeout=300)
    plain = run_probe(entry, list(args), steps=STEPS, out=tmp_path / "b.json", env=PROBE_ENV, cwd=tmp_path, timeout=300)
    gated = ran["losses"]
    assert len(gated) == STEPS
    assert plain == gated, config
    # what a trial credits is what the tuned script has: a knob took effect exactly where its value is in the text
    assert set(ran["applied"]) == _baked_knobs(script, config), config


def _trial(tmp_path: Path) -> str:
    """A trial's spec that never ends the run (the probe stops it): the patched script runs as in a search's trial,
    with its framework hooks, which are what record the knobs a Trainer's resolved settings hold."""
    spec = tmp_path / "trial.json"
    spec.write_text(json.dumps({"warmup": 0, "steps": 10**9, "result": str(tmp_path / "trial-result.json")}))
    return str(spec)


def _baked_knobs(script: Path, config: dict) -> set[str]:
    """The knobs of ``config`` whose value the baked text shows: baking ``config`` without one of them writes
    another text."""
    project = load_project(script)

    def texts(values: dict) -> list[str]:
        return [f.new_text for f in bake(project, values, "cpu").files]

    full = texts(config)
    return {name for name in config if texts({k: v for k, v in config.items() if k != name}) != full}


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, rounds", [pytest.param(s, rounds, id=_id(s)) for s, _, ranks, rounds in PLAN if ranks > 1]
)
def test_distributed_baked_trains_like_patched_at_every_choice(script, rounds, tmp_path):
    """One launch runs the patched script at every round's config, each followed by the round's baked script (a
    launch is three processes that import torch: one a round took this test 15-35 s a fixture)."""
    patched = tmp_path / "patched" / script.name
    write_outputs(run(load_project(script), select()), patched.parent, script.name)
    none = _config(tmp_path / "none.yaml", {})
    configs, scripts = [], []
    for i, config in enumerate(rounds):
        configs += [_config(tmp_path / f"round{i}.yaml", config), none]
        scripts += [patched, _write_baked(script, config, tmp_path / f"baked{i}")]
    ran = run_dist_probe(patched, configs, steps=STEPS, out=tmp_path / "runs", scripts=scripts)
    for i, config in enumerate(rounds):
        for rank in range(2):
            gated, plain = ran[rank][2 * i], ran[rank][2 * i + 1]
            assert gated["ended"] == plain["ended"] == "steps"
            assert plain["losses"] == gated["losses"], config
            assert plain["grads"] == gated["grads"], config
