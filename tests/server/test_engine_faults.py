"""A step that hangs or keeps raising fails requests and readiness, never hangs a client
(issue 16, acceptance 5).

Engine on a thread (``--engine-in-process``): the real app runs under uvicorn on a
loopback port around a real engine whose model runner is wrapped by the test: armed, its
``execute`` blocks until released (a hung kernel) or raises (a broken device). Engine
core in its own process (the default): a real ``kvpilot serve`` whose core process is
stopped with SIGSTOP (a hang), or whose model runner a ``sitecustomize`` on the child's
``PYTHONPATH`` makes raise once a flag file exists. Clients are real: the openai SDK and
httpx streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time

import httpx
import openai
import psutil
import pytest

from kvpilot.engine.bench.server_process import launch_server
from kvpilot.engine.runtime.messages import MAX_CONSECUTIVE_STEP_FAILURES
from kvpilot.engine.server.config import ServerConfig

from support.in_process_server import serving

pytestmark = pytest.mark.slow

HANG_TIMEOUT_S = 3.0    # a step of the demo model on a busy 2-core machine can take a second
SLACK_S = 1.0          # polling period, watchdog period and a busy 2-core machine
LONG = {"model": "kvpilot-demo", "prompt": "Once upon a time", "max_tokens": 400,
        "ignore_eos": True, "temperature": 0}


def sdk_args(max_tokens: int) -> dict:
    """``LONG`` as openai SDK arguments (``ignore_eos`` is a kvpilot / vLLM extra)."""
    return {"model": LONG["model"], "prompt": LONG["prompt"], "max_tokens": max_tokens,
            "temperature": 0, "extra_body": {"ignore_eos": True}}


class FaultyExecute:
    """Wraps ``ModelRunner.execute``: ``mode`` None passes through, "hang" blocks until
    ``release``, "raise" raises."""

    def __init__(self, execute) -> None:
        self.execute = execute
        self.mode: str | None = None
        self.release = threading.Event()
        self.hung_at: float | None = None    # when the hanging call began

    def __call__(self, *args, **kwargs):
        if self.mode == "hang":
            self.hung_at = time.monotonic()
            self.release.wait(120)
        elif self.mode == "raise":
            raise RuntimeError("injected: device error")
        return self.execute(*args, **kwargs)


@pytest.fixture(scope="module")
def llm():
    from kvpilot.engine import LLM

    return LLM("demo", kv_cache_memory_bytes=16 << 20, max_model_len=1024, max_num_seqs=4)


@pytest.fixture
def faulty(llm, monkeypatch):
    """The engine's model runner, wrapped for fault injection (unwrapped afterwards)."""
    wrapper = FaultyExecute(llm.llm_engine.runner.execute)
    monkeypatch.setattr(llm.llm_engine.runner, "execute", wrapper)
    yield wrapper
    wrapper.mode = None
    wrapper.release.set()


@contextlib.asynccontextmanager
async def clients(base_url: str):
    """An openai SDK client and an httpx client for the server at ``base_url``."""
    sdk = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=60)
    async with sdk, httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        yield sdk, http


async def _stream(http: httpx.AsyncClient, first: asyncio.Event) -> list[dict | str]:
    """A completion stream's events (``[DONE]`` as the string); sets ``first`` on the first."""
    events: list[dict | str] = []
    async with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
                first.set()
    return events


async def _wait_status(http: httpx.AsyncClient, path: str, status: int, since: float) -> float:
    """Polls ``path`` every 50 ms until it answers ``status``; seconds since ``since``."""
    while (await http.get(path)).status_code != status:
        assert time.monotonic() - since < 30, f"{path} never answered {status}"
        await asyncio.sleep(0.05)
    return time.monotonic() - since


async def _in_flight(http: httpx.AsyncClient, sdk: openai.AsyncOpenAI):
    """Two streams that have had their first chunk and a plain request under way."""
    firsts = [asyncio.Event(), asyncio.Event()]
    streams = [asyncio.ensure_future(_stream(http, f)) for f in firsts]
    plain = asyncio.ensure_future(sdk.completions.create(**sdk_args(LONG["max_tokens"])))
    for f in firsts:
        await asyncio.wait_for(f.wait(), 30)
    await asyncio.sleep(0.1)
    assert not plain.done()
    return streams, plain


def _assert_failed_stream(events: list) -> None:
    assert events[-1] == "[DONE]" and "choices" in events[0]
    error = events[-2]["error"]
    assert error["type"] == "server_error", events[-2]


async def _hang_scenario(base_url: str, hang, release) -> dict[str, float]:
    """Requests in flight, then ``hang()`` (returns when the hang began): readiness must
    turn 503 and the requests fail; after ``release()`` the server serves as before.
    Returns the seconds from the hang to readiness 503, to the plain request's 500 and to
    the streams' error events."""
    figures = {}
    async with clients(base_url) as (sdk, http):
        before = (await sdk.completions.create(**sdk_args(8))).choices[0].text
        streams, plain = await _in_flight(http, sdk)
        hung_at = await hang()
        await _wait_status(http, "/health", 503, hung_at)
        figures["readiness"] = time.monotonic() - hung_at
        assert (await http.get("/health")).json()["error"]["code"] == "engine_stalled"
        assert (await http.get("/livez")).status_code == 200      # not a restart case
        with pytest.raises(openai.InternalServerError) as info:
            await asyncio.wait_for(plain, 10)
        assert "no progress" in info.value.body["message"]
        figures["plain"] = time.monotonic() - hung_at
        for stream in streams:
            _assert_failed_stream(await asyncio.wait_for(stream, 10))
        figures["streams"] = time.monotonic() - hung_at
        refused = await http.post("/v1/completions", json=LONG)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_stalled"
        assert refused.headers["Retry-After"]

        release()
        await _wait_status(http, "/health", 200, time.monotonic())
        after = (await sdk.completions.create(**sdk_args(8))).choices[0].text
        assert after == before
    return figures


def _report_hang(label: str, figures: dict[str, float]) -> None:
    print(f"\n[A5 {label}] threshold {HANG_TIMEOUT_S} s; after the hang began: /health 503 after "
          f"{figures['readiness']:.2f} s, plain request 500 after {figures['plain']:.2f} s, both "
          f"streams error+[DONE] after {figures['streams']:.2f} s; recovered when released")
    # The stalled iteration began a little before the hang (scheduling), hence the 0.2 s.
    assert HANG_TIMEOUT_S - 0.2 <= figures["readiness"] <= HANG_TIMEOUT_S + SLACK_S
    assert figures["streams"] <= HANG_TIMEOUT_S + SLACK_S


def test_hung_step_fails_readiness_and_requests_then_recovers(llm, faulty):
    """The engine on a thread of the server (``--engine-in-process``)."""
    engine = llm.llm_engine

    async def hang() -> float:
        faulty.mode = "hang"
        while faulty.hung_at is None:
            await asyncio.sleep(0.01)
        return faulty.hung_at

    def release() -> None:
        faulty.mode = None
        faulty.release.set()

    with serving(lambda: engine, ServerConfig(engine_hang_timeout=HANG_TIMEOUT_S)) as base_url:
        figures = asyncio.run(_hang_scenario(base_url, hang, release))
    assert not engine.has_unfinished_requests()
    _report_hang("hung step, engine thread", figures)


def test_stopped_core_process_fails_readiness_and_requests_then_recovers(tmp_path):
    """A real ``kvpilot serve`` (engine core in its own process, the default) whose core
    process is stopped with SIGSTOP mid-generation, then continued with SIGCONT."""
    flags = ["--model", "demo", "--max-model-len", "1024", "--kv-cache-memory-bytes", "16Mi", "--max-num-seqs", "4",
             "--engine-hang-timeout", str(HANG_TIMEOUT_S), "--uvicorn-log-level", "warning"]
    with launch_server(flags, log_path=tmp_path / "serve.log", timeout=300) as server:
        (core,) = psutil.Process(server.process.pid).children()
        # The first steps of a fresh core (allocations, first forwards) may themselves
        # outlast the threshold on a busy machine: warm it up first.
        for _ in range(5):
            warm = httpx.post(f"{server.base_url}/v1/completions", json={**LONG, "max_tokens": 8},
                              timeout=60)
            if warm.status_code == 200:
                break
        assert warm.status_code == 200, warm.text

        async def hang() -> float:
            core.suspend()
            return time.monotonic()

        figures = asyncio.run(_hang_scenario(server.base_url, hang, core.resume))
    _report_hang("stopped core process", figures)


# Loaded by every Python process of the server through PYTHONPATH (the API process and the
# engine core, which runs the model): the runner raises once the flag file exists.
RAISING_RUNNER = """
import os
from pathlib import Path

FLAG = Path(os.environ["KVPILOT_TEST_RAISE_FLAG"])  # set only for the server under test


def _patch():
    from kvpilot.engine.model import runner

    execute = runner.ModelRunner.execute

    def raising_execute(self, *args, **kwargs):
        if FLAG.exists():
            raise RuntimeError("injected: device error")
        return execute(self, *args, **kwargs)

    runner.ModelRunner.execute = raising_execute


_patch()
"""


async def _raise_scenario(base_url: str, arm, max_failures: int) -> dict[str, float]:
    """Requests in flight, then ``arm()`` (steps raise from then on): the requests fail;
    after the engine's limit of consecutive failed steps readiness and liveness are 503.
    Returns the seconds from arming to the failures and to readiness 503."""
    figures = {}
    async with clients(base_url) as (sdk, http):
        streams, plain = await _in_flight(http, sdk)
        armed = arm()
        with pytest.raises(openai.InternalServerError) as info:
            await asyncio.wait_for(plain, 30)
        assert "(request id" in info.value.body["message"]      # the exception text: the log's
        assert "injected" not in info.value.body["message"]
        for stream in streams:
            _assert_failed_stream(await asyncio.wait_for(stream, 30))
        figures["requests"] = time.monotonic() - armed
        # One failed step is taken as transient; consecutive ones mean a broken engine.
        for _ in range(max_failures - 1):
            assert (await http.get("/health")).status_code == 200
            failed = await http.post("/v1/completions", json=LONG)
            assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error"
        figures["readiness"] = await _wait_status(http, "/health", 503, armed)
        assert (await http.get("/livez")).status_code == 503
        assert (await http.post("/v1/completions", json=LONG)).status_code == 503
    return figures


def _report_raise(label: str, figures: dict[str, float], max_failures: int) -> None:
    print(f"\n[A5 raise, {label}] in-flight requests 500 / error+[DONE] after "
          f"{figures['requests']:.2f} s; /health and /livez 503 after {max_failures} failed "
          f"steps ({figures['readiness']:.2f} s)")


def test_raising_steps_in_the_core_process_fail_requests_then_readiness_and_liveness(tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(RAISING_RUNNER)
    flag = tmp_path / "raise"
    env = {"PYTHONPATH": str(hook), "KVPILOT_TEST_RAISE_FLAG": str(flag)}
    flags = ["--model", "demo", "--max-model-len", "1024", "--kv-cache-memory-bytes", "16Mi", "--max-num-seqs", "4",
             "--uvicorn-log-level", "warning"]
    with launch_server(flags, log_path=tmp_path / "serve.log", env=env, timeout=300) as server:
        def arm() -> float:
            flag.touch()
            return time.monotonic()

        figures = asyncio.run(_raise_scenario(server.base_url, arm, MAX_CONSECUTIVE_STEP_FAILURES))
    _report_raise("core process", figures, MAX_CONSECUTIVE_STEP_FAILURES)


def test_raising_steps_fail_requests_then_readiness_and_liveness(llm, faulty):
    engine = llm.llm_engine

    def arm() -> float:
        faulty.mode = "raise"
        return time.monotonic()

    with serving(lambda: engine, ServerConfig(engine_hang_timeout=HANG_TIMEOUT_S)) as base_url:
        figures = asyncio.run(_raise_scenario(base_url, arm, MAX_CONSECUTIVE_STEP_FAILURES))
    faulty.mode = None
    assert not engine.has_unfinished_requests()
    _report_raise("engine thread", figures, MAX_CONSECUTIVE_STEP_FAILURES)
