"""What analysis finds in the fixture scripts, without running them."""

from __future__ import annotations

from pathlib import Path

import libcst as cst
import pytest

from autotune.analysis import _LAYOUT, ModuleFacts, _libcst_positions, _positions, load_project

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "fixtures/scripts"
ALL = sorted([*SCRIPTS.glob("*.py"), *SCRIPTS.glob("*/train.py")])


def _loop_lines(path: Path) -> list[tuple[str, int]]:
    project = load_project(path)
    return [(Path(l.module.display).name, l.module.position(l.node)[0]) for l in project.loops]


def _ast_positions(facts: ModuleFacts) -> dict:
    """Every position ast gives, statement by statement (None where ast and libcst do not line up)."""
    out = {}
    for top, roots in facts.ast_statements().items():
        found = _positions(facts, top, roots)
        assert found is not None, f"{facts.display}: ast and libcst disagree at line {roots[0].lineno}"
        out.update(found)
    return out


@pytest.mark.parametrize("path", ALL, ids=lambda p: str(p.relative_to(SCRIPTS)))
def test_ast_positions_match_libcst(path: Path):
    for facts in load_project(path).modules:
        expected = _libcst_positions(facts)
        assert _ast_positions(facts) == expected
        assert {n: facts.position(n) for n in expected} == expected


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


def test_entry_in_scripts_folder_finds_the_package_at_the_repository_root():
    root = REPO / "fixtures/realistic/pkg_scripts"
    project = load_project(root / "scripts/train.py")
    assert project.root == root
    assert {m.modname for m in project.modules} == {"scripts.train", "scripts", "mypkg", "mypkg.data", "mypkg.model"}
    model = project.by_modname("mypkg.model")
    assert model is not None and model.display == str(root / "mypkg/model.py")


def test_a_lone_module_beside_a_plain_script_folder_is_not_imported(tmp_path: Path):
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools/train.py").write_text("import helpers\nimport pkg.mod\n")
    (tmp_path / "helpers.py").write_text("x = 1\n")  # no package: running tools/train.py cannot import it
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg/__init__.py").write_text('"""A package."""\n')
    (tmp_path / "pkg/mod.py").write_text("y = 2\n")
    project = load_project(tmp_path / "tools/train.py")
    assert {m.modname for m in project.modules} == {"train", "pkg", "pkg.mod"}


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
    assert _ast_positions(facts) == _libcst_positions(facts)


# Layouts where libcst's ownership of blank lines and comments is easy to get wrong.
LAYOUTS = {
    "decorators": "# header\n\nimport os\n\n\n@dec\n# between\n@dec2(\n    1,\n)\n\nasync def f():\n    pass\n"
    "    # indented trailing\n\n  # odd indent\n# dedented\n\nclass A:  # c\n    x = 1\n",
    "semicolons": "a = 1; b = 2\nx = (1,\n 2); y = 3\nif a: b = 1; c = 2\nelse: pass\n",
    "crlf": "import os\r\n\r\n# c\r\ndef f():\r\n    return 1\r\n\r\nx = f()\r\n",
    "cr": "import os\r\rdef f():\r    return 1\rx = 2\r",
    "form_feed": "def f():\n    pass\n\x0c\ndef g():\n    s = '\x0c\u2028'\n    return s\n",
    "continuation": "x = 1 + \\\n    2\ny = [\n    1,  # one\n]\n",
    "footer": '"""Doc."""\n\nimport os\n\n# trailing comment\n\n',
    "no_final_newline": "import os\nx = 1",
    "main_guard": 'def main():\n    pass\n\n\nif __name__ == "__main__":\n    main()\nelse:\n    pass\n    # end\n',
    "tabs": "if True:\n\tx = 1\n\t# tab comment\n# top\ny = 2\n",
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_statement_texts_are_what_libcst_writes(name: str, tmp_path: Path):
    path = tmp_path / f"{name}.py"
    path.write_bytes(LAYOUTS[name].encode())
    facts = ModuleFacts.load(path, path.name, name, LAYOUTS[name])
    module, texts = facts.module, facts.statement_texts()
    assert list(texts) == list(module.body)
    # without a final newline libcst writes the last statement differently (patch then generates all the code)
    compared = module.body if module.has_trailing_newline else module.body[:-1]
    assert all(texts[s] == module.code_for_node(s) for s in compared)
    around = [module.code_for_node(line) for line in (*module.header, *module.footer)]
    assert "".join([*around[: len(module.header)], *texts.values(), *around[len(module.header) :]]) == facts.source


@pytest.mark.parametrize("path", ALL, ids=lambda p: str(p.relative_to(SCRIPTS)))
def test_statement_texts_cover_every_fixture_statement(path: Path):
    for facts in load_project(path).modules:
        texts = facts.statement_texts()
        assert list(texts) == list(facts.module.body)
        assert all(texts[s] == facts.module.code_for_node(s) for s in facts.module.body)


class _PreOrder(cst.CSTVisitor):
    def __init__(self) -> None:
        self.nodes: list[cst.CSTNode] = []

    def on_visit(self, node: cst.CSTNode) -> bool:
        self.nodes.append(node)
        return True


@pytest.mark.parametrize("path", [*ALL, "f-strings"], ids=lambda p: p if isinstance(p, str) else str(p.relative_to(SCRIPTS)))
def test_index_walks_the_nodes_libcst_visits_in_its_order(path, tmp_path: Path):
    if path == "f-strings":  # libcst visits a format spec only when there is one
        path = tmp_path / "f.py"
        path.write_text('a = f"{x}"\nb = f"{x:>{width(y)}}"\nc = f"{x!r:{z}}" f"{w}"\n')
    for facts in load_project(path).modules:
        visitor = _PreOrder()
        facts.module.visit(visitor)
        assert list(facts._enter) == [n for n in visitor.nodes if type(n) not in _LAYOUT]


def test_star_imports_resolve_through_a_package(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "__init__.py").write_text("from .resnet import *\n")
    (tmp_path / "models" / "resnet.py").write_text(
        "import torch.nn as nn\n__all__ = ['ResNet18']\nclass ResNet(nn.Module):\n    pass\ndef ResNet18():\n    return ResNet()\n"
    )
    (tmp_path / "train.py").write_text("from models import *\nnet = ResNet18()\nx = ResNet()\n")
    project = load_project(tmp_path / "train.py")
    calls = project.entry.calls
    assert [project.entry.qualname(c.func) for c in calls] == ["models.resnet.ResNet18", "ResNet"]  # not in __all__
