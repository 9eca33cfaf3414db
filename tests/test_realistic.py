"""The realistic fixtures: scan against their truth (precision and recall), and every one patches, compiles,
re-patches to nothing and, where it runs on CPU, keeps its losses bit for bit at default knobs.

    python -m pytest -q -s tests/test_realistic.py -k precision    # prints the table per transform
"""

from __future__ import annotations

from pathlib import Path

import pytest
from loss_probe import run_probe
from realistic import CASES, Case, load_case, measure, details, table, totals, Tally

from autotune.project import load_project
from autotune.patch import run, write_outputs
from autotune.transform import all_transforms

# What this branch achieves on fixtures/realistic; a change that lowers either fails here.
PRECISION_FLOOR = 0.978  # 136/139 after the merge of issue 12's work (0.92 before it)
RECALL_FLOOR = 0.992  # 131/132 (0.85 before)
STEPS = 3

# Scripts that crash scan or patch, or change at default knobs, for reasons issue 12 assigns elsewhere: each
# must fail until that fix lands (strict), then the entry goes.
KNOWN: dict[str, str] = {}  # case -> why it is expected to fail (strict: a fix makes the test fail until removed)


def _param(folder: Path):
    reason = KNOWN.get(folder.name)
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
    return pytest.param(folder, id=folder.name, marks=marks)


def test_truth_names_known_transforms_and_resolves():
    known = {t.name for t in all_transforms()}
    assert len(CASES) >= 15
    for folder in CASES:
        case = load_case(folder)  # every location resolves, or it raises
        assert case.entry.is_file(), case.entry
        assert set(case.applies) | set(case.not_applicable) <= known, folder.name


def test_scan_precision_and_recall_hold_their_floor():
    outcomes = measure()
    summary = table(outcomes)
    print("\n" + summary + "\n" + details(outcomes))
    overall = sum(totals(outcomes).values(), Tally())
    assert overall.precision >= PRECISION_FLOOR and overall.recall >= RECALL_FLOOR, summary


def _probe(case: Case, root: Path, entry: Path, out: Path) -> list[str]:
    """Per-step losses of ``entry`` run from ``root`` as the case says (``python -m`` cases find their package
    through PYTHONPATH, as running from the repository root would)."""
    env = {"AUTOTUNE_CONFIG": None, "AUTOTUNE_TRIAL": None, "PYTHONPATH": str(root) if case.module else None}
    return run_probe(entry, list(case.args or ()), steps=STEPS, out=out, env=env, cwd=entry.parent, timeout=240)


@pytest.mark.parametrize("folder", [_param(f) for f in CASES])
def test_patches_compiles_repatches_to_nothing_and_keeps_losses(folder: Path, tmp_path: Path):
    case = load_case(folder)
    result = run(load_project(case.entry))  # compiles every changed file, or raises
    assert result.changed, "nothing to patch in a script with applicable sites"
    out = tmp_path / "out"
    write_outputs(result, out, str(case.entry))
    patched = out / result.files[0].rel
    assert (patched.parent / "autotune.yaml").is_file()  # the runtime reads the knob table beside the entry
    again = run(load_project(patched))
    assert not [f.rel for f in again.files if f.changed], "a second patch changed the patched script"
    if case.args is None:
        return
    original = _probe(case, case.folder, case.entry, tmp_path / "orig.json")
    new = _probe(case, out, patched, tmp_path / "patched.json")
    assert len(original) == STEPS
    assert new == original
