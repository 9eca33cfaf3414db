"""The fixture training scripts run, train, and are bit-for-bit deterministic.

Every script under fixtures/scripts (``*.py`` and ``*/train.py``, except the
inference-only ``no_loop.py``) is run twice through the loss probe for 4
backward calls; both runs must record the same 4 finite losses.
"""

import math
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from loss_probe import probe  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SCRIPTS_DIR = REPO / "fixtures" / "scripts"
NO_LOOP = SCRIPTS_DIR / "no_loop.py"
STEPS = 4

# One intra-op thread: faster for these tiny models and immune to the heavy
# OpenMP slowdown seen when another process is busy on one of the 2 cores.
PROBE_ENV = {"OMP_NUM_THREADS": "1"}


def training_scripts():
    scripts = sorted(SCRIPTS_DIR.glob("*.py")) + sorted(SCRIPTS_DIR.glob("*/train.py"))
    return [s for s in scripts if s != NO_LOOP]


@pytest.mark.slow
@pytest.mark.parametrize(
    "script", training_scripts(), ids=lambda p: str(p.relative_to(SCRIPTS_DIR))
)
def test_fixture_is_deterministic(script, tmp_path):
    first = probe(script, [], steps=STEPS, out=tmp_path / "a.json", env=PROBE_ENV, cwd=REPO, timeout=180)
    second = probe(script, [], steps=STEPS, out=tmp_path / "b.json", env=PROBE_ENV, cwd=REPO, timeout=180)

    assert first["ended"] == "steps", first["output"][-2000:]
    assert len(first["losses"]) == STEPS
    assert all(math.isfinite(float.fromhex(v)) for v in first["losses"]), first["losses"]
    assert first["losses"] == second["losses"]


@pytest.mark.slow
def test_no_loop_never_calls_backward(tmp_path):
    result = probe(NO_LOOP, [], steps=STEPS, out=tmp_path / "n.json", env=PROBE_ENV, cwd=REPO, timeout=180)
    assert result["losses"] == []
    assert result["ended"] == "script_exit"
