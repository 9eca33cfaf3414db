"""Reading what users and studies feed autotune: regular files only and bounded, YAML without bombs, short messages."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from autotune.errors import UsageError
from autotune.inputs import MAX_YAML_NODES, load_yaml, read_bytes, read_text, shown

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "fixtures/search/tiny.py"

# nine levels of nine aliases: 9**9 (387 million) strings once expanded, 100 lines of text
BILLION_LAUGHS = 'a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n' + "".join(
    f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi")
) + "knobs: {gc.freeze: *i}\n"


def _memory_capped(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``autotune ARGS`` in a process that may use 2 GiB at most: reading without a limit fails, not the machine."""
    import resource

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    cmd = [sys.executable, "-m", "autotune", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, preexec_fn=cap)


def test_billion_laughs_is_refused_before_it_expands():
    with pytest.raises(UsageError) as err:
        load_yaml(BILLION_LAUGHS, "bomb.yaml")
    assert str(err.value) == f"bomb.yaml: too large once its aliases (*name) are expanded (over {MAX_YAML_NODES} values)"


def test_a_recursive_alias_is_refused():
    with pytest.raises(UsageError, match="aliases"):
        load_yaml("knobs: &k {gc.freeze: *k}\n", "loop.yaml")


def test_aliases_that_expand_a_little_load_as_written():
    # yaml.safe_dump writes an anchor for a list it meets twice: autotune's own files may hold aliases
    text = yaml.safe_dump({"a": (shared := [1, 2]), "b": shared})
    assert "&id001" in text and load_yaml(text, "ours.yaml") == {"a": [1, 2], "b": [1, 2]}


def test_deeply_nested_yaml_is_one_line():
    with pytest.raises(UsageError) as err:
        load_yaml("knobs: " + "[" * 5000 + "]" * 5000 + "\n", "deep.yaml")
    assert str(err.value) == "deep.yaml: nested too deeply"


def test_a_bad_yaml_problem_is_cut_short():
    with pytest.raises(UsageError) as err:
        load_yaml("knobs: [\n", "bad.yaml")
    assert str(err.value).startswith("bad.yaml:") and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "value",
    ["x" * 1_000_000, [[["deep"] * 1000] * 1000] * 1000, {f"k{i}": i for i in range(10_000)}],
    ids=["long-string", "aliased-lists", "big-mapping"],
)
def test_shown_values_are_short_however_big(value):
    assert len(shown(value)) <= 80


def test_a_fifo_is_refused_at_once(tmp_path: Path):
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    with pytest.raises(UsageError, match="is not a regular file"):
        read_text(fifo, "a knob config")


def test_a_device_is_refused_without_reading_it():
    with pytest.raises(UsageError, match="/dev/zero: is not a regular file"):
        read_bytes(Path("/dev/zero"), "a knob config", 1 << 20)


def test_a_file_over_the_limit_is_refused(tmp_path: Path):
    path = tmp_path / "big.yaml"
    path.write_bytes(b"#" * (2 << 20))
    with pytest.raises(UsageError, match="larger than 1 MiB"):
        read_bytes(path, "a knob config", 1 << 20)
    assert read_bytes(path, "a knob config", 2 << 20) == b"#" * (2 << 20)


def test_a_bom_is_dropped_from_a_config(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_bytes(b"\xef\xbb\xbfknobs: {}\n")
    assert load_yaml(read_text(path, "a knob config"), "c.yaml") == {"knobs": {}}


@pytest.mark.parametrize("source", ["fifo", "/dev/zero"])
@pytest.mark.parametrize("command", ["scan", "bake"])
def test_cli_refuses_a_script_or_config_that_is_not_a_regular_file(source, command, tmp_path: Path):
    if source == "fifo":
        source = str(tmp_path / "pipe")
        os.mkfifo(source)
    out = str(tmp_path / "out")
    args = ["scan", source] if command == "scan" else ["bake", str(TINY), "--config", source, "--out", out]
    done = _memory_capped(*args, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == f"autotune: error: {source}: is not a regular file (a device, FIFO or socket), " + (
        "expected a Python script" if command == "scan" else "expected a knob config"
    )


def test_cli_refuses_a_billion_laughs_space_in_one_line(tmp_path: Path):
    bomb = tmp_path / "space.yaml"
    bomb.write_text(BILLION_LAUGHS.replace("knobs: {gc.freeze: *i}", "knobs: {gc.freeze: *i}\nothers: *i"))
    done = _memory_capped("search", str(TINY), "--space", str(bomb), "--out", str(tmp_path / "out"), "--trials", "2")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [f"autotune: error: {bomb}: too large once its aliases (*name) are expanded "
                                               f"(over {MAX_YAML_NODES} values)"]


@pytest.mark.parametrize("char", ["\x00", "\x07"])
def test_a_control_character_in_yaml_is_one_line_with_its_line(char):
    with pytest.raises(UsageError, match=rf"^space.yaml:2: not valid YAML: character {ord(char):#04x} is not allowed$"):
        load_yaml(f"a: 1\nb: {char}x\n", "space.yaml")


def test_cli_refuses_a_nul_in_a_bake_config_in_one_line_writing_nothing(tmp_path: Path):
    config = tmp_path / "bad.yaml"
    config.write_bytes(b"knobs:\n  gc.mode: \x00off\n")
    done = subprocess.run([sys.executable, "-m", "autotune", "bake", str(TINY), "--config", str(config), "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [f"autotune: error: {config}:2: not valid YAML: character 0x00 is not allowed"]
    assert not (tmp_path / "out").exists()
