"""Bake: chosen knob values written into the script as plain code, with no autotune import and no trial hook."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from autotune import files
from autotune.project import Project
from autotune.errors import UsageError
from autotune.inputs import load_yaml_file, shown
from autotune.knobs import checked
from autotune.patch import CONFIG_NAME, PatchResult, run, select, write_files
from autotune.patch import check_out_dir as check_project_out_dir
from autotune.transform import Mode, all_knobs

DIFF_NAME = "tuned.diff"
DEVICES = ("cpu", "cuda")


def read_config(path: Path) -> tuple[dict[str, Any], str | None]:
    """Knob values and device from a YAML file: ``knobs: {name: value}`` (or ``{name: {value: ...}}``), ``device:``.

    Takes the ``autotune.yaml`` that search and patch write as well as a hand-written one.
    """
    where = str(path)
    doc = load_yaml_file(Path(path), "a knob config")
    if not isinstance(doc, dict) or not isinstance(doc.get("knobs"), dict):
        raise UsageError(f"{where}: expected a mapping with 'knobs:' (knob name -> value)")
    device = doc.get("device")
    if device is not None and (type(device) is not str or device not in DEVICES):
        raise UsageError(f"{where}: device must be cpu or cuda, not {shown(device)}")
    values = {
        name: spec.get("value", spec.get("default")) if isinstance(spec, dict) else spec
        for name, spec in doc["knobs"].items()
    }
    return checked(values, all_knobs(), where), device


def bake(project: Project, values: Mapping[str, Any], device: str) -> PatchResult:
    """The project's files with ``values`` written in; a knob at its default changes nothing.

    ``values`` may come from a study anyone with access to its storage can edit: each must be a declared choice.
    """
    values = checked(values, all_knobs(), "the knob values to bake")
    # the device is written into code too (autocast's device_type): the declared constant, never the value given
    device = next((d for d in DEVICES if type(device) is str and d == device), None)
    if device is None:
        raise UsageError(f"the device to bake for must be cpu or cuda, not {shown(device)}")
    return run(project, select(), Mode(values=values, device=device), hooks=False)


def check_out_dir(out: Path, project: Project, names: Iterable[str] = ()) -> Path:
    """The output folder of a bake (or a search), refused where writing its outputs and ``names`` there could
    overwrite the user's own files or would fail; nothing is written."""
    return check_project_out_dir(out, project, (CONFIG_NAME, DIFF_NAME, *names))


def write_baked(result: PatchResult, out_dir: Path, config: Mapping[str, Any] | None = None, header: str = "") -> list[Path]:
    """Write every file of the baked project (same layout as the original), ``tuned.diff`` where it changes anything
    (an empty patch makes ``git apply`` fail; an older one in the folder is removed) and, given, the config."""
    files.claim_out_dir(out_dir)
    written = []
    if config is not None:
        written.append(files.write_file(out_dir / CONFIG_NAME, header + yaml.safe_dump(dict(config), sort_keys=False)))
    written.extend(write_files(result, out_dir))
    diff = result.diff()
    if diff:
        written.append(files.write_file(out_dir / DIFF_NAME, diff))
    else:
        (out_dir / DIFF_NAME).unlink(missing_ok=True)
    return written
