"""A tensor-parallel server whose worker dies fails loudly and at once.

A real ``kvpilot serve --tensor-parallel-size 2`` (gloo on CPU, the demo model) streams
a long completion while a plain one waits for its answer; its worker process is killed
with SIGKILL. Both requests must end in an error naming the dead rank, /health must
answer 503 and new requests must be refused, all within seconds, and nothing may hang.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx
import pytest

from kvpilot.engine.server.launch import launch_server

DETECTION_LIMIT_S = 5.0


def _worker_pid(server) -> int:
    match = re.search(r"worker pids \[(\d+)\]", server.log_path.read_text())
    assert match, server.log_tail()
    return int(match.group(1))


@pytest.mark.slow
def test_killing_a_worker_fails_requests_and_health_within_seconds(tmp_path):
    flags = ["--tensor-parallel-size", "2", "--kv-cache-memory-bytes", "16Mi", "--max-model-len", "1024",
             "--max-num-seqs", "4", "--served-model-name", "tp", "--uvicorn-log-level", "warning"]
    with launch_server(flags, log_path=tmp_path / "serve.log", timeout=300) as server, \
            httpx.Client(base_url=server.base_url, timeout=60) as http:
        pid = _worker_pid(server)
        body = {"model": "tp", "prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True,
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
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            error = next(e for e in events if "error" in e)["error"]
            stream_failed = time.monotonic() - killed
        assert f"tensor-parallel worker rank 1 (pid {pid}) was killed by SIGKILL" in error["message"]
        deadline = killed + DETECTION_LIMIT_S
        while (health := http.get("/health")).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        health_failed = time.monotonic() - killed
        assert health.status_code == 503 and "SIGKILL" in health.json()["error"]["message"]
        waiter.join(DETECTION_LIMIT_S)
        assert not waiter.is_alive()
        assert plain["response"].status_code == 500
        assert "tensor-parallel worker rank 1" in plain["response"].json()["error"]["message"]
        refused = http.post("/v1/completions", json=body)
        assert refused.status_code == 503 and "SIGKILL" in refused.json()["error"]["message"]
        print(f"\n[tensor-parallel worker killed] stream error after {stream_failed:.2f} s, "
              f"/health 503 after {health_failed:.2f} s")
        assert stream_failed < DETECTION_LIMIT_S and health_failed < DETECTION_LIMIT_S
