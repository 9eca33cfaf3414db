"""Training inside a framework's Trainer (issue 21.1): scan names the framework and the call that trains; patch and
search go on with the framework's own settings as knobs (tests/test_transform_hf_trainer.py,
test_transform_lightning_trainer.py), and refuse with its name, in one line, where the Trainer is built inside the call
that trains. The fixtures are parsed, never run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotune.cli import main
from autotune.project import load_project

FRAMEWORKS = Path(__file__).resolve().parent.parent / "fixtures" / "frameworks"


@pytest.mark.parametrize(
    "name, framework, call",
    [
        ("hf_trainer.py", "the Hugging Face Trainer", "trainer.train"),
        ("trainer_subclass.py", "the Hugging Face Trainer", "trainer.train"),  # a local subclass of transformers.Trainer
        ("lightning_fit.py", "the Lightning Trainer", "L.Trainer(max_epochs=1, limit_train_batches=100).fit"),
    ],
)
def test_the_call_that_trains_inside_a_framework_is_found(name, framework, call):
    project = load_project(FRAMEWORKS / name)
    assert not project.loops
    # once each: nn.Module.train() and trainer.evaluate() are not training calls
    assert [(str(f.framework), f.module.code(f.call.func)) for f in project.frameworks] == [(framework, call)]


def test_a_train_call_on_an_object_of_no_known_trainer_is_not_framework_training(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import transformers\n"
        "from mylib import Trainer\n"
        "trainer = Trainer()\n"
        "trainer.train()\n"
        "other = transformers.Trainer() if False else Trainer()\n"  # one binding, not a Trainer call of a framework
        "other.train()\n"
        "trained = transformers.Trainer()\n"
        "def fit(trained):\n"  # a parameter shadows the module's Trainer: what it holds is not known
        "    trained.train()\n"
    )
    assert load_project(script).frameworks == []


def test_scan_names_the_framework_whose_settings_are_the_knobs(capsys):
    script = FRAMEWORKS / "hf_trainer.py"
    assert main(["scan", str(script)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "training runs inside the Hugging Face Trainer" in out and "hf_trainer.py:39: trainer.train()" in out
    assert "its settings are the knobs" in out

    assert main(["scan", str(script), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["training_loops"] == []
    assert doc["framework_training"] == [
        {"framework": "the Hugging Face Trainer", "path": str(script), "line": 39, "call": "trainer.train"}
    ]
    assert any(s["transform"] == "hf_trainer" and s["status"] == "applicable" for s in doc["sites"])


def test_patch_refuses_a_trainer_built_inside_the_call_that_trains_with_its_name(tmp_path, monkeypatch, capsys):
    script = FRAMEWORKS / "lightning_fit.py"  # L.Trainer(...).fit(model): no name to hand to the trial hook
    assert main(["scan", str(script)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "training runs inside the Lightning Trainer" in out and "the Trainer is built inside the call" in out

    monkeypatch.chdir(tmp_path)
    assert main(["patch", str(script), "--out", "out"]) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert "the Lightning Trainer" in err and "assign it to a name first" in err and "nothing patched" in err
    assert not (tmp_path / "out").exists()


def test_a_trainer_built_inside_the_training_call_cannot_be_timed(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(
        "from transformers import Trainer, TrainingArguments\n"
        "Trainer(model=None, args=TrainingArguments(output_dir='out')).train()\n"
    )
    assert main(["patch", str(script), "--out", str(tmp_path / "out")]) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert "the Trainer is built inside the call" in err


def test_a_framework_is_a_typed_value_never_recognised_by_its_display_text():
    """Transforms ask ``framework.hugging_face`` or compare with ``Framework.LIGHTNING_TRAINER``: a framework's
    wording (how the scan names it to users) is written once, in autotune/project.py."""
    import re

    from autotune.project import Framework

    root = Path(__file__).resolve().parent.parent
    for path in [*(root / "autotune").rglob("*.py"), *(root / "transforms").glob("*.py")]:
        if path.name == "project.py":
            continue
        text = path.read_text(encoding="utf-8")
        for f in Framework:
            assert not re.search(re.escape(f'"{f.value}'), text), f"{path.name} names {f.value!r} as text"
