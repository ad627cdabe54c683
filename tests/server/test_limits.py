"""Huge inputs never block the server (issue 16, acceptance 1).

A real ``kvpilot serve`` on the demo model gets a 20 MB prompt (completions and chat),
a prompt just under the character bound that it must tokenize (seconds of work), and
bodies over ``--max-request-body-bytes`` (announced by Content-Length, and streamed
chunked without one), while a thread polls ``/livez`` and ``/health`` every 100 ms.
Every poll must answer 200 within 250 ms; the oversized requests get 400 / 413 with
OpenAI error JSON within a second; the server serves normally afterwards.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import openai
import pytest

from kvpilot.engine.bench.server_process import launch_server

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 2048
BODY_LIMIT = 24 << 20
POLL_PERIOD_S = 0.1
POLL_LIMIT_S = 0.25
REJECT_LIMIT_S = 1.0
PROMPT_20MB = "x" * 20_000_000


class ProbePoller(threading.Thread):
    """Polls /livez and /health every 100 ms; records (path, status, seconds) per poll."""

    def __init__(self, base_url: str) -> None:
        super().__init__(daemon=True)
        self.base_url = base_url
        self.polls: list[tuple[str, int, float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=10) as client:
            while not self.stop.is_set():
                tick = time.monotonic()
                for path in ("/livez", "/health"):
                    start = time.monotonic()
                    try:
                        status = client.get(path).status_code
                    except httpx.TransportError:
                        status = 0
                    self.polls.append((path, status, time.monotonic() - start))
                self.stop.wait(max(0.0, POLL_PERIOD_S - (time.monotonic() - tick)))


@pytest.fixture
def server(tmp_path):
    flags = ["--model", "demo", "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", "16Mi",
             "--max-num-seqs", "4", "--max-request-body-bytes", str(BODY_LIMIT),
             "--uvicorn-log-level", "warning"]
    with launch_server(flags, log_path=tmp_path / "serve.log", timeout=300) as launched:
        yield launched


def _raw_post(base_url: str, headers: dict[str, str], body: bytes) -> tuple[int, dict]:
    """POSTs with exactly these headers over a plain socket; returns status and JSON body."""
    parts = urlsplit(base_url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{head}\r\n".encode() + body)
        data = b""
        while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < _length(data):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


def _length(data: bytes) -> int:
    for line in data.partition(b"\r\n\r\n")[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 1 << 30


def _timed(fn):
    start = time.monotonic()
    result = fn()
    return result, time.monotonic() - start


def _refused(call) -> tuple[dict, float]:
    """The 400 error body of ``call()`` (through the openai SDK) and the seconds it took."""
    start = time.monotonic()
    with pytest.raises(openai.BadRequestError) as info:
        call()
    return info.value.body, time.monotonic() - start


def test_huge_prompts_are_refused_fast_and_probes_never_stall(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0,
                           timeout=120)
    poller = ProbePoller(server.base_url)
    poller.start()
    try:
        time.sleep(0.5)   # a few polls of the idle server first

        # 20 MB of text: refused from its length alone, before tokenizing.
        error, took_20mb = _refused(lambda: client.completions.create(
            model="kvpilot-demo", prompt=PROMPT_20MB, max_tokens=1))
        assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
        assert "20000000 characters" in error["message"]
        error, took_chat = _refused(lambda: client.chat.completions.create(
            model="kvpilot-demo", max_tokens=1, messages=[{"role": "user", "content": PROMPT_20MB}]))
        assert error["code"] == "context_length_exceeded" and error["param"] == "messages"

        # Just under the bound: the server must tokenize it (a second or more), off the loop.
        near = "hello world " * 170_000
        error, took_near = _refused(lambda: client.completions.create(
            model="kvpilot-demo", prompt=near, max_tokens=1))
        assert error["code"] == "context_length_exceeded"
        assert "tokens" in error["message"] and "characters" not in error["message"]

        # Over the body limit, announced: refused before the body is read.
        (status, body), took_announced = _timed(lambda: _raw_post(
            server.base_url, {"Content-Type": "application/json",
                              "Content-Length": str(64 << 20)}, b'{"prompt": "'))
        assert status == 413 and body["error"]["code"] == "request_too_large"
        assert str(BODY_LIMIT) in body["error"]["message"]

        # Over the body limit, streamed without Content-Length: counted as it arrives.
        def chunks():
            yield b'{"model": "kvpilot-demo", "prompt": "'
            for _ in range(BODY_LIMIT >> 20):
                yield b"y" * (1 << 20)
            yield b'"}'

        streamed, took_streamed = _timed(lambda: httpx.post(
            f"{server.base_url}/v1/completions", content=chunks(),
            headers={"Content-Type": "application/json"}, timeout=30))
        assert "content-length" not in streamed.request.headers
        assert streamed.status_code == 413
        assert streamed.json()["error"]["type"] == "invalid_request_error"

        time.sleep(0.3)
        served = client.completions.create(model="kvpilot-demo", prompt="Hello", max_tokens=3)
        assert served.usage.completion_tokens == 3
    finally:
        poller.stop.set()
        poller.join(10)

    polls = poller.polls
    worst = max(polls, key=lambda p: p[2])
    print(f"\n[A1] {len(polls)} probe polls, worst {worst[0]} {worst[2] * 1000:.1f} ms; "
          f"20 MB prompt 400 in {took_20mb * 1000:.0f} ms (chat {took_chat * 1000:.0f} ms); "
          f"{len(near)}-char prompt tokenized and refused in {took_near:.2f} s; "
          f"413 by Content-Length in {took_announced * 1000:.0f} ms, "
          f"streamed {BODY_LIMIT >> 20} MiB+ in {took_streamed * 1000:.0f} ms")
    assert len(polls) >= 2 * 10
    assert {status for _, status, _ in polls} == {200}, polls
    assert worst[2] < POLL_LIMIT_S, worst
    assert took_20mb < REJECT_LIMIT_S and took_chat < REJECT_LIMIT_S
    assert took_announced < REJECT_LIMIT_S and took_streamed < REJECT_LIMIT_S
