"""Every case in fixtures/transforms/<name>/: expected output, bake output, idempotence, compiles."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from autotune.project import load_project
from autotune.patch import run, select
from autotune.transform import Mode, all_transforms

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "transforms"
CASES = sorted(FIXTURES.glob("*/*.in.py"))
BAKE_CASES = [c for c in CASES if c.with_name(c.name.replace(".in.py", ".bake.yaml")).exists()]


def _case_id(path: Path) -> str:
    return f"{path.parent.name}/{path.name[: -len('.in.py')]}"


def _patched(path: Path, name: str, mode: Mode = Mode()) -> str:
    result = run(load_project(path), select([name]), mode, hooks=False)
    return result.files[0].new_text


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_case(case: Path, tmp_path: Path):
    name = case.parent.name
    expected_path = case.with_name(case.name.replace(".in.py", ".out.py"))
    source = case.read_text()
    expected = expected_path.read_text() if expected_path.exists() else source  # no .out.py: must not change
    out = _patched(case, name)
    assert out == expected
    compile(out, str(case), "exec")
    again = tmp_path / "again.py"
    again.write_text(out)
    assert _patched(again, name) == out, "a second patch changed the output"


@pytest.mark.parametrize("case", BAKE_CASES, ids=_case_id)  # only the cases that have a .bake.yaml
def test_bake(case: Path):
    spec = yaml.safe_load(case.with_name(case.name.replace(".in.py", ".bake.yaml")).read_text())
    expected = case.with_name(case.name.replace(".in.py", ".bake.py")).read_text()
    out = _patched(case, case.parent.name, Mode(values=spec["knobs"], device=spec.get("device", "cpu")))
    assert out == expected
    assert "_autotune" not in out
    compile(out, str(case), "exec")


def test_every_transform_has_cases():
    names = {t.name for t in all_transforms()}
    with_cases = {c.parent.name for c in CASES}
    assert names <= with_cases, f"transforms without fixtures: {sorted(names - with_cases)}"


@pytest.mark.parametrize("transform", all_transforms(), ids=lambda t: t.name)
def test_transform_declares_itself(transform):
    assert transform.description(), "the class docstring is the transform's documentation"
    assert transform.knobs, "a transform without knobs cannot be searched"
    for knob in transform.knobs:
        assert knob.name.startswith(transform.name + ".")
        # choices must survive a round trip through hand-written YAML (no bare off/on/yes/no strings)
        for choice in knob.choices:
            assert yaml.safe_load(yaml.safe_dump(choice)) == choice
            if isinstance(choice, str):
                assert yaml.safe_load(choice) == choice, f"{knob.name}: choice {choice!r} needs quoting in YAML"
