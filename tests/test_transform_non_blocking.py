"""non_blocking: host-to-device batch copies in the training loop become asynchronous behind a knob."""

from __future__ import annotations

import pytest
import torch
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
        ("batch_class", [N, N, A, A]),  # Batch.to's own copy is outside the loop; the model is a module
    ],
)
def test_sites(name, expected):
    assert statuses(T, name) == expected


def test_copies_in_branches_that_run_without_cuda_are_left_alone():
    reasons = [s.reason for s in sites(T, "get_batch") if s.status is N]
    assert reasons[0] == 'x.to(...) runs only without CUDA (under `else of if device_type == "cuda"`): nothing to overlap'
    text = patched(T, "device_branches")
    assert "x = x.to(device)\n" in text and "x = x.cuda(**_autotune.non_blocking(x))" in text


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
    for name in ("loop_copies", "get_batch", "cuda_method", "device_branches", "batch_class"):
        text = patched(T, name)
        applicable = statuses(T, name).count(A)
        assert text.count("**_autotune.non_blocking(") == applicable
        bake = baked(T, name, {"non_blocking.enabled": True}, device="cuda")
        assert bake.count("non_blocking=True") == applicable + text.count("non_blocking=True")


def test_runtime_knob(tmp_path, monkeypatch):
    # the default passes nothing: the call as written, whatever object's .to it is
    for value, kwargs in ((False, {}), (True, {"non_blocking": True})):
        path = tmp_path / "knobs.yaml"
        path.write_text(yaml.safe_dump({"knobs": {"non_blocking.enabled": value}}))
        monkeypatch.setenv(runtime.CONFIG_ENV, str(path))
        runtime.reset()
        assert runtime.non_blocking(torch.zeros(1)) == runtime.non_blocking() == kwargs
        assert runtime.applied() == (["non_blocking.enabled"] if value else [])
    monkeypatch.delenv(runtime.CONFIG_ENV)
    runtime.reset()


class _OwnBatch:
    def to(self, device):
        return self


class _Forwards:
    def to(self, *args, **kwargs):
        return self


def test_a_receiver_whose_to_takes_no_flag_gets_none_and_the_knob_does_not_count(tmp_path, monkeypatch):
    # a tokenizer's BatchEncoding in transformers 4 is such a receiver: BatchEncoding.to(device) only
    path = tmp_path / "knobs.yaml"
    path.write_text(yaml.safe_dump({"knobs": {"non_blocking.enabled": True}}))
    monkeypatch.setenv(runtime.CONFIG_ENV, str(path))
    runtime.reset()
    assert runtime.non_blocking(_Forwards()) == {"non_blocking": True}
    assert runtime.applied() == ["non_blocking.enabled"]
    assert runtime.non_blocking(_OwnBatch()) == {}
    assert runtime.non_blocking(torch.zeros(1)) == {"non_blocking": True}
    assert runtime.applied() == []  # baked, non_blocking=True would reach _OwnBatch.to too
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


@pytest.mark.slow
def test_a_batch_class_of_the_scripts_own_runs_at_every_value(tmp_path):
    # its .to(device) takes no non_blocking: at the default the call is as written, and with the knob on the
    # runtime leaves that call alone (it used to crash a patched Accelerate example at its defaults)
    base = original(tmp_path, T, "batch_class")
    gated = patched(T, "batch_class")
    assert losses(tmp_path, "default", gated) == base
    assert losses(tmp_path, "on", gated, {"non_blocking.enabled": True}) == base


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.parametrize("name", ["loop_copies", "get_batch", "cuda_method"])
def test_losses_on_cuda(tmp_path, name):
    base = original(tmp_path, T, name)
    gated = patched(T, name)
    knobs = {"non_blocking.enabled": True}
    on = losses(tmp_path, "on", gated, knobs, device="cuda")
    assert losses(tmp_path, "baked", baked(T, name, knobs, device="cuda")) == on == base
