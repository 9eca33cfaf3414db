"""Every fixture script, patched with every transform: same losses bit for bit with no config, idempotent,
comments kept, and the knob table lists exactly the injected knobs."""

from __future__ import annotations

import io
import tokenize
from collections import Counter
from pathlib import Path

import pytest
import yaml

from autotune.project import load_project
from autotune.patch import run, select, write_outputs
from autotune.transform import Status
from loss_probe import run_probe
from transform_cases import trial

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(
    p for p in [*(REPO / "fixtures/scripts").glob("*.py"), *(REPO / "fixtures/scripts").glob("*/train.py")]
    if p.name != "no_loop.py"
)
STEPS = 4


def _id(path: Path) -> str:
    return str(path.relative_to(REPO / "fixtures/scripts"))


def _comments(text: str) -> Counter:
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    return Counter(t.string for t in tokens if t.type == tokenize.COMMENT)


@pytest.fixture(scope="module")
def patched(tmp_path_factory) -> dict[Path, Path]:
    """script -> its patched entry, each in its own output folder."""
    out = {}
    for script in SCRIPTS:
        dest = tmp_path_factory.mktemp(script.stem)
        result = run(load_project(script))
        write_outputs(result, dest, str(script))
        out[script] = dest / script.relative_to(script.parent)
    return out


@pytest.mark.parametrize("script", SCRIPTS, ids=_id)
def test_default_knobs_reproduce_losses_bit_for_bit(script: Path, patched, tmp_path: Path):
    original = run_probe(script, steps=STEPS, out=tmp_path / "orig.json", cwd=REPO)
    new = run_probe(patched[script], steps=STEPS, out=tmp_path / "patched.json", cwd=REPO, env={"AUTOTUNE_CONFIG": None})
    assert len(original) == STEPS
    assert new == original


@pytest.mark.parametrize("script", SCRIPTS, ids=_id)
def test_second_patch_changes_nothing(script: Path, patched):
    again = run(load_project(patched[script]))
    changed = [f.rel for f in again.files if f.changed]
    assert not changed, f"patching the patched script changed {changed}"


@pytest.mark.parametrize("script", SCRIPTS, ids=_id)
def test_comments_and_untouched_lines_survive(script: Path):
    result = run(load_project(script))
    for f in result.files:
        assert not (_comments(f.facts.source) - _comments(f.new_text)), f"{f.rel}: comments lost"
        # every original line is still there, in order, unless a transform edited it
        new_lines = f.new_text.splitlines()
        kept = [line for line in f.facts.source.splitlines() if line in new_lines]
        assert len(kept) >= 0.8 * len(f.facts.source.splitlines()), f"{f.rel}: too many lines rewritten"


@pytest.mark.parametrize("script", SCRIPTS, ids=_id)
def test_knob_table_lists_injected_knobs(script: Path, patched):
    table = yaml.safe_load((patched[script].parent / "autotune.yaml").read_text())["knobs"]
    result = run(load_project(script))
    assert set(table) == {k.name for k in result.knobs}
    for name, spec in table.items():
        assert spec["value"] == spec["default"] and spec["default"] in spec["choices"], name


def test_already_optimized_script_is_left_alone_but_for_its_own_compile_switch():
    result = run(load_project(REPO / "fixtures/scripts/already_optimized.py"))
    # `if args.compile: model.compile()`, off by default: the switch is the one knob (issue 21.3)
    assert {k.name.split(".")[0] for k in result.knobs} == {"compile"}, result.diff()
    assert [s.transform for s in result.sites if s.status is Status.APPLICABLE] == ["compile"]


def test_step_hook_lands_in_the_loop_file_when_only_the_model_file_changes():
    project = load_project(REPO / "fixtures/projects/minigpt/train.py")
    result = run(project, select(["sdpa"]))
    changed = {f.rel.as_posix(): f.new_text for f in result.files if f.changed}
    (loop,) = project.loops
    loop_file = loop.module.path.relative_to(project.root).as_posix()
    assert any("scaled_dot_product_attention" in text for text in changed.values())
    assert "_autotune.step(" in changed[loop_file]


@pytest.mark.parametrize("script", SCRIPTS, ids=_id)
def test_every_transform_analyses_every_file(script: Path):
    failed = [s for s in run(load_project(script)).sites if s.status is Status.NOT_ANALYSED]
    assert not failed, failed


# script -> (arguments, what each trial loss is times the loss backward() saw): one backward() per step in each
ONE_BACKWARD_PER_STEP = {
    "amp_branches.py": [((), 1.0), (("--amp",), 65536.0)],  # GradScaler's initial scale: backward() sees loss * 2**16
    "two_optimizers.py": [((), 1.0)],
    "trainer_class.py": [((), 1.0)],
    "trainer_step.py": [((), 1.0)],
    "rnn_optional_optimizer.py": [((), 1.0), (("--optimizer", "adamw"), 1.0)],
    "gpt_moduledict.py": [((), 1.0)],
    "manual_sgd.py": [((), 1.0)],  # parameters updated by hand: the step hook after the loop over them
    "manual_sgd_module.py": [((), 1.0)],
    "manual_sgd_class.py": [((), 1.0)],  # the update in a method the loop calls after the one that runs backward()
}
HOOK_CASES = [(name, args, factor) for name, runs in ONE_BACKWARD_PER_STEP.items() for args, factor in runs]


@pytest.mark.parametrize(("name", "args", "factor"), HOOK_CASES, ids=[f"{n}{''.join(a)}" for n, a, _ in HOOK_CASES])
def test_step_hook_fires_once_per_step_on_the_path_that_runs(name: str, args, factor: float, patched, tmp_path: Path):
    script = REPO / "fixtures/scripts" / name
    original = run_probe(script, list(args), steps=STEPS, out=tmp_path / "orig.json", cwd=REPO)
    result = trial(patched[script], args, tmp_path, warmup=1, steps=STEPS - 1)
    assert result["status"] == "ok" and result["steps_done"] == STEPS, result["error"]
    # one hook per step, each after that step's backward(): the k-th trial loss is the k-th loss backward() saw
    assert [[v * factor] for (v,) in result["losses"]] == [[float.fromhex(h)] for h in original]


def test_a_training_managers_step_shared_by_a_warm_up_loop_counts_each_step_once(patched, tmp_path: Path):
    # a speedrun-style script: its warm-up loop and its training loop both call manager.step_optimizers(step),
    # where the optimizers step; one hook there (a hook per calling loop counted every step twice), and the loss of
    # each step added up from the loops' own backward passes (the helper sees none)
    script = REPO / "fixtures/scripts/training_manager.py"
    text = patched[script].read_text()
    assert text.count("_autotune.step()") == 1 and text.count("_autotune.accumulate(loss)") == 2
    seen = [float.fromhex(h) for h in run_probe(script, [], steps=7, out=tmp_path / "orig.json", cwd=REPO)]
    result = trial(patched[script], (), tmp_path, warmup=1, steps=4)
    assert result["status"] == "ok" and result["steps_done"] == 5, result["error"]
    # three warm-up steps of one backward() each, then training steps of two micro-batches
    expected = [seen[0], seen[1], seen[2], seen[3] + seen[4], seen[5] + seen[6]]
    assert [v for (v,) in result["losses"]] == pytest.approx(expected, rel=1e-6)


def test_step_hook_after_an_lbfgs_closure_reads_no_loss_and_counts_steps(patched, tmp_path: Path):
    script = REPO / "fixtures/scripts/lbfgs.py"
    assert "_autotune.step()" in patched[script].read_text()  # the closure's loss is not bound where the step ends
    result = trial(patched[script], (), tmp_path, warmup=1, steps=2)
    assert result["status"] == "ok" and result["steps_done"] == 3, result["error"]
