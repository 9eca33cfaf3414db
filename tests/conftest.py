import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
sys.path.insert(0, str(TESTS))


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _cpu_unless_marked_cuda(request, monkeypatch):
    """Scripts a test runs see no GPU unless the test is marked cuda.

    The fixture scripts pick CUDA when they see it, and CUDA kernels (cuDNN's algorithm choice, atomics in
    backward) are not bitwise reproducible run to run, while the CPU tests assert bit-identical losses.
    """
    if "cuda" not in request.keywords:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
