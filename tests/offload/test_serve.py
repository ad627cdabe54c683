"""``kvpilot serve --kv-offloading-*``: the flags reach the engine, and the offload metrics
and log line come out.

Through the real server process, the ``openai`` SDK and prometheus_client's parser: the
request sharing an evicted prefix reports it as cached, its completion equals the
offline no-offload engine's, and ``/metrics`` counts exactly the tokens and bytes that
the offload tiers served.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine.bench.server_process import launch_server
from kvpilot.engine.offload.config import GIB

from support.offload_helpers import GREEDY, PREFIX_BLOCK_TOKENS

pytestmark = pytest.mark.slow
BYTES_PER_BLOCK = 4 * 2 * 16 * 2 * 32 * 4     # layers x K/V x tokens x kv heads x head dim x fp32


def scrape(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return {f"{s.name}{{{s.labels.get('transfer_type', '')}}}": s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_serve_flags_metrics_and_log_line(offload_model, prompts, reference, tmp_path):
    flags = ["--model", offload_model, "--dtype", "float32", "--served-model-name", "offload",
             "--kv-cache-memory-bytes", str(100 * BYTES_PER_BLOCK), "--max-model-len", "1600",
             "--max-num-batched-tokens", "2048", "--kv-offloading-size", "0.05",
             "--kv-offloading-backend", "native", "--kv-offloading-disk-path", str(tmp_path / "kv"),
             "--kv-offloading-disk-size", "0.1", "--log-stats-interval", "0.5",
             "--uvicorn-log-level", "warning"]
    with launch_server(flags, log_path=tmp_path / "serve.log", timeout=120) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)

        def complete(prompt):
            return client.completions.create(model="offload", prompt=prompt, max_tokens=GREEDY.max_tokens,
                                             temperature=0, extra_body={"ignore_eos": True})

        complete(prompts.first)
        complete(prompts.filler)
        second = complete(prompts.second)
        assert second.usage.prompt_tokens_details.cached_tokens == PREFIX_BLOCK_TOKENS
        assert second.choices[0].text == reference[tuple(prompts.second)].text

        deadline = time.monotonic() + 30
        while True:   # disk writes finish in the background
            m = scrape(server.base_url)
            if m.get("vllm:kv_offload_total_bytes_total{CPU_to_disk}", 0) > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        external = m["vllm:external_prefix_cache_hits_total{}"]
        assert external > 0
        assert external + m["vllm:prefix_cache_hits_total{}"] == PREFIX_BLOCK_TOKENS
        assert m["vllm:external_prefix_cache_queries_total{}"] == sum(
            len(p) for p in (prompts.first, prompts.filler, prompts.second))
        assert m["vllm:kv_offload_total_bytes_total{CPU_to_GPU}"] == external / 16 * BYTES_PER_BLOCK
        assert m["vllm:kv_offload_total_bytes_total{GPU_to_CPU}"] > 0
        assert m["vllm:kv_offload_total_bytes_total{CPU_to_disk}"] > 0
        assert "vllm:kv_offload_total_bytes_total{disk_to_CPU}" in m
        assert m["kvpilot:kv_offload_cpu_capacity_bytes{}"] == int(0.05 * GIB)
        assert 0 < m["kvpilot:kv_offload_cpu_usage_bytes{}"] <= int(0.05 * GIB)
        assert m["kvpilot:kv_offload_disk_capacity_bytes{}"] == int(0.1 * GIB)

        deadline = time.monotonic() + 10
        while "External prefix cache hit rate" not in server.log_path.read_text():
            assert time.monotonic() < deadline, server.log_tail()
            time.sleep(0.2)
