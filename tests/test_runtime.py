"""The runtime's knob config: every value checked against the knob registry, whatever the file itself lists."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from autotune import runtime
from autotune.patch import patch_path, write_outputs

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "fixtures/search/tiny.py"


@pytest.fixture(autouse=True)
def _no_env_config(monkeypatch):
    monkeypatch.delenv(runtime.CONFIG_ENV, raising=False)


def _fails(table: Path | None = None, override: Path | None = None) -> str:
    with pytest.raises(SystemExit) as exc:
        runtime.load_config(table or Path("/nonexistent/autotune.yaml"), override)
    message = str(exc.value.code)
    assert message.startswith("autotune: ") and "\n" not in message
    return message


@pytest.mark.parametrize(
    "knobs, message",
    [
        ("gc.froze: true", "unknown knob 'gc.froze'"),
        ("dataloader.num_workers: 2.0", "has no choice 2.0 (float;"),
        ("dataloader.num_workers: true", "has no choice True (bool;"),
        ("dataloader.num_workers: '2'", "has no choice '2' (str;"),
        # the file's own list of choices does not widen the knob's
        ("dataloader.num_workers: {value: '2', choices: ['2']}", "has no choice '2' (str;"),
        ("compile.dynamic: 1", "has no choice 1 (int;"),
    ],
    ids=["unknown", "float-for-int", "bool-for-int", "str-for-int", "own-choices", "int-for-bool"],
)
def test_a_config_beside_the_script_is_checked_against_the_registry(knobs, message, tmp_path: Path):
    table = tmp_path / "autotune.yaml"
    table.write_text(f"knobs:\n  {knobs}\n")
    assert message in _fails(table)


def test_an_override_without_a_table_is_checked_too(tmp_path: Path):
    override = tmp_path / "trial.yaml"
    override.write_text("knobs:\n  no_such.knob: 1\n")
    assert "unknown knob 'no_such.knob'" in _fails(override=override)


@pytest.mark.parametrize(
    "content, message",
    [
        (b"knobs: {gc.freeze: \xff}\n", "is not UTF-8 text"),
        (b"a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + b"".join(
            f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 10)}]\n".encode() for i in range(6)
        ) + b"knobs: {gc.freeze: *g}\n", "aliases"),
        (b"knobs: " + b"[" * 3000 + b"]" * 3000 + b"\n", "nested too deeply"),
        (b"device: {a: 1}\nknobs: {}\n", "device must be"),
    ],
    ids=["not-utf8", "alias-bomb", "deep", "bad-device"],
)
def test_a_bad_config_file_is_one_line(content: bytes, message: str, tmp_path: Path):
    table = tmp_path / "autotune.yaml"
    table.write_bytes(content)
    assert message in _fails(table)


def test_values_are_the_declared_choices(tmp_path: Path):
    table = tmp_path / "autotune.yaml"
    table.write_text("knobs:\n  compile.dynamic: true\n  dataloader.num_workers: {value: 4}\n")
    values, device = runtime.load_config(table, None)
    assert values == {"compile.dynamic": True, "dataloader.num_workers": 4} and device is None


def test_a_patched_script_with_a_wrong_value_beside_it_stops_in_one_line(tmp_path: Path):
    out = tmp_path / "out"
    write_outputs(patch_path(TINY), out, "tiny.py")
    config = out / "autotune.yaml"
    config.write_text(config.read_text().replace("value: false", "value: 0", 1))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop(runtime.CONFIG_ENV, None)
    done = subprocess.run([sys.executable, str(out / "tiny.py"), "--iters", "2"], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().startswith(f"autotune: {config}: knob ") and "has no choice 0 (int;" in done.stderr
