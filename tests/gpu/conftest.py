"""The GPU tier (marker ``gpu``): skipped, with the reason printed, where CUDA is absent.
``scripts/gpu_check.sh`` runs it on a GPU machine (under 8 minutes on one GPU)."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="no CUDA device on this machine")
    for item in items:
        if "tests/gpu/" in str(item.path).replace("\\", "/"):
            item.add_marker("gpu")
            if skip is not None:
                item.add_marker(skip)
