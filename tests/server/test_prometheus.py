"""A real Prometheus scrapes the server under a shared-prefix load.

Asserted through Prometheus' HTTP API (not by parsing /metrics ourselves): KV cache
usage was above zero under load, the prefix-cache hit rate computed by PromQL is
positive, and the TTFT histogram counted exactly the requests sent.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import subprocess
import time

import httpx
import pytest

from kvpilot.engine.bench.server_process import free_port

pytestmark = pytest.mark.slow

PROMETHEUS = shutil.which("prometheus")
NUM_REQUESTS = 8
PREFIX_TOKENS = 512


class Prometheus:
    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=10)

    def query(self, promql: str) -> list[dict]:
        resp = self.http.get("/api/v1/query", params={"query": promql})
        resp.raise_for_status()
        body = resp.json()
        assert body["status"] == "success", body
        return body["data"]["result"]

    def scalar(self, promql: str) -> float | None:
        result = self.query(promql)
        return float(result[0]["value"][1]) if result else None

    def wait_for_sample_after(self, series: str, t: float, timeout: float = 60) -> float:
        """Waits until ``series`` has a sample scraped after wall-clock time ``t``; returns it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stamp = self.scalar(f"timestamp({series})")
            if stamp is not None and stamp > t:
                return self.scalar(series)
            time.sleep(0.5)
        raise AssertionError(f"Prometheus scraped no {series} after {t} within {timeout} s")


@pytest.fixture
def prometheus(server, tmp_path):
    if PROMETHEUS is None:
        pytest.skip("the prometheus binary is not installed (scripts/bootstrap.sh test installs it)")
    target = server.base_url.removeprefix("http://")
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: kvpilot\n    metrics_path: /metrics\n"
        f"    static_configs:\n      - targets: ['{target}']\n")
    port = free_port()
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={config}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    prom = Prometheus(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
            try:
                if prom.scalar('up{job="kvpilot"}') == 1.0:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "Prometheus never scraped the server"
            time.sleep(0.5)
        yield prom
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


async def _shared_prefix_load(async_client, model: str) -> None:
    rng = random.Random(11)
    prefix = [rng.randrange(1000, 100_000) for _ in range(PREFIX_TOKENS)]
    suffixes = [[rng.randrange(1000, 100_000) for _ in range(8)] for _ in range(NUM_REQUESTS)]
    # the first request fills the cache, the rest (4 at a time) share its prefix
    await async_client.completions.create(model=model, prompt=prefix + suffixes[0], max_tokens=12,
                                          temperature=0, extra_body={"ignore_eos": True})
    limit = asyncio.Semaphore(4)

    async def one(suffix: list[int]) -> None:
        async with limit:
            await async_client.completions.create(model=model, prompt=prefix + suffix,
                                                  max_tokens=12, temperature=0,
                                                  extra_body={"ignore_eos": True})

    await asyncio.gather(*(one(s) for s in suffixes[1:]))


async def _observed_while_running(async_client, model: str, prometheus: Prometheus) -> None:
    """Streams a long request and holds it until Prometheus has scraped the KV usage it
    causes: on a fast machine the shared-prefix load can finish between two scrapes."""
    rng = random.Random(12)
    stream = await async_client.completions.create(
        model=model, prompt=[rng.randrange(1000, 100_000) for _ in range(200)], max_tokens=1500,
        temperature=0, stream=True, extra_body={"ignore_eos": True})
    async for _ in stream:
        started = time.time()
        await asyncio.to_thread(prometheus.wait_for_sample_after, "vllm:kv_cache_usage_perc", started)
        break
    await stream.close()      # a disconnect: the server aborts the request


def test_prometheus_sees_kv_usage_prefix_hits_and_every_ttft(prometheus, server, metrics,
                                                             async_client, settings):
    ttft_count = "vllm:time_to_first_token_seconds_count"
    metrics.wait_until_idle()
    before = prometheus.wait_for_sample_after(ttft_count, time.time())

    async def load() -> None:    # one event loop: the async client is bound to it
        await _shared_prefix_load(async_client, settings.model)
        await _observed_while_running(async_client, settings.model, prometheus)

    asyncio.run(load())
    metrics.wait_until_idle()
    after = prometheus.wait_for_sample_after(ttft_count, time.time())

    assert after - before == NUM_REQUESTS + 1     # the shared-prefix load and the held request
    peak_usage = prometheus.scalar("max_over_time(vllm:kv_cache_usage_perc[2m])")
    assert peak_usage is not None and 0 < peak_usage <= 1
    hit_rate = prometheus.scalar(
        "rate(vllm:prefix_cache_hits_total[1m]) / rate(vllm:prefix_cache_queries_total[1m])")
    assert hit_rate is not None and hit_rate > 0
    info = prometheus.query("vllm:cache_config_info")
    assert info and info[0]["metric"]["enable_prefix_caching"] == "True"
    assert info[0]["metric"]["model_name"] == settings.model
