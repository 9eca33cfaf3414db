"""The knob table the runtime checks configs against is the transforms' declarations, and costs no libcst import."""

from __future__ import annotations

import json
import subprocess
import sys

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
        "values = [rt.knob('gc.freeze', False), rt.knob('fused_optimizer.impl', 'default')]\n"
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
    code = "import autotune.runtime as rt\nrt.knob('dataloader.num_workers', 0)\n"
    env = {"AUTOTUNE_CONFIG": str(config), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        f"autotune: {config}: knob 'dataloader.num_workers' has no choice 3 (int; choices: 0, 1, 2, 4, 8, 16)"
    ]
