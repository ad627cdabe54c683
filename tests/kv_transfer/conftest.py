"""Shared set-up of the disaggregated prefill/decode tests: the small model and the prompts.
The replicas (``support.pd_cluster.PDPair``) and the reference engine belong to
``test_pd.py``, the one module that starts them.
"""

from __future__ import annotations

import random

import pytest

from support.pd_cluster import BLOCK_SIZE


@pytest.fixture(scope="session")
def pd_model(demo_model_dir) -> str:
    return str(demo_model_dir)


@pytest.fixture(scope="session")
def pd_prompts() -> list[list[int]]:
    """Token prompts of 200-700 tokens: one ends on a block boundary, two share a
    400-token (25-block) prefix."""
    rng = random.Random(44)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 4096) for _ in range(n)]

    prefix = tokens(400)
    return [tokens(200), tokens(333), tokens(30 * BLOCK_SIZE), tokens(700), prefix + tokens(50), prefix + tokens(77)]


@pytest.fixture(scope="session")
def fault_prompts() -> list[list[int]]:
    """The fault tests' own prompts (the replicas are shared: no other test's prompt may
    sit in their prefix caches); the last, 87 blocks to read, is the one read half-way."""
    rng = random.Random(45)
    return [[rng.randrange(3, 4096) for _ in range(n)] for n in (210, 350, 650, 250, 1400)]


@pytest.fixture(scope="session")
def feature_prompts() -> list[list[int]]:
    """The feature tests' own prompts (n > 1, stop strings, LoRA twice, structured
    outputs), each read by the decode replica once."""
    rng = random.Random(46)
    return [[rng.randrange(3, 4096) for _ in range(n)] for n in (300, 250, 120, 100, 260)]
