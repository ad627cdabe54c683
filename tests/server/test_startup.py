"""Start-up: /health is 503 while the engine loads; a KV cache too small for one
``max_model_len`` sequence stops ``kvpilot serve`` with the largest length that fits."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvpilot.engine.model.models.demo import ensure_demo_model
from kvpilot.engine.server.launch import free_port

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
         "--port", str(free_port()), "--device", "cpu", "--max-model-len", "8192",
         "--kv-cache-memory-bytes", str(kv_bytes)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "kvpilot serve: error: the engine failed to start" in proc.stderr
    assert f"the largest max_model_len that fits is {fits}" in proc.stderr, proc.stderr[-2000:]
