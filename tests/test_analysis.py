"""What analysis finds in the fixture scripts, without running them."""

from __future__ import annotations

from pathlib import Path

import libcst as cst
import pytest

from autotune.analysis import _LAYOUT, ModuleFacts, _libcst_positions, _positions
from autotune.project import load_project

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


# scripts with more than one loop that steps the optimizer: training_manager.py's warm-up loop and training loop
STEP_LOOPS = {"training_manager.py": 2}


@pytest.mark.parametrize("path", [p for p in ALL if p.name != "no_loop.py"], ids=lambda p: str(p.relative_to(SCRIPTS)))
def test_every_training_script_has_one_step_loop(path: Path):
    project = load_project(path)
    assert len(project.loops) == STEP_LOOPS.get(path.name, 1)
    for loop in project.loops:
        assert any(s.backward for s in loop.scopes) and any(s.stepping for s in loop.scopes)
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


# a training step whose update is written out: (the update, whether it is one)
HAND_UPDATES = [
    ("p.data += -lr * p.grad", True),
    ("p -= lr * p.grad", True),
    ("p.data = p.data - lr * p.grad", True),
    ("p.data.add_(p.grad, alpha=-lr)", True),
    ("p.sub_(lr * p.grad)", True),
    ("p.data.mul_(0.99)", False),  # weight decay alone reads no gradient
    ("p = p - lr * p.grad", False),  # rebinds the loop's name: no tensor is written
    ("q.data -= lr * p.grad", False),  # another tensor's gradient
    ("p.grad.clamp_(-1, 1)", False),  # clips the gradient, writes no parameter
]


@pytest.mark.parametrize(("update", "found"), HAND_UPDATES, ids=[u for u, _ in HAND_UPDATES])
def test_parameters_updated_from_their_own_gradients_by_hand_are_the_step(update: str, found: bool, tmp_path: Path):
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\n"
        "w = torch.zeros(3, requires_grad=True)\nq = torch.zeros(3)\nlr = 0.1\n"
        "for i in range(5):\n"
        "    loss = (w * 2).sum()\n"
        "    w.grad = None\n"
        "    loss.backward()\n"
        "    with torch.no_grad():\n"
        "        for p in [w]:\n"
        f"            {update}\n"
    )
    project = load_project(script)
    assert bool(project.loops) is found
    if found:
        (loop,) = project.loops
        (scope,) = [s for s in loop.scopes if s.updates]
        assert not scope.steps and [loop.module.code(u).strip() for u in scope.updates] == [update]
    else:
        assert "updates parameters from their .grad by hand" in project.no_loop_reason()


def test_a_hand_written_update_without_torch_is_not_a_training_loop(tmp_path: Path):
    # micrograd's Value objects train with the same lines; nothing of torch runs there to tune
    script = tmp_path / "train.py"
    script.write_text(
        "from micrograd.nn import MLP\n"
        "model = MLP(3, [4, 1])\n"
        "for k in range(20):\n"
        "    loss = sum(model(x) for x in [[1.0, 2.0, 3.0]])\n"
        "    model.zero_grad()\n"
        "    loss.backward()\n"
        "    for p in model.parameters():\n"
        "        p.data += -0.05 * p.grad\n"
    )
    assert load_project(script).loops == []


def test_a_method_of_the_scripts_own_named_backward_is_not_a_backward_pass():
    # net.backward() runs the class's own method, which calls the real backward(); only that one is the step's
    project = load_project(SCRIPTS / "manual_sgd_class.py")
    (loop,) = project.loops
    backward = [loop.module.code(c) for s in loop.scopes for c in s.backward]
    updates = [s.owner.name.value for s in loop.scopes if s.updates]
    assert backward == ["self.loss.backward()"] and updates == ["update_params"]


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


# --- what Python accepts, autotune handles ------------------------------------------------------------------


def _python_compiles(source: str) -> bool:
    """Whether ``python script.py`` would compile ``source``: compile() at the default limit, in a fresh thread."""
    import threading

    ok = []
    thread = threading.Thread(target=lambda: ok.append(_compile(source)))
    thread.start()
    thread.join()
    return ok[0]


def _compile(source: str) -> bool:
    try:
        compile(source, "x.py", "exec")
    except (SyntaxError, RecursionError, MemoryError):
        return False
    return True


TINY = REPO / "fixtures/search/tiny.py"
DEEP = {
    "sum-1000": "X = " + "+".join(["1"] * 1000),  # the case
    "sum-2900": "X = " + "+".join(["1"] * 2900),
    "attribute-2900": "X = a" + ".b" * 2900,  # the case
    "call-chain-2900": "X = a" + "()" * 2900,
    "negation-2900": "X = " + "-" * 2900 + "1",
    "in-the-loop": "loss = " + " + ".join(["0 * x.sum()"] * 900) + " + nn.functional.mse_loss(model(x), y)",
}


@pytest.mark.parametrize("case", sorted(DEEP))
def test_any_depth_python_compiles_is_scanned_patched_and_baked(case: str, tmp_path: Path):
    from autotune.bake import bake
    from autotune.patch import run, select

    line = DEEP[case]
    text = TINY.read_text()
    if case == "in-the-loop":  # the deep expression is the loss: patch and bake rewrite around it
        text = text.replace("        loss = nn.functional.mse_loss(model(x), y)\n", f"        {line}\n")
    else:
        text += f"\n{line}\n"
    assert _python_compiles(text)
    script = tmp_path / "train.py"
    script.write_text(text)
    project = load_project(script)
    assert len(project.loops) == 1
    patched = run(project, select())
    assert patched.changed and line in patched.files[0].new_text
    baked = bake(project, {"gc.freeze": True}, "cpu")
    assert "gc.freeze()" in baked.files[0].new_text and line in baked.files[0].new_text


@pytest.mark.parametrize(
    "line",
    ["X = " + "+".join(["1"] * 4000), "X = a" + ".b" * 4000, "X = " + "-" * 30000 + "1"],
    ids=["sum-4000", "attribute-4000", "negation-30000"],
)
def test_deeper_than_python_compiles_is_one_line_exit_2(line: str, tmp_path: Path, capsys):
    from autotune.cli import main

    script = tmp_path / "train.py"
    script.write_text(TINY.read_text() + f"\n{line}\n")
    assert not _python_compiles(script.read_text())
    assert main(["scan", str(script)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"autotune: error: {script}:1:1: nested too deeply (Python cannot compile it either)"


def test_the_recursion_limit_is_as_it_was_after_loading():
    import sys

    before = sys.getrecursionlimit()
    load_project(TINY)
    assert sys.getrecursionlimit() == before


# --- files ---------------------------------------------------------------------------------------------------


def test_a_utf8_bom_is_accepted_and_kept_in_every_file_written(tmp_path: Path):
    from autotune.cli import main

    bom = "\ufeff"
    (tmp_path / "helpers.py").write_text(bom + "SCALE = 1\n", encoding="utf-8")
    (tmp_path / "train.py").write_text(bom + "import helpers\n" + TINY.read_text(), encoding="utf-8")
    project = load_project(tmp_path / "train.py")
    assert [m.modname for m in project.modules] == ["train", "helpers"]
    assert project.entry.source.startswith("import helpers") and project.entry.position(project.loops[0].node)[0] == 23
    assert main(["patch", str(tmp_path / "train.py"), "--out", str(tmp_path / "out")]) == 0
    for name in ("train.py", "helpers.py"):  # changed and unchanged alike, the BOM once, at the start
        written = (tmp_path / "out" / name).read_text(encoding="utf-8")
        assert written.startswith(bom) and written.count(bom) == 1, name


@pytest.mark.parametrize("init", ["", "  \n\n", "\n# nothing here\n"], ids=["empty", "whitespace", "comment"])
def test_an_empty_package_init_is_a_module_like_any_other(init: str, tmp_path: Path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text(init)
    (tmp_path / "pkg" / "model.py").write_text("WIDTH = 8\n")
    (tmp_path / "train.py").write_text("from pkg import model\n" + TINY.read_text())
    project = load_project(tmp_path / "train.py")
    assert {m.modname for m in project.modules} == {"train", "pkg", "pkg.model"}


def test_a_script_over_the_size_limit_is_refused(tmp_path: Path):
    from autotune.source import MAX_SOURCE_BYTES
    from autotune.errors import UsageError

    script = tmp_path / "train.py"
    script.write_text(TINY.read_text() + "#" * MAX_SOURCE_BYTES)
    with pytest.raises(UsageError, match="larger than 16 MiB"):
        load_project(script)


def test_a_relative_import_beyond_the_top_reads_nothing_outside_the_project(tmp_path: Path):
    project_dir = tmp_path / "proj"
    project_dir.mkdir()
    (tmp_path / "proj.py").write_text("this file is outside the project and not Python\n")
    (project_dir / "train.py").write_text("from . import helpers\nfrom .. import other\n" + TINY.read_text())
    (project_dir / "helpers.py").write_text("X = 1\n")
    project = load_project(project_dir / "train.py")
    assert [m.path for m in project.modules] == [(project_dir / "train.py").resolve()]


def test_a_module_linked_from_outside_the_project_is_not_local(tmp_path: Path):
    from autotune.cli import main

    outside = tmp_path / "shared"
    outside.mkdir()
    (outside / "helpers.py").write_text("SCALE = 1\n")
    project_dir = tmp_path / "proj"
    project_dir.mkdir()
    (project_dir / "helpers.py").symlink_to(outside / "helpers.py")
    (project_dir / "train.py").write_text("import helpers\n" + TINY.read_text())
    project = load_project(project_dir / "train.py")
    assert [m.modname for m in project.modules] == ["train"]
    config = tmp_path / "c.yaml"
    config.write_text("knobs: {gc.freeze: true}\n")
    assert main(["bake", str(project_dir / "train.py"), "--config", str(config), "--out", str(tmp_path / "out")]) == 0
    assert (outside / "helpers.py").read_text() == "SCALE = 1\n" and not (tmp_path / "out" / "helpers.py").exists()
