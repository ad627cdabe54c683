"""``kvpilot bench frontend`` at toy size: the offline figure and a real ``kvpilot serve``
run (the engine core in its own process) of the same workload, with each process's CPU
seconds, in one JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_frontend_bench_reports_serve_next_to_offline(tmp_path):
    out = tmp_path / "frontend.json"
    proc = subprocess.run(
        # enough tokens (2,048) that every process spends more than /proc's 10 ms tick
        [sys.executable, "-m", "kvpilot.engine.cli.main", "bench", "frontend", "--num-clients", "16",
         "--prompt-len", "8", "--output-len", "128", "--modes", "core", "--stream-intervals", "1,4",
         "--json-out", str(out)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    offline, serve, gathered = json.loads(out.read_text())
    assert gathered["name"] == "serve (core, interval 4)" and gathered["output_tokens_per_s"] > 0
    assert set(gathered["cpu_s_per_1k_tokens"]) == {"server", "core", "clients"}
    assert offline["name"] == "offline (LLM.generate)" and offline["output_tokens_per_s"] > 0
    assert serve["name"] == "serve (core)" and serve["output_tokens_per_s"] > 0
    assert serve["share_of_offline"] == pytest.approx(serve["output_tokens_per_s"]
                                                      / offline["output_tokens_per_s"])
    assert set(serve["cpu_s"]) == {"server", "core", "clients"}
    assert all(seconds > 0 for seconds in serve["cpu_s"].values())
    assert "of offline" in proc.stdout
