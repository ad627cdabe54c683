"""How many KV blocks to allocate at start-up, and the memory profile behind the number.

On CUDA (or against the test hook's simulated GPU, see ``device_memory.py``) the engine
always profiles: after loading the weights it runs one worst-case step (a forward pass of
``max_num_batched_tokens`` tokens, then the sampler over ``max_num_seqs`` rows) and the KV
cache may use::

    available = gpu_memory_utilization x total - weights - activation peak - non-torch growth
                - LoRA slots

measured from a baseline taken when the engine started, as vLLM does: the CUDA context and
whatever other processes hold lie outside the budget (and free memory at start must cover
it). The LoRA adapter slots (``--max-loras`` of ``--max-lora-rank``, allocated after the
profile) are counted by their formula (``kvpilot.engine.lora.memory``). Order of precedence for the block count: an explicit ``num_gpu_blocks``; a pinned
``kv_cache_memory_bytes``, which must fit in ``available`` (else start-up fails naming both
figures, or with ``clamp_kv_cache_memory`` the cache shrinks to ``available`` with a
warning); else ``available``. On CPU without the hook nothing is profiled and the size must
be given. Blocks are counted with the shared torch-free formula (``KVLayout.num_blocks``),
the one the planner uses too.

Under tensor parallelism every rank profiles its own device (its shard, its KV heads)
in the same worst-case step, and all ranks adopt the profile of the rank that leaves the
least for the KV cache: the block count is then the same everywhere and fits every GPU.

Under pipeline parallelism the stages hold different layers (and so different bytes per
block), so profiles are not compared: every rank turns its own budget into blocks of its
own stage's layout (``stage_num_blocks``, run by every rank at once) and the group takes
the minimum over the ranks' block counts (an all-gather on the control group), which the
driver logs with every rank's figure.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from kvpilot.contract.kv_layout import KVLayout
from kvpilot.engine.config import CacheConfig, SchedulerConfig
from kvpilot.engine.model.device_memory import DeviceMemory, MemorySnapshot

logger = logging.getLogger(__name__)
GIB = 1 << 30


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.2f} GiB ({num_bytes:,} bytes)"


@dataclass(frozen=True, slots=True)
class MemoryProfile:
    """What profiling measured (bytes) and what it leaves for the KV cache."""

    total_bytes: int
    gpu_memory_utilization: float
    weights_bytes: int
    activation_peak_bytes: int
    non_torch_bytes: int
    lora_bytes: int = 0           # the LoRA adapter slots, allocated after profiling

    @property
    def requested_bytes(self) -> int:
        return int(self.total_bytes * self.gpu_memory_utilization)

    @property
    def available_kv_bytes(self) -> int:
        return (self.requested_bytes - self.weights_bytes - self.activation_peak_bytes
                - self.non_torch_bytes - self.lora_bytes)

    def describe(self) -> str:
        lora = f" - LoRA slots {self.lora_bytes / GIB:.2f} GiB" if self.lora_bytes else ""
        return (f"{self.gpu_memory_utilization:g} x {self.total_bytes / GIB:.2f} GiB total - weights "
                f"{self.weights_bytes / GIB:.2f} GiB - activation peak {self.activation_peak_bytes / GIB:.2f} GiB "
                f"- non-torch {self.non_torch_bytes / GIB:.2f} GiB{lora}")


@dataclass(frozen=True, slots=True)
class KVCacheSizing:
    """The block count chosen at start-up and how."""

    num_blocks: int
    profile: MemoryProfile | None = None      # None when nothing was profiled
    clamped: bool = False                     # a pinned budget was cut to the profiled figure


def profile_memory(device_memory: DeviceMemory, baseline: MemorySnapshot, runner,
                   cache: CacheConfig, scheduler: SchedulerConfig, lora_bytes: int = 0) -> MemoryProfile:
    """Run the worst-case step and measure it against ``baseline`` (taken at engine start);
    ``lora_bytes``: the LoRA slots still to allocate."""
    requested = int(baseline.total_bytes * cache.gpu_memory_utilization)
    if baseline.free_bytes < requested:
        raise ValueError(
            f"free GPU memory at start-up, {_gib(baseline.free_bytes)} of {baseline.total_bytes / GIB:.2f} GiB, "
            f"is less than gpu_memory_utilization={cache.gpu_memory_utilization} asks for ({_gib(requested)}): "
            "another process holds GPU memory; lower --gpu-memory-utilization or free the GPU")
    device_memory.begin_profile()
    loaded = device_memory.snapshot()
    runner.profile_run(scheduler.max_num_batched_tokens, scheduler.max_num_seqs)
    device_memory.end_profile()
    after = device_memory.snapshot()
    profile = MemoryProfile(
        total_bytes=baseline.total_bytes, gpu_memory_utilization=cache.gpu_memory_utilization,
        weights_bytes=loaded.torch_allocated_bytes - baseline.torch_allocated_bytes,
        activation_peak_bytes=max(0, after.torch_peak_bytes - loaded.torch_allocated_bytes),
        non_torch_bytes=max(0, after.non_torch_bytes - baseline.non_torch_bytes),
        lora_bytes=lora_bytes)
    if runner.tp.world_size > 1:
        profile = _smallest_across_ranks(runner.tp, profile)
    logger.info("memory profile: %s -> %.2f GiB for the KV cache", profile.describe(),
                profile.available_kv_bytes / GIB)
    return profile


def _smallest_across_ranks(tp, profile: MemoryProfile) -> MemoryProfile:
    """The profile, among all ranks' (a collective: every rank calls it), that leaves the
    least for the KV cache."""
    mine = torch.tensor([profile.total_bytes, profile.weights_bytes, profile.activation_peak_bytes,
                         profile.non_torch_bytes], dtype=torch.int64)
    rows = tp.all_gather_cpu(mine).tolist()
    profiles = [MemoryProfile(total, profile.gpu_memory_utilization, weights, activation, non_torch,
                              profile.lora_bytes)
                for total, weights, activation, non_torch in rows]
    smallest = min(profiles, key=lambda p: p.available_kv_bytes)
    if smallest.available_kv_bytes < profile.available_kv_bytes:
        logger.info("rank %d's profile leaves %.2f GiB for the KV cache; the tightest rank's, "
                    "%.2f GiB, sizes every rank", tp.rank, profile.available_kv_bytes / GIB,
                    smallest.available_kv_bytes / GIB)
    return smallest


def _pinned_blocks(layout: KVLayout, cache: CacheConfig, profile: MemoryProfile | None) -> KVCacheSizing:
    pinned = cache.kv_cache_memory_bytes
    num = layout.num_blocks(pinned)
    if num < 1:
        raise ValueError(f"kv_cache_memory_bytes={pinned} is smaller than one KV block "
                         f"({layout.bytes_per_block} bytes)")
    if profile is None or layout.memory_for_blocks(num) <= profile.available_kv_bytes:
        return KVCacheSizing(num, profile)
    available = max(0, profile.available_kv_bytes)
    if not cache.clamp_kv_cache_memory:
        raise ValueError(
            f"--kv-cache-memory-bytes {_gib(pinned)} exceeds the {_gib(available)} that profiling leaves for "
            f"the KV cache ({profile.describe()}); lower it, raise --gpu-memory-utilization, or pass "
            "--clamp-kv-cache-memory to use the profiled figure")
    clamped = layout.num_blocks(available)
    logger.warning("--kv-cache-memory-bytes %s exceeds the %s that profiling leaves (%s): clamped to %d blocks",
                   _gib(pinned), _gib(available), profile.describe(), clamped)
    if clamped < 1:
        raise ValueError(f"profiling leaves {_gib(available)} for the KV cache, less than one block "
                         f"({layout.bytes_per_block} bytes)")
    return KVCacheSizing(clamped, profile, clamped=True)


def determine_num_blocks(layout: KVLayout, cache: CacheConfig, runner, scheduler: SchedulerConfig,
                         device_memory: DeviceMemory | None = None,
                         baseline: MemorySnapshot | None = None, lora_bytes: int = 0) -> KVCacheSizing:
    """The KV block count (see the module docstring for the precedence)."""
    if cache.num_gpu_blocks is not None:
        return KVCacheSizing(cache.num_gpu_blocks)
    profile = None
    if device_memory is not None and baseline is not None:
        profile = profile_memory(device_memory, baseline, runner, cache, scheduler, lora_bytes)
    if cache.kv_cache_memory_bytes is not None:
        return _pinned_blocks(layout, cache, profile)
    if profile is None:
        raise ValueError("on CPU the KV cache size must be given (kv_cache_memory_bytes or num_gpu_blocks)")
    if profile.available_kv_bytes <= 0:
        raise ValueError(f"no memory left for the KV cache at gpu_memory_utilization="
                         f"{cache.gpu_memory_utilization} ({profile.describe()})")
    return KVCacheSizing(layout.num_blocks(profile.available_kv_bytes), profile)


def stage_kv_layout(runner, cache: CacheConfig) -> KVLayout:
    """This rank's KV cache shape by the shared formula: its stage's layers (all of them
    with one stage), its KV heads, per-layer dtypes where they differ."""
    per_layer = tuple(d.itemsize for d in runner.layer_kv_dtypes)
    return KVLayout(len(per_layer), runner.num_kv_heads, runner.model_config.arch.head_dim,
                    cache.kv_dtype_bytes(runner.model_config.dtype), cache.block_size,
                    layer_dtype_bytes=per_layer if len(set(per_layer)) > 1 else ())


def stage_num_blocks(runner, cache: CacheConfig, scheduler: SchedulerConfig,
                     device_memory: DeviceMemory | None = None,
                     baseline: MemorySnapshot | None = None) -> tuple[KVCacheSizing, list[int]]:
    """Pipeline parallelism: this rank's block count for its own stage (by
    ``determine_num_blocks``), then the group's, the minimum over every rank (a collective:
    every rank calls it). Returns the group's sizing and every rank's count, in rank order."""
    sizing = determine_num_blocks(stage_kv_layout(runner, cache), cache, runner, scheduler,
                                  device_memory, baseline)
    counts = runner.pp.world.all_gather_cpu(torch.tensor([sizing.num_blocks])).flatten().tolist()
    if runner.pp.is_driver:
        logger.info("KV blocks each rank's budget holds (its stage's layers): %s; the group "
                    "allocates the minimum, %d, on every rank", counts, min(counts))
    return replace(sizing, num_blocks=min(counts)), counts
