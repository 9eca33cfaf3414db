"""threads: the CPU thread count as a knob; the script's own choice is kept; each value trains and bakes alike."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from transform_cases import FIXTURES, baked, losses, original, patched, sites

from autotune.transform import Status

T = "threads"


@pytest.mark.parametrize(
    "name, status, reason",
    [
        ("basic", Status.APPLICABLE, "sets the CPU thread count once after the imports"),
        ("user_sets_threads", Status.USER,
         'the script calls torch.set_num_threads(int(os.environ.get("TRAIN_THREADS", "1"))): its choice is kept'),
        ("no_training_loop", Status.NOT_APPLICABLE, "no training loop: threads would speed up nothing"),
    ],
)
def test_sites(name, status, reason):
    (site,) = sites(T, name)
    assert (site.status, site.reason) == (status, reason)


def test_the_default_changes_nothing(tmp_path):
    assert losses(tmp_path, "patched", patched(T, "basic")) == original(tmp_path, T, "basic")  # bit for bit


@pytest.mark.parametrize("value, expected", [("default", 2), (1, 1), (4, 4)])
def test_the_value_is_what_torch_computes_with(value, expected, tmp_path):
    text = patched(T, "basic").replace(
        "    torch.manual_seed(0)", "    print('threads', torch.get_num_threads())\n    torch.manual_seed(0)"
    )
    (tmp_path / "train.py").write_text(text)
    (tmp_path / "k.yaml").write_text(yaml.safe_dump({"device": "cpu", "knobs": {"threads.intra_op": value}}))
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "2", "AUTOTUNE_CONFIG": str(tmp_path / "k.yaml")}
    done = subprocess.run([sys.executable, "train.py", "--steps", "1"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert f"threads {expected}\n" in done.stdout


@pytest.mark.parametrize("value", [1, 2])
def test_patched_and_baked_train_the_same(value, tmp_path):
    """Another thread count reorders sums (the knob's numerics say so); the patched script at a value and the script
    baked with it run the same code: bit for bit the same losses."""
    text = baked(T, "basic", {"threads.intra_op": value})
    assert f"torch.set_num_threads({value})" in text and "autotune" not in text
    assert losses(tmp_path, "baked", text) == losses(tmp_path, "patched", patched(T, "basic"), {"threads.intra_op": value})


def test_bake_at_the_default_writes_nothing():
    assert baked(T, "basic", {"threads.intra_op": "default"}) == (FIXTURES / T / "basic.in.py").read_text()
