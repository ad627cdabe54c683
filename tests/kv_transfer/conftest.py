"""Shared set-up of the disaggregated prefill/decode tests: the small model, prompts and the
offline reference engine (one replica, same dtype and block size). The replicas themselves
(``support.pd_cluster.PDPair``) belong to ``test_pd.py``, the one module that starts them.
"""

from __future__ import annotations

import random

import pytest

from kvpilot.engine import LLM, SamplingParams

from support.pd_cluster import BLOCK_SIZE, MAX_TOKENS, NUM_BLOCKS

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


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
    """The fault tests' own prompts, one per test (the replicas are shared: no other test's
    prompt may sit in their prefix caches)."""
    rng = random.Random(45)
    return [[rng.randrange(3, 4096) for _ in range(n)] for n in (210, 350, 650, 250)]


@pytest.fixture(scope="session")
def reference_llm(pd_model) -> LLM:
    """One replica's engine, in process: the oracle for every disaggregated answer."""
    return LLM(pd_model, dtype="float32", num_gpu_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
               max_model_len=2048, max_num_batched_tokens=2048)


@pytest.fixture(scope="session")
def reference(reference_llm, pd_prompts, fault_prompts) -> dict[tuple[int, ...], str]:
    """One replica's greedy answer to every prompt whose answer a test checks (of the fault
    prompts, only the one the decode replica recomputes)."""
    prompts = pd_prompts + fault_prompts[2:3]
    outs = reference_llm.generate(prompts, GREEDY)
    return {tuple(p): o.outputs[0].text for p, o in zip(prompts, outs, strict=True)}
