"""What the suite's markers do beyond selecting tests (the root conftest installs it).

``gpu``: the test needs a CUDA device; without one it is skipped, saying why. (Kernel and
engine tests that run on CUDA or under the Triton interpreter carry no marker: they run
everywhere.)

``k8s``: the test runs against a real cluster, whose image pulls and model loads take
minutes a step (``support.platforms.ClusterPlatform.timeout``): its timeout is
``K8S_TIMEOUT_S`` instead of the suite's (pyproject's ``timeout``), unless it sets its own.
"""

from __future__ import annotations

import pytest

NO_CUDA = "needs a CUDA device (torch.cuda.is_available() is False)"
K8S_TIMEOUT_S = 3600


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    for item in items:
        if item.get_closest_marker("k8s") is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(K8S_TIMEOUT_S))
        if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason=NO_CUDA))
