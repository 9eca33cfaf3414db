"""Reading a script's source as Python would run it: its bytes (within MAX_SOURCE_BYTES), the encoding it declares
or UTF-8 (a leading BOM kept), a notebook told apart, and the libcst and ``ast`` trees, with the compiler's own
refusals (what ``compile()`` would reject though the grammar accepts it) as one clear line."""

from __future__ import annotations

import ast
import codecs
import contextlib
import gc
import io
import json
import sys
import threading
import tokenize
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import libcst as cst

from autotune.errors import UnparseableScript, UsageError
from autotune.inputs import read_bytes

T = TypeVar("T")

BOM = "\ufeff"  # Python runs a UTF-8 file that starts with one; autotune keeps it in what it writes
MAX_SOURCE_BYTES = 16 << 20  # the longest training scripts and modules are well under 1 MiB


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """The cycle collector off for a while, as it was after.

    A parse makes a hundred thousand nodes and the maps that index them, and with the collector on its passes
    walk every one of them again and again, though trees hold no cycles; cycles made meanwhile are collected
    after, as usual.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def read_source(path: Path, display: str | None = None, entry: bool = True) -> str:
    """The text of a Python source file (a UTF-8 BOM kept), or a UsageError that says in one line why it cannot be
    used; an empty module is fine, an empty entry script is not."""
    display = display or str(path)
    data = read_bytes(path, "a Python script", MAX_SOURCE_BYTES, display)
    if b"\x00" in data:
        raise UsageError(f"{display}: is a binary file, expected a Python script")
    if path.suffix.lower() == ".ipynb" or _is_notebook(data):
        name = Path(display).name if path.suffix.lower() == ".ipynb" else "NOTEBOOK.ipynb"
        raise UsageError(
            f"{display}: is a Jupyter notebook, not a Python script; export it first "
            f"(jupyter nbconvert --to script {name}) and give autotune the .py file"
        )
    declared = _declared_encoding(data, display)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        said = f", and declares {declared}" if declared else ""
        raise UsageError(f"{display}: is not UTF-8 text (byte {exc.start}: {data[exc.start]:#x}{said})") from None
    if declared and not data.isascii():  # read as UTF-8, it would not be the text Python runs
        raise UsageError(
            f"{display}: declares the encoding {declared}; autotune reads and writes UTF-8 scripts only "
            f"(convert it: iconv -f {declared} -t utf-8)"
        )
    if declared:
        _check_declared(data, text, declared, display)
    if entry and not text.removeprefix(BOM).strip():
        raise UsageError(f"{display}: is empty")
    return text


def _declared_encoding(data: bytes, display: str) -> str | None:
    """The encoding a coding line (PEP 263) declares, where it is not UTF-8; an unknown one is refused, as Python
    refuses to run the file."""
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError as exc:  # "unknown encoding: foo", a BOM with another declared encoding, or not UTF-8
        if exc.msg.startswith("invalid or missing encoding declaration"):
            return None  # no coding line, and bytes that are not UTF-8: the decoding says so, with the byte
        raise UsageError(f"{display}: {exc.msg} (Python cannot run it either)") from None
    return None if codecs.lookup(encoding).name in ("utf-8", "utf-8-sig") else encoding


def _check_declared(data: bytes, text: str, declared: str, display: str) -> None:
    """Refuse an ASCII script whose declared codec Python will not read it with (rot13, hex, utf-16, undefined:
    no ASCII-compatible text encoding), which patch would otherwise write out unrunnable as it found it."""
    try:
        with _python_recursion_limit():
            ast.parse(data, filename=display)
    except SyntaxError as exc:
        try:
            with _python_recursion_limit():
                ast.parse(text, filename=display)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return  # the text itself does not parse: parse() says where
        raise UsageError(f"{display}: declares the encoding {declared}, which Python cannot read it with "
                         f"({exc.msg.splitlines()[0][:120]})") from None
    except (ValueError, RecursionError, MemoryError):
        return


def _is_notebook(data: bytes) -> bool:
    """Whether ``data`` is a Jupyter notebook's JSON (which Python would read as one dict literal)."""
    head = data.lstrip()[:1]
    if head != b"{":
        return False
    try:
        doc = json.loads(data)
    except ValueError:
        return False
    return isinstance(doc, dict) and "cells" in doc and "nbformat" in doc


def parse(text: str, display: str) -> tuple[cst.Module, ast.Module]:
    """Both trees of one source text; a syntax error becomes ``path:line:col: message``."""
    try:
        with _python_recursion_limit():
            tree = ast.parse(text, filename=display)
    except SyntaxError as exc:
        raise UnparseableScript(display, exc.lineno or 1, exc.offset or 1, exc.msg) from None
    except (RecursionError, MemoryError):  # what compile() itself says of such a file
        raise UnparseableScript(display, 1, 1, "nested too deeply (Python cannot compile it either)") from None
    refused = _compiler_refuses(tree)
    if refused is not None:
        raise UnparseableScript(display, *refused)
    try:
        module = cst.parse_module(text)
    except cst.ParserSyntaxError as exc:  # pragma: no cover - ast accepted it, so libcst rarely refuses
        raise UnparseableScript(display, exc.raw_line, exc.raw_column + 1, exc.message) from None
    return module, tree


def _compiler_refuses(tree: ast.Module) -> tuple[int, int, str] | None:
    """What Python's parser accepts and its compiler refuses (line, column, its message): return, yield or await
    outside a function, await or async for/with outside an async one, break or continue outside a loop, nonlocal at
    module level. Python would run neither the script nor a patched copy; walked without recursion, so any depth
    the parser takes is fine (compiling the tree again recurses, and costs about half a parse)."""
    FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
    stack: list[tuple[ast.AST, str | None, bool]] = [(tree, None, False)]  # node, the function kind around, in a loop
    while stack:
        node, func, loop = stack.pop()
        where = (getattr(node, "lineno", 1), getattr(node, "col_offset", 0) + 1)
        if isinstance(node, ast.Return) and func is None:
            return (*where, "'return' outside function")
        if isinstance(node, (ast.Yield, ast.YieldFrom)) and func is None:
            return (*where, "'yield' outside function")
        if isinstance(node, (ast.Await, ast.AsyncFor, ast.AsyncWith)) and func != "async":
            what = "'await'" if isinstance(node, ast.Await) else f"'async {'for' if isinstance(node, ast.AsyncFor) else 'with'}'"
            return (*where, f"{what} outside {'async ' if func else ''}function")
        if isinstance(node, (ast.Break, ast.Continue)) and not loop:
            return (*where, f"'{'break' if isinstance(node, ast.Break) else 'continue'}' outside loop")
        if isinstance(node, ast.Nonlocal) and func is None:
            return (*where, "nonlocal declaration not allowed at module level")
        if isinstance(node, FUNCS):
            inner = ("async" if isinstance(node, ast.AsyncFunctionDef) else "sync"), False
            stack.extend((d, func, loop) for d in (*node.args.defaults, *node.args.kw_defaults,
                                                   *getattr(node, "decorator_list", ())) if d is not None)
            body = node.body if isinstance(node.body, list) else [node.body]
            stack.extend((child, *inner) for child in body)
            continue
        if isinstance(node, ast.ClassDef):
            stack.extend((child, None, False) for child in node.body)
            stack.extend((d, func, loop) for d in (*node.decorator_list, *node.bases, *node.keywords))
            continue
        if isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
            stack.extend((child, func, True) for child in node.body)
            stack.extend((child, func, loop) for child in (*node.orelse, getattr(node, "iter", None) or node.test)
                         if child is not None)
            continue
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            # a comprehension is a function of its own, but await in one follows the function around it
            stack.extend((child, func or "comp", loop) for child in ast.iter_child_nodes(node))
            continue
        stack.extend((child, func, loop) for child in ast.iter_child_nodes(node))
    return None


# --- room to recurse ---------------------------------------------------------------------------------------

# Python compiles expressions nested about three times as deep as its recursion limit (a 2,997-term ``1+1+...``
# or ``a.b.b...`` at the default 1,000). libcst's visitors and code generator recurse a few frames per level: the
# deepest expression Python compiles, with the loss inside it rewritten and baked, needs a limit of 8,000
# (measured); 20 times the limit leaves room over that. The stack is virtual memory, touched only as used.
DEEP_STACK_BYTES = 512 << 20
_deep = threading.local()  # .base: the recursion limit outside deep(), set while inside
_deep_lock = threading.Lock()


def _deep_limit(base: int) -> int:
    return 20 * base


def deep(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` with room to recurse through the deepest code Python compiles: in a thread with a big stack and
    a raised recursion limit (the one Python compiles with stays the limit for what is accepted, see ``parse``)."""
    if getattr(_deep, "base", None) is not None:
        return fn(*args)
    out: list[tuple[bool, Any]] = []

    def target() -> None:
        _deep.base = base
        try:
            out.append((True, fn(*args)))
        except BaseException as exc:  # re-raised in the calling thread
            out.append((False, exc))

    thread = threading.Thread(target=target, name="autotune-deep", daemon=True)
    with _deep_lock:
        base = sys.getrecursionlimit()
        sys.setrecursionlimit(_deep_limit(base))
        try:
            old_stack = threading.stack_size(DEEP_STACK_BYTES)  # the size a thread gets when it starts
            try:
                thread.start()
            finally:
                threading.stack_size(old_stack)
            thread.join()
        finally:
            sys.setrecursionlimit(base)
    ok, value = out[0]
    if not ok:
        raise value
    return value


@contextlib.contextmanager
def _python_recursion_limit() -> Iterator[None]:
    """Inside ``deep``, the recursion limit outside it for a while: what ``ast`` accepts is what Python compiles."""
    base = getattr(_deep, "base", None)
    if base is None:
        yield
        return
    raised = sys.getrecursionlimit()
    depth, frame = 0, sys._getframe()
    while frame is not None:
        depth, frame = depth + 1, frame.f_back
    # ast's limit counts the frames below it: these frames too, which a script Python runs does not have
    sys.setrecursionlimit(base + depth)
    try:
        yield
    finally:
        sys.setrecursionlimit(raised)
