"""Frozen snapshots of the engine's state and counters (``EngineStats``) and of what its
steps did since the previous look (``StepStats``)."""

from __future__ import annotations

import operator
from dataclasses import dataclass, fields

from kvpilot.engine.core.kv_residency import BlockResidency
from kvpilot.engine.core.spec_stats import SpecDecodingStats
from kvpilot.engine.kv_transfer.stats import KVTransferStats
from kvpilot.engine.lora.stats import LoRAStats


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running_reqs: int
    num_waiting_reqs: int          # waiting requests, those whose KV is on its way included
    kv_cache_usage: float          # fraction of blocks referenced by running requests, 0..1
    num_gpu_blocks: int
    num_free_blocks: int
    prefix_cache_queries: int      # prompt tokens looked up in the prefix cache (cumulative)
    prefix_cache_hits: int         # of which hit (cumulative)
    num_preemptions: int           # cumulative
    prompt_tokens: int             # prompt tokens of requests that produced a first token (cumulative)
    computed_prompt_tokens: int    # prompt tokens run through the model: hits excluded, recompute included
    generation_tokens: int         # tokens generated (cumulative)
    num_steps: int                 # model steps run (cumulative)
    # KV offload (None when offload is off, or where the backend cannot tell):
    external_prefix_cache_queries: int | None = None   # prompt tokens looked up in offload tiers
    external_prefix_cache_hits: int | None = None      # of which loaded from them, not computed
    kv_offload_gpu_to_cpu_bytes: int | None = None     # device KV cache -> host memory
    kv_offload_cpu_to_gpu_bytes: int | None = None     # host memory -> device KV cache
    kv_offload_cpu_to_disk_bytes: int | None = None    # written to the disk tier
    kv_offload_disk_to_cpu_bytes: int | None = None    # read back from the disk tier
    kv_offload_cpu_used_bytes: int | None = None       # CPU tier contents
    kv_offload_cpu_capacity_bytes: int | None = None
    kv_offload_disk_used_bytes: int | None = None      # disk tier contents
    kv_offload_disk_capacity_bytes: int | None = None
    kv_offload_disk_writable: bool | None = None       # the disk tier takes new blocks
    kv_offload_corrupt_blocks: int | None = None       # read back corrupt: dropped, recomputed
    # Where the prompt tokens of admitted sequences came from, counted at first admission
    # (cumulative): computed, found in the device prefix cache, loaded from offload tiers.
    prompt_tokens_local_compute: int = 0
    prompt_tokens_local_cache_hit: int = 0
    prompt_tokens_external_kv_transfer: int = 0
    prompt_tokens_recomputed: int = 0   # of local_compute: cached tokens computed again
    # external_kv_transfer by the offload tier that served it (vllm:prompt_tokens_cached_by_source;
    # None where the backend has no such tier, or offload is off)
    prompt_tokens_cached_host: int | None = None
    prompt_tokens_cached_disk: int | None = None
    prompt_tokens_cached_external_unspecified: int | None = None
    # Uncached prompt tokens by why they missed, counted at first admission
    # (core.prefix_miss.MISS_REASONS; None when misses are not explained).
    prefix_miss_never_seen: int | None = None
    prefix_miss_evicted_capacity: int | None = None
    prefix_miss_evicted_preemption: int | None = None
    prefix_miss_evicted_offload_full: int | None = None
    prefix_miss_different_cache_salt: int | None = None
    prefix_miss_different_lora_adapter: int | None = None
    prefix_miss_divergence: int | None = None
    prefix_miss_last_partial_block: int | None = None
    prefix_miss_last_token: int | None = None
    prefix_miss_too_short: int | None = None
    # API requests refused by --max-waiting-requests (vllm:admission_rejections; set by the
    # API server's engine client, None in an offline engine)
    admission_rejections_max_waiting_requests: int | None = None
    # Requests whose logits held a NaN (cumulative; None unless NaNs are checked).
    num_corrupted_reqs: int | None = None
    # Model-shape estimates per GPU (cumulative; None unless --enable-mfu-metrics).
    estimated_flops: int | None = None
    estimated_read_bytes: int | None = None
    estimated_write_bytes: int | None = None
    # LoRA adapters: running / waiting ones, counters per adapter (None when LoRA is off).
    lora: LoRAStats | None = None
    # Verified drafts (cumulative; None without speculative decoding).
    spec_decoding: SpecDecodingStats | None = None
    # Waiting requests whose KV is on its way from another engine (WAITING_FOR_REMOTE_KVS).
    num_waiting_for_remote_kvs: int = 0
    # KV transfer between engines (NixlConnector); None without a transfer connector.
    kv_transfer: KVTransferStats | None = None

    def __reduce__(self):
        # one snapshot crosses to the API process per step: pickled as its constructor's
        # arguments (one attrgetter call) rather than a slotted dataclass's field-by-field
        # state: dumps in about a third of the time, loads in about two thirds
        return EngineStats, _ENGINE_STATS_VALUES(self)

    @property
    def prompt_tokens_cached(self) -> int:
        """Prompt tokens not computed: device prefix-cache hits plus offload-tier loads."""
        return self.prompt_tokens_local_cache_hit + self.prompt_tokens_external_kv_transfer

    @property
    def num_waiting_for_capacity(self) -> int:
        """Waiting requests held back by the batch or the KV cache (not by a remote KV
        transfer)."""
        return self.num_waiting_reqs - self.num_waiting_for_remote_kvs

    @property
    def num_waiting_deferred(self) -> int:
        """Waiting requests deferred for something else: their KV is on its way from
        another engine."""
        return self.num_waiting_for_remote_kvs

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def external_prefix_cache_hit_rate(self) -> float | None:
        """Offload-tier hits / queries (tokens); None when offload is off."""
        if self.external_prefix_cache_queries is None:
            return None
        queries = self.external_prefix_cache_queries
        return (self.external_prefix_cache_hits or 0) / queries if queries else 0.0


_ENGINE_STATS_VALUES = operator.attrgetter(*(f.name for f in fields(EngineStats)))


@dataclass(frozen=True, slots=True)
class StepStats:
    """What the engine's steps did since the last ``LLMEngine.take_step_stats()``.

    ``iteration_tokens``: tokens computed by each model step, in order.
    ``kv_block_residency``: evictions and reuses of sampled KV blocks (``--kv-cache-metrics``).
    """

    iteration_tokens: tuple[int, ...] = ()
    kv_block_residency: tuple[BlockResidency, ...] = ()
