"""Frozen snapshots of the engine's state and counters (``EngineStats``) and of what its
steps did since the previous look (``StepStats``), and how the engine's parts make an
``EngineStats`` (``engine_stats``: the scheduler's queues and prompt-token sources, the block
manager's pool and prefix-cache counters, the output counts, and the optional parts' own
figures: offload tiers, KV transfers, LoRA, speculative decoding, the step cost estimate)."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, fields

from kvpilot.engine.core.kv_residency import BlockResidency
from kvpilot.engine.core.spec_stats import SpecDecodingStats
from kvpilot.engine.kv_transfer.stats import KVTransferStats
from kvpilot.engine.lora.stats import LoRAStats, adapter_names


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


@dataclass(frozen=True, slots=True)
class OptionalParts:
    """The engine's optional parts a snapshot reads (None: not running)."""

    kv_connector: object | None = None
    kv_offload: object | None = None
    count_nans: bool = False                    # ``--compute-nans-in-logits``
    estimated: Sequence[int] | None = None      # flops, read bytes, write bytes (the cost model's)
    lora: LoRAStats | None = None


def engine_stats(scheduler, kv_cache_manager, output_processor, *, num_gpu_blocks: int, num_steps: int,
                 parts: OptionalParts) -> EngineStats:
    """The engine's state now: the scheduler's queues and sources, the block manager
    (``KVCacheManager`` or the hybrid one), the output processor's counts, and ``parts``."""
    kv, sources = kv_cache_manager, scheduler.prompt_token_sources
    return EngineStats(
        num_running_reqs=scheduler.num_running,
        num_waiting_reqs=scheduler.num_waiting,
        num_waiting_for_remote_kvs=scheduler.num_waiting_for_remote_kvs,
        kv_cache_usage=kv.usage,
        num_gpu_blocks=num_gpu_blocks,
        num_free_blocks=kv.num_free_blocks,
        prefix_cache_queries=kv.stats.queries,
        prefix_cache_hits=kv.stats.hits,
        num_preemptions=scheduler.num_preemptions,
        prompt_tokens=output_processor.prompt_tokens,
        computed_prompt_tokens=scheduler.num_computed_prompt_tokens,
        generation_tokens=output_processor.generation_tokens,
        num_steps=num_steps,
        prompt_tokens_local_compute=sources.local_compute,
        prompt_tokens_local_cache_hit=sources.local_cache_hit,
        prompt_tokens_external_kv_transfer=sources.external_kv_transfer,
        prompt_tokens_recomputed=sources.recomputed,
        **_cached_by_tier(parts.kv_connector, sources),
        **_miss_fields(kv),
        num_corrupted_reqs=scheduler.num_corrupted if parts.count_nans else None,
        **(dict(zip(("estimated_flops", "estimated_read_bytes", "estimated_write_bytes"),
                    parts.estimated, strict=True)) if parts.estimated is not None else {}),
        **(parts.kv_offload.stats().engine_stat_fields() if parts.kv_offload is not None else {}),
        kv_transfer=_kv_transfer_stats(parts.kv_connector, scheduler),
        lora=parts.lora,
        spec_decoding=scheduler.spec_stats.snapshot() if scheduler.spec_stats is not None else None,
    )


def lora_stats(lora, max_loras: int, scheduler, counters) -> LoRAStats:
    """The adapters' figures: which the running and waiting requests use, the load counters,
    and how many are loaded, on the device and in host memory."""
    return LoRAStats(max_loras, adapter_names(scheduler.running), adapter_names(scheduler.waiting),
                     counters.snapshot(), len(lora.adapters()), lora.num_device_resident, lora.num_host_resident)


def _cached_by_tier(kv_connector, sources) -> dict[str, int]:
    """The connector-served prompt tokens by tier, for the tiers the connector has."""
    if kv_connector is None:
        return {}
    return {f"prompt_tokens_cached_{tier}": getattr(sources, f"cached_{tier}")
            for tier in kv_connector.scheduler.cache_tiers}


def _miss_fields(kv_cache_manager) -> dict[str, int]:
    explainer = getattr(kv_cache_manager, "explainer", None)
    if explainer is None:
        return {}
    return {f"prefix_miss_{reason}": tokens for reason, tokens in explainer.miss_tokens.items()}


def _kv_transfer_stats(kv_connector, scheduler):
    """The inter-engine KV transfer figures (``kv_transfer.stats``); None without them."""
    stats = getattr(kv_connector.worker, "stats", None) if kv_connector is not None else None
    if stats is None:
        return None
    external = scheduler.external
    return stats().with_scheduler_counts(external.num_failed_loads, external.num_recomputed_tokens)
