"""anomaly: a set_detect_anomaly(True) left in the script becomes a knob; the script's own switch and scoped blocks
stay; off, the script trains to the same losses."""

from __future__ import annotations

import os

import pytest
import yaml
from loss_probe import run_script
from transform_cases import FIXTURES, baked, losses, original, patched, sites

from autotune.transform import Status

T = "anomaly"


@pytest.mark.parametrize(
    "name, status, reason",
    [
        ("left_on", Status.APPLICABLE, "anomaly detection is switched on: a debugging aid that slows every backward"),
        ("trainer_method", Status.APPLICABLE,
         "anomaly detection is switched on: a debugging aid that slows every backward"),
        ("debug_flag", Status.USER,
         "torch.autograd.set_detect_anomaly(args.debug): the script decides when it is on; kept"),
        ("scoped_block", Status.NOT_APPLICABLE,
         "torch.autograd.detect_anomaly(): a block the script scoped itself; left as written"),
        ("already_off", Status.PRESENT, "autograd.set_detect_anomaly(mode=False): anomaly detection is off"),
    ],
)
def test_sites(name, status, reason):
    (site,) = sites(T, name)
    assert (site.status, site.reason) == (status, reason)


def test_the_default_changes_nothing(tmp_path):
    assert losses(tmp_path, "patched", patched(T, "left_on")) == original(tmp_path, T, "left_on")  # bit for bit


@pytest.mark.parametrize("value", [True, False])
def test_the_knob_decides_whether_autograd_checks(value, tmp_path):
    text = patched(T, "left_on").replace(
        "    torch.manual_seed(0)", "    print('anomaly', torch.is_anomaly_enabled())\n    torch.manual_seed(0)"
    )
    (tmp_path / "train.py").write_text(text)
    (tmp_path / "k.yaml").write_text(yaml.safe_dump({"device": "cpu", "knobs": {"anomaly.detect": value}}))
    env = {**os.environ, "AUTOTUNE_CONFIG": str(tmp_path / "k.yaml")}
    env.pop("AUTOTUNE_TRIAL", None)
    rc, output = run_script(tmp_path / "train.py", ["--steps", "1"], env=env, cwd=tmp_path, timeout=240)
    assert rc == 0, output
    assert f"anomaly {value}\n" in output


def test_off_trains_to_the_same_losses(tmp_path):
    """Anomaly mode adds checks and stack traces, never arithmetic: the losses stay bit for bit (numerics: exact)."""
    off = losses(tmp_path, "off", baked(T, "left_on", {"anomaly.detect": False}))
    assert off == original(tmp_path, T, "left_on")


def test_bake_at_the_default_writes_nothing():
    assert baked(T, "left_on", {"anomaly.detect": True}) == (FIXTURES / T / "left_on.in.py").read_text()
