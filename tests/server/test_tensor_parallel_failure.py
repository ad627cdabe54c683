"""A tensor-parallel server whose worker dies fails loudly and at once.

A real ``kvpilot serve --tensor-parallel-size 2`` (gloo on CPU, the demo model) streams
a long completion while a plain one waits for its answer; its worker process is killed
with SIGKILL. Both requests must end in an error naming the dead rank, /health must
answer 503 and new requests must be refused, all within seconds, and nothing may hang.
"""

from __future__ import annotations

import os
import re
import signal

import httpx
import pytest

from kvpilot.engine.bench.server_process import launch_server

DETECTION_LIMIT_S = 5.0


def _worker_pid(server) -> int:
    match = re.search(r"worker pids \[(\d+)\]", server.log_path.read_text())
    assert match, server.log_tail()
    return int(match.group(1))


@pytest.mark.slow
def test_killing_a_worker_fails_requests_and_health_within_seconds(tmp_path, kill_mid_generation):
    flags = ["--model", "demo", "--tensor-parallel-size", "2", "--kv-cache-memory-bytes", "16Mi", "--max-model-len", "1024",
             "--max-num-seqs", "4", "--served-model-name", "tp", "--uvicorn-log-level", "warning"]
    with launch_server(flags, log_path=tmp_path / "serve.log", timeout=300) as server, \
            httpx.Client(base_url=server.base_url, timeout=60) as http:
        pid = _worker_pid(server)
        death = kill_mid_generation(http, "tp", lambda: os.kill(pid, signal.SIGKILL), DETECTION_LIMIT_S)
        # in-flight requests: a generic 500 with their request id; why, in the log and /health
        assert "the engine failed while serving this request (request id" in death.stream_error
        assert death.health.status_code == 503 and "SIGKILL" in death.health.json()["error"]["message"]
        assert death.plain.status_code == 500
        assert "(request id" in death.plain.json()["error"]["message"]
        assert f"tensor-parallel worker rank 1 (pid {pid}) was killed by SIGKILL" in server.log_tail(200)
        assert death.refused.status_code == 503 and "SIGKILL" in death.refused.json()["error"]["message"]
        print(f"\n[tensor-parallel worker killed] stream error after {death.stream_failed_s:.2f} s, "
              f"/health 503 after {death.health_failed_s:.2f} s")
        assert death.stream_failed_s < DETECTION_LIMIT_S and death.health_failed_s < DETECTION_LIMIT_S
