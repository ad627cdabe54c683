"""Start-up: /health is 503 while the engine loads; a KV cache too small for one
``max_model_len`` sequence stops ``kvpilot serve`` with the largest length that fits; against
a GPU simulated through the test hook, /metrics shows the profiled and the pinned KV memory."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from kvpilot.engine.bench.server_process import free_port
from kvpilot.engine.model.models.demo import ensure_demo_model

pytestmark = pytest.mark.slow


def test_health_is_503_until_the_engine_is_ready(server):
    codes = server.health_codes
    assert codes[-1] == 200
    assert 503 in codes, f"never saw 503 while loading: {codes}"
    assert set(codes[codes.index(503):-1]) == {503}


def test_too_small_kv_cache_fails_at_start_with_the_largest_length_that_fits():
    config = json.loads((ensure_demo_model() / "config.json").read_text())
    # The textbook formula, by hand: K and V x layers x KV heads x head dim x 4 bytes
    # (the engine computes in float32 on CPU), in whole blocks of 16 tokens.
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    bytes_per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
    kv_bytes = 1 << 20
    fits = kv_bytes // (bytes_per_token * 16) * 16
    assert fits < 8192
    proc = subprocess.run(
        [sys.executable, "-m", "kvpilot.engine.cli.main", "serve", "--host", "127.0.0.1",
         "--port", str(free_port()), "--model", "demo", "--dtype", "float32", "--device", "cpu", "--max-model-len", "8192",
         "--kv-cache-memory-bytes", str(kv_bytes)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "kvpilot serve: error: the engine failed to start" in proc.stderr
    assert f"the largest max_model_len that fits is {fits}" in proc.stderr, proc.stderr[-2000:]


# A simulated 4 GiB GPU through the documented test hook (engine/model/device_memory.py):
# the server profiles against it on CPU; 0.9 x 4 GiB - 1 GiB weights - 0.5 GiB activations.
FAKE_GPU = {"KVPILOT_FAKE_DEVICE_MEMORY": json.dumps({"total_gib": 4, "free_gib": 4, "weights_gib": 1,
                                                      "activation_gib": 0.5})}
PROFILED = int(int(4 * 2**30) * 0.9) - 2**30 - 2**29
SMALL_ENGINE = ["--model", "demo", "--device", "cpu", "--max-model-len", "64", "--max-num-batched-tokens", "64",
                "--max-num-seqs", "4"]


def test_metrics_show_the_profiled_and_the_pinned_kv_memory(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    from kvpilot.engine.bench.server_process import launch_server

    pinned = 64 << 20
    with launch_server([*SMALL_ENGINE, "--kv-cache-memory-bytes", str(pinned)], env=FAKE_GPU,
                       log_path=tmp_path / "serve.log") as server:
        text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    samples = {s.name: s for family in text_string_to_metric_families(text) for s in family.samples}
    profiled = samples["kvpilot:kv_cache_profiled_available_bytes"]
    assert profiled.value == PROFILED and profiled.labels == {"model_name": "kvpilot-demo"}
    blocks = int(samples["vllm:cache_config_info"].labels["num_gpu_blocks"])
    allocated = samples["kvpilot:kv_cache_memory_bytes"].value
    assert allocated <= pinned and allocated % blocks == 0 and pinned - allocated < allocated / blocks

