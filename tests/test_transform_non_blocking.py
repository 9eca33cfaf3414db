"""non_blocking: host-to-device batch copies in the training loop become asynchronous behind a knob."""

from __future__ import annotations

import pytest
import yaml
from transform_cases import baked, losses, original, patched, sites, statuses

from autotune import runtime
from autotune.transform import Status

T = "non_blocking"
A, P, U, N = Status.APPLICABLE, Status.PRESENT, Status.USER, Status.NOT_APPLICABLE


@pytest.mark.parametrize(
    "name, expected",
    [
        ("loop_copies", [N, A, A]),  # model.to(device) moves a module
        ("get_batch", [P, P, N, N, N]),  # pinned copies already asynchronous; the else branch runs without CUDA
        ("device_branches", [N, A, N, N, A]),
        ("cuda_method", [N, A, A]),
        ("user_choice", [N, U, P, U]),
        ("not_copies", [N, N, N, N, N, N]),
    ],
)
def test_sites(name, expected):
    assert statuses(T, name) == expected


def test_copies_in_branches_that_run_without_cuda_are_left_alone():
    reasons = [s.reason for s in sites(T, "get_batch") if s.status is N]
    assert reasons[0] == 'x.to(...) runs only without CUDA (under `else of if device_type == "cuda"`): nothing to overlap'
    text = patched(T, "device_branches")
    assert "x = x.to(device)\n" in text and "x = x.cuda(non_blocking=_autotune.non_blocking())" in text


def test_not_applicable_reasons():
    reasons = [s.reason for s in sites(T, "not_copies")]
    assert reasons == [
        "torch.randn(...).to(...) is outside any training loop",
        "student.to(...) moves a module, not a batch",
        "teacher.to(...) moves a module, not a batch",
        "x.to(...) changes dtype or layout, no device copy",
        "pred.detach(...).cpu(...) copies to the host, which must wait",
        "pred.to(...) copies to the host, which must wait",
    ]


def test_every_applicable_copy_reads_the_knob():
    for name in ("loop_copies", "get_batch", "cuda_method", "device_branches"):
        text = patched(T, name)
        applicable = statuses(T, name).count(A)
        assert text.count("non_blocking=_autotune.non_blocking()") == applicable
        bake = baked(T, name, {"non_blocking.enabled": True}, device="cuda")
        assert bake.count("non_blocking=True") == applicable + text.count("non_blocking=True")


def test_runtime_knob(tmp_path, monkeypatch):
    for value in (False, True):
        path = tmp_path / "knobs.yaml"
        path.write_text(yaml.safe_dump({"knobs": {"non_blocking.enabled": value}}))
        monkeypatch.setenv(runtime.CONFIG_ENV, str(path))
        runtime.reset()
        assert runtime.non_blocking() is value
    monkeypatch.delenv(runtime.CONFIG_ENV)
    runtime.reset()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["loop_copies", "get_batch", "cuda_method", "device_branches"])
def test_losses_on_cpu(tmp_path, name):
    # The knob is for CUDA; on the CPU a non-blocking copy is an ordinary one, so every value must still run.
    base = original(tmp_path, T, name)
    gated = patched(T, name)
    assert losses(tmp_path, "default", gated) == base
    on = losses(tmp_path, "on", gated, {"non_blocking.enabled": True})
    assert losses(tmp_path, "baked", baked(T, name, {"non_blocking.enabled": True})) == on == base


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.parametrize("name", ["loop_copies", "get_batch", "cuda_method"])
def test_losses_on_cuda(tmp_path, name):
    base = original(tmp_path, T, name)
    gated = patched(T, name)
    knobs = {"non_blocking.enabled": True}
    on = losses(tmp_path, "on", gated, knobs, device="cuda")
    assert losses(tmp_path, "baked", baked(T, name, knobs, device="cuda")) == on == base
