"""The tests that need a real NVIDIA GPU: skipped where torch sees none (CI, this test bed).

Run them on a GPU machine with ``python -m pytest -m gpu tests/gpu``; what they check is
listed in ``docs/gpus.md`` ("On a real GPU").
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        usable = torch.cuda.is_available()
    except Exception:  # no torch, or a broken CUDA install: nothing here can run
        usable = False
    skip = pytest.mark.skip(reason="needs a CUDA GPU that torch can use")
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(pytest.mark.gpu)
            if not usable:
                item.add_marker(skip)
