"""Helpers for the per-transform tests: patch or bake one fixture case, run it, and compare per-step losses."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml
from loss_probe import run_probe, run_script

from autotune.project import load_project
from autotune.patch import run, select
from autotune.transform import Mode, Site, Status

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "transforms"
TIMEOUT = 240


def case(transform: str, name: str) -> Path:
    return FIXTURES / transform / f"{name}.in.py"


def sites(transform: str, name: str) -> list[Site]:
    return list(run(load_project(case(transform, name)), select([transform]), hooks=False).sites)


def statuses(transform: str, name: str) -> list[Status]:
    return [s.status for s in sites(transform, name)]


def patched(transform: str, name: str, mode: Mode = Mode()) -> str:
    """The gated (or, with ``mode``, baked) text of a single-file case."""
    result = run(load_project(case(transform, name)), select([transform]), mode, hooks=False)
    (file,) = result.files
    return file.new_text


def baked(transform: str, name: str, knobs: Mapping[str, Any], device: str = "cpu") -> str:
    return patched(transform, name, Mode(values=dict(knobs), device=device))


def losses(
    tmp: Path,
    label: str,
    text: str,
    knobs: Mapping[str, Any] | None = None,
    args: Sequence[str] = (),
    steps: int = 6,
    device: str = "cpu",
) -> list[str]:
    """Per-step losses (hex) of ``text`` run as a script in ``tmp``, under ``AUTOTUNE_CONFIG`` when ``knobs`` is given.

    Asserts that the script reached ``steps`` backward calls and that every loss is finite.
    """
    script = tmp / f"{label}.py"
    script.write_text(text, encoding="utf-8")
    env: dict[str, str | None] = {"AUTOTUNE_CONFIG": None, "AUTOTUNE_TRIAL": None}
    if knobs is not None:
        config = tmp / f"{label}.yaml"
        config.write_text(yaml.safe_dump({"device": device, "knobs": dict(knobs)}), encoding="utf-8")
        env["AUTOTUNE_CONFIG"] = str(config)
    out = run_probe(script, list(args), steps=steps, out=tmp / f"{label}.json", env=env, cwd=tmp, timeout=TIMEOUT)
    assert len(out) == steps, f"{label}: {len(out)} losses, expected {steps}"
    assert all(math.isfinite(float.fromhex(v)) for v in out), f"{label}: non-finite loss in {out}"
    return out


CUDA_RTOL = 1e-5  # identical code on an H100 differed by 1 ulp (2e-7 relative) from run to run


def assert_same_losses(got: Sequence[str], want: Sequence[str], device: str) -> None:
    """Bitwise on CPU; on CUDA within float32 rounding, since its kernels (cuDNN's algorithms, atomic adds in
    backward) do not reproduce bitwise from one run of the same program to the next."""
    if device == "cuda":
        assert len(got) == len(want)
        assert [float.fromhex(v) for v in got] == pytest.approx([float.fromhex(v) for v in want], rel=CUDA_RTOL)
    else:
        assert list(got) == list(want)


def original(tmp: Path, transform: str, name: str, args: Sequence[str] = (), steps: int = 6) -> list[str]:
    return losses(tmp, "original", case(transform, name).read_text(encoding="utf-8"), args=args, steps=steps)


def trial(script: Path, args: Sequence[str], tmp: Path, knobs: Mapping[str, Any] | None = None, warmup: int = 2,
          steps: int = 3) -> dict:
    """The result of one trial (``AUTOTUNE_TRIAL``) of a patched ``script`` run in ``tmp``, under ``knobs`` if given."""
    import json
    import os
    import shutil
    import tempfile

    spec, result = tmp / "spec.json", tmp / "result.json"
    # multiprocessing's folder for the run's processes, removed after it as the search's runner does (a trial ends
    # by os._exit: its DataLoader workers' pymp-* folders were left in /tmp); short, as a socket's path must be
    mp_tempdir = tempfile.mkdtemp(prefix="t")
    spec.write_text(json.dumps({"warmup": warmup, "steps": steps, "result": str(result), "mp_tempdir": mp_tempdir}))
    env = {**os.environ, "AUTOTUNE_TRIAL": str(spec)}
    env.pop("AUTOTUNE_CONFIG", None)
    if knobs is not None:
        config = tmp / "config.yaml"
        config.write_text(yaml.safe_dump({"device": "cpu", "knobs": dict(knobs)}))
        env["AUTOTUNE_CONFIG"] = str(config)
    try:
        _, output = run_script(script, args, env=env, cwd=tmp, timeout=TIMEOUT)
    finally:
        shutil.rmtree(mp_tempdir, ignore_errors=True)
    assert result.exists(), output[-3000:]
    return json.loads(result.read_text())
