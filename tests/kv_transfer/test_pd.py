"""Disaggregated prefill and decode with real processes: one prefill and one decode
``kvpilot serve`` (``support.pd_cluster.PDPair``, started once for this module) and the real
``vllm-router --vllm-pd-disaggregation --kv-connector nixl`` in front (issue 44, acceptance
1 and 3).

Oracles: the same prompts on one replica's engine (the offline ``LLM``, same dtype and
block size: itself checked token for token against HF transformers in tests/engine) and
vllm-router's own P/D protocol (it sends the prefill request with ``max_tokens=1`` and
``do_remote_decode``, then the client's request with the prefill's ``kv_transfer_params`` to
the decode replica). Each decode-side prompt is accounted by source from ``/metrics``: the
decode replica computes only the prompt's last partial block (a whole block when the
prompt ends on a boundary: the last token is computed for its logits); its own prefix
cache serves a shared prefix; everything else comes over NIXL.

Faults follow the router's protocol step by step (``support.pd_router``), so a fault can be
put between the steps:

- the decode side never reads: the prefill replica frees the held blocks when the hold
  (``kv_lease_duration``) ends, counted in ``kvpilot:nixl_num_kv_expired_reqs``;
- the prefill replica dies (SIGKILL, its engine core included) before the read: the decode
  replica's read fails and, under ``kv_load_failure_policy: recompute``, it computes the
  prompt itself: the client gets the one-replica answer; the failure is counted;
- a pull fails under ``kv_load_failure_policy: fail`` (the prefill replica's own policy):
  the client gets an OpenAI error with ``code: kv_transfer_failed`` saying why;
- the decode side is handed KV params it cannot honour (a malformed pull): a 400 OpenAI
  error, nothing allocated.

Afterwards the replicas hold no block (0 leaked). The module's tests share the replicas; the
one that kills the prefill replica runs last in file order (a test after it in another
order gets a fresh one: ``PDPair.prefill``).
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.bench.server_process import free_port
from kvpilot.engine.kv_transfer.params import producer_params

from support.pd_cluster import (
    BLOCK_SIZE,
    FAIL_HANDSHAKE_S,
    LEASE_S,
    MAX_TOKENS,
    MODEL,
    NUM_BLOCKS,
    PDPair,
    nixl_missing,
    router_binary,
    scrape,
    wait_idle,
)
from support.pd_router import pd_request, prefill_body

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(nixl_missing(), reason="NIXL is not installed (pip install 'kvpilot[nixl]')"),
              pytest.mark.skipif(router_binary() is None, reason="vllm-router is not installed (pip install "
                                                                 "vllm-router; the test extra has it)")]
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def pd(pd_model, tmp_path_factory):
    pair = PDPair(pd_model, tmp_path_factory.mktemp("pd"))   # starting in the background
    yield pair
    pair.stop()


@pytest.fixture(scope="module")
def reference_llm(pd, pd_model):
    """One replica's engine, in process: the oracle for every disaggregated answer. (It
    takes ``pd`` only so that the replicas start first and come up while this computes.)"""
    llm = LLM(pd_model, dtype="float32", num_gpu_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
              max_model_len=2048, max_num_batched_tokens=2048)
    yield llm
    llm.llm_engine.close()


@pytest.fixture(scope="module")
def reference(reference_llm, pd_prompts, fault_prompts) -> dict[tuple[int, ...], str]:
    """One replica's greedy answer to every prompt whose answer a test checks (of the fault
    prompts, only the one the decode replica recomputes)."""
    prompts = pd_prompts + fault_prompts[2:3]
    outs = reference_llm.generate(prompts, GREEDY)
    return {tuple(p): o.outputs[0].text for p, o in zip(prompts, outs, strict=True)}


def sources(m: dict[str, float]) -> dict[str, float]:
    return {s: m[f"vllm:prompt_tokens_by_source_total{{source={s}}}"] for s in SOURCES}


def _body(prompt: list[int], max_tokens: int = MAX_TOKENS) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def test_pd_outputs_are_identical_to_one_replica(pd, pd_prompts, reference, reference_llm):
    prefill, decode = pd.prefill, pd.decode
    client = openai.OpenAI(base_url=f"{pd.router.base_url}/v1", api_key="none", max_retries=0, timeout=120)
    expired = scrape(prefill.base_url)["kvpilot:nixl_num_kv_expired_reqs_total{}"]   # other tests' included
    failed = scrape(decode.base_url)["kvpilot:nixl_num_failed_transfers_total{}"]
    seen_prefix = False
    for i, prompt in enumerate(pd_prompts):
        before = sources(scrape(decode.base_url))
        kw = dict(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
        if i % 2:   # streamed and not, alternately
            text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
        else:
            text = client.completions.create(**kw).choices[0].text
        assert text == reference[tuple(prompt)], f"prompt {i} ({len(prompt)} tokens)"
        after = sources(scrape(decode.base_url))
        got = {s: after[s] - before[s] for s in SOURCES}
        local_hit = 400 if i == len(pd_prompts) - 1 else 0   # the shared prefix, cached by prompt 4
        seen_prefix |= local_hit > 0
        pulled = (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE - local_hit
        assert got == {"local_compute": len(prompt) - local_hit - pulled, "local_cache_hit": local_hit,
                       "external_kv_transfer": pulled}, f"prompt {i} ({len(prompt)} tokens)"
        assert got["local_compute"] <= BLOCK_SIZE
    assert seen_prefix

    messages = [{"role": "user", "content": "Which blocks does the decode engine read?"}]
    expected = reference_llm.chat(messages, GREEDY)[0].outputs[0].text
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert plain.choices[0].message.content == expected
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected

    m = wait_idle(prefill.base_url)
    assert m["kvpilot:nixl_num_kv_expired_reqs_total{}"] == expired   # every held request was read
    d = wait_idle(decode.base_url)
    assert d["kvpilot:nixl_num_failed_transfers_total{}"] == failed
    assert d["kvpilot:kv_transfer_blocks_received_total{}"] > 0
    assert d["kvpilot:nixl_xfer_time_seconds_count{}"] >= len(pd_prompts)


def test_bad_kv_transfer_params_are_a_400(pd, fault_prompts):
    prefill, decode = pd.prefill, pd.decode
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


def test_unread_kv_expires_on_the_prefill_side(pd, fault_prompts):
    prefill = pd.prefill
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


def test_fail_policy_ends_the_request_with_why(pd, fault_prompts):
    """``kv_load_failure_policy: fail`` (vLLM's default; the prefill replica's, a ``kv_both``):
    a pull from a prefill engine that does not answer ends the request with an OpenAI error
    saying why (a 500 with ``code: kv_transfer_failed``), its blocks freed; the engine goes on."""
    prefill = pd.prefill
    prompt = fault_prompts[3]   # never seen here: the whole prompt would be pulled
    before = scrape(prefill.base_url)["kvpilot:nixl_num_failed_transfers_total{}"]
    gone = producer_params(engine_id="gone", request_id="cmpl-gone", block_ids=list(range(13)), host="127.0.0.1",
                           port=free_port(), tp_size=1, num_tokens=len(prompt), prefix_hash=None)
    answer = httpx.post(f"{prefill.base_url}/v1/completions", json={**_body(prompt, 4), "kv_transfer_params": gone},
                        timeout=60)
    assert answer.status_code == 500, answer.text
    error = answer.json()["error"]
    assert error["code"] == "kv_transfer_failed"
    assert f"did not answer within {FAIL_HANDSHAKE_S:g} s" in error["message"]
    after = wait_idle(prefill.base_url)
    assert after["kvpilot:nixl_num_failed_transfers_total{}"] == before + 1
    answer = httpx.post(f"{prefill.base_url}/v1/completions", json=_body(prompt[:40], 4), timeout=60)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4   # the engine goes on
    wait_idle(prefill.base_url)


def test_prefill_dies_before_the_read_decode_recomputes(pd, fault_prompts, reference):
    """Last in file order: it kills the shared prefill replica."""
    prompt, decode = fault_prompts[2], pd.decode
    first = httpx.post(f"{pd.prefill.base_url}/v1/completions", json=prefill_body(_body(prompt)), timeout=60)
    assert first.status_code == 200, first.text
    params = first.json()["kv_transfer_params"]
    pd.kill_prefill()
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
