"""Parse -> transforms -> one rewrite pass per file -> compile() check -> write / diff."""

from __future__ import annotations

import difflib
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import libcst as cst

from autotune.analysis import (
    RUNTIME_ALIAS,
    RUNTIME_MODULE,
    ModuleFacts,
    Project,
    TrainingLoop,
    deep,
    load_project,
    no_gc,
    source_lines,
)
from autotune.errors import UsageError
from autotune.knobs import Knob
from autotune.transform import Edits, Mode, Site, Status, Transform, all_transforms, is_docstring, stmt

CONFIG_NAME = "autotune.yaml"
DIFF_NAME = "patch.diff"


@dataclass(frozen=True)
class FileChange:
    """One file of the project: where it lives, its original and its new text."""

    facts: ModuleFacts
    rel: Path  # relative to the entry script's directory
    new_text: str

    @property
    def changed(self) -> bool:
        return self.new_text != self.facts.text


@dataclass(frozen=True)
class PatchResult:
    """What a patch (or a bake) of a project found and produced."""

    project: Project
    sites: tuple[Site, ...]
    files: tuple[FileChange, ...]
    knobs: tuple[Knob, ...]  # knobs the gated files now read

    @property
    def changed(self) -> bool:
        return any(f.changed for f in self.files)

    def diff(self, old_prefix: str = "a/", new_prefix: str = "b/") -> str:
        chunks = []
        for f in self.files:
            if f.changed:
                chunks.extend(
                    difflib.unified_diff(
                        source_lines(f.facts.text, keepends=True),
                        source_lines(f.new_text, keepends=True),
                        f"{old_prefix}{f.rel.as_posix()}",
                        f"{new_prefix}{f.rel.as_posix()}",
                    )
                )
        return "".join(c if c.endswith("\n") else c + "\n\\ No newline at end of file\n" for c in chunks)


def select(only: Iterable[str] | None = None, skip: Iterable[str] | None = None) -> list[type[Transform]]:
    """The transforms to run; an unknown name is a UsageError listing the known ones."""
    known = {t.name: t for t in all_transforms()}
    only, skip = list(only or []), list(skip or [])
    for name in [*only, *skip]:
        if name not in known:
            raise UsageError(f"unknown transform '{name}' (known: {', '.join(known)})")
    return [t for n, t in known.items() if (not only or n in only) and n not in skip]


def run(
    project: Project,
    transforms: list[type[Transform]] | None = None,
    mode: Mode = Mode(),
    hooks: bool = True,
) -> PatchResult:
    """Run ``transforms`` over every file of ``project`` and produce the new texts (nothing is written).

    ``hooks=False`` leaves out the trial step hook, so a transform's fixture shows only its own edits.
    """
    return deep(_run_no_gc, project, transforms, mode, hooks)


def _run_no_gc(project: Project, transforms: list[type[Transform]] | None, mode: Mode, hooks: bool) -> PatchResult:
    with no_gc():
        return _run(project, transforms, mode, hooks)


def _run(project: Project, transforms: list[type[Transform]] | None, mode: Mode, hooks: bool) -> PatchResult:
    transforms = transforms if transforms is not None else list(all_transforms())
    if not mode.gated:
        # baking writes only what differs from the original behaviour
        transforms = [t for t in transforms if any(mode.value(k) != k.default for k in t.knobs)]
    instances = [t(project, mode) for t in transforms]
    used: dict[str, Knob] = {}
    per_file: list[tuple[ModuleFacts, Edits]] = []
    for facts in project.modules:
        edits = Edits()
        per_file.append((facts, edits))
        for transform in instances:
            if transform.entry_only and facts is not project.entry:
                continue
            before, asked = len(transform.sites), edits.runtime_calls
            transform.apply(facts, edits)
            applicable = any(s.status is Status.APPLICABLE for s in transform.sites[before:])
            # a site already present can still be made a knob (the dtype of the script's own autocast)
            if mode.gated and (applicable or edits.runtime_calls > asked):
                used.update((k.name, k) for k in transform.knobs_read())
    # a trial times the loop wherever it lives, even when only the model's file changed (sdpa, checkpointing)
    if mode.gated and hooks and any(edits for _, edits in per_file):
        for facts, edits in per_file:
            _step_hooks(project, facts, edits)
    files = []
    for facts, edits in per_file:
        new_text, check = _code(facts, _apply(facts, edits)) if edits else (facts.source, facts.source)
        new_text = facts.bom + new_text  # Python runs a file with a BOM: the copy keeps it
        if new_text != facts.text:
            try:
                compile(check, facts.display, "exec")
            except SyntaxError as exc:  # a transform bug, never the user's: say which file and line
                raise RuntimeError(f"autotune produced invalid code for {facts.display}:{exc.lineno}: {exc.msg}") from exc
        files.append(FileChange(facts, facts.path.relative_to(project.root), new_text))
    sites = tuple(s for t in instances for s in t.sites)
    return PatchResult(project, sites, tuple(files), tuple(sorted(used.values(), key=lambda k: k.name)))


def scan(project: Project, transforms: list[type[Transform]] | None = None) -> tuple[Site, ...]:
    """A patch whose trees are thrown away: the sites, with the same code that would rewrite them."""
    return run(project, transforms).sites


# --- the step hook -----------------------------------------------------------------------------------------


def _hook_losses(facts: ModuleFacts, exprs: list[cst.BaseExpression]) -> list[str]:
    """Loss expressions that can be evaluated again after the step: names, attributes and arithmetic on them."""
    out = []
    for e in exprs:
        if not any(isinstance(n, cst.Call) for n in _walk(e)):
            code = facts.code(e)
            if code not in out:
                out.append(code)
    return out


def _walk(node: cst.CSTNode):
    yield node
    for child in node.children:
        yield from _walk(child)


def _batch_name(loop: TrainingLoop) -> str | None:
    node = loop.node
    if not isinstance(node, cst.For):
        return None
    target = node.target
    if isinstance(node.iter, cst.Call) and isinstance(node.iter.func, cst.Name) and node.iter.func.value == "range":
        return None  # counting steps, not iterating batches
    if isinstance(node.iter, cst.Call) and isinstance(node.iter.func, cst.Name) and node.iter.func.value == "enumerate":
        if isinstance(target, cst.Tuple) and len(target.elements) == 2:
            target = target.elements[1].value
    if isinstance(target, (cst.Tuple, cst.List)) and target.elements:
        target = target.elements[0].value
    return target.value if isinstance(target, cst.Name) else None


def _step_hooks(project: Project, facts: ModuleFacts, edits: Edits) -> None:
    """After the last optimizer step of each training step, ``_autotune.step(losses...)`` (a no-op outside trials)."""
    for loop in project.loops:
        scopes = [s for s in loop.scopes if s.module is facts and s.steps]
        if not scopes:
            continue
        scope = scopes[-1]
        if any(facts.is_runtime_call(c, "step") for c in facts.calls_in(scope.owner)):
            continue  # already patched
        last = max(scope.steps, key=lambda c: facts._enter[c])
        anchor = facts.statement_of(last)
        args = _hook_losses(facts, scope.loss_exprs())
        batch = _batch_name(loop) if loop.module is facts and facts.contains(loop.node, anchor) else None
        if batch is not None and batch not in args:
            args.append(f"batch={batch}")
        edits.insert_after(anchor, stmt(f"{edits.runtime('step')}({', '.join(args)})\n"))


# --- applying edits ----------------------------------------------------------------------------------------


class _Applier(cst.CSTTransformer):
    """Applies one file's edits in a single pass, descending only into subtrees that hold an edit."""

    def __init__(self, facts: ModuleFacts, edits: Edits) -> None:
        super().__init__()
        self.facts, self.e = facts, edits
        self.wrapped = {s for group, _ in edits.wraps for s in group}
        self.wrap_blocks = {facts.block_of(group[0]) for group, _ in edits.wraps}
        targets = set(edits.replace) | set(edits.before) | set(edits.after) | self.wrapped
        self.paths: set[cst.CSTNode] = set()
        for node in targets:
            self.paths.update(facts.ancestors(node))
        self.done: dict[cst.CSTNode, list[cst.BaseStatement]] = {}

    def on_visit(self, node: cst.CSTNode) -> bool:
        return node in self.paths

    def on_leave(self, original: cst.CSTNode, updated: cst.CSTNode):
        node = updated
        for fn in self.e.replace.get(original, ()):
            node = fn(node)
        if isinstance(original, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
            out = [*self.e.before.get(original, ()), node, *self.e.after.get(original, ())]
            self.done[original] = out
            if len(out) > 1:
                return cst.FlattenSentinel(out)
        if original in self.wrap_blocks:
            node = node.with_changes(body=self._rebuild(original.body))
        return node

    def _rebuild(self, body) -> list[cst.BaseStatement]:
        # each item: the original statements it stands for, and what now stands in their place
        items: list[tuple[frozenset, list[cst.BaseStatement]]] = [(frozenset([s]), list(self.done.get(s, [s]))) for s in body]
        here = set(body)
        # innermost first: a wrap around a wrapped group (no_sync around autocast) wraps the statement it became
        for group, fn in sorted((w for w in self.e.wraps if w[0][0] in here), key=lambda w: len(w[0])):
            wanted = set(group)
            idx = [i for i, (orig, _) in enumerate(items) if orig & wanted]
            covered = frozenset().union(*(items[i][0] for i in idx))
            if covered != wanted or idx != list(range(idx[0], idx[-1] + 1)):
                raise RuntimeError(f"{self.facts.display}: two transforms wrap overlapping statements")
            new = fn([x for i in idx for x in items[i][1]])
            items[idx[0] : idx[-1] + 1] = [(covered, list(new) if isinstance(new, (list, tuple)) else [new])]
        return [x for _, stmts in items for x in stmts]


def _header_end(body: list[cst.BaseStatement]) -> int:
    """Index after the module docstring and ``from __future__`` imports."""
    i = 0
    if body and is_docstring(body[0]):
        i = 1
    while i < len(body) and isinstance(body[i], cst.SimpleStatementLine) and all(
        isinstance(s, cst.ImportFrom) and isinstance(s.module, cst.Name) and s.module.value == "__future__"
        for s in body[i].body
    ):
        i += 1
    return i



def _is_import_line(node: cst.BaseStatement) -> bool:
    return isinstance(node, cst.SimpleStatementLine) and all(isinstance(s, (cst.Import, cst.ImportFrom)) for s in node.body)


def _apply(facts: ModuleFacts, edits: Edits) -> cst.Module:
    module = facts.module.visit(_Applier(facts, edits))
    body = list(module.body)
    head = _header_end(body)
    if edits.post_imports:
        last_import = None
        for i, s in enumerate(body):
            if _is_import_line(s):
                last_import = i
            elif isinstance(s, cst.BaseCompoundStatement) and not isinstance(s, (cst.Try, cst.If)):
                break
        at = last_import + 1 if last_import is not None else head
        body[at:at] = edits.post_imports
    top: list[cst.BaseStatement] = []
    if edits.uses_runtime and not facts.has_runtime_import():
        top.append(stmt(f"import {RUNTIME_MODULE} as {RUNTIME_ALIAS}\n"))
    for name in edits.imports:
        if facts.imports.get(name) != name:
            top.append(stmt(f"import {name}\n"))
    top.extend(edits.top)
    if top:
        if head < len(body):
            # keep the blank lines and comments that led the first statement above the inserted block
            first = body[head]
            top[0] = top[0].with_changes(leading_lines=first.leading_lines)
            body[head] = first.with_changes(leading_lines=[])
            if head > 0:
                top.append(body[head])
                body[head : head + 1] = top
            else:
                body[head : head + 1] = [*top, body[head]]
        else:
            body.extend(top)
    return module.with_changes(body=body)


def _code(facts: ModuleFacts, module: cst.Module) -> tuple[str, str]:
    """The text of ``module``, copying the original text of each top-level statement the edits left alone, and
    the text to compile() as a check of it.

    Generating code is the slowest step of a rewrite, and most statements of a long file are untouched. The
    check text is the new text with each copied statement past the module's head (docstring and ``__future__``
    imports) blanked to a ``pass`` on its last line: the user's own statements compiled when ast parsed them,
    whether a top-level statement compiles does not depend on the others, and the line numbers stay those of the
    new text for the error message.
    """
    texts = facts.statement_texts()
    if not texts or not module.has_trailing_newline:  # without a final newline, libcst drops the last one it writes
        code = module.code
        return code, code
    parts = [module.code_for_node(line) for line in module.header]
    check = list(parts)
    original = facts.module.body
    head = set(original[: _header_end(list(original))])
    for s in module.body:
        if s in texts:
            text = texts[s]
            parts.append(text)
            check.append(text if s in head else _blank(text))
        else:
            text = module.code_for_node(s)
            parts.append(text)
            check.append(text)
    tail = [module.code_for_node(line) for line in module.footer]
    return "".join(parts + tail), "".join(check + tail)


def _blank(text: str) -> str:
    """A statement's text as as many lines, the last one ``pass``."""
    return "\n" * (len(source_lines(text)) - 1) + "pass\n"


# --- outputs -----------------------------------------------------------------------------------------------


def knob_table(knobs: Iterable[Knob], values: Mapping[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """The ``knobs:`` section of autotune.yaml: value, default, choices, numerics and devices of each knob."""
    values = values or {}
    return {
        k.name: {
            "value": values.get(k.name, k.default),
            "default": k.default,
            "choices": list(k.choices),
            "numerics": str(k.numerics),
            "devices": sorted(k.devices),
            "help": k.help,
        }
        for k in knobs
    }


def write_files(result: PatchResult, out_dir: Path) -> list[Path]:
    """Every file of the project, changed or not, at its place relative to the entry script under ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for f in result.files:
        dest = out_dir / f.rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(f.new_text, encoding="utf-8")
        written.append(dest)
    return written


def write_outputs(result: PatchResult, out_dir: Path, script_display: str) -> list[Path]:
    """Write the patched files, the unchanged local modules beside them, autotune.yaml and patch.diff."""
    import yaml  # here, not at the top: scan and patch --diff write no config, and start-up counts

    root = result.project.root
    out_dir = out_dir.resolve()
    if out_dir == root:
        raise UsageError(f"{out_dir}: the output folder must not be the script's own folder (use --in-place)")
    written = write_files(result, out_dir)
    config = out_dir / CONFIG_NAME
    header = (
        f"# Knobs autotune injected into {script_display}. Every value is the default, which reproduces the\n"
        "# original script exactly. Change a value (one of its choices) to try it, or run `autotune search`.\n"
    )
    doc = {"script": script_display, "knobs": knob_table(result.knobs)}
    config.write_text(header + yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    diff = out_dir / DIFF_NAME
    diff.write_text(result.diff(), encoding="utf-8")
    return [*written, config, diff]


def _backup_path(path: Path) -> Path:
    """``<file>.orig``, or ``<file>.orig.N`` when an earlier backup exists: the first original is never lost."""
    backup = path.with_name(path.name + ".orig")
    n = 1
    while backup.exists():
        backup = path.with_name(f"{path.name}.orig.{n}")
        n += 1
    return backup


def write_in_place(result: PatchResult) -> list[Path]:
    """Overwrite the user's changed files, each after keeping ``<file>.orig``; autotune.yaml beside the entry."""
    import yaml

    written = []
    for f in result.files:
        if not f.changed:
            continue
        shutil.copy2(f.facts.path, _backup_path(f.facts.path))
        f.facts.path.write_text(f.new_text, encoding="utf-8")
        written.append(f.facts.path)
    config = result.project.root / CONFIG_NAME
    if config.exists():
        shutil.copy2(config, _backup_path(config))
    doc = {"script": result.project.entry.display, "knobs": knob_table(result.knobs)}
    config.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return [*written, config]


def patch_path(path: Path, only=None, skip=None, mode: Mode = Mode()) -> PatchResult:
    return run(load_project(path), select(only, skip), mode)
