"""Knob values for patched scripts: read from the config once, each knob's default as its transform declares it.

Standard library and PyYAML only. Values come from the YAML file named by ``AUTOTUNE_CONFIG`` or, without it,
``autotune.yaml`` beside the script. With neither, every knob takes its default and the patched script behaves
exactly like the original. With one, each value is checked against every knob autotune declares
(``autotune.knob_table``, standard library only).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

CONFIG_ENV = "AUTOTUNE_CONFIG"
CONFIG_NAME = "autotune.yaml"

_values: dict[str, Any] | None = None
_device: str | None = None
# knobs whose non-default value reached the running program: the injected code that reads them ran (the trial
# result lists them, so a knob that was switched on where no code of it runs is not mistaken for a measurement)
_applied: dict[str, None] = {}
_late_reports: list[Callable[[], list[str]]] = []
_resets: list[Callable[[], None]] = []
_defaults: dict[str, Any] | None = None  # knob -> its declared default, once asked for


def _fail(msg: str) -> None:
    # SystemExit with a string prints one line and exits 1: no traceback inside the user's script.
    raise SystemExit(f"autotune: {msg}")


def _script_dir() -> Path:
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None) or (sys.argv[0] if sys.argv and sys.argv[0] else "")
    return Path(path).resolve().parent if path else Path.cwd()


def _read_yaml(path: Path) -> dict:
    from autotune.errors import UsageError
    from autotune.inputs import load_yaml_file

    try:
        doc = load_yaml_file(path, "a knob config")
    except UsageError as exc:
        _fail(str(exc))
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        _fail(f"{path}: expected a mapping at the top level")
    return doc


def _knob_section(doc: dict, path: Path) -> dict[str, Any]:
    knobs = doc.get("knobs") or {}
    if not isinstance(knobs, dict):
        _fail(f"{path}: 'knobs' must be a mapping of knob name to value")
    return knobs


def _checked(values: dict[str, Any], path: Path) -> dict[str, Any]:
    """``values`` as the knobs' declared choices, checked against every knob autotune has (not the file's list)."""
    from autotune.errors import UsageError
    from autotune.knobs import checked
    from autotune.knob_table import KNOBS

    try:
        return checked(values, KNOBS, str(path))
    except UsageError as exc:
        _fail(str(exc))


def load_config(table_path: Path | None = None, override_path: Path | None = None) -> tuple[dict[str, Any], str | None]:
    """Knob values and device from the knob table beside the script and the optional override file."""
    from autotune.inputs import shown

    table_path = table_path if table_path is not None else _script_dir() / CONFIG_NAME
    env = os.environ.get(CONFIG_ENV)
    override_path = override_path if override_path is not None else (Path(env) if env else None)
    table: dict[str, Any] = {}
    values: dict[str, Any] = {}
    device = None
    if table_path.is_file():
        doc = _read_yaml(table_path)
        device = doc.get("device")
        table = {
            name: spec.get("value", spec.get("default")) if isinstance(spec, dict) else spec
            for name, spec in _knob_section(doc, table_path).items()
        }
        values.update(_checked(table, table_path))
    if override_path is not None:
        if not override_path.exists():
            _fail(f"{override_path}: {CONFIG_ENV} names a file that does not exist")
        doc = _read_yaml(override_path)
        device = doc.get("device", device)
        override = {
            name: spec.get("value") if isinstance(spec, dict) else spec
            for name, spec in _knob_section(doc, override_path).items()
        }
        unread = [name for name in override if table and name not in table]
        if unread:
            _fail(f"{override_path}: unknown knob {shown(unread[0])} (this script has: {', '.join(sorted(table))})")
        values.update(_checked(override, override_path))
    if device is not None and (type(device) is not str or device not in ("cpu", "cuda")):
        _fail(f"device must be 'cpu' or 'cuda', not {shown(device)}")
    return values, device


def _loaded() -> dict[str, Any]:
    global _values, _device
    if _values is None:
        _values, _device = load_config()
    return _values


def default(name: str) -> Any:
    """The default of knob ``name`` as its transform declares it (``autotune.knob_table``, read once: helpers ask on
    every training step)."""
    global _defaults
    if _defaults is None:
        from autotune.knob_table import KNOBS

        _defaults = {n: k.default for n, k in KNOBS.items()}
    return _defaults[name]


def knob(name: str, record: bool = True) -> Any:
    """The configured value of knob ``name``, or its declared default when no config sets it.

    A value other than the default counts as applied (see ``applied``) unless ``record`` is false: helpers whose
    effect depends on more than the knob record it themselves, when it takes effect.
    """
    values = _loaded()
    if name not in values:
        return default(name)
    value = values[name]
    if record and value != default(name):
        _applied.setdefault(name)
    return value


def took_effect(*names: str) -> None:
    """Record knobs as applied: their helper changed the program."""
    for name in names:
        _applied.setdefault(name)


def applied() -> list[str]:
    """The knobs that took effect in this process so far, in the order they first did."""
    late = [name for report in _late_reports for name in report()]
    return list(dict.fromkeys([*_applied, *late]))


def reports_applied(report: Callable[[], list[str]]) -> None:
    """Have ``applied`` also list what ``report()`` returns when it is asked: knobs whose effect shows only later
    (an environment variable that counts once a library reads it)."""
    _late_reports.append(report)


def on_reset(forget: Callable[[], None]) -> None:
    """Have ``reset`` also call ``forget()``: a helper's own record of what it did."""
    _resets.append(forget)


def reset() -> None:
    """Forget the loaded config (tests, and scripts that change AUTOTUNE_CONFIG at run time)."""
    global _values, _device
    _values, _device = None, None
    _applied.clear()
    for forget in _resets:
        forget()


def device_type() -> str:
    """The device the knobs target: the config's ``device``, else cuda when available, else cpu."""
    _loaded()  # the config may name the device
    if _device is not None:
        return _device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
