"""What analysis finds in the fixture scripts, without running them."""

from __future__ import annotations

from pathlib import Path

import libcst as cst
import pytest

from autotune.analysis import ModuleFacts, _libcst_positions, _positions, load_project

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "fixtures/scripts"
ALL = sorted([*SCRIPTS.glob("*.py"), *SCRIPTS.glob("*/train.py")])


def _loop_lines(path: Path) -> list[tuple[str, int]]:
    project = load_project(path)
    return [(Path(l.module.display).name, l.module.position(l.node)[0]) for l in project.loops]


@pytest.mark.parametrize("path", ALL, ids=lambda p: str(p.relative_to(SCRIPTS)))
def test_ast_positions_match_libcst(path: Path):
    for facts in load_project(path).modules:
        assert _positions(facts) == _libcst_positions(facts)


@pytest.mark.parametrize("path", [p for p in ALL if p.name != "no_loop.py"], ids=lambda p: str(p.relative_to(SCRIPTS)))
def test_every_training_script_has_one_step_loop(path: Path):
    project = load_project(path)
    assert len(project.loops) == 1
    loop = project.loops[0]
    assert any(s.backward for s in loop.scopes) and any(s.steps for s in loop.scopes)
    line = loop.module.source.splitlines()[loop.module.position(loop.node)[0] - 1]
    assert line.lstrip().startswith(("for ", "while "))


def test_no_loop_script_has_none():
    assert load_project(SCRIPTS / "no_loop.py").loops == []


def test_step_reached_through_local_function():
    project = load_project(SCRIPTS / "train_function.py")
    (loop,) = project.loops
    owners = [s.owner for s in loop.scopes if s.steps]
    assert [o.name.value for o in owners if isinstance(o, cst.FunctionDef)] == ["train_step"]
    assert isinstance(loop.outer, cst.For) and loop.outer is not loop.node  # the epoch loop around it


def test_package_project_follows_local_imports():
    project = load_project(SCRIPTS / "pkg_project/train.py")
    names = {m.modname for m in project.modules}
    assert {"train", "mylib", "mylib.model", "mylib.engine", "mylib.data"} <= names
    (loop,) = project.loops
    assert loop.module.modname == "mylib.engine"


def test_scheduler_step_is_not_an_optimizer_step():
    project = load_project(SCRIPTS / "module_level.py")
    (loop,) = project.loops
    steps = [loop.module.code(c) for s in loop.scopes for c in s.steps]
    assert steps and not any("sched" in s for s in steps)


def test_qualified_names_through_aliases(tmp_path: Path):
    src = (
        "import torch.optim as o\nfrom torch.optim import AdamW as AW\nfrom torch import optim\n"
        "import torch.nn.functional as F\n"
        "a = o.SGD\nb = AW\nc = optim.Adam\nd = F.softmax\n"
    )
    path = tmp_path / "m.py"
    path.write_text(src)
    facts = ModuleFacts.load(path, "m.py", "m")
    values = [s.body[0].value for s in facts.module.body[4:]]
    assert [facts.qualname(v) for v in values] == [
        "torch.optim.SGD",
        "torch.optim.AdamW",
        "torch.optim.Adam",
        "torch.nn.functional.softmax",
    ]


def test_relative_imports_resolve_inside_packages(tmp_path: Path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .model import Net\n")
    (pkg / "model.py").write_text("class Net: pass\n")
    (tmp_path / "train.py").write_text("from pkg import Net\n")
    project = load_project(tmp_path / "train.py")
    init = project.by_modname("pkg")
    assert init is not None and init.imports["Net"] == "pkg.model.Net"
    assert project.by_modname("pkg.model") is not None


def test_positions_count_characters_not_bytes(tmp_path: Path):
    path = tmp_path / "u.py"
    path.write_text('x = "ünïcödé"; y = len(x)\n')
    facts = ModuleFacts.load(path, "u.py", "u")
    assert _positions(facts) == _libcst_positions(facts)
