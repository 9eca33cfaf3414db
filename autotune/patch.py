"""Parse -> transforms -> one rewrite pass per file -> compile() check -> write / diff."""

from __future__ import annotations

import ast
import difflib
import sys
import traceback
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import libcst as cst

from autotune.analysis import RUNTIME_ALIAS, RUNTIME_MODULE, ModuleFacts, source_lines
from autotune.source import deep, no_gc
from autotune.project import Project, load_project
from autotune import files
from autotune.hooks import framework_hooks, step_hooks
from autotune.bound import is_bound, statement_binds, statement_reads
from autotune.errors import UsageError
from autotune.knobs import Knob
from autotune.transform import Edits, Mode, Site, Status, Transform, all_transforms
from autotune.syntax import is_docstring, stmt

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
        """A unified diff of every changed file; paths from the root of the git repository holding the script,
        if one does (so that ``git apply`` takes it there), else from the script's folder."""
        root = self.project.root.resolve()
        repo = next((d for d in (root, *root.parents) if (d / ".git").exists()), root)  # a worktree's .git is a file
        under = root.relative_to(repo).as_posix() + "/" if repo != root else ""
        chunks = []
        for f in self.files:
            if f.changed:
                chunks.extend(
                    difflib.unified_diff(
                        source_lines(f.facts.text, keepends=True),
                        source_lines(f.new_text, keepends=True),
                        f"{old_prefix}{under}{f.rel.as_posix()}",
                        f"{new_prefix}{under}{f.rel.as_posix()}",
                    )
                )
        return "".join(c if c.endswith("\n") else c + "\n\\ No newline at end of file\n" for c in chunks)


def select(only: Iterable[str] | None = None, skip: Iterable[str] | None = None) -> list[type[Transform]]:
    """The transforms to run (``only`` None: all); an unknown name, or a selection of none, is a UsageError listing
    the known ones."""
    known = {t.name: t for t in all_transforms()}
    names = ", ".join(known)
    if only is not None:
        only = list(only)
        if not only:
            raise UsageError(f"--only names no transform (known: {names})")
    skip = list(skip or [])
    for name in [*(only or []), *skip]:
        if name not in known:
            raise UsageError(f"unknown transform '{name}' (known: {names})")
    chosen = [t for n, t in known.items() if (only is None or n in only) and n not in skip]
    if not chosen:
        raise UsageError(f"--skip leaves no transform to run (known: {names})")
    return chosen


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
    # each transform writes into edits of its own, merged in transform order once all succeeded: one that fails
    # inside its own analysis leaves its sites untouched in every file, and the others go on
    own: dict[tuple[ModuleFacts, Transform], Edits] = {}
    failed: set[Transform] = set()
    for facts in project.modules:
        for transform in instances:
            if transform in failed or (transform.entry_only and facts is not project.entry):
                continue
            edits = own[facts, transform] = Edits()
            before = len(transform.sites)
            try:
                transform.apply(facts, edits)
            except Exception as exc:  # a transform bug: the script is still scanned and patched by the others
                failed.add(transform)
                transform.sites[:] = [Site(transform.name, facts.display, 1, 1, Status.NOT_ANALYSED, _failure(exc))]
                continue
            unbound_read = _unbound_read(facts, edits)
            if unbound_read is not None:  # the edits would raise NameError at the default: none of them is made
                own[facts, transform] = Edits()
                transform.sites[before:] = [
                    replace(s, status=Status.NOT_APPLICABLE, reason=unbound_read) if s.status is Status.APPLICABLE else s
                    for s in transform.sites[before:]
                ]
    used: dict[str, Knob] = {}
    per_file: list[tuple[ModuleFacts, Edits]] = []
    for facts in project.modules:
        edits = Edits()
        for transform in instances:
            if transform not in failed and (facts, transform) in own:
                edits.merge(own[facts, transform])
        per_file.append((facts, edits))
    for transform in instances:
        # a site already present can still be made a knob (the dtype of the script's own autocast)
        asked = any(e.runtime_calls for (_, t), e in own.items() if t is transform)
        applicable = any(s.status is Status.APPLICABLE for s in transform.sites)
        if mode.gated and transform not in failed and (applicable or asked):
            used.update((k.name, k) for k in transform.knobs_read())
    # a trial times the loop wherever it lives, even when only the model's file changed (sdpa, checkpointing)
    if mode.gated and hooks and any(edits for _, edits in per_file):
        for facts, edits in per_file:
            step_hooks(project, facts, edits)
            framework_hooks(project, facts, edits)
    files = []
    for facts, edits in per_file:
        new_text, check = facts.source, facts.source
        if edits:
            module = _apply(facts, edits)
            new_text, check = _code(facts, module)
            stale = _stale_imports(facts, new_text) if not mode.gated and new_text != facts.source else set()
            if stale:  # baked code is read and kept by people: an import only the replaced code used goes too
                new_text, check = _code(facts, _drop_imports(module, stale))
        new_text = facts.bom + new_text  # Python runs a file with a BOM: the copy keeps it
        if new_text != facts.text:
            try:
                compile(check, facts.display, "exec")
            except SyntaxError as exc:  # a transform bug, never the user's: say which file and line
                raise RuntimeError(f"autotune produced invalid code for {facts.display}:{exc.lineno}: {exc.msg}") from exc
        files.append(FileChange(facts, facts.path.relative_to(project.root), new_text))
    sites = tuple(s for t in instances for s in t.sites)
    return PatchResult(project, sites, tuple(files), tuple(sorted(used.values(), key=lambda k: k.name)))


def _unbound_read(facts: ModuleFacts, edits: Edits) -> str | None:
    """Why a statement ``edits`` inserts could raise NameError: a name it reads that some path leaves unbound."""
    added = [s for group in (*edits.before.values(), *edits.after.values()) for s in group]
    ours = {RUNTIME_ALIAS, *(m.split(".")[0] for m in edits.imports)}
    for s in [*edits.top, *edits.post_imports]:
        ours |= statement_binds(s)
    binds = [statement_binds(s) for s in added]
    for placed, after in ((edits.before, False), (edits.after, True)):
        for anchor, stmts in placed.items():
            for s in stmts:
                # names the other inserted statements bind; not the ones this one binds from its own reads
                # (``a, b = f(a, b)`` needs a and b bound before it)
                others = ours.union(*(b for t, b in zip(added, binds) if t is not s))
                for name in statement_reads(s):
                    if name not in others and not is_bound(facts, anchor, name, after):
                        # ast gives positions of calls and compound statements, not of a line as a whole
                        line = facts.position(next(iter(facts.calls_in(anchor)), anchor))[0]
                        return f"{name} is not bound on every path to {facts.display}:{line}, where the edit reads it"
    return None


def _failure(exc: Exception) -> str:
    """Why a transform could not analyse a file: the exception and the line of autotune that raised it."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {Path(frames[-1].filename).parent.name}/{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    return f"{type(exc).__name__}: {exc}{where} (a bug in autotune; its sites are left as written)"


def scan(project: Project, transforms: list[type[Transform]] | None = None) -> tuple[Site, ...]:
    """A patch whose trees are thrown away: the sites, with the same code that would rewrite them."""
    return run(project, transforms).sites


# --- the step hook -----------------------------------------------------------------------------------------


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


def _add_import(body: list[cst.BaseStatement], head: int, module: str) -> bool:
    """Insert ``import module`` among the module's leading imports: a standard-library module in name order among
    the standard-library ones, any other after the last; False when the module starts with no import."""
    end = head
    while end < len(body) and _is_import_line(body[end]):
        end += 1
    if end == head:
        return False
    new = stmt(f"import {module}\n")
    if module.split(".")[0] in sys.stdlib_module_names:
        std = [i for i in range(head, end) if all(_module(s).split(".")[0] in sys.stdlib_module_names for s in body[i].body)]
        later = [i for i in std if _module(body[i].body[0]) > module]
        if later:  # before it, in its place: the blank lines and comments above it now lead the new import
            at = later[0]
            body[at : at + 1] = [new.with_changes(leading_lines=body[at].leading_lines), body[at].with_changes(leading_lines=[])]
            return True
        if std:
            body.insert(std[-1] + 1, new)
            return True
    body.insert(end, new)
    return True


def _module(node: cst.Import | cst.ImportFrom) -> str:
    """The dotted module an import statement reads (``""`` for a relative import)."""
    if isinstance(node, cst.Import):
        return cst.Module([]).code_for_node(node.names[0].name)
    if node.relative or node.module is None:
        return ""
    return cst.Module([]).code_for_node(node.module)


def _stale_imports(facts: ModuleFacts, new_text: str) -> set[str]:
    """Names that top-level standard-library imports bind, that the original code read and ``new_text`` no longer
    does (``math`` once SDPA replaced the hand-written attention)."""
    def read(tree: ast.AST) -> set[str]:
        return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}

    bound = set()
    for node in facts.tree.body:
        if isinstance(node, ast.Import):
            bound |= {(a.asname or a.name.split(".")[0], a.name.split(".")[0]) for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            bound |= {(a.asname or a.name, node.module.split(".")[0]) for a in node.names if a.name != "*"}
    before = read(facts.tree)
    if "__all__" in before:  # names may be exported by a string
        return set()
    candidates = {name for name, root in bound if root in sys.stdlib_module_names and name in before}
    return candidates - read(ast.parse(new_text)) if candidates else set()


def _drop_imports(module: cst.Module, names: set[str]) -> cst.Module:
    """``module`` without the top-level standard-library import aliases that bind ``names``; a line left empty
    goes, its leading comments passed on to the next statement."""
    def binds(alias: cst.ImportAlias, plain: bool) -> str:
        if alias.asname is not None:
            return cst.Module([]).code_for_node(alias.asname.name)
        dotted = cst.Module([]).code_for_node(alias.name)
        return dotted.split(".")[0] if plain else dotted

    body: list[cst.BaseStatement] = []
    carried: list[cst.EmptyLine] | None = None
    for line in module.body:
        if _is_import_line(line):
            smalls = []
            for small in line.body:
                plain = isinstance(small, cst.Import)
                if isinstance(small.names, cst.ImportStar) or _module(small).split(".")[0] not in sys.stdlib_module_names:
                    smalls.append(small)
                    continue
                keep = [a for a in small.names if binds(a, plain) not in names]
                if keep:
                    if len(keep) < len(small.names):
                        keep[-1] = keep[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
                        small = small.with_changes(names=keep)
                    smalls.append(small)
            if not smalls:
                carried = [*(carried or []), *line.leading_lines]
                continue
            if len(smalls) < len(line.body):
                smalls[-1] = smalls[-1].with_changes(semicolon=cst.MaybeSentinel.DEFAULT)
                line = line.with_changes(body=smalls)
            elif smalls != list(line.body):
                line = line.with_changes(body=smalls)
        if carried is not None:
            comments = any(x.comment is not None for x in carried)
            lead = [*carried, *line.leading_lines] if comments else list(line.leading_lines) or carried  # no pile-up
            while not body and lead and lead[0].comment is None:
                lead = lead[1:]  # now the first statement: no blank line above it
            line = line.with_changes(leading_lines=lead)
            carried = None
        body.append(line)
    return module.with_changes(body=body)


def _apply(facts: ModuleFacts, edits: Edits) -> cst.Module:
    module = facts.module.visit(_Applier(facts, edits))
    body = list(module.body)
    head = _header_end(body)
    wanted = [name for name in edits.imports if facts.imports.get(name) != name]
    placed = [name for name in wanted if _add_import(body, head, name)]  # among the script's imports, not above
    if edits.post_imports:
        last_import = None
        for i, s in enumerate(body):
            if _is_import_line(s):
                last_import = i
            elif isinstance(s, cst.BaseCompoundStatement) and not isinstance(s, (cst.Try, cst.If)):
                break
        at = last_import + 1 if last_import is not None else head
        body[at:at] = edits.post_imports
        after = at + len(edits.post_imports)
        if isinstance(body[after - 1], (cst.FunctionDef, cst.ClassDef)) and after < len(body):
            # two blank lines below a definition, as above it (PEP 8)
            lead = list(body[after].leading_lines)
            blank = next((i for i, line in enumerate(lead) if line.comment is not None), len(lead))  # above a comment
            body[after] = body[after].with_changes(leading_lines=[cst.EmptyLine()] * max(0, 2 - blank) + lead)
    top: list[cst.BaseStatement] = []
    if edits.uses_runtime and not facts.has_runtime_import():
        top.append(stmt(f"import {RUNTIME_MODULE} as {RUNTIME_ALIAS}\n"))
    top.extend(stmt(f"import {name}\n") for name in wanted if name not in placed)  # a module without imports
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


def check_out_dir(out: Path, project: Project, names: Iterable[str] = ()) -> Path:
    """The output folder for ``project``'s files and ``names``, refused where writing there could overwrite the
    user's files (the script itself, or a folder autotune did not make) or would fail; nothing is written."""
    files.refuse_dangling(out)
    resolved = out.resolve()
    root = project.root.resolve()
    rels = [m.path.relative_to(project.root) for m in project.modules]  # as write_files places them
    sources = {m.path.resolve() for m in project.modules}
    if resolved == root or any((resolved / rel).resolve() in sources for rel in rels):
        raise UsageError(
            f"{resolved}: the output folder must not be the script's own folder, where the outputs would overwrite "
            "the script (pass --out DIR)"
        )
    return files.check_out_dir(resolved, [*rels, *names])


def write_files(result: PatchResult, out_dir: Path) -> list[Path]:
    """Every file of the project, changed or not, at its place relative to the entry script under ``out_dir``."""
    return [files.write_file(out_dir / f.rel, f.new_text) for f in result.files]


def write_outputs(result: PatchResult, out_dir: Path, script_display: str) -> list[Path]:
    """Write the patched files, the unchanged local modules beside them, autotune.yaml and patch.diff."""
    import yaml  # here, not at the top: scan and patch --diff write no config, and start-up counts

    beside = result.files[0].rel.parent / CONFIG_NAME
    out_dir = files.claim_out_dir(check_out_dir(out_dir, result.project, (beside, DIFF_NAME)))
    written = write_files(result, out_dir)
    header = (
        f"# Knobs autotune injected into {script_display}. Every value is the default, which reproduces the\n"
        "# original script exactly. Change a value (one of its choices) to try it, or run `autotune search`.\n"
    )
    doc = {"script": script_display, "knobs": knob_table(result.knobs)}
    # the runtime reads it beside the entry (in a subfolder for an entry such as scripts/train.py)
    config = files.write_file(out_dir / result.files[0].rel.parent / CONFIG_NAME, header + yaml.safe_dump(doc, sort_keys=False))
    diff = files.write_file(out_dir / DIFF_NAME, result.diff())
    return [*written, config, diff]


def write_in_place(result: PatchResult) -> list[Path]:
    """Overwrite the user's changed files, each after keeping ``<file>.orig``, and autotune.yaml beside the entry:
    all of them or, should one fail, none."""
    import yaml

    doc = {"script": result.project.entry.display, "knobs": knob_table(result.knobs)}
    changes = [(f.facts.path, f.new_text) for f in result.files if f.changed]
    changes.append((result.project.entry.path.parent / CONFIG_NAME, yaml.safe_dump(doc, sort_keys=False)))
    return files.replace_all(changes)


def patch_path(path: Path, only=None, skip=None, mode: Mode = Mode()) -> PatchResult:
    return run(load_project(path), select(only, skip), mode)
