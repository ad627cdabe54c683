"""Unit tests of the offload building blocks: block copies, the two stores, the config."""

from __future__ import annotations

import hashlib
import logging
import os
import time

import pytest
import torch

from kvpilot.engine.engine_args import EngineArgs
from kvpilot.engine.offload.block_io import BlockIO
from kvpilot.engine.offload.config import GIB, OffloadConfig
from kvpilot.engine.offload.disk_store import HEADER, STALE_TMP_SECONDS, DiskStore
from kvpilot.engine.offload.host_store import HostStore

LAYOUT = b"layout01"


def block_hash(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def payload(i: int, size: int = 256) -> torch.Tensor:
    return torch.full((size,), i % 251, dtype=torch.uint8)


@pytest.mark.parametrize("layout", ["one tensor", "mixed dtypes"])
def test_block_io_round_trip(layout):
    gen = torch.Generator().manual_seed(0)

    def layer(dtype):
        return torch.randn((2, 6, 4, 2, 8), generator=gen).to(dtype)   # [2, blocks, bs, heads, dim]

    if layout == "one tensor":
        kv = torch.randn((3, 2, 6, 4, 2, 8), generator=gen)
        original = [kv[i].clone() for i in range(3)]
    else:
        kv = [layer(torch.float8_e4m3fn), layer(torch.float32), layer(torch.bfloat16)]
        original = [t.clone() for t in kv]
    io = BlockIO(kv)
    assert io.bytes_per_block == sum(2 * 4 * 2 * 8 * t.element_size() for t in original)
    payloads, event = io.gather([4, 1])
    assert event is None and [p.numel() for p in payloads] == [io.bytes_per_block] * 2
    io.scatter([0, 5], payloads)      # block 4 -> 0, block 1 -> 5; others untouched
    layers = [kv[i] for i in range(3)] if layout == "one tensor" else kv
    for now, before in zip(layers, original, strict=True):
        u8_now, u8_before = now.view(torch.uint8), before.view(torch.uint8)
        assert torch.equal(u8_now[:, 0], u8_before[:, 4]) and torch.equal(u8_now[:, 5], u8_before[:, 1])
        assert torch.equal(u8_now[:, 1:5], u8_before[:, 1:5])


def test_host_store_is_lru_and_byte_bounded():
    store = HostStore(capacity_bytes=3 * 256 + 100, bytes_per_block=256)
    for i in range(3):
        store.put(block_hash(i), payload(i))
    assert store.get(block_hash(0)) is not None          # 0 becomes most recently used
    assert store.put(block_hash(3), payload(3)) == 1     # evicts 1, the least recently used
    assert block_hash(1) not in store and len(store) == 3 and store.used_bytes == 3 * 256
    assert HostStore(0, 256).put(block_hash(0), payload(0)) == 0   # a zero-size tier keeps nothing


def test_disk_store_bounds_size_and_survives_a_restart(tmp_path):
    file_bytes = HEADER.size + 256
    store = DiskStore(tmp_path, capacity_bytes=3 * file_bytes, bytes_per_block=256, layout_id=LAYOUT)
    for i in range(5):
        assert store.submit(block_hash(i), payload(i))
        store.flush()
    assert not store.submit(block_hash(4), payload(4))             # already stored
    assert len(store) == 3 and store.used_bytes == 3 * file_bytes
    assert sorted(p.name for p in tmp_path.rglob("*.kvb")) == sorted(
        store.path(block_hash(i)).name for i in (2, 3, 4))         # 0 and 1 were evicted
    assert store.read(block_hash(3))[1] is True                    # 3 is now most recent
    store.close()
    for age, i in enumerate((2, 3, 4)):   # distinct modification times, oldest first
        os.utime(store.path(block_hash(i)), (1_000_000 + age, 1_000_000 + age))

    again = DiskStore(tmp_path, capacity_bytes=2 * file_bytes, bytes_per_block=256, layout_id=LAYOUT)
    assert len(again) == 2 and block_hash(2) not in again          # oldest file evicted at start-up
    got, from_file = again.read(block_hash(4))
    assert from_file and torch.equal(got, payload(4))
    other_layout = DiskStore(tmp_path, 10 * file_bytes, 256, layout_id=b"layout02")
    assert other_layout.read(block_hash(4)) is None                # never served to another layout
    assert not store.path(block_hash(4)).exists()


def test_disk_store_rejects_a_file_of_another_block(tmp_path, caplog):
    store = DiskStore(tmp_path, 1 << 20, 256, LAYOUT)
    store.submit(block_hash(1), payload(1))
    store.flush()
    target = store.path(block_hash(2))
    target.parent.mkdir(exist_ok=True)
    store.path(block_hash(1)).rename(target)                        # right bytes, wrong name
    store.close()
    store = DiskStore(tmp_path, 1 << 20, 256, LAYOUT)
    with caplog.at_level(logging.WARNING):
        assert store.read(block_hash(2)) is None
    assert "holds another block" in caplog.text and store.num_corrupt == 1


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(kv_offloading_size=-1.0), ">= 0"),
    (dict(kv_offloading_size=1.0, kv_offloading_backend="redis"), "must be one of"),
    (dict(kv_offloading_disk_path="/tmp/kv"), "need kv_offloading_size"),
    (dict(kv_offloading_size=1.0, kv_offloading_disk_path="/tmp/kv"), "positive kv_offloading_disk_size"),
    (dict(kv_offloading_size=1.0, kv_offloading_disk_size=2.0), "needs kv_offloading_disk_path"),
    (dict(kv_offloading_size=0.0), "nothing to offload to"),
    (dict(kv_offloading_size=1.0, enable_prefix_caching=False), "needs enable_prefix_caching"),
    (dict(kv_offloading_size=1.0, kv_offloading_backend="lmcache", calculate_kv_scales=True),
     "calculate_kv_scales"),
])
def test_bad_offload_settings_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs).create_offload_config()


def test_offload_settings_map_to_bytes():
    config = EngineArgs(kv_offloading_size=1.5, kv_offloading_disk_path="/var/kv",
                        kv_offloading_disk_size=10).create_offload_config()
    assert config == OffloadConfig("native", int(1.5 * GIB), "/var/kv", 10 * GIB)
    assert EngineArgs().create_offload_config() is None


def test_stats_line_reports_the_offload_hit_rate_over_the_interval():
    from kvpilot.engine.server.stats_logger import StatsLogger
    from kvpilot.engine.stats import EngineStats

    def snapshot(queries: int | None, hits: int | None) -> EngineStats:
        return EngineStats(1, 0, 0.5, 100, 50, 10, 0, 0, 10, 10, 10, 1,
                           external_prefix_cache_queries=queries, external_prefix_cache_hits=hits)

    lines: list[str] = []
    logger = StatsLogger(log=lines.append)
    logger.update(snapshot(1000, 900), 0.0)
    line = logger.update(snapshot(3000, 1400), 1.0)     # this interval: 500 of 2000 tokens
    assert line is not None and line.endswith("External prefix cache hit rate: 25.0%")
    off = StatsLogger(log=lines.append)
    off.update(snapshot(None, None), 0.0)
    assert "External" not in off.update(snapshot(None, None), 1.0)


def test_a_peers_write_in_progress_survives_a_start_up_but_a_stale_temporary_does_not(tmp_path):
    store = DiskStore(tmp_path, 1 << 20, 256, LAYOUT)
    store.submit(block_hash(1), payload(1))
    store.close()
    folder = store.path(block_hash(1)).parent
    live = folder / "live.kvb.0123abcd.tmp"          # a peer engine is writing this block now
    live.write_bytes(b"partial")
    stale = folder / "crashed.kvb.4567.tmp"          # left by an engine killed mid-write
    stale.write_bytes(b"partial")
    old = time.time() - 2 * STALE_TMP_SECONDS
    os.utime(stale, (old, old))
    peer = DiskStore(tmp_path, 1 << 20, 256, LAYOUT)
    assert live.exists() and not stale.exists()
    assert len(peer) == 1 and peer.read(block_hash(1))[1] is True


def test_two_engines_in_two_processes_share_one_disk_directory(tmp_path):
    """Both write the shared blocks and their own, restarting (scanning) as they go, each as
    PID 1. Before: one's start-up deleted the other's temporary mid-write (or both wrote one
    PID-named temporary), and the loser's tier stopped taking blocks for good."""
    import json
    import subprocess
    import sys

    from support import shared_disk as w
    from support import with_support_path

    env = with_support_path({**os.environ, "PYTHONSAFEPATH": "1"})
    count = 400
    procs = [subprocess.Popen([sys.executable, "-m", "support.shared_disk", str(tmp_path), role, str(count)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for role in ("a", "b")]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:   # a timeout or a failed writer: the other one is not left running
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    assert results == [{"writable": True, "corrupt": 0, "written": count}] * 2, results
    reader = DiskStore(tmp_path, 1 << 34, w.BLOCK_BYTES, w.LAYOUT)
    wanted = set(w.blocks("a", count)) | set(w.blocks("b", count))
    assert len(reader) == len(wanted) == 3 * count // 2
    for tag, i in sorted(wanted):
        got, from_file = reader.read(w.block_hash(tag, i))
        assert from_file and torch.equal(got, w.payload(tag, i)), (tag, i)
    assert reader.num_corrupt == 0 and not list(tmp_path.rglob("*.tmp"))
