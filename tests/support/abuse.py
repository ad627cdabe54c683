"""Measuring what an attack does to everyone else: a victim stream beside it, raw HTTP
requests that time their answer, and a demo-model server to run them against.

Used by tests/server/test_abuse.py (issue 26, server items): the victim's largest gap
between chunks must stay under 0.5 s while the attack is answered (401/400/413/429)
within 1 s.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx


def demo_model_flags(name: str = "kvpilot-demo") -> list[str]:
    """``--model demo --served-model-name NAME``: the built-in random-weight demo model,
    named explicitly (``kvpilot serve`` without ``--model`` serves a real one)."""
    return ["--model", "demo", "--served-model-name", name]


class VictimStream(threading.Thread):
    """Streams one long completion and records when each chunk arrived.

    ``wait_streaming()`` returns once chunks flow; ``finish()`` stops it and returns the
    largest gap between consecutive chunks seen from then on (the warm-up excluded).
    With ``renew``, a completion that ends at ``max_tokens`` is followed at once by the
    next one, so the stream lasts as long as the test, however fast the engine decodes
    (the arrivals go on in one list; ``renewals`` counts the restarts).
    """

    def __init__(self, base_url: str, api_key: str | None, model: str,
                 max_tokens: int = 4000, renew: bool = False) -> None:
        super().__init__(daemon=True)
        self.base_url, self.model, self.max_tokens = base_url, model, max_tokens
        self.renew, self.renewals = renew, 0
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.arrivals: list[float] = []
        self.error: str | None = None
        self.finish_reason: str | None = None
        self._streaming = threading.Event()
        self._halt = threading.Event()

    def run(self) -> None:
        try:
            with httpx.Client(base_url=self.base_url, timeout=60, headers=self.headers) as client:
                while self._stream_once(client) and self.renew and not self._halt.is_set():
                    self.renewals += 1
        except httpx.HTTPError as exc:
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self._streaming.set()

    def _stream_once(self, client: httpx.Client) -> bool:
        """One streamed completion; True when it ended by ``max_tokens``."""
        body = {"model": self.model, "prompt": "The victim says", "max_tokens": self.max_tokens,
                "ignore_eos": True, "temperature": 0, "stream": True}
        self.finish_reason = None
        with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                self.error = f"HTTP {response.status_code}: {response.read()[:300]!r}"
                return False
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    self.error = str(event["error"])
                    return False
                self.arrivals.append(time.monotonic())
                if len(self.arrivals) >= 5:
                    self._streaming.set()
                self.finish_reason = event["choices"][0].get("finish_reason") or self.finish_reason
                if self._halt.is_set():
                    return False
        return self.finish_reason == "length"

    def wait_streaming(self, timeout: float = 60.0) -> float:
        """Waits until chunks flow; returns the time from which gaps count."""
        assert self._streaming.wait(timeout), "the victim stream never started"
        assert self.error is None, self.error
        self.since = time.monotonic()
        return self.since

    def halt(self) -> None:
        """Stops the stream (if it still runs) and waits for the thread."""
        self._halt.set()
        self.join(30)

    def finish(self) -> float:
        """Stops the stream; the largest gap (s) between chunks since ``wait_streaming``.
        Fails if the stream broke or ended before ``finish``."""
        assert self.is_alive(), f"the victim stream ended early: {self.error or self.finish_reason}"
        self.halt()
        assert self.error is None, f"the victim stream failed: {self.error}"
        times = [t for t in self.arrivals if t >= self.since - 1.0]
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        gaps.append(time.monotonic() - times[-1] if times else float("inf"))
        return max(gaps)


@dataclass(frozen=True)
class RawAnswer:
    status: int
    headers: dict[str, str]
    body: bytes
    seconds: float           # from the first byte sent to the whole answer read

    def json(self) -> dict:
        return json.loads(self.body)


def raw_request(base_url: str, method: str, path: str, headers: dict[str, str],
                body: bytes = b"", timeout: float = 30.0) -> RawAnswer:
    """One HTTP/1.1 request over a plain socket: the head at once, the body from a thread
    (a server may answer, and close, before reading it), the answer read meanwhile."""
    parts = urlsplit(base_url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=timeout)
    head = "".join(f"{k}: {v}\r\n" for k, v in {"Host": "x", **headers}.items())
    start = time.monotonic()
    sock.sendall(f"{method} {path} HTTP/1.1\r\n{head}\r\n".encode())

    def send_body() -> None:
        try:
            view = memoryview(body)
            while view:
                sent = sock.send(view[:1 << 20])
                view = view[sent:]
        except OSError:
            pass     # the server answered and closed without reading it: the point

    sender = threading.Thread(target=send_body, daemon=True)
    sender.start()
    data = b""
    try:
        while not _complete(data):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except ConnectionResetError:
        pass
    seconds = time.monotonic() - start
    sock.close()
    sender.join(5)
    head_bytes, _, payload = data.partition(b"\r\n\r\n")
    lines = head_bytes.decode("latin-1").split("\r\n")
    assert lines and lines[0].startswith("HTTP/"), f"no HTTP answer: {data[:200]!r}"
    fields = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return RawAnswer(int(lines[0].split()[1]), {k.lower(): v for k, v in fields.items()},
                     payload, seconds)


def _complete(data: bytes) -> bool:
    head, sep, payload = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(payload) >= int(value)
    return False


async def _slow_client(host: str, port: int, period: float) -> tuple[bytes | None, float]:
    """Dribbles a request head a byte every ``period`` s until the server answers or closes;
    (its status line or None, seconds from the connection until then)."""
    reader, writer = await asyncio.open_connection(host, port)
    start = time.monotonic()
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"s" * 400 + b"\r\n\r\n"
    answer = b""
    try:
        for byte in head:
            writer.write(bytes([byte]))
            await writer.drain()
            try:
                answer = await asyncio.wait_for(reader.read(4096), period)
            except TimeoutError:
                continue
            break
    except OSError:
        pass
    seconds = time.monotonic() - start
    writer.close()
    return answer.split(b"\r\n", 1)[0] or None, seconds


def slow_clients(host: str, port: int, count: int, period: float) -> list[tuple[bytes | None, float]]:
    """``count`` slowloris clients at once (run it in a process of its own, so that their
    event loop does not take the GIL from the measuring threads): each one's status
    line and seconds, as ``_slow_client``."""

    async def all_of_them():
        return await asyncio.gather(*(_slow_client(host, port, period) for _ in range(count)))

    return asyncio.run(all_of_them())
