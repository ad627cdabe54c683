"""The scheduler's side of the KV cache at start-up: the offload tiers, the block manager
over the allocated blocks, the KV connector, and the step cost model (per-step FLOPs and
bytes from the KV layout).

Each is a function of the configs and of what ``kv_cache_setup`` allocated. ``LLMEngine``
calls them after the allocation, in that order: the manager records evictions for the
offload tiers, and the offload tiers' connector reads the manager's pool. Nothing here
keeps state.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvpilot.contract.constants import MODEL_DTYPE_BYTES
from kvpilot.contract.kv_layout import HybridKVLayout, KVLayout
from kvpilot.contract.step_cost import StepCostModel
from kvpilot.engine.config import ModelConfig, ParallelConfig
from kvpilot.engine.core.hybrid_kv_cache_manager import HybridKVCacheManager
from kvpilot.engine.core.kv_cache_manager import KVCacheManager
from kvpilot.engine.kv_cache_setup import release_window

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ManagerOptions:
    """What the block manager is asked for, beside the blocks themselves."""

    prefix_caching: bool
    hash_root: bytes
    token_granular_reuse: bool       # asked for (``--token-granular-reuse``)
    explain_misses: bool             # ``--explain-prefix-misses``
    split_over_ranks: bool           # tensor / pipeline parallel: each rank holds a part
    draft_keeps_kv: bool             # a draft model or EAGLE head keeps its KV beside the target's
    recompute_last_hit_block: bool   # EAGLE: its head needs the last hit block's hidden states


def token_reuse(options: ManagerOptions, window: int | None, hybrid: bool = False) -> bool:
    """Whether token-granular reuse can run here (asked for, and it can hold): the copy is
    made on this rank's cache alone, in one table, and a release window may free its
    sources. Says why at WARNING when it was asked for and cannot."""
    if not options.token_granular_reuse:
        return False
    why = ("prefix caching is off" if not options.prefix_caching else
           "the KV cache is split over ranks (tensor / pipeline parallel)" if options.split_over_ranks else
           "a hybrid model keeps two block tables (full and sliding-window layers)" if hybrid else
           "the model's layers all slide (blocks released outside the window)" if window is not None else
           "a draft model or EAGLE head keeps its own KV beside the target's" if options.draft_keeps_kv else
           None)
    if why is not None:
        logger.warning("token-granular reuse is off: %s", why)
    return why is None


def build_kv_cache_manager(layout: KVLayout, num_blocks: int, model_config: ModelConfig,
                           options: ManagerOptions, kv_offload, residency):
    """The block manager over ``num_blocks`` blocks: a hybrid model's two pools, or one pool
    (with its release window, token reuse and miss explainer, and the offload tiers' eviction
    records where they exist)."""
    if isinstance(layout, HybridKVLayout):
        if kv_offload is not None:   # EngineArgs refuses it first; never silently wrong
            raise ValueError("KV offload is not implemented for hybrid sliding-window models")
        token_reuse(options, None, hybrid=True)   # only to say why it is off
        return HybridKVCacheManager(
            num_blocks, layout.num_sliding_blocks(num_blocks), layout.block_size, options.prefix_caching,
            options.hash_root, layout.sliding_window, residency=residency)
    window = release_window(model_config)
    manager = KVCacheManager(
        num_blocks, layout.block_size, options.prefix_caching, options.hash_root,
        record_evictions=kv_offload is not None, residency=residency, release_window=window,
        token_reuse=token_reuse(options, window), explain_misses=options.explain_misses,
        recompute_last_hit_block=options.recompute_last_hit_block)
    if manager.explainer is not None and kv_offload is not None:
        kv_offload.set_eviction_hook(manager.explainer.on_offload_evict)
    return manager


def create_offload(offload_config, kv_caches, layout: KVLayout, hash_root: bytes):
    """The KV offload backend over the allocated cache, or None when offload is off."""
    if offload_config is None:
        return None
    from kvpilot.engine.offload import create_kv_offload

    return create_kv_offload(offload_config, kv_caches=kv_caches, block_size=layout.block_size,
                             hash_root=hash_root)


def create_connector(kv_offload, kv_transfer_config, kv_caches, kv_cache_manager, layout: KVLayout,
                     hash_root: bytes, parallel_config: ParallelConfig, cache_info):
    """The KV connector (``kv_transfer.base.KVConnector``): the offload tiers, the one
    ``--kv-transfer-config`` names, or None."""
    if kv_offload is not None:
        from kvpilot.engine.offload.connector import offload_connector

        return offload_connector(kv_offload, kv_cache_manager.pool, layout.block_size)
    if kv_transfer_config is None or not kv_transfer_config.is_kv_transfer_instance:
        return None
    from kvpilot.engine.kv_transfer.factory import create_kv_connector

    return create_kv_connector(kv_transfer_config, kv_caches, kv_cache_manager, layout, hash_root,
                               parallel_config, cache_info)


def step_cost_model(model_config: ModelConfig, parallel_config: ParallelConfig, layout: KVLayout) -> StepCostModel:
    """The per-step FLOPs and bytes estimate (``--enable-mfu-metrics``), per GPU."""
    arch, tp = model_config.arch, parallel_config.tensor_parallel_size
    return StepCostModel(
        num_layers=arch.num_hidden_layers, hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size, num_heads=arch.num_attention_heads,
        num_kv_heads=arch.num_key_value_heads, head_dim=arch.head_dim,
        vocab_size=arch.vocab_size,
        # FP8 checkpoints read their (dominant) linear weights at one byte each
        weight_bytes=1 if arch.quantization is not None else MODEL_DTYPE_BYTES[model_config.dtype],
        kv_bytes_per_token=layout.bytes_per_token * tp, tensor_parallel_size=tp,
        num_sliding_layers=len(arch.sliding_window_layers), sliding_window=arch.sliding_window)
