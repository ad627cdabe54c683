"""Faults of disaggregated prefill and decode, with real processes (issue 44, acceptance 3).

Each request follows vllm-router's P/D protocol step by step (``support.pd_router``: the
prefill request with ``do_remote_decode``, then the original request with the prefill's
``kv_transfer_params`` to the decode replica), so a fault can be put between the steps:

- the decode side never reads: the prefill replica frees the held blocks when the hold
  (``kv_lease_duration``) ends, counted in ``kvpilot:nixl_num_kv_expired_reqs``;
- the prefill replica dies (SIGKILL) before the read: the decode replica's read fails and,
  under ``kv_load_failure_policy: recompute``, it computes the prompt itself: the client
  gets the one-replica answer; the failure is counted;
- the decode side is handed KV params it cannot honour (a malformed pull): a 400 OpenAI
  error, nothing allocated.

Afterwards both replicas hold no block (0 leaked).
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from support.pd_cluster import (
    BLOCK_SIZE,
    LEASE_S,
    MAX_TOKENS,
    MODEL,
    NUM_BLOCKS,
    nixl_missing,
    scrape,
    start_replica,
    wait_idle,
)
from support.pd_router import pd_request, prefill_body

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(nixl_missing(), reason="NIXL is not installed (pip install 'kvpilot[nixl]')")]


def _body(prompt: list[int]) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}


def test_unread_kv_expires_on_the_prefill_side(prefill, fault_prompts):
    before = scrape(prefill.base_url)["kvpilot:nixl_num_kv_expired_reqs_total{}"]
    answer = httpx.post(f"{prefill.base_url}/v1/completions", json=prefill_body(_body(fault_prompts[1])), timeout=60)
    assert answer.status_code == 200, answer.text
    params = answer.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_port"] == prefill.side_channel_port
    assert len(params["remote_block_ids"]) == -(-len(fault_prompts[1]) // BLOCK_SIZE)
    held = scrape(prefill.base_url)
    assert held["kvpilot:kv_transfer_held_requests{}"] == 1 and held["vllm:kv_cache_usage_perc{}"] > 0
    start = time.monotonic()
    wait_idle(prefill.base_url, timeout=LEASE_S + 10,
              **{"kvpilot:nixl_num_kv_expired_reqs_total{}": before + 1})
    assert time.monotonic() - start >= LEASE_S - 1.0   # held until the lease ended, not freed early


def test_prefill_dies_before_the_read_decode_recomputes(pd_model, decode, fault_prompts, reference, tmp_path):
    prompt = fault_prompts[2]
    dying, _ = start_replica(pd_model, "kv_producer", tmp_path / "dying-prefill.log")
    try:
        first = httpx.post(f"{dying.base_url}/v1/completions", json=prefill_body(_body(prompt)), timeout=60)
        assert first.status_code == 200, first.text
        params = first.json()["kv_transfer_params"]
        os.kill(dying.process.pid, signal.SIGKILL)
        dying.process.wait(10)
    finally:
        dying.stop()
    before = scrape(decode.base_url)
    answer = httpx.post(f"{decode.base_url}/v1/completions", json={**_body(prompt), "kv_transfer_params": params},
                        timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == reference[tuple(prompt)]
    after = wait_idle(decode.base_url)
    assert after["kvpilot:kv_transfer_failed_loads_total{}"] == before["kvpilot:kv_transfer_failed_loads_total{}"] + 1
    pulled = (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert (after["kvpilot:kv_transfer_recomputed_tokens_total{}"]
            - before["kvpilot:kv_transfer_recomputed_tokens_total{}"]) == pulled
    assert after["kvpilot:nixl_num_failed_transfers_total{}"] == before["kvpilot:nixl_num_failed_transfers_total{}"] + 1


def test_bad_kv_transfer_params_are_a_400(prefill, decode, fault_prompts):
    body = _body(fault_prompts[0])
    bad = {**body, "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "x"}}
    answer = httpx.post(f"{decode.base_url}/v1/completions", json=bad, timeout=60)
    assert answer.status_code == 400, answer.text
    assert "remote_block_ids" in answer.json()["error"]["message"]
    # a decode-only engine hands no KV out
    answer = httpx.post(f"{decode.base_url}/v1/completions", json=prefill_body(body), timeout=60)
    assert answer.status_code == 400 and "kv_consumer" in answer.json()["error"]["message"]
    with httpx.Client(timeout=60) as client:   # and the protocol itself still works afterwards
        assert pd_request(client, prefill.base_url, decode.base_url, "/v1/completions", body).status == 200
    wait_idle(prefill.base_url)
    wait_idle(decode.base_url)


def test_fail_policy_ends_the_request_with_why(pd_model, fault_prompts):
    """``kv_load_failure_policy: fail`` (vLLM's default): the request ends with an error
    saying why (through the API: a 500 with ``code: kv_transfer_failed``), its blocks freed."""
    from kvpilot.engine import LLM, SamplingParams
    from kvpilot.engine.bench.server_process import free_port
    from kvpilot.engine.exceptions import KVTransferFailed
    from kvpilot.engine.kv_transfer.config import KVTransferConfig
    from kvpilot.engine.kv_transfer.params import producer_params

    config = KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_consumer", kv_load_failure_policy="fail",
                              kv_connector_extra_config={"kv_handshake_timeout": 0.5})
    llm = LLM(pd_model, dtype="float32", num_gpu_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_model_len=2048,
              kv_transfer_config=config)
    try:
        prompt = fault_prompts[0]
        gone = producer_params(engine_id="gone", request_id="cmpl-gone", block_ids=list(range(13)), host="127.0.0.1",
                               port=free_port(), tp_size=1, num_tokens=len(prompt), prefix_hash=None)
        with pytest.raises(KVTransferFailed, match="did not answer within 0.5 s"):
            llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, kv_transfer_params=gone))
        stats = llm.get_stats()
        assert stats.num_free_blocks == NUM_BLOCKS and stats.kv_transfer.num_failed_transfers == 1
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4))   # the engine goes on
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.llm_engine.close()
