"""Fixtures of the operator tests that run the real operator process: one emulator and
one operator per test module (start-up costs ~1.5 s), emptied after every test, and a
cluster of its own for a test that changes the cluster itself (installs CRDs).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from support.operator_cluster import Cluster, running_cluster


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory) -> Iterator[Cluster]:
    with running_cluster(tmp_path_factory.mktemp("operator")) as cluster:
        yield cluster


@pytest.fixture
def cluster(shared_cluster: Cluster) -> Iterator[Cluster]:
    """The module's cluster, emptied of InferenceServices after the test."""
    try:
        yield shared_cluster
    finally:
        shared_cluster.delete_all()


@pytest.fixture
def own_cluster(tmp_path) -> Iterator[Cluster]:
    """A cluster for this test alone (for tests that change the cluster itself)."""
    with running_cluster(tmp_path) as cluster:
        yield cluster
