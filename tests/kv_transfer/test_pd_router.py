"""Greedy requests through the real ``vllm-router --vllm-pd-disaggregation --kv-connector
nixl`` over one prefill and one decode ``kvpilot serve`` (issue 44, acceptance 1).

Oracles: the same prompts on one replica's engine (the offline ``LLM``, same dtype and
block size: itself checked token for token against HF transformers in tests/engine) and
vllm-router's own P/D protocol (it sends the prefill request with ``max_tokens=1`` and
``do_remote_decode``, then the client's request with the prefill's ``kv_transfer_params`` to
the decode replica). Each decode-side prompt is accounted by source from ``/metrics``: the
decode replica computes only the prompt's last partial block (a whole block when the
prompt ends on a boundary: the last token is computed for its logits); its own prefix
cache serves a shared prefix; everything else comes over NIXL. Afterwards neither replica
holds a block.
"""

from __future__ import annotations

import openai
import pytest

from kvpilot.engine import SamplingParams

from support.pd_cluster import (
    BLOCK_SIZE,
    MAX_TOKENS,
    MODEL,
    nixl_missing,
    router_binary,
    scrape,
    start_pd_router,
    wait_idle,
)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(nixl_missing(), reason="NIXL is not installed (pip install 'kvpilot[nixl]')"),
              pytest.mark.skipif(router_binary() is None, reason="vllm-router is not installed (pip install "
                                                                 "vllm-router; the test extra has it)")]
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def sources(m: dict[str, float]) -> dict[str, float]:
    return {s: m[f"vllm:prompt_tokens_by_source_total{{source={s}}}"] for s in SOURCES}


@pytest.fixture(scope="module")
def router(prefill, decode, tmp_path_factory):
    r = start_pd_router(prefill.base_url, decode.base_url, tmp_path_factory.mktemp("pd-router") / "router.log")
    yield r
    r.stop()


def test_pd_outputs_are_identical_to_one_replica(router, prefill, decode, pd_prompts, reference,
                                                 reference_llm):
    client = openai.OpenAI(base_url=f"{router.base_url}/v1", api_key="none", max_retries=0, timeout=120)
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
    expected = reference_llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))[0].outputs[0].text
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
