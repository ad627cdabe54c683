"""Shared set-up of the disaggregated prefill/decode tests: the small model, prompts, the
offline reference engine (one replica, same dtype and block size), and one prefill and one
decode ``kvpilot serve`` with a ``NixlConnector`` each (``support.pd_cluster``).

The prefill replica holds a finished request's blocks for at most ``pd_cluster.LEASE_S`` seconds
unread (short, so the expiry test is quick; a reader pins them first, which extends the
hold); the decode replica recomputes what a failed read did not bring
(``kv_load_failure_policy: recompute``) and waits ``pd_cluster.HANDSHAKE_S`` for a prefill engine's
side channel.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvpilot.engine import LLM, SamplingParams

from support.pd_cluster import (
    BLOCK_SIZE,
    HANDSHAKE_S,
    LEASE_S,
    MAX_TOKENS,
    NUM_BLOCKS,
    start_replica,
)

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
    """The fault tests' own prompts (the replicas are shared: no other test's prompt may sit
    in their prefix caches)."""
    rng = random.Random(45)
    return [[rng.randrange(3, 4096) for _ in range(n)] for n in (210, 350, 650)]


@pytest.fixture(scope="session")
def reference_llm(pd_model) -> LLM:
    """One replica's engine, in process: the oracle for every disaggregated answer."""
    return LLM(pd_model, dtype="float32", num_gpu_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
               max_model_len=2048, max_num_batched_tokens=2048)


@pytest.fixture(scope="session")
def reference(reference_llm, pd_prompts, fault_prompts) -> dict[tuple[int, ...], str]:
    """One replica's greedy answer to every prompt."""
    prompts = pd_prompts + fault_prompts
    outs = reference_llm.generate(prompts, GREEDY)
    return {tuple(p): o.outputs[0].text for p, o in zip(prompts, outs, strict=True)}


@pytest.fixture(scope="session")
def pd_pair(pd_model, tmp_path_factory):
    """(prefill, decode) replicas, started side by side."""
    logs = tmp_path_factory.mktemp("pd")
    with ThreadPoolExecutor(2) as pool:
        starts = [pool.submit(start_replica, pd_model, "kv_producer", logs / "prefill.log",
                              kv_lease_duration=LEASE_S),
                  pool.submit(start_replica, pd_model, "kv_consumer", logs / "decode.log",
                              kv_handshake_timeout=HANDSHAKE_S)]
    servers, errors = [], [start.exception() for start in starts]
    for start, error in zip(starts, errors, strict=True):
        if error is None:
            server, server.side_channel_port = start.result()
            servers.append(server)
    try:
        if any(errors):
            raise next(e for e in errors if e is not None)
        yield servers
    finally:
        for server in servers:   # both, whichever failed to start
            server.stop()


@pytest.fixture(scope="session")
def prefill(pd_pair):
    return pd_pair[0]


@pytest.fixture(scope="session")
def decode(pd_pair):
    return pd_pair[1]
