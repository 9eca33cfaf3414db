"""nccl_env: NCCL's all-reduce algorithm, channel count and buffer size, set before the process group starts."""

from __future__ import annotations

import libcst as cst

from autotune.analysis import ModuleFacts
from autotune.knobs import Knob, Numerics
from autotune.transform import Edits, Status, Transform
from autotune.syntax import stmt
from autotune.transforms._dist import INIT_DEVICE_MESH, INIT_PROCESS_GROUP, backend_arg, calls_to, literal_string

_SETTERS = ("setdefault", "putenv", "update", "__setitem__")
_CUDA = frozenset({"cuda"})
# Every one of these changes how NCCL splits a buffer into ring or tree steps, hence the order in which each
# element's contributions are summed.
_ORDER = "changes the order of the sums"


class NcclEnv(Transform):
    """Set NCCL_ALGO, NCCL_MIN_NCHANNELS and NCCL_BUFFSIZE before the NCCL process group starts."""

    name = "nccl_env"
    tracks_settings = True
    entry_only = True
    devices = _CUDA
    knobs = (
        Knob(
            "nccl_env.algo",
            ("default", "ring", "tree"),
            "default",
            Numerics.REORDER,
            _CUDA,
            help="default: NCCL picks per message size; ring: NCCL_ALGO=Ring (every collective has it); tree: "
            "all-reduce as a tree, the rest ring or tree (NCCL_ALGO='ring,tree;allreduce:tree', NCCL 2.24+: a bare "
            f"Tree leaves broadcast and all-gather without an algorithm); {_ORDER}",
        ),
        Knob(
            "nccl_env.min_nchannels",
            ("default", 4, 8, 16, 32),
            "default",
            Numerics.REORDER,
            _CUDA,
            help=f"NCCL_MIN_NCHANNELS: at least this many channels (thread blocks) per collective; {_ORDER}",
        ),
        Knob(
            "nccl_env.buffsize_mb",
            ("default", 1, 2, 8, 16),
            "default",
            Numerics.REORDER,
            _CUDA,
            help=f"NCCL_BUFFSIZE in MiB (NCCL's default is 4): the staging buffer per channel and peer; {_ORDER}",
        ),
    )


    def apply(self, facts: ModuleFacts, edits: Edits) -> None:
        patched = next((c for c in facts.calls if facts.is_runtime_call(c, "nccl_env")), None)
        if patched is not None:
            self.report(facts, patched, Status.PRESENT, "the NCCL variables are already knobs")
            return
        starts = self._process_groups()
        if not starts:
            self.report(facts, facts.module, Status.NOT_APPLICABLE, "no process group is started with the NCCL backend")
            return
        script = self._script_sets()
        for module, node, var in script:
            self.report(module, node, Status.USER, f"the script sets {var} itself")
        free = [s for s, var in VARIABLES.items() if var not in {v for _, _, v in script}]
        if not free:
            return
        module, call, how = starts[0]
        anchor = _first_import(facts)
        self.report(facts, anchor, Status.APPLICABLE, f"{', '.join(VARIABLES[s] for s in free)} before {how}")
        if self.mode.gated:
            self.settings_read.update(free)
            sets = sorted(VARIABLES[s] for s in VARIABLES if s not in free)
            quoted = ", ".join(f'"{v}"' for v in sets)
            arg = f"script_sets=({quoted},)" if sets else ""
            edits.prelude(stmt(f"{edits.runtime('nccl_env')}({arg})\n"))
            return
        lines = []
        for declared in self.knobs:
            setting = declared.name.split(".", 1)[1]
            value = self.mode.value(declared)
            if setting in free and value != declared.default:
                lines.append(stmt(f'os.environ.setdefault("{VARIABLES[setting]}", "{env_value(setting, value)}")\n'))
        if not lines:
            return
        lines[0] = lines[0].with_changes(
            leading_lines=[cst.EmptyLine(), cst.EmptyLine(comment=cst.Comment("# NCCL reads these when the process group starts"))]
        )
        early_os = _early_os_import(facts)
        if early_os is not None:
            edits.insert_after(early_os, *lines)
        else:
            edits.prelude(stmt("import os\n"), *lines)

    def _process_groups(self) -> list[tuple[ModuleFacts, cst.Call, str]]:
        """Where the project starts a process group that can use NCCL: (module, call, how)."""
        out = []
        for module in self.project.modules:
            for call in calls_to(module, INIT_PROCESS_GROUP):
                backend = backend_arg(call)
                names = _backends(module, backend) if backend is not None else {"nccl"}
                where = _where(self.project, module, call)
                if names is None:
                    out.append((module, call, where[:-1] + ", backend chosen at run time)"))
                elif any("nccl" in n.lower() for n in names):
                    # no backend: torch picks NCCL for CUDA tensors
                    out.append((module, call, where if len(names) == 1 else where[:-1] + f", backend {' or '.join(sorted(names))})"))
            for call in calls_to(module, INIT_DEVICE_MESH):
                args = [a for a in call.args if a.keyword is None]
                kind = literal_string(args[0].value) if args else None
                if kind in (None, "cuda"):
                    out.append((module, call, _where(self.project, module, call)))
        return out

    def _script_sets(self) -> list[tuple[ModuleFacts, cst.CSTNode, str]]:
        """The NCCL variables the script writes itself (``os.environ["NCCL_ALGO"] = ...``)."""
        found = []
        names = set(VARIABLES.values())
        for module in self.project.modules:
            for node in module.strings:
                if node.evaluated_value not in names:
                    continue
                line = module.statement_of(node)
                for anc in module.ancestors(node):
                    if anc is line:
                        break
                    if isinstance(anc, cst.AssignTarget) or (
                        isinstance(anc, cst.Call) and isinstance(anc.func, cst.Attribute) and anc.func.attr.value in _SETTERS
                    ):
                        found.append((module, node, node.evaluated_value))
                        break
        return found


def _backends(facts: ModuleFacts, node: cst.BaseExpression, depth: int = 0) -> set[str] | None:
    """The backend names an expression can hold: literals, ``a if cond else b``, a variable the file assigns
    only such values, ``dist.Backend.GLOO``; None where it cannot be told (an argument, a config value)."""
    name = literal_string(node)
    if name is not None:
        return {name}
    if isinstance(node, cst.IfExp):
        a, b = _backends(facts, node.body, depth), _backends(facts, node.orelse, depth)
        return a | b if a is not None and b is not None else None
    qual = facts.qualname(node) or ""
    if qual.startswith("torch.distributed.Backend.") and qual.count(".") == 3:
        return {qual.rsplit(".", 1)[1].lower()}
    if isinstance(node, cst.Name) and depth < 3:
        values = [a.value for a in facts.assigns if any(isinstance(t.target, cst.Name) and t.target.value == node.value for t in a.targets)]
        found = [_backends(facts, v, depth + 1) for v in values]
        if values and all(f is not None for f in found):
            return set().union(*found)
    return None


def _where(project, module: ModuleFacts, call: cst.Call) -> str:
    """``dist.init_process_group() (line 12)``, with the file when it is not the entry script."""
    line = module.position(call)[0]
    place = f"line {line}" if module is project.entry else f"{module.display}:{line}"
    return f"{module.code(call.func)}() ({place})"


def _top_imports(facts: ModuleFacts):
    for s in facts.module.body:
        if isinstance(s, cst.SimpleStatementLine) and all(isinstance(x, (cst.Import, cst.ImportFrom)) for x in s.body):
            yield s


def _first_import(facts: ModuleFacts) -> cst.CSTNode:
    for line in _top_imports(facts):
        first = line.body[0]
        if not (isinstance(first, cst.ImportFrom) and isinstance(first.module, cst.Name) and first.module.value == "__future__"):
            return first
    return facts.module


def _early_os_import(facts: ModuleFacts) -> cst.SimpleStatementLine | None:
    """The last of the leading standard-library import lines, when ``import os`` is among them: nothing can have
    started NCCL yet, and ``os`` is there to use."""
    last, has_os = None, False
    for s in facts.module.body:
        if not (isinstance(s, cst.SimpleStatementLine) and all(isinstance(x, (cst.Import, cst.ImportFrom)) for x in s.body)):
            if last is None and isinstance(s, cst.SimpleStatementLine) and len(s.body) == 1 and isinstance(s.body[0], cst.Expr):
                continue  # the docstring
            break
        if not all(_stdlib(facts, small) for small in s.body):
            break
        last = s
        has_os = has_os or any(
            isinstance(small, cst.Import) and any(a.asname is None and facts.code(a.name) == "os" for a in small.names)
            for small in s.body
        )
    return last if has_os else None


def _stdlib(facts: ModuleFacts, small: cst.BaseSmallStatement) -> bool:
    if isinstance(small, cst.ImportFrom):
        if small.relative or small.module is None:
            return False  # a local module: it may import torch
        return facts.code(small.module).split(".")[0] in sys.stdlib_module_names
    return all(facts.code(a.name).split(".")[0] in sys.stdlib_module_names for a in small.names)  # type: ignore[union-attr]


# === runtime: what the patched script runs (python -m autotune.catalog copies it into autotune/runtime_helpers.py) ===

import os
import sys
from typing import Any

from autotune.knob_values import knob, on_reset, reports_applied

# knob setting -> environment variable
VARIABLES = {"algo": "NCCL_ALGO", "min_nchannels": "NCCL_MIN_NCHANNELS", "buffsize_mb": "NCCL_BUFFSIZE"}
# tree: all-reduce pinned to Tree, every other collective free to use Ring or Tree. A bare NCCL_ALGO=Tree leaves
# broadcast and all-gather with no algorithm (NVIDIA/nccl#317); a bare "allreduce:tree" disables the others from
# NCCL 2.31 on (vllm-project/vllm#58179).
ALGO = {"ring": "Ring", "tree": "ring,tree;allreduce:tree"}


def env_value(setting: str, value: Any) -> str:
    """The environment value for a choice of ``nccl_env.<setting>``: what the baked and the patched script set."""
    if setting == "algo":
        return ALGO[value]
    return str(int(value) * 1024 * 1024) if setting == "buffsize_mb" else str(value)


def nccl_env(script_sets: tuple[str, ...] = ()) -> None:
    """Set the NCCL variables the knobs ask for, before any process group starts.

    A variable already in the environment, or one the script sets itself (named in ``script_sets``), is left alone.
    """
    for setting, var in VARIABLES.items():
        value = knob(f"nccl_env.{setting}", record=False)
        if value == "default" or var in script_sets or var in os.environ:
            continue
        os.environ[var] = env_value(setting, value)
        _nccl_set.append(f"nccl_env.{setting}")


_nccl_set: list[str] = []  # the nccl_env knobs whose variable this process set: applied once NCCL runs


def _nccl_running() -> bool:
    """Whether this process has a process group on the NCCL backend (the variables only matter to one)."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    try:
        return bool(dist and dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend()).lower())
    except (RuntimeError, ValueError):  # pragma: no cover - a group torn down meanwhile
        return False


reports_applied(lambda: list(_nccl_set) if _nccl_set and _nccl_running() else [])
on_reset(_nccl_set.clear)
