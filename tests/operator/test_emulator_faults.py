"""The emulator's fault injection and watch details behave as the tests rely on."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from support.harness import EmulatorThread
from support.kube_faults import Fault

CM = "/api/v1/namespaces/default/configmaps"


@pytest.fixture(scope="module")
def emu():
    with EmulatorThread() as emu:
        yield emu
        assert emu.emulator.failures == []


@pytest.fixture(autouse=True)
def no_faults_left(emu):
    yield
    emu.run(lambda e: e.faults.clear())


def call(emu, method, path, body=None, agent="test"):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(emu.url + path, data=data, method=method,
                                 headers={"Content-Type": "application/merge-patch+json"
                                          if method == "PATCH" else "application/json", "User-Agent": agent})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


def test_faults_answer_matching_requests_for_their_count(emu):
    fault = emu.run(lambda e: e.faults.add(Fault(429, path=r"/configmaps", user_agent="victim", times=2,
                                                 retry_after=3)))
    code, headers, status = call(emu, "POST", CM, {"metadata": {"name": "f1"}}, agent="victim/1.0")
    assert (code, headers["Retry-After"], status["reason"]) == (429, "3", "TooManyRequests")
    assert call(emu, "POST", CM, {"metadata": {"name": "f1"}}, agent="bystander")[0] == 201  # not matched
    assert call(emu, "GET", f"{CM}/f1", agent="victim")[0] == 200  # GET: not a write
    assert call(emu, "PATCH", f"{CM}/f1", {"data": {"a": "1"}}, agent="victim")[0] == 429
    assert call(emu, "PATCH", f"{CM}/f1", {"data": {"a": "1"}}, agent="victim")[0] == 200  # spent
    assert fault.hits == 2 and fault.spent


def test_a_delay_fault_serves_the_request_late(emu):
    emu.run(lambda e: e.faults.add(Fault(None, methods=frozenset({"GET"}), path="/configmaps/slow", delay=0.5)))
    call(emu, "POST", CM, {"metadata": {"name": "slow"}})
    started = time.monotonic()
    assert call(emu, "GET", f"{CM}/slow")[0] == 200
    assert time.monotonic() - started >= 0.5


def _watch(emu, query: str, lines: list, done: threading.Event) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", emu.port, timeout=10)
    try:
        conn.request("GET", f"{CM}?watch=true&{query}")
        resp = conn.getresponse()
        while line := resp.readline():
            lines.append(json.loads(line))
    except (http.client.IncompleteRead, ConnectionError, OSError) as exc:
        lines.append(type(exc).__name__)
    finally:
        done.set()


def _raw_watch(emu, timeout_seconds: int, received: list, done: threading.Event) -> None:
    with socket.create_connection(("127.0.0.1", emu.port), timeout=10) as sock:
        sock.sendall(f"GET {CM}?watch=true&timeoutSeconds={timeout_seconds} HTTP/1.1\r\n"
                     f"Host: x\r\nConnection: close\r\n\r\n".encode())
        while chunk := sock.recv(65536):
            received.append(chunk)
    done.set()


def test_dropped_watch_streams_are_cut_mid_stream(emu):
    for drop, timeout_seconds in ((False, 1), (True, 30)):
        received, done = [], threading.Event()
        threading.Thread(target=_raw_watch, args=(emu, timeout_seconds, received, done), daemon=True).start()
        time.sleep(0.3)
        if drop:
            emu.run(lambda e: e.drop_watches())
        assert done.wait(5)
        # a stream that ends normally ends with the last (empty) chunk; a cut one does not
        assert b"".join(received).endswith(b"0\r\n\r\n") is not drop


def test_bookmarks_and_objects_leaving_a_label_selector(emu):
    emu.emulator.bookmark_seconds = 0.2
    try:
        call(emu, "POST", CM, {"metadata": {"name": "sel", "labels": {"team": "a"}}})
        _, _, obj = call(emu, "GET", f"{CM}/sel")
        lines, done = [], threading.Event()
        query = f"labelSelector=team%3Da&allowWatchBookmarks=true&timeoutSeconds=2&" \
                f"resourceVersion={obj['metadata']['resourceVersion']}"
        threading.Thread(target=_watch, args=(emu, query, lines, done), daemon=True).start()
        time.sleep(0.5)
        call(emu, "PATCH", f"{CM}/sel", {"metadata": {"labels": {"team": "b"}}})
        call(emu, "PATCH", f"{CM}/sel", {"metadata": {"labels": {"team": "a"}}})
        assert done.wait(5)
    finally:
        emu.emulator.bookmark_seconds = 60.0
    changes = [(e["type"], e["object"]["metadata"]["labels"]["team"]) for e in lines if e["type"] != "BOOKMARK"]
    assert changes == [("DELETED", "b"), ("ADDED", "a")]  # as the API server's watch cache says it
    bookmark = next(e for e in lines if e["type"] == "BOOKMARK")
    assert bookmark["object"]["kind"] == "ConfigMap" and int(bookmark["object"]["metadata"]["resourceVersion"])
