"""Compile caches carried to the tuned script: what the search's runs of the chosen configuration compiled, saved as
one file beside the tuned script (``torch.compiler.save_cache_artifacts``), and a few lines at the top of the tuned
script that load it (``torch.compiler.load_cache_artifacts``), so that its first run on the same torch and machine
finds the compiler's caches warm. A missing file, or one another torch or machine made, costs only a normal compile.
"""

from __future__ import annotations

import libcst as cst

CACHE_NAME = "compile_cache.bin"
CACHES_NAME = ".compile-caches"  # in a search's output folder: what each compiling candidate's latest run compiled
LOADER = "_autotune_compile_cache"

_LOADER_CODE = f'''
def {LOADER}():
    """Written by autotune: load what its search's runs of this configuration compiled ({CACHE_NAME} beside this
    file), so that a first run on the same torch and machine starts with the compiler's caches warm. A missing
    file, or one another torch or machine made, only means an ordinary compile; delete it to compile from scratch."""
    import os

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "{CACHE_NAME}")
    if not os.path.isfile(path):
        return
    try:
        import torch

        with open(path, "rb") as f:
            torch.compiler.load_cache_artifacts(f.read())
    except Exception:
        pass


{LOADER}()
'''


def with_loader(text: str) -> str:
    """``text`` (a script) with the loader after its docstring and ``from __future__`` imports (which must stay
    first); unchanged where it has one already."""
    module = cst.parse_module(text)
    if any(isinstance(s, cst.FunctionDef) and s.name.value == LOADER for s in module.body):
        return text
    body = list(module.body)
    at = 0
    while at < len(body) and _stays_first(body[at], at):
        at += 1
    loader = list(cst.parse_module(_LOADER_CODE).body)
    loader[0] = loader[0].with_changes(leading_lines=[cst.EmptyLine(), cst.EmptyLine()] if at else [])
    rest = body[at:]
    if rest:
        rest[0] = rest[0].with_changes(leading_lines=[cst.EmptyLine(), cst.EmptyLine(), *_comments(rest[0])])
    return module.with_changes(body=[*body[:at], *loader, *rest]).code


def _stays_first(stmt: cst.CSTNode, index: int) -> bool:
    if not isinstance(stmt, cst.SimpleStatementLine):
        return False
    first = stmt.body[0]
    if index == 0 and isinstance(first, cst.Expr) and isinstance(first.value, (cst.SimpleString, cst.ConcatenatedString)):
        return True  # the module's docstring
    return isinstance(first, cst.ImportFrom) and isinstance(first.module, cst.Name) and first.module.value == "__future__"


def _comments(stmt: cst.CSTNode) -> list[cst.EmptyLine]:
    """The comment lines above ``stmt`` (blank lines dropped: the loader's own spacing goes before them)."""
    return [line for line in getattr(stmt, "leading_lines", ()) if line.comment is not None]
