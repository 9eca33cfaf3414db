"""Bake: chosen knob values written into the script as plain code, with no autotune import and no trial hook."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from autotune import files
from autotune.analysis import Project
from autotune.errors import UsageError
from autotune.patch import CONFIG_NAME, PatchResult, run, select, write_files
from autotune.patch import check_out_dir as check_project_out_dir
from autotune.transform import Mode, all_knobs

DIFF_NAME = "tuned.diff"


def read_config(path: Path) -> tuple[dict[str, Any], str | None]:
    """Knob values and device from a YAML file: ``knobs: {name: value}`` (or ``{name: {value: ...}}``), ``device:``.

    Takes the ``autotune.yaml`` that search and patch write as well as a hand-written one.
    """
    where = str(path)
    try:
        doc = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"{where}: cannot read the config: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{where}: the config is not UTF-8 text") from None
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UsageError(f"{where}: not valid YAML: {problem}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("knobs"), dict):
        raise UsageError(f"{where}: expected a mapping with 'knobs:' (knob name -> value)")
    device = doc.get("device")
    if device is not None and device not in ("cpu", "cuda"):
        raise UsageError(f"{where}: device must be cpu or cuda, not {device!r}")
    known = all_knobs()
    values: dict[str, Any] = {}
    for name, spec in doc["knobs"].items():
        value = spec.get("value", spec.get("default")) if isinstance(spec, dict) else spec
        knob = known.get(name)
        if knob is None:
            raise UsageError(f"{where}: unknown knob '{name}' (known: {', '.join(sorted(known))})")
        if value not in knob.choices:
            raise UsageError(f"{where}: knob '{name}' has no choice {value!r} (choices: {', '.join(map(repr, knob.choices))})")
        values[name] = value
    return values, device


def bake(project: Project, values: Mapping[str, Any], device: str) -> PatchResult:
    """The project's files with ``values`` written in; a knob at its default changes nothing."""
    unknown = sorted(set(values) - set(all_knobs()))
    if unknown:
        raise UsageError(f"unknown knob(s): {', '.join(unknown)}")
    return run(project, select(), Mode(values=dict(values), device=device), hooks=False)


def check_out_dir(out: Path, project: Project, names: Iterable[str] = ()) -> Path:
    """The output folder of a bake (or a search), refused where writing its outputs and ``names`` there could
    overwrite the user's own files or would fail; nothing is written."""
    return check_project_out_dir(out, project, (CONFIG_NAME, DIFF_NAME, *names))


def write_baked(result: PatchResult, out_dir: Path, config: Mapping[str, Any] | None = None, header: str = "") -> list[Path]:
    """Write every file of the baked project (same layout as the original), ``tuned.diff`` and, given, the config."""
    files.claim_out_dir(out_dir)
    written = []
    if config is not None:
        written.append(files.write_file(out_dir / CONFIG_NAME, header + yaml.safe_dump(dict(config), sort_keys=False)))
    written.extend(write_files(result, out_dir))
    written.append(files.write_file(out_dir / DIFF_NAME, result.diff()))
    return written
