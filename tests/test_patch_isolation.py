"""A transform that fails inside its own analysis: reported as not analysed, its edits dropped, the others go on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import autotune.patch as patch_mod
from autotune.project import load_project
from autotune.cli import main
from autotune.knobs import Knob, Numerics
from autotune.patch import run
from autotune.search.live import QuietDisplay
from autotune.search.search import Search, SearchOptions
from autotune.transform import Status, Transform, all_transforms
from autotune.syntax import stmt

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "fixtures" / "search" / "tiny.py"


class Broken(Transform):
    """A transform whose analysis raises after it reported a site and asked for an edit."""

    name = "broken"
    knobs = (Knob("broken.on", (False, True), False, Numerics.EXACT),)

    def apply(self, facts, edits) -> None:
        self.report(facts, facts.module.body[0], Status.APPLICABLE, "looks applicable")
        edits.prelude(stmt("BROKEN_EDIT = 1\n"))
        edits.runtime("broken")
        [][0]  # the IndexError a real transform bug raised (issue 12)


@pytest.fixture
def with_broken(monkeypatch):
    transforms = (Broken, *all_transforms())  # first: its partial edits would land before every other's
    monkeypatch.setattr(patch_mod, "all_transforms", lambda: transforms)


def test_patch_drops_the_failed_transforms_edits_and_applies_the_others(with_broken):
    result = run(load_project(TINY))
    (failed,) = [s for s in result.sites if s.transform == "broken"]
    assert failed.status is Status.NOT_ANALYSED
    assert failed.reason.startswith("IndexError: list index out of range at tests/test_patch_isolation.py:")
    assert failed.path == str(TINY)
    (entry,) = [f for f in result.files if f.facts.path == TINY]
    assert "BROKEN_EDIT" not in entry.new_text and "broken" not in entry.new_text
    assert "_autotune.step(" in entry.new_text and "_autotune.optimizer_impl()" in entry.new_text
    assert "broken.on" not in {k.name for k in result.knobs}
    assert {"fused_optimizer.impl", "gc.freeze"} <= {k.name for k in result.knobs}
    compile(entry.new_text, str(TINY), "exec")


def test_scan_shows_the_failure_as_a_row_and_goes_on(with_broken, capsys):
    assert main(["scan", str(TINY), "--json"]) == 0
    sites = json.loads(capsys.readouterr().out)["sites"]
    broken = [s for s in sites if s["transform"] == "broken"]
    assert [s["status"] for s in broken] == ["not_analysed"]
    assert any(s["transform"] == "fused_optimizer" and s["status"] == "applicable" for s in sites)
    assert main(["scan", str(TINY)]) == 0
    assert "not analysed" in capsys.readouterr().out


def test_search_setup_goes_on_without_the_failed_transform(with_broken, tmp_path):
    search = Search(SearchOptions(script=TINY, out=tmp_path / "out", device="cpu"), QuietDisplay())
    names = {k.name for k in search.patch.knobs}
    assert "broken.on" not in names and "fused_optimizer.impl" in names
    assert all(not name.startswith("broken.") for name in search.space.describe())


def _inserting(name: str) -> type[Transform]:
    class Inserts(Transform):
        """A transform that reads ``name`` in a statement it inserts before the gradient clipping."""

        knobs = (Knob("inserts.on", (False, True), False, Numerics.EXACT),)

        def apply(self, facts, edits) -> None:
            for call in facts.calls:
                if facts.qualname(call.func) == "torch.nn.utils.clip_grad_norm_":
                    self.report(facts, call, Status.APPLICABLE, "inserts a statement")
                    edits.insert_before(facts.statement_of(call), stmt(f"{edits.runtime('noop')}({name})\n"))

    Inserts.name = "inserts"
    return Inserts


@pytest.mark.parametrize(("name", "applied"), [("optimizer", False), ("model", True), ("loss", True)])
def test_an_edit_that_reads_a_name_unbound_on_some_path_is_not_made(name: str, applied: bool):
    # the script binds ``optimizer`` only under --optimizer adamw, and clips on every path
    result = run(load_project(REPO / "fixtures/scripts/rnn_optional_optimizer.py"), [_inserting(name)], hooks=False)
    (site,) = result.sites
    (file,) = result.files
    assert (f"_autotune.noop({name})" in file.new_text) is applied
    if applied:
        assert site.status is Status.APPLICABLE and [k.name for k in result.knobs] == ["inserts.on"]
    else:
        assert site.status is Status.NOT_APPLICABLE and not result.changed and not result.knobs
        assert site.reason == f"{name} is not bound on every path to {file.facts.display}:46, where the edit reads it"
