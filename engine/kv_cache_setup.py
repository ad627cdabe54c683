"""The engine's KV cache at start-up: its shape, how many blocks, and their allocation.

Three steps, in this order, each a function of the runner (the loaded model) and the
configs: ``kv_layout`` (one rank's cache shape per the shared KV formula), ``size_kv_cache``
(blocks: given, from a byte budget checked against profiling, or by profiling; never fewer
than one ``max_model_len`` sequence needs) and ``allocate_kv_cache`` (the tensors, and the
``KVCacheInfo`` the server reports). ``LLMEngine`` calls them; nothing here keeps state.
"""

from __future__ import annotations

import logging

from kvpilot.contract.kv_layout import HybridKVLayout, KVLayout, blocks_held, sliding_pool_blocks
from kvpilot.engine.config import (
    CacheConfig,
    KVCacheInfo,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from kvpilot.engine.model.memory_profiling import (
    KVCacheSizing,
    determine_num_blocks,
    stage_num_blocks,
)
from kvpilot.engine.model.parallel.step_channel import Command

logger = logging.getLogger(__name__)


def kv_layout(runner, model_config: ModelConfig, cache: CacheConfig,
              sched: SchedulerConfig) -> KVLayout | HybridKVLayout:
    """One rank's cache shape per the shared KV formula: its KV heads (all of them at one
    rank), per-layer dtypes where they differ; a hybrid model's two pools
    (``HybridKVLayout``: the sliding pool sized by ``sliding_pool_blocks``)."""
    arch = model_config.arch
    layer_bytes = tuple(d.itemsize for d in runner.layer_kv_dtypes)

    def pool(num_layers: int, dtype_bytes: int, per_layer: tuple[int, ...]) -> KVLayout:
        return KVLayout(num_layers, runner.num_kv_heads, arch.head_dim, dtype_bytes,
                        cache.block_size, layer_dtype_bytes=per_layer if len(set(per_layer)) > 1 else ())

    groups = runner.layer_kv_groups
    if groups is None:
        # this stage's layers (all of them with one stage)
        return pool(len(layer_bytes), cache.kv_dtype_bytes(model_config.dtype), layer_bytes)
    pools = []
    for group in (0, 1):
        group_bytes = tuple(b for b, g in zip(layer_bytes, groups, strict=True) if g == group)
        pools.append(pool(len(group_bytes), group_bytes[0], group_bytes))
    return HybridKVLayout(pools[0], pools[1], arch.sliding_window, sliding_pool_blocks(
        sched.max_num_seqs, sched.max_num_batched_tokens, model_config.max_model_len,
        cache.block_size, arch.sliding_window))


def release_window(model_config: ModelConfig) -> int | None:
    """The sliding window outside which blocks are released (all layers slide and a
    sequence can outgrow the window), else None."""
    window = model_config.arch.kv_release_window
    return window if window is not None and model_config.max_model_len > window else None


def size_kv_cache(layout: KVLayout, runner, model_config: ModelConfig, cache: CacheConfig,
                  sched: SchedulerConfig, parallel: ParallelConfig, device_memory, memory_baseline,
                  lora_bytes: int) -> tuple[KVCacheSizing, list[int]]:
    """(blocks to allocate, what each rank's budget holds); must hold one ``max_model_len``
    sequence (on a model whose layers all slide: its window, one block, and a full prefill
    chunk), else ValueError naming the largest ``max_model_len`` that fits."""
    if parallel.pipeline_parallel_size > 1:
        # every rank sizes its own stage's cache; the group takes the minimum
        runner.channel.send(Command.SIZE)
        sizing, per_rank = stage_num_blocks(runner, cache, sched, device_memory, memory_baseline)
    else:
        sizing = determine_num_blocks(layout, cache, runner, sched, device_memory, memory_baseline,
                                      lora_bytes=lora_bytes)
        per_rank = [sizing.num_blocks] * parallel.world_size
    num_blocks = sizing.num_blocks
    capacity = layout.token_capacity(num_blocks)
    max_len = model_config.max_model_len
    window = release_window(model_config)
    if window is not None:
        # a chunk's queries see from window - 1 keys before it to its end
        needed = blocks_held(max_len, layout.block_size, window - 1 + sched.max_num_batched_tokens)
        if num_blocks >= needed:
            return sizing, per_rank
    if capacity < max_len:
        raise ValueError(
            f"the KV cache holds {capacity} tokens ({num_blocks} blocks of {layout.block_size}), "
            f"fewer than max_model_len={max_len}; the largest max_model_len "
            f"that fits is {capacity}. Give the cache more memory (kv_cache_memory_bytes / "
            f"gpu_memory_utilization) or lower max_model_len.")
    return sizing, per_rank


def allocate_kv_cache(layout: KVLayout, sizing: KVCacheSizing, runner, model_config: ModelConfig,
                      cache: CacheConfig, per_gpu: bool) -> KVCacheInfo:
    """Allocate the runner's cache (and capture its CUDA graphs over it); what was allocated.
    ``per_gpu``: the figures logged are one rank's of several."""
    num_blocks = sizing.num_blocks
    if isinstance(layout, HybridKVLayout):
        runner.allocate_kv_cache(num_blocks, layout.num_sliding_blocks(num_blocks))
        logger.info("hybrid KV cache: %d full-attention layers in %d blocks, %d sliding-window "
                    "layers (window %d) in %d blocks", layout.full.num_layers, num_blocks,
                    layout.sliding.num_layers, layout.sliding_window,
                    layout.num_sliding_blocks(num_blocks))
    else:
        runner.allocate_kv_cache(num_blocks)
    runner.capture_cuda_graphs()
    info = KVCacheInfo(
        num_gpu_blocks=num_blocks, block_size=layout.block_size,
        kv_cache_dtype=cache.kv_dtype_name(model_config.dtype),
        bytes_per_block=layout.bytes_per_block, kv_cache_memory_bytes=layout.memory_for_blocks(num_blocks),
        enable_prefix_caching=cache.enable_prefix_caching,
        gpu_memory_utilization=cache.gpu_memory_utilization,
        profiled_available_bytes=(sizing.profile.available_kv_bytes if sizing.profile is not None else None),
    )
    logger.info("KV cache%s: %d blocks x %d tokens (%s, %.2f GiB); max_model_len %d",
                " per GPU" if per_gpu else "", num_blocks, layout.block_size,
                info.kv_cache_dtype, info.kv_cache_memory_bytes / (1 << 30), model_config.max_model_len)
    return info
