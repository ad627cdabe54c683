"""KV offload through LMCache: its CPU tier, its disk tier, and a shared ``lmcache server``.

LMCache hits are chunk-granular: with ``LMCACHE_CHUNK_SIZE=64`` a 1,500-token shared
prefix reuses its first 23 chunks (1,472 tokens); the rest is computed.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvpilot.engine import LLM

from support import with_support_path
from support.offload_helpers import (
    ENGINE_KW,
    GREEDY,
    PREFIX_LEN,
    assert_same_output,
    delta,
    exported,
    run_measured,
)

pytest.importorskip("lmcache")
pytestmark = pytest.mark.slow

CHUNK = 64
CHUNK_PREFIX_TOKENS = PREFIX_LEN // CHUNK * CHUNK     # 1472: whole chunks of the prefix
HERE = Path(__file__).resolve().parent


@pytest.fixture
def lmcache_env(monkeypatch):
    monkeypatch.setenv("LMCACHE_CHUNK_SIZE", str(CHUNK))
    monkeypatch.setenv("LMCACHE_TRACK_USAGE", "false")
    return monkeypatch


def assert_chunk_hit(before, after, prompt: list[int]) -> None:
    device = delta(after, before, "prefix_cache_hits")
    external = delta(after, before, "external_prefix_cache_hits")
    assert device < CHUNK_PREFIX_TOKENS                # evicted from the device pool
    assert external >= CHUNK_PREFIX_TOKENS // 2
    assert device + external == CHUNK_PREFIX_TOKENS
    assert delta(after, before, "computed_prompt_tokens") == len(prompt) - CHUNK_PREFIX_TOKENS


def test_lmcache_cpu_tier(offload_model, prompts, reference, lmcache_env):
    llm = LLM(offload_model, **ENGINE_KW, kv_offloading_backend="lmcache", kv_offloading_size=0.05)
    try:
        llm.generate([prompts.first], GREEDY)
        llm.generate([prompts.filler], GREEDY)
        out, before, after = run_measured(llm, prompts.second)
        assert_chunk_hit(before, after, prompts.second)
        assert_same_output(out, reference[tuple(prompts.second)])
        assert after.kv_offload_cpu_used_bytes > 0 and after.kv_offload_gpu_to_cpu_bytes > 0
    finally:
        llm.llm_engine.close()


def test_lmcache_disk_tier_only(offload_model, prompts, reference, lmcache_env, tmp_path):
    lmcache_env.setenv("LMCACHE_LOCAL_CPU", "false")    # LMCache's own switch: no CPU hot cache
    disk = tmp_path / "lmcache-disk"
    llm = LLM(offload_model, **ENGINE_KW, kv_offloading_backend="lmcache", kv_offloading_size=0.05,
              kv_offloading_disk_path=str(disk), kv_offloading_disk_size=0.1)
    try:
        llm.generate([prompts.first], GREEDY)
        llm.generate([prompts.filler], GREEDY)
        llm.llm_engine.kv_offload.flush()
        out, before, after = run_measured(llm, prompts.second)
        assert_chunk_hit(before, after, prompts.second)
        assert_same_output(out, reference[tuple(prompts.second)])
        assert after.kv_offload_cpu_used_bytes == 0          # nothing could come from the CPU tier
        assert after.kv_offload_disk_used_bytes > 0 and any(disk.iterdir())
    finally:
        llm.llm_engine.close()


def test_lmcache_a_corrupt_chunk_is_a_miss_recomputed_and_replaced(offload_model, prompts, reference,
                                                                  lmcache_env, tmp_path):
    """Every chunk file on LMCache's disk gets one byte flipped (bit rot, or a peer's bytes):
    no chunk is served, the output is still the reference, the chunks are counted, removed
    and stored again by the request that recomputed them."""
    lmcache_env.setenv("LMCACHE_LOCAL_CPU", "false")
    disk = tmp_path / "lmcache-disk"
    llm = LLM(offload_model, **ENGINE_KW, kv_offloading_backend="lmcache", kv_offloading_size=0.05,
              kv_offloading_disk_path=str(disk), kv_offloading_disk_size=0.1)
    try:
        llm.generate([prompts.first], GREEDY)
        llm.generate([prompts.filler], GREEDY)
        llm.llm_engine.kv_offload.flush()
        files = [p for p in disk.rglob("*") if p.is_file()]
        assert files
        for path in files:
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0x5A
            path.write_bytes(bytes(data))
        out, before, after = run_measured(llm, prompts.second)
        assert delta(after, before, "external_prefix_cache_hits") == 0
        assert delta(after, before, "kv_offload_corrupt_blocks") >= 1
        assert exported(after)["kvpilot:kv_offload_corrupt_blocks_total"] >= 1
        assert_same_output(out, reference[tuple(prompts.second)])
        llm.generate([prompts.filler], GREEDY)   # the prefix leaves the device pool again
        llm.llm_engine.kv_offload.flush()
        out, before, after = run_measured(llm, prompts.third)
        assert delta(after, before, "kv_offload_corrupt_blocks") == 0
        assert delta(after, before, "external_prefix_cache_hits") + delta(after, before, "prefix_cache_hits") \
            == CHUNK_PREFIX_TOKENS   # stored anew by the request that recomputed it
        assert_same_output(out, reference[tuple(prompts.third)])
    finally:
        llm.llm_engine.close()


def test_lmcache_backend_needs_a_cpu_buffer():
    from kvpilot.engine.offload import OffloadConfig

    with pytest.raises(ValueError, match="lmcache backend needs kv_offloading_size > 0"):
        OffloadConfig.from_engine_args(0, "lmcache", "/tmp/x", 1.0)


def test_lmcache_keys_are_the_engine_block_hashes():
    from lmcache.v1.metadata import LMCacheMetadata

    from kvpilot.engine.core.block_hash import extend_block_hashes, root_hash
    from kvpilot.engine.offload.lmcache_adapter import SALT_KEY, BlockHashTokenDatabase

    root = root_hash("seed", "model")
    metadata = LMCacheMetadata(model_name="m", world_size=1, local_world_size=1, worker_id=0,
                               local_worker_id=0, kv_dtype=torch.float32, kv_shape=(2, 2, 32, 2, 8))
    db = BlockHashTokenDatabase(metadata, chunk_size=32, block_size=16, hash_root=root)
    tokens = list(range(100, 200))                                 # 100 tokens: 3 whole chunks
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, 16, root)
    got = list(db.process_tokens(tokens=tokens, make_key=False))
    assert [(start, end) for start, end, _ in got] == [(0, 32), (32, 64), (64, 96)]
    assert [key for _, _, key in got] == [int.from_bytes(hashes[i][:8], "big") for i in (1, 3, 5)]
    skipped = list(db.process_tokens(tokens=tokens, mask=torch.arange(100) >= 32, make_key=False))
    assert skipped == got[1:]
    salted = list(db.process_tokens(tokens=tokens, make_key=False,
                                    request_configs={SALT_KEY: "tenant"}))
    assert not {k for *_, k in salted} & {k for *_, k in got}


@pytest.fixture
def lmcache_server():
    """``lmcache_server 127.0.0.1 PORT cpu``; yields its ``lm://`` URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = Path(sys.executable).with_name("lmcache_server")
    proc = subprocess.Popen([str(exe), "127.0.0.1", str(port), "cpu"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL,
                            env=dict(os.environ, LMCACHE_TRACK_USAGE="false"))
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("lmcache_server did not start") from None
                time.sleep(0.1)
        yield f"lm://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_two_engine_processes_share_one_lmcache_server(offload_model, prompts, reference,
                                                      lmcache_server, tmp_path):
    env = with_support_path(dict(os.environ, LMCACHE_REMOTE_URL=lmcache_server,
                                 LMCACHE_CHUNK_SIZE=str(CHUNK), LMCACHE_TRACK_USAGE="false"))
    results = {}
    for which in ("first", "second"):        # process 1 computes the prefix, process 2 reuses it
        out_path = tmp_path / f"{which}.json"
        done = subprocess.run([sys.executable, str(HERE / "lmcache_worker.py"), offload_model, which,
                               str(out_path)], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        results[which] = json.loads(out_path.read_text())
    first, second = results["first"], results["second"]
    assert first["external_prefix_cache_hits"] == 0 and first["gpu_to_cpu_bytes"] > 0
    assert second["prefix_cache_hits"] == 0                     # a fresh device pool
    assert second["external_prefix_cache_hits"] == CHUNK_PREFIX_TOKENS
    assert second["computed_prompt_tokens"] == len(prompts.second) - CHUNK_PREFIX_TOKENS
    ref = reference[tuple(prompts.second)]
    assert second["token_ids"] == ref.token_ids
    want = [lp[t].logprob for lp, t in zip(ref.logprobs, ref.token_ids, strict=True)]
    assert second["logprobs"] == pytest.approx(want, abs=1e-4)
