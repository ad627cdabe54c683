"""Start-up sizing against a GPU faked through the documented test hook.

``KVPILOT_FAKE_DEVICE_MEMORY`` (engine/model/device_memory.py) replaces only the device
query: the engine loads the demo model on CPU, runs its real profile step, and sizes the
cache against the simulated GPU's free/total memory and allocator readings. The expected
figures are computed here from the hook's numbers and the documented rule
``utilization x total - weights - activation peak - non-torch``.
"""

from __future__ import annotations

import json
import logging

import pytest

from kvpilot.engine import EngineArgs, LLMEngine
from kvpilot.engine.model.device_memory import FAKE_DEVICE_MEMORY_ENV

GIB, MIB = 1 << 30, 1 << 20
SMALL = dict(max_model_len=64, max_num_batched_tokens=64, max_num_seqs=4, device="cpu")


def fake_gpu(monkeypatch, ranks: dict | None = None, **gib: float) -> int:
    """Install the simulated GPU (``ranks``: per-rank overrides, as the hook takes them);
    returns the KV bytes its profile must leave at utilization 0.9."""
    spec = {f"{k}_gib": v for k, v in gib.items()}
    if ranks:
        spec["ranks"] = ranks
    monkeypatch.setenv(FAKE_DEVICE_MEMORY_ENV, json.dumps(spec))
    used = sum(int(gib.get(k, 0) * GIB) for k in ("weights", "activation", "non_torch"))
    return int(int(gib["total"] * GIB) * 0.9) - used


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.2f} GiB ({num_bytes:,} bytes)"


def test_a_pinned_budget_above_the_profiled_figure_fails_naming_both(monkeypatch, demo_model_dir):
    available = fake_gpu(monkeypatch, total=8, free=7.75, weights=1, activation=0.5, non_torch=0.25)
    pinned = 6 * GIB
    assert pinned > available
    with pytest.raises(ValueError) as err:
        LLMEngine(EngineArgs(model=str(demo_model_dir), kv_cache_memory_bytes=pinned, **SMALL))
    message = str(err.value)
    assert f"--kv-cache-memory-bytes {_gib(pinned)} exceeds the {_gib(available)} that profiling leaves" in message
    assert "--clamp-kv-cache-memory" in message


def test_a_pinned_budget_below_the_profiled_figure_is_allocated_as_pinned(monkeypatch, demo_model_dir):
    available = fake_gpu(monkeypatch, total=4, free=4, weights=1, activation=0.5)
    engine = LLMEngine(EngineArgs(model=str(demo_model_dir), kv_cache_memory_bytes=64 * MIB, **SMALL))
    info = engine.cache_info
    assert info.profiled_available_bytes == available
    assert info.kv_cache_memory_bytes == 64 * MIB // info.bytes_per_block * info.bytes_per_block


def test_clamp_shrinks_the_cache_to_the_profiled_figure(monkeypatch, demo_model_dir, caplog):
    available = fake_gpu(monkeypatch, total=2, free=2, weights=1.5, activation=0.1)   # 204.8 MiB
    caplog.set_level(logging.WARNING, logger="kvpilot.engine.model.memory_profiling")
    engine = LLMEngine(EngineArgs(model=str(demo_model_dir), kv_cache_memory_bytes=GIB,
                                  clamp_kv_cache_memory=True, **SMALL))
    info = engine.cache_info
    assert info.num_gpu_blocks == available // info.bytes_per_block
    assert "clamped to" in caplog.text and _gib(available) in caplog.text


def test_without_a_pinned_budget_the_profile_sizes_the_cache(monkeypatch, demo_model_dir):
    available = fake_gpu(monkeypatch, total=2, free=1.9, weights=1.5, activation=0.05, non_torch=0.05)
    engine = LLMEngine(EngineArgs(model=str(demo_model_dir), **SMALL))
    assert engine.cache_info.num_gpu_blocks == available // engine.cache_info.bytes_per_block
    assert engine.cache_info.profiled_available_bytes == available


def test_free_memory_at_start_must_cover_the_utilization(monkeypatch, demo_model_dir):
    fake_gpu(monkeypatch, total=8, free=5)       # another process holds 3 GiB; 0.9 x 8 = 7.2 GiB asked
    with pytest.raises(ValueError, match=r"free GPU memory at start-up, 5\.00 GiB .* is less than "
                                         r"gpu_memory_utilization=0\.9 asks for \(7\.20 GiB"):
        LLMEngine(EngineArgs(model=str(demo_model_dir), kv_cache_memory_bytes=64 * MIB, **SMALL))


def test_the_hook_rejects_a_bad_spec(monkeypatch, demo_model_dir):
    monkeypatch.setenv(FAKE_DEVICE_MEMORY_ENV, '{"total_gib": 8}')
    with pytest.raises(ValueError, match="total_gib and free_gib"):
        LLMEngine(EngineArgs(model=str(demo_model_dir), **SMALL))


@pytest.mark.slow
def test_two_ranks_size_the_cache_by_the_tightest_rank(monkeypatch, demo_model_dir):
    """Each rank profiles its own (simulated) GPU; rank 1's larger activation peak leaves
    less, and every rank allocates what it leaves."""
    fake_gpu(monkeypatch, total=1, free=1, weights=0.5, activation=0.1,
             ranks={"1": {"activation_gib": 0.25}})
    tightest = int(int(1 * GIB) * 0.9) - int(0.5 * GIB) - int(0.25 * GIB)
    engine = LLMEngine(EngineArgs(model=str(demo_model_dir), tensor_parallel_size=2, **SMALL))
    try:
        info = engine.cache_info
        assert info.profiled_available_bytes == tightest
        assert info.num_gpu_blocks == tightest // info.bytes_per_block
        assert engine.runner.num_blocks_per_rank == [info.num_gpu_blocks] * 2
    finally:
        engine.close()
