"""Shared fixtures: one ``kvpilot serve`` process for the whole session, clients for it,
and an in-process ``LLM`` with the same engine settings as the oracle for outputs.

The server runs the built-in demo model with a small KV cache and tight limits
(4 running sequences, 2 waiting requests) so that queue-full and disconnect
behaviour can be provoked quickly.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine.bench.server_process import launch_server


@dataclass(frozen=True)
class Settings:
    """How the session's server is configured (tests read it through the ``settings`` fixture)."""

    api_key: str = "test-secret-key"
    model: str = "kvpilot-demo"
    alias: str = "demo-alias"
    max_model_len: int = 2048
    max_num_seqs: int = 4
    max_waiting: int = 2
    kv_cache_bytes: int = 32 << 20


SETTINGS = Settings()
API_KEY, MODEL, ALIAS = SETTINGS.api_key, SETTINGS.model, SETTINGS.alias
MAX_MODEL_LEN, MAX_NUM_SEQS, MAX_WAITING = SETTINGS.max_model_len, SETTINGS.max_num_seqs, SETTINGS.max_waiting
KV_CACHE_BYTES = SETTINGS.kv_cache_bytes

SERVER_FLAGS = [
    "--model", "demo",
    "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
    "--max-model-len", str(MAX_MODEL_LEN),
    "--max-num-seqs", str(MAX_NUM_SEQS),
    "--max-waiting-requests", str(MAX_WAITING),
    "--api-key", API_KEY,
    "--served-model-name", MODEL, ALIAS,
    "--log-stats-interval", "1",
    "--uvicorn-log-level", "warning",
]


@pytest.fixture(scope="session")
def settings() -> Settings:
    return SETTINGS


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("server") / "serve.log"
    launched = launch_server(SERVER_FLAGS, log_path=log_path, timeout=300)
    yield launched
    status = launched.stop()
    # SIGTERM -> graceful shutdown; uvicorn then re-raises the signal (status -15).
    assert status in (0, -15), f"server exited with {status}:\n{launched.log_tail()}"


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0,
                         timeout=300)


@pytest.fixture(scope="session")
def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0,
                              timeout=300)


@pytest.fixture(scope="session")
def http(server) -> httpx.Client:
    with httpx.Client(base_url=server.base_url, timeout=300,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


@pytest.fixture(scope="session")
def offline_llm():
    """The engine in-process, configured like the server: the oracle for its outputs."""
    from kvpilot.engine import LLM

    return LLM("demo", kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=MAX_MODEL_LEN,
               max_num_seqs=MAX_NUM_SEQS)


class MetricsReader:
    """Reads the session server's /metrics through prometheus_client's own parser."""

    def __init__(self, http: httpx.Client) -> None:
        self._http = http

    def scrape(self) -> dict[str, float]:
        """``{"sample_name{label=value,...}": value}``, without the model_name label."""
        text = self._http.get("/metrics").text
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                                  if k != "model_name")
                samples[f"{s.name}{{{labels}}}"] = s.value
        return samples

    def wait_until_idle(self, timeout: float = 60.0) -> dict[str, float]:
        """Polls until nothing runs or waits and no KV block is in use; returns that scrape."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.scrape()
            if (m["vllm:num_requests_running{}"] == 0 and m["vllm:num_requests_waiting{}"] == 0
                    and m["vllm:kv_cache_usage_perc{}"] == 0):
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout} s: {m}")
            time.sleep(0.1)


@pytest.fixture(scope="session")
def metrics(http) -> MetricsReader:
    return MetricsReader(http)


@dataclass(frozen=True)
class Death:
    """What clients saw when a part of the engine was killed mid-generation."""

    stream_error: str            # the error event ending the streamed completion
    stream_failed_s: float       # seconds from the kill to that event
    health: httpx.Response       # the first /health that was not 200 (or the last tried)
    health_failed_s: float
    plain: httpx.Response        # the non-streamed completion that was waiting
    refused: httpx.Response      # a completion sent afterwards


def _kill_mid_generation(http: httpx.Client, model: str, kill: Callable[[], None],
                        limit_s: float) -> Death:
    """Streams a long completion and waits on a plain one, calls ``kill`` once generation
    is under way, and reports how each request and /health ended (waiting at most
    ``limit_s`` for each)."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True,
            "temperature": 0}
    plain: dict = {}
    waiter = threading.Thread(target=lambda: plain.update(response=http.post("/v1/completions",
                                                                               json=body)))
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
        events = (json.loads(line[6:]) for line in stream.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]")
        for _ in range(3):                       # generation is under way
            assert "choices" in next(events)
        waiter.start()
        time.sleep(0.5)
        kill()
        killed = time.monotonic()
        error = next(e for e in events if "error" in e)["error"]
        stream_failed = time.monotonic() - killed
    while (health := http.get("/health")).status_code == 200 and time.monotonic() < killed + limit_s:
        time.sleep(0.05)
    health_failed = time.monotonic() - killed
    waiter.join(limit_s)
    assert not waiter.is_alive(), "the plain request still waits"
    refused = http.post("/v1/completions", json=body)
    return Death(error["message"], stream_failed, health, health_failed, plain["response"], refused)


@pytest.fixture
def kill_mid_generation() -> Callable[..., Death]:
    """``kill_mid_generation(http, model, kill, limit_s) -> Death`` (see ``_kill_mid_generation``)."""
    return _kill_mid_generation
