"""Reading what users and studies feed autotune: regular files of bounded size, YAML without bombs, values shown short.

Standard library and PyYAML only: the runtime that patched scripts import uses it too.
"""

from __future__ import annotations

import os
import reprlib
import stat
from pathlib import Path
from typing import Any

from autotune.errors import UsageError

MAX_CONFIG_BYTES = 1 << 20  # autotune.yaml and search spaces are a few KiB
# a knob config or search space holds a few hundred values; an alias-heavy ("billion laughs") file expands to
# billions, which nothing that walks the loaded value (an error message, a comparison) survives
MAX_YAML_NODES = 100_000
SHOWN_CHARS = 80


def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)`` cut to about ``limit`` characters: a value from a file goes into a one-line message."""
    short = reprlib.Repr()
    short.maxlevel, short.maxlist, short.maxdict, short.maxstring, short.maxother = 2, 6, 6, limit, limit
    text = short.repr(value)  # bounded however big or deep the value is, unlike repr()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_bytes(path: Path, what: str, limit: int, where: str | None = None) -> bytes:
    """The bytes of regular file ``path``; a FIFO, device, directory or a file over ``limit`` bytes is one UsageError.

    ``where`` is the path as the user wrote it, for the message.
    """
    where = where or str(path)
    try:
        # O_NONBLOCK: opening a FIFO with no writer returns at once instead of blocking until one comes
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except FileNotFoundError:
        raise UsageError(f"{where}: no such file") from None
    except IsADirectoryError:
        raise UsageError(f"{where}: is a directory, expected {what}") from None
    except OSError as exc:
        raise UsageError(f"{where}: cannot read {what}: {exc.strerror}") from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise UsageError(f"{where}: is a directory, expected {what}")
        if not stat.S_ISREG(mode):
            raise UsageError(f"{where}: is not a regular file (a device, FIFO or socket), expected {what}")
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise UsageError(f"{where}: cannot read {what}: {exc.strerror}") from None
    finally:
        os.close(fd)
    if size > limit:
        raise UsageError(f"{where}: larger than {limit >> 20} MiB, too large for {what}")
    return b"".join(chunks)


def read_text(path: Path, what: str, limit: int = MAX_CONFIG_BYTES) -> str:
    """The UTF-8 text of regular file ``path`` (a leading BOM dropped); anything else is one UsageError."""
    data = read_bytes(path, what, limit)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: is not UTF-8 text (byte {exc.start}: {data[exc.start]:#x}), expected {what}") from None


def load_yaml(text: str, where: str) -> Any:
    """The document in ``text``, parsed safely; bad YAML, deep nesting or alias bombs are one UsageError."""
    import yaml

    try:
        loader = yaml.SafeLoader(text)  # its reader refuses a control character (NUL, BEL) here, at once
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        raise UsageError(f"{where}:{line}: not valid YAML: character {exc.character:#04x} is not allowed") from None
    try:
        node = loader.get_single_node()
        if node is not None and _expanded_size(node) > MAX_YAML_NODES:
            raise UsageError(
                f"{where}: too large once its aliases (*name) are expanded (over {MAX_YAML_NODES} values)"
            )
        return loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UsageError(f"{where}{at}: not valid YAML: {problem[:200]}") from None
    except RecursionError:
        raise UsageError(f"{where}: nested too deeply") from None
    finally:
        loader.dispose()


def load_yaml_file(path: Path, what: str) -> Any:
    """The YAML document in regular file ``path`` (see ``read_text`` and ``load_yaml``)."""
    return load_yaml(read_text(path, what), str(path))


def _expanded_size(root) -> int:
    """How many nodes the document holds with every alias expanded, counted without expanding (iteratively)."""
    import yaml

    def kids(node) -> list:
        return [x for pair in node.value for x in pair] if isinstance(node, yaml.MappingNode) else list(node.value)

    sizes: dict[int, int] = {}
    pending: set[int] = set()  # nodes whose children are still being counted
    stack = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            # a child still pending is an alias of its own ancestor: a recursive document, endless once expanded
            sizes[key] = 1 + sum(sizes.get(id(k), MAX_YAML_NODES + 1) for k in kids(node))
            pending.discard(key)
            if sizes[key] > MAX_YAML_NODES:
                return sizes[key]
        elif key not in sizes and key not in pending:
            if isinstance(node, yaml.ScalarNode):
                sizes[key] = 1
                continue
            pending.add(key)
            stack.append((node, True))
            stack.extend((k, False) for k in kids(node))
    return sizes[id(root)]
