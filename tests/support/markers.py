"""What the suite's markers do beyond selecting tests (the root conftest installs it).

``gpu``: the test needs a CUDA device; without one it is skipped, saying why. (Kernel and
engine tests that run on CUDA or under the Triton interpreter carry no marker: they run
everywhere.)
"""

from __future__ import annotations

import pytest

NO_CUDA = "needs a CUDA device (torch.cuda.is_available() is False)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(pytest.mark.skip(reason=NO_CUDA))
