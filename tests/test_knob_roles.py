"""The search reads what a knob is from its declaration (Knob.role), never from its name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from autotune.knobs import Knob, Numerics, Role
from autotune.transform import all_knobs

AUTOTUNE = Path(__file__).resolve().parent.parent / "autotune"
GENERATED = {"runtime_helpers.py", "knob_table.py"}  # written from the transforms by python -m autotune.catalog


def test_no_knob_is_named_outside_its_transform():
    names = set(all_knobs())
    found = []
    for path in sorted(AUTOTUNE.rglob("*.py")):
        if path.name in GENERATED:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{path.relative_to(AUTOTUNE.parent)}:{node.lineno}: {node.value}")
    assert found == []


def test_the_roles_the_search_reads():
    def named(role):
        return [k.name for k in all_knobs().values() if k.role is role]

    assert named(Role.SPLIT) == ["batch_split.factor", "hf_trainer.batch_split"]
    assert {k.name: k.on for k in all_knobs().values() if k.role is Role.MEMORY_SAVER} == {
        "checkpointing.blocks": "all", "checkpointing.framework": True, "hf_trainer.gradient_checkpointing": True}
    assert named(Role.THREADS) == ["threads.intra_op"]
    # every knob that computes in reduced precision by choice is a precision knob, and only those
    assert set(named(Role.PRECISION)) == {"autocast.dtype", "hf_trainer.precision", "lightning_trainer.precision",
                                          "accelerator.mixed_precision", "fabric.precision"}


def test_a_memory_saver_names_the_choice_that_turns_it_on():
    with pytest.raises(ValueError, match="memory saver"):
        Knob("x.saver", (False, True), False, Numerics.EXACT, role=Role.MEMORY_SAVER)
    with pytest.raises(ValueError, match="memory saver"):
        Knob("x.saver", (False, True), False, Numerics.EXACT, role=Role.MEMORY_SAVER, on="yes")
    with pytest.raises(ValueError, match="memory saver"):
        Knob("x.other", (False, True), False, Numerics.EXACT, on=True)
    assert Knob("x.saver", (False, True), False, Numerics.EXACT, role=Role.MEMORY_SAVER, on=True).on is True
