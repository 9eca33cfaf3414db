"""The knob table the runtime checks configs against is the transforms' declarations, and costs no libcst import."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from autotune import catalog
from autotune.knob_table import KNOBS
from autotune.transform import all_knobs


def test_the_table_is_what_the_transforms_declare():
    assert KNOBS == all_knobs()
    # the text too, so a regenerated table is never a diff: after adding or changing a knob, regenerate it
    assert catalog.TABLE.read_text(encoding="utf-8") == catalog.table_source(), "run: python -m autotune.catalog"


def test_a_patched_script_with_a_config_imports_neither_libcst_nor_torch_to_read_a_knob(tmp_path):
    config = tmp_path / "knobs.yaml"
    config.write_text("knobs:\n  gc.freeze: true\n  fused_optimizer.impl: fused\n")
    code = (
        "import json, sys\n"
        "import autotune.runtime as rt\n"
        "values = [rt.knob('gc.freeze'), rt.knob('fused_optimizer.impl')]\n"
        "print(json.dumps([values, sorted(m for m in sys.modules if m.split('.')[0] in ('libcst', 'torch'))]))\n"
    )
    env = {"AUTOTUNE_CONFIG": str(config), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    values, heavy = json.loads(out.stdout)
    assert values == [True, "fused"]
    assert heavy == []


def test_a_value_the_table_does_not_declare_still_stops_the_script_with_one_line(tmp_path):
    config = tmp_path / "knobs.yaml"
    config.write_text("knobs:\n  dataloader.num_workers: 3\n")
    code = "import autotune.runtime as rt\nrt.knob('dataloader.num_workers')\n"
    env = {"AUTOTUNE_CONFIG": str(config), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        f"autotune: {config}: knob 'dataloader.num_workers' has no choice 3 (int; choices: 0, 1, 2, 4, 8, 16)"
    ]


def test_the_runtime_helpers_are_the_transforms_runtime_sections():
    # patched scripts run this copy: after changing a transform's runtime section, regenerate it
    assert catalog.HELPERS.read_text(encoding="utf-8") == catalog.helpers_source(), "run: python -m autotune.catalog"


_HEAD = '"""A transform."""\n\nTABLE = {"a": 1}\n\n\n' + catalog.MARKER + " ===\n\n"


@pytest.mark.parametrize(
    "section, message",
    [
        ("import torch\n\n\ndef helper():\n    return torch.ones(1)\n", "its runtime section imports torch at the top"),
        ("def helper():\n    return TABLE['a']\n", "its runtime section uses TABLE without binding it"),
        ("def knob_value():\n    return 1\n", "both define knob_value"),
    ],
    ids=["imports_torch", "leans_on_its_module", "name_taken"],
)
def test_a_runtime_section_that_cannot_be_copied_alone_is_refused(section, message, tmp_path):
    mine = tmp_path / "mine.py"
    mine.write_text(_HEAD + section)
    other = tmp_path / "other.py"
    other.write_text(_HEAD + "def knob_value():\n    return 0\n")
    with pytest.raises(ValueError, match=message):
        catalog.helpers_source([("mine", mine), ("other", other)])


def test_a_section_runs_in_the_copy_as_in_its_module(tmp_path):
    mine = tmp_path / "mine.py"
    mine.write_text(_HEAD + "import os\n\nfrom autotune.knob_values import knob\n\n\ndef helper():\n    return os.sep\n")
    text = catalog.helpers_source([("mine", mine)])
    assert "import os\n" in text and "from autotune.knob_values import knob\n" in text
    assert "__all__ = [\n    'helper',\n]" in text
    namespace: dict = {}
    exec(compile(text, "runtime_helpers.py", "exec"), namespace)
    assert namespace["helper"]() == __import__("os").sep
