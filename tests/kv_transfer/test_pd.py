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

Through the router, the features a client may ask of the decode side: ``n`` > 1 (the
prompt's KV read once, the other sequences served from the decode replica's prefix cache),
stop strings, a LoRA adapter both replicas serve under one name (KV computed under another
adapter is refused and the prompt computed locally), structured outputs (checked with
``jsonschema`` and the choice list too). Each answer is the one-replica answer; the openai
SDK is the client.

Faults follow the router's protocol step by step (``support.pd_router``), so a fault can be
put between the steps:

- the decode side never reads: the prefill replica frees the held blocks when the hold
  (``kv_lease_duration``) ends, counted in ``kvpilot:nixl_num_kv_expired_reqs``;
- the prefill replica dies (SIGKILL, its engine core included) before the read, or during
  it (the decode replica's test hook pauses a long read between two NIXL transfers, and
  the prefill replica is killed in the pause): the decode replica's read fails and, under
  ``kv_load_failure_policy: recompute``, it computes what did not arrive: the client gets
  the one-replica answer; the failure is counted;
- a pull fails under ``kv_load_failure_policy: fail`` (the prefill replica's own policy):
  the client gets an OpenAI error with ``code: kv_transfer_failed`` saying why;
- the decode side is handed KV params it cannot honour (a malformed pull): a 400 OpenAI
  error, nothing allocated.

Afterwards the replicas hold no block (0 leaked). The module's tests share the replicas; the
one that kills the prefill replica runs last in file order (a test after it in another
order gets a fresh one: ``PDPair.prefill``).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.bench.server_process import free_port
from kvpilot.engine.kv_transfer.params import producer_params
from kvpilot.engine.lora.config import LoRAModule
from kvpilot.engine.sampling_params import StructuredOutputsParams

from support.lora_adapters import random_adapter
from support.pd_cluster import (
    BLOCK_SIZE,
    FAIL_HANDSHAKE_S,
    LEASE_S,
    MAX_TOKENS,
    MID_READ_BLOCKS,
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
LORA = "pd-lora"
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def pd_adapter(pd_model, tmp_path_factory) -> Path:
    """A random rank-8 LoRA adapter of the model, which both replicas serve as ``LORA``."""
    return random_adapter(Path(pd_model), tmp_path_factory.mktemp("pd-lora") / LORA, rank=8, seed=44)


@pytest.fixture(scope="module")
def pd(pd_model, pd_adapter, tmp_path_factory):
    # a loaded machine may take long over the grammar compiler's first vocabulary pass
    flags = ("--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"{LORA}={pd_adapter}",
             "--structured-output-compile-timeout", "120")
    pair = PDPair(pd_model, tmp_path_factory.mktemp("pd"), flags)   # starting in the background
    yield pair
    pair.stop()


@pytest.fixture(scope="module")
def reference_llm(pd, pd_model, pd_adapter):
    """One replica's engine, in process, with the same adapter: the oracle for every
    disaggregated answer. (It takes ``pd`` only so that the replicas start first and come
    up while this computes.)"""
    llm = LLM(pd_model, dtype="float32", num_gpu_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
              max_model_len=2048, max_num_batched_tokens=2048, enable_lora=True, max_lora_rank=8,
              lora_modules=(LoRAModule(LORA, str(pd_adapter)),))
    yield llm
    llm.llm_engine.close()


@pytest.fixture(scope="module")
def reference(reference_llm, pd_prompts, fault_prompts) -> dict[tuple[int, ...], str]:
    """One replica's greedy answer to every prompt whose answer a test checks (of the fault
    prompts, only those the decode replica recomputes)."""
    prompts = pd_prompts + [fault_prompts[2], fault_prompts[4]]
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


def _client(pd: PDPair) -> openai.OpenAI:
    """The openai SDK in front of vllm-router in P/D mode."""
    return openai.OpenAI(base_url=f"{pd.router.base_url}/v1", api_key="none", max_retries=0, timeout=120)


def _read(num_prompt_tokens: int) -> int:
    """Prompt tokens a decode replica that holds none of the prompt reads over NIXL."""
    return (num_prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


def _delta(before: dict[str, float], base_url: str) -> dict[str, float]:
    after = sources(scrape(base_url))
    return {s: after[s] - before[s] for s in SOURCES}


def _texts(stream) -> dict[int, str]:
    """A streamed answer's text per choice index (completions or chat)."""
    texts: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            piece = c.text if hasattr(c, "text") else c.delta.content
            texts[c.index] = texts.get(c.index, "") + (piece or "")
    return texts


def test_n_sequences_read_the_prompt_once(pd, feature_prompts, reference_llm):
    """``n`` > 1 through the router: the prefill replica holds the first sequence's blocks;
    on the decode replica one sequence reads them and the others take them from its prefix
    cache (none computes the prompt). Greedy: every choice is the one-replica answer;
    seeded sampling (a chat, streamed): each choice is the one-replica engine's choice of
    that index."""
    client, decode, prompt = _client(pd), pd.decode, feature_prompts[0]
    greedy = reference_llm.generate(prompt, GREEDY)[0].outputs[0].text
    before = sources(scrape(decode.base_url))
    answer = client.completions.create(model=MODEL, prompt=prompt, n=3, max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert {c.index: c.text for c in answer.choices} == {0: greedy, 1: greedy, 2: greedy}
    read = _read(len(prompt))
    assert _delta(before, decode.base_url) == {"external_kv_transfer": read, "local_cache_hit": 2 * read,
                                               "local_compute": 3 * (len(prompt) - read)}

    messages = [{"role": "user", "content": "Three sequences of one request: do they read the prompt once?"}]
    sampled = SamplingParams(n=2, temperature=1.0, seed=44, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = reference_llm.chat(messages, sampled)[0]
    before = sources(scrape(decode.base_url))
    texts = _texts(client.chat.completions.create(model=MODEL, messages=messages, n=2, temperature=1.0, seed=44,
                                                  max_tokens=MAX_TOKENS, stream=True,
                                                  extra_body={"ignore_eos": True}))
    assert texts == {o.index: o.text for o in expected.outputs}
    assert texts[0] != texts[1]   # sampled: each sequence draws its own tokens
    read = _read(len(expected.prompt_token_ids))
    assert _delta(before, decode.base_url)["external_kv_transfer"] == read > 0
    wait_idle(pd.prefill.base_url)
    wait_idle(decode.base_url)


def test_stop_strings_end_the_decode(pd, feature_prompts, reference_llm):
    """A stop string from the middle of the greedy answer ends it there on the decode
    replica, streamed and not, as on one replica (the text before it, ``finish_reason:
    stop``)."""
    client, prompt = _client(pd), feature_prompts[1]
    full = reference_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    text = full.outputs[0].text
    stop = next(text[k:k + 2] for k in range(1, len(text) - 1) if text.find(text[k:k + 2]) == k)
    expected = reference_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                             stop=[stop]))[0].outputs[0]
    assert expected.finish_reason == "stop" and 0 < len(expected.text) < len(text)
    kw = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    before = sources(scrape(pd.decode.base_url))
    plain = client.completions.create(**kw).choices[0]
    assert (plain.text, plain.finish_reason) == (expected.text, "stop")
    assert _delta(before, pd.decode.base_url)["external_kv_transfer"] == _read(len(prompt))
    finish = None
    texts = {}
    for chunk in client.completions.create(stream=True, **kw):   # again: now a hit in the decode replica's cache
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            finish = c.finish_reason or finish
    assert (texts, finish) == ({0: expected.text}, "stop")
    wait_idle(pd.prefill.base_url)
    wait_idle(pd.decode.base_url)


def test_lora_kv_is_read_for_the_same_adapter_only(pd, feature_prompts, reference_llm):
    """Both replicas serve the adapter under one name (``--lora-modules``): a request for it
    through the router is prefilled under it, its KV read by the decode replica, and the
    answer is the one-replica answer with the adapter (not the base model's). A block's
    hash carries the adapter (its name and checkpoint digest), so KV computed under another
    adapter (here the base model) is refused: the decode replica computes the prompt itself,
    says so in its log, and the prefill replica's hold is released."""
    client, prefill, decode = _client(pd), pd.prefill, pd.decode
    prompt, other = feature_prompts[2], feature_prompts[3]
    with_lora = [o.outputs[0].text for o in reference_llm.generate([prompt, other], GREEDY, lora_name=LORA)]
    assert with_lora[0] != reference_llm.generate(prompt, GREEDY)[0].outputs[0].text   # the adapter tells
    before = sources(scrape(decode.base_url))
    texts = _texts(client.completions.create(model=LORA, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True}))
    assert texts == {0: with_lora[0]}
    read = _read(len(prompt))
    assert _delta(before, decode.base_url) == {"external_kv_transfer": read, "local_cache_hit": 0,
                                               "local_compute": len(prompt) - read}

    expired = scrape(prefill.base_url)["kvpilot:nixl_num_kv_expired_reqs_total{}"]
    base_kv = httpx.post(f"{prefill.base_url}/v1/completions", json=prefill_body(_body(other)), timeout=60)
    assert base_kv.status_code == 200, base_kv.text
    before = sources(scrape(decode.base_url))
    answer = httpx.post(f"{decode.base_url}/v1/completions", timeout=60,
                        json={**_body(other), "model": LORA, "kv_transfer_params": base_kv.json()["kv_transfer_params"]})
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == with_lora[1]
    assert _delta(before, decode.base_url) == {"external_kv_transfer": 0, "local_cache_hit": 0,
                                               "local_compute": len(other)}
    assert "the prefill engine's prompt hashes differently" in (pd.logs / "decode.log").read_text()
    wait_idle(prefill.base_url, **{"kvpilot:nixl_num_kv_expired_reqs_total{}": expired})   # released, not expired
    wait_idle(decode.base_url)


def test_structured_outputs_on_the_decode_side(pd, feature_prompts, reference_llm):
    """The decode replica applies the request's constraint from the first token it samples:
    a JSON schema (chat, ``response_format``) and a choice (completions, streamed) answer
    as on one replica, valid by ``jsonschema`` and the choice list, over KV it read."""
    client, decode = _client(pd), pd.decode
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                               "size": {"enum": ["S", "M", "L"]}},
              "required": ["colour", "size"], "additionalProperties": False}
    choices = ["prefill", "decode", "both"]
    messages = [{"role": "user", "content": "Describe the KV blocks that cross between the replicas."}]
    with ThreadPoolExecutor(2) as pool:
        # both replicas' grammar compilers (their first vocabulary pass) ready meanwhile: a
        # prefilled request must not wait on the decode replica's (its KV is held LEASE_S)
        warm = [pool.submit(_compile_on, replica.base_url, [{"json": schema}, {"choice": choices}])
                for replica in (decode, pd.prefill)]
        as_json = reference_llm.chat(messages, SamplingParams(temperature=0, max_tokens=40,
                                                              structured_outputs=StructuredOutputsParams(json=schema)))[0]
        as_choice = reference_llm.generate(feature_prompts[4], SamplingParams(
            temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=choices)))[0]
        for compiled in warm:
            compiled.result()
    before = sources(scrape(decode.base_url))
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                          response_format={"type": "json_schema",
                                                           "json_schema": {"name": "kv", "schema": schema}})
    content = chat.choices[0].message.content
    jsonschema.validate(json.loads(content), schema)
    assert content == as_json.outputs[0].text and chat.choices[0].finish_reason == "stop"
    texts = _texts(client.completions.create(model=MODEL, prompt=feature_prompts[4], max_tokens=8, temperature=0,
                                             stream=True, extra_body={"structured_outputs": {"choice": choices}}))
    assert texts == {0: as_choice.outputs[0].text} and texts[0] in choices
    assert _delta(before, decode.base_url)["external_kv_transfer"] == (
        _read(len(as_json.prompt_token_ids)) + _read(len(feature_prompts[4])))
    wait_idle(pd.prefill.base_url)
    wait_idle(decode.base_url)


def _compile_on(base_url: str, constraints: list[dict]) -> None:
    """Each constraint compiled on the replica at ``base_url`` (a one-token request)."""
    for constraint in constraints:
        answer = httpx.post(f"{base_url}/v1/completions", timeout=150, json={
            "model": MODEL, "prompt": [11, 12, 13], "max_tokens": 1, "structured_outputs": constraint})
        assert answer.status_code == 200, answer.text


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


def test_prefill_dies_before_or_during_the_read_decode_recomputes(pd, fault_prompts, reference):
    """Last in file order: it kills the shared prefill replica (SIGKILL, its engine core
    included), once for both cases, under the decode replica's ``recompute`` policy:

    - during the read: a client's request through the router whose read of 87 blocks the
      decode replica's test hook posts as two NIXL transfers (``MID_READ_BLOCKS``, then the
      rest) with a pause between; the prefill replica dies in the pause (once the decode
      log says so), the second transfer fails (NIXL: the remote agent disconnected), and
      the decode replica keeps the blocks that arrived and computes the rest;
    - before the read: a prompt the prefill replica computed and holds; the decode
      replica's read fails at the side channel and it computes the prompt.

    Both times the client gets the one-replica answer, the failure is counted, and the
    decode replica's pool returns to idle (0 blocks in use)."""
    decode, held, half = pd.decode, fault_prompts[2], fault_prompts[4]
    first = httpx.post(f"{pd.prefill.base_url}/v1/completions", json=prefill_body(_body(held)), timeout=60)
    assert first.status_code == 200, first.text
    client, log = _client(pd), pd.logs / "decode.log"
    pauses = log.read_text().count("paused mid-read")
    before = scrape(decode.base_url)
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(client.completions.create, model=MODEL, prompt=half, max_tokens=MAX_TOKENS,
                             temperature=0, extra_body={"ignore_eos": True})
        deadline = time.monotonic() + 60
        while log.read_text().count("paused mid-read") == pauses:   # the first transfer is done
            assert not answer.done() and time.monotonic() < deadline, "the read never paused"
            time.sleep(0.02)
        pd.kill_prefill()
        assert answer.result(timeout=60).choices[0].text == reference[tuple(half)]
    assert f"after {MID_READ_BLOCKS} of {_read(len(half)) // BLOCK_SIZE} blocks arrived" in log.read_text()

    late = httpx.post(f"{decode.base_url}/v1/completions", timeout=60,
                      json={**_body(held), "kv_transfer_params": first.json()["kv_transfer_params"]})
    assert late.status_code == 200, late.text
    assert late.json()["choices"][0]["text"] == reference[tuple(held)]

    after = wait_idle(decode.base_url)
    grew = {name: after[name] - before[name] for name in (
        "kvpilot:kv_transfer_failed_loads_total{}", "kvpilot:nixl_num_failed_transfers_total{}",
        "kvpilot:kv_transfer_blocks_received_total{}", "kvpilot:kv_transfer_recomputed_tokens_total{}")}
    assert grew == {"kvpilot:kv_transfer_failed_loads_total{}": 2, "kvpilot:nixl_num_failed_transfers_total{}": 2,
                    "kvpilot:kv_transfer_blocks_received_total{}": MID_READ_BLOCKS,   # kept: not computed again
                    "kvpilot:kv_transfer_recomputed_tokens_total{}":
                        _read(len(half)) - MID_READ_BLOCKS * BLOCK_SIZE + _read(len(held))}
