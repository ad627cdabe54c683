"""1,000 concurrent streams against a real ``kvpilot serve`` (issue 16, acceptance 3).

``--max-waiting-requests`` bounds the queue, so a burst of 1,000 streams (asyncio +
httpx, one connection each) splits into streams that run and 429s; 30% of the clients
hang up after their first chunk. Every response must be a complete stream (``[DONE]``
after a finished choice), a 429 with ``Retry-After``, or, for a client that hung up, a
stream that was fine until then; nothing else. After the load drains, /metrics must show
no request running or waiting and no KV block in use, and the server's resident memory
(API and engine core process together) must be back within a few percent of its level
after a first, identical round.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine.bench.server_process import launch_server

pytestmark = pytest.mark.slow

NUM_CLIENTS = 1000
DISCONNECT_SHARE = 0.3
MAX_NUM_SEQS = 64
MAX_WAITING = 128
MAX_TOKENS = 4
RSS_TOLERANCE = 0.05


@pytest.fixture
def server(tmp_path):
    flags = ["--model", "demo", "--max-model-len", "256", "--kv-cache-memory-bytes", "32Mi",
             "--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting-requests", str(MAX_WAITING),
             "--disable-log-stats", "--uvicorn-log-level", "warning",
             "--disable-uvicorn-access-log"]
    with launch_server(flags, log_path=tmp_path / "serve.log", timeout=300) as launched:
        yield launched


async def _client(http: httpx.AsyncClient, i: int, hang_up: bool) -> str:
    """One stream; returns its outcome: complete, 429, hung-up or other:<why>."""
    body = {"model": "kvpilot-demo", "prompt": f"client {i} says", "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True}
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code == 429:
                await response.aread()
                ok = response.headers.get("Retry-After") and "error" in response.json()
                return "429" if ok else "other:429 without Retry-After or error JSON"
            if response.status_code != 200:
                return f"other:HTTP {response.status_code}"
            events = []
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if hang_up:
                    return "hung-up" if "choices" in json.loads(events[0]) else "other:bad first"
            if events[-1] != "[DONE]":
                return "other:no [DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            if any("error" in c for c in chunks):
                return "other:error event"
            return "complete" if chunks[-1]["choices"][0]["finish_reason"] == "length" else \
                "other:unfinished"
    except httpx.HTTPError as exc:
        return f"other:{type(exc).__name__}"


async def _round(base_url: str) -> Counter:
    limits = httpx.Limits(max_connections=NUM_CLIENTS, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as http:
        hang_ups = {i for i in range(NUM_CLIENTS) if i % 10 < DISCONNECT_SHARE * 10}
        outcomes = await asyncio.gather(*(_client(http, i, i in hang_ups)
                                          for i in range(NUM_CLIENTS)))
    return Counter(outcomes)


def _idle_metrics(base_url: str, timeout: float = 60) -> dict[str, float]:
    """Waits until nothing runs or waits and no KV block is in use; returns those gauges."""
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
        values = {s.name: s.value for f in text_string_to_metric_families(text)
                  for s in f.samples if s.name in names}
        if not any(values.values()) or time.monotonic() > deadline:
            return values
        time.sleep(0.2)


def _rss(process: psutil.Process) -> int:
    """Resident memory of the server: the API process and the engine core process."""
    return sum(p.memory_info().rss for p in (process, *process.children(recursive=True)))


def test_1000_streams_with_hang_ups_leak_nothing(server):
    process = psutil.Process(server.process.pid)
    rss_fresh = _rss(process)
    started = time.monotonic()
    warm = asyncio.run(_round(server.base_url))    # lets every lazy allocation happen once
    _idle_metrics(server.base_url)
    rss_before = _rss(process)
    counts = asyncio.run(_round(server.base_url))
    took = time.monotonic() - started
    idle = _idle_metrics(server.base_url)
    rss_after = _rss(process)
    other = {k: v for k, v in counts.items() if k.startswith("other")}
    print(f"\n[A3] {NUM_CLIENTS} streams (30% hang up after the first chunk), "
          f"--max-num-seqs {MAX_NUM_SEQS} --max-waiting-requests {MAX_WAITING}: "
          f"complete {counts['complete']}, 429 {counts['429']}, hung up {counts['hung-up']}, "
          f"other {sum(other.values())} {other or ''}; after drain running "
          f"{idle['vllm:num_requests_running']:.0f}, waiting {idle['vllm:num_requests_waiting']:.0f}, "
          f"KV usage {idle['vllm:kv_cache_usage_perc']:.3f}; RSS fresh {rss_fresh / 2**20:.1f} MiB, "
          f"after round 1 {rss_before / 2**20:.1f} MiB, after round 2 (drained) "
          f"{rss_after / 2**20:.1f} MiB ("
          f"{(rss_after / rss_before - 1) * 100:+.1f}%); "
          f"two rounds in {took:.1f} s (first round: {dict(warm)})")
    assert not other
    assert sum(counts.values()) == NUM_CLIENTS
    assert counts["complete"] > 0 and counts["429"] > 0 and counts["hung-up"] > 0
    assert idle == {"vllm:num_requests_running": 0, "vllm:num_requests_waiting": 0,
                    "vllm:kv_cache_usage_perc": 0}
    assert abs(rss_after / rss_before - 1) < RSS_TOLERANCE
