"""Native KV offload through the engine: CPU tier, disk tier, restart, corruption, full disk.

Each case runs: ``first`` (prefix + A), ``filler`` (evicts the prefix from the device
pool), then ``second`` (prefix + B), and checks with the engine's counters that
``second`` loaded the prefix from the offload tiers instead of computing it, and that
its greedy output equals the no-offload engine's.
"""

from __future__ import annotations

import logging
import os
import subprocess

import pytest

from kvpilot.engine import LLM

from support.offload_helpers import (
    BLOCK,
    ENGINE_KW,
    GREEDY,
    PREFIX_BLOCK_TOKENS,
    assert_same_output,
    delta,
    exported,
    run_measured,
)

pytestmark = pytest.mark.slow
GIB = 1 << 30


def evict_prefix(llm: LLM, prompts) -> None:
    llm.generate([prompts.first], GREEDY)
    llm.generate([prompts.filler], GREEDY)


def assert_offload_hit(before, after, prompt: list[int], *, min_external: int) -> int:
    """The prefix came from device + offload tiers; only the remainder was computed."""
    device = delta(after, before, "prefix_cache_hits")
    external = delta(after, before, "external_prefix_cache_hits")
    assert device < PREFIX_BLOCK_TOKENS          # the prefix really was evicted from the pool
    assert external >= min_external
    assert device + external == PREFIX_BLOCK_TOKENS
    assert delta(after, before, "computed_prompt_tokens") == len(prompt) - PREFIX_BLOCK_TOKENS
    assert delta(after, before, "external_prefix_cache_queries") == len(prompt)
    return external


def test_offload_off_reports_no_offload_stats(offload_model):
    stats = LLM(offload_model, **ENGINE_KW).get_stats()
    assert stats.external_prefix_cache_hits is None and stats.kv_offload_cpu_to_gpu_bytes is None
    assert stats.kv_offload_disk_writable is None and "kvpilot:kv_offload_disk_writable" not in exported(stats)
    assert stats.external_prefix_cache_hit_rate is None


def test_cpu_tier_serves_the_evicted_prefix(offload_model, prompts, reference):
    llm = LLM(offload_model, **ENGINE_KW, kv_offloading_size=0.05)
    evict_prefix(llm, prompts)
    out, before, after = run_measured(llm, prompts.second)
    external = assert_offload_hit(before, after, prompts.second, min_external=PREFIX_BLOCK_TOKENS // 2)
    assert_same_output(out, reference[tuple(prompts.second)])
    bytes_per_block = llm.llm_engine.kv_offload.block_io.bytes_per_block
    assert delta(after, before, "kv_offload_cpu_to_gpu_bytes") == external // BLOCK * bytes_per_block
    assert after.kv_offload_gpu_to_cpu_bytes > 0
    assert 0 < after.kv_offload_cpu_used_bytes <= after.kv_offload_cpu_capacity_bytes
    assert after.kv_offload_disk_used_bytes is None and after.kv_offload_cpu_to_disk_bytes is None


def test_cache_salt_separates_tenants_in_the_offload_tiers(offload_model, prompts, reference):
    llm = LLM(offload_model, **ENGINE_KW, kv_offloading_size=0.05)
    llm.generate([prompts.first], GREEDY, cache_salt="tenant-a")
    llm.generate([prompts.filler], GREEDY)
    before = llm.get_stats()
    other = llm.generate([prompts.second], GREEDY, cache_salt="tenant-b")[0].outputs[0]
    after = llm.get_stats()
    assert delta(after, before, "external_prefix_cache_hits") == 0
    assert delta(after, before, "computed_prompt_tokens") == len(prompts.second)
    assert_same_output(other, reference[tuple(prompts.second)])


def test_disk_tier_with_a_tiny_cpu_tier_and_across_a_restart(offload_model, prompts, reference,
                                                            tmp_path):
    disk = dict(kv_offloading_disk_path=str(tmp_path / "kv"), kv_offloading_disk_size=0.1)
    tiny_cpu = 4 * 32 * 1024 / GIB        # room for 4 blocks of this model (32 KiB each)
    llm = LLM(offload_model, **ENGINE_KW, kv_offloading_size=tiny_cpu, **disk)
    assert llm.llm_engine.kv_offload.host.capacity_blocks == 4
    evict_prefix(llm, prompts)
    llm.llm_engine.kv_offload.flush()
    out, before, after = run_measured(llm, prompts.second)
    external = assert_offload_hit(before, after, prompts.second, min_external=PREFIX_BLOCK_TOKENS // 2)
    assert_same_output(out, reference[tuple(prompts.second)])
    bytes_per_block = llm.llm_engine.kv_offload.block_io.bytes_per_block
    # All but at most the 4 blocks the CPU tier holds were read from disk.
    assert delta(after, before, "kv_offload_disk_to_cpu_bytes") >= (external // BLOCK - 4) * bytes_per_block
    assert after.kv_offload_cpu_to_disk_bytes > 0
    assert 0 < after.kv_offload_disk_used_bytes <= after.kv_offload_disk_capacity_bytes
    llm.llm_engine.close()

    # A new engine on the same directory: everything comes from disk (device pool empty).
    restarted = LLM(offload_model, **ENGINE_KW, kv_offloading_size=0, **disk)
    out, before, after = run_measured(restarted, prompts.third)
    assert delta(after, before, "prefix_cache_hits") == 0
    assert delta(after, before, "external_prefix_cache_hits") == PREFIX_BLOCK_TOKENS
    assert delta(after, before, "computed_prompt_tokens") == len(prompts.third) - PREFIX_BLOCK_TOKENS
    assert_same_output(out, reference[tuple(prompts.third)])
    restarted.llm_engine.close()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_disk_file_is_a_miss_and_recomputed(offload_model, prompts, reference, tmp_path,
                                                    caplog, damage):
    disk = dict(kv_offloading_size=0, kv_offloading_disk_path=str(tmp_path / "kv"),
                kv_offloading_disk_size=0.1)
    writer = LLM(offload_model, **ENGINE_KW, **disk)
    writer.generate([prompts.first], GREEDY)
    writer.llm_engine.close()

    reader = LLM(offload_model, **ENGINE_KW, **disk)
    offload = reader.llm_engine.kv_offload
    bad_block = 40
    request_hashes = _block_hashes(reader, prompts.second)
    path = offload.disk.path(request_hashes[bad_block])
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF          # one payload byte: only the checksum can tell
    else:
        data = data[: len(data) - 100]
    path.write_bytes(bytes(data))

    with caplog.at_level(logging.WARNING, logger="kvpilot.engine.offload.disk_store"):
        out, before, after = run_measured(reader, prompts.second)
    assert delta(after, before, "external_prefix_cache_hits") == bad_block * BLOCK
    assert delta(after, before, "computed_prompt_tokens") == len(prompts.second) - bad_block * BLOCK
    assert_same_output(out, reference[tuple(prompts.second)])
    assert any(str(path) in r.getMessage() for r in caplog.records)
    assert (before.kv_offload_corrupt_blocks, after.kv_offload_corrupt_blocks) == (0, 1)  # exported
    assert exported(after)["kvpilot:kv_offload_corrupt_blocks_total"] == 1.0
    assert exported(after)["kvpilot:kv_offload_disk_writable"] == 1.0
    # The damaged file was dropped, then written again from the recomputed block.
    offload.flush()
    assert offload.disk.read(request_hashes[bad_block]) is not None
    reader.llm_engine.close()


def _block_hashes(llm: LLM, prompt: list[int]) -> list[bytes]:
    from kvpilot.engine.core.block_hash import extend_block_hashes

    kv = llm.llm_engine.kv_cache_manager
    hashes: list[bytes] = []
    extend_block_hashes(hashes, prompt, kv.block_size, kv.hash_root)
    return hashes


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 1 MiB tmpfs, so writing blocks fails with ENOSPC like a full volume."""
    mount = tmp_path / "full"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                          capture_output=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_full_disk_degrades_to_the_cpu_tier(offload_model, prompts, reference, tiny_tmpfs, caplog):
    llm = LLM(offload_model, **ENGINE_KW, kv_offloading_size=0.05,
              kv_offloading_disk_path=str(tiny_tmpfs), kv_offloading_disk_size=1.0)
    with caplog.at_level(logging.WARNING, logger="kvpilot.engine.offload.disk_store"):
        evict_prefix(llm, prompts)
        llm.llm_engine.kv_offload.flush()
    disk = llm.llm_engine.kv_offload.disk
    assert not disk.writable
    assert llm.get_stats().kv_offload_disk_writable is False
    assert exported(llm.get_stats())["kvpilot:kv_offload_disk_writable"] == 0.0
    warnings = [r for r in caplog.records if "takes no new blocks" in r.getMessage()]
    assert len(warnings) == 1 and "No space left" in warnings[0].getMessage()
    out, before, after = run_measured(llm, prompts.second)
    assert_offload_hit(before, after, prompts.second, min_external=PREFIX_BLOCK_TOKENS // 2)
    assert_same_output(out, reference[tuple(prompts.second)])
    llm.llm_engine.close()
