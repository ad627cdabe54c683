"""How many KV blocks to allocate at start-up.

Order of precedence: an explicit ``num_gpu_blocks``; ``kv_cache_memory_bytes`` (the
CPU default comes from EngineArgs); else, on CUDA, profiling: after loading the
weights, one forward pass of ``max_num_batched_tokens`` tokens measures the peak
activation memory, and the KV cache gets ``gpu_memory_utilization x total`` minus
weights, peak activations and memory held outside torch. Blocks are counted with the
shared torch-free formula (``KVLayout.num_blocks``), the one the planner uses too.
"""

from __future__ import annotations

import logging

import torch

from kvpilot.engine.config import CacheConfig, SchedulerConfig
from kvpilot.engine.core.kv_layout import KVLayout

logger = logging.getLogger(__name__)


def determine_num_blocks(layout: KVLayout, cache: CacheConfig, runner, scheduler: SchedulerConfig) -> int:
    if cache.num_gpu_blocks is not None:
        return cache.num_gpu_blocks
    if cache.kv_cache_memory_bytes is not None:
        num = layout.num_blocks(cache.kv_cache_memory_bytes)
        if num < 1:
            raise ValueError(f"kv_cache_memory_bytes={cache.kv_cache_memory_bytes} is smaller than "
                             f"one KV block ({layout.bytes_per_block} bytes)")
        return num
    if runner.device.type != "cuda":
        raise ValueError("on CPU the KV cache size must be given (kv_cache_memory_bytes or num_gpu_blocks)")
    return _profile_cuda(layout, cache, runner, scheduler)


def _profile_cuda(layout: KVLayout, cache: CacheConfig, runner, scheduler: SchedulerConfig) -> int:
    device = runner.device
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    free_before, total = torch.cuda.mem_get_info(device)
    weights = torch.cuda.memory_allocated(device)
    runner.profile_run(scheduler.max_num_batched_tokens)
    torch.cuda.synchronize(device)
    peak_activation = torch.cuda.max_memory_allocated(device) - weights
    free_after, _ = torch.cuda.mem_get_info(device)
    non_torch = max(0, (total - free_after) - torch.cuda.memory_reserved(device))
    budget = int(total * cache.gpu_memory_utilization) - weights - peak_activation - non_torch
    logger.info("memory profile: total %.2f GiB x %.2f; weights %.2f GiB; peak activation %.2f GiB; "
                "non-torch %.2f GiB -> KV cache %.2f GiB", total / 2**30, cache.gpu_memory_utilization,
                weights / 2**30, peak_activation / 2**30, non_torch / 2**30, budget / 2**30)
    if budget <= 0:
        raise ValueError(f"no memory left for the KV cache at gpu_memory_utilization="
                         f"{cache.gpu_memory_utilization} (weights {weights / 2**30:.2f} GiB, "
                         f"activations {peak_activation / 2**30:.2f} GiB of {total / 2**30:.2f} GiB)")
    del free_before
    return layout.num_blocks(budget)
