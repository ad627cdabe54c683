"""The engine: add requests, step, collect outputs. Single-threaded by design.

``step()`` is the whole data flow: ``scheduler.schedule()`` -> ``runner.execute()`` ->
``scheduler.update_from_output()`` -> detokenize and check stops -> outputs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from kvpilot.engine.config import KVCacheInfo, SchedulerConfig
from kvpilot.engine.core.block_hash import root_hash
from kvpilot.engine.core.kv_cache_manager import KVCacheManager
from kvpilot.engine.core.kv_layout import KVLayout
from kvpilot.engine.core.request import Request, RequestStatus
from kvpilot.engine.core.scheduler import Scheduler
from kvpilot.engine.engine_args import EngineArgs, model_fingerprint
from kvpilot.engine.model.device_memory import device_memory_for
from kvpilot.engine.model.memory_profiling import KVCacheSizing, determine_num_blocks
from kvpilot.engine.model.runner import ModelRunner
from kvpilot.engine.model.sampler import SampleResult
from kvpilot.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.stats import EngineStats
from kvpilot.engine.structured_output import StructuredOutputManager
from kvpilot.engine.text.detokenizer import IncrementalDetokenizer
from kvpilot.engine.text.stop import check_token_stop, find_stop_string
from kvpilot.engine.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Child:
    """Per-sequence output state (one per ``n``)."""

    request: Request
    index: int
    parent: _Parent
    detok: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    stop_buffer: int                       # chars held back while streaming (stop strings)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def output(self) -> CompletionOutput:
        return CompletionOutput(self.index, self.text, list(self.request.output_token_ids),
                                self.cumulative_logprob,
                                list(self.logprobs) if self.logprobs is not None else None,
                                self.finish_reason, self.stop_reason)


@dataclass(slots=True)
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    arrival_time: float
    children: list[_Child] = field(default_factory=list)
    prompt_counted: bool = False   # the prompt counts once per request, not per child

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)

    def output(self) -> RequestOutput:
        reqs = [c.request for c in self.children]
        first = [r.first_token_time for r in reqs if r.first_token_time is not None]
        sched = [r.first_scheduled_time for r in reqs if r.first_scheduled_time is not None]
        last = [r.last_token_time for r in reqs if r.last_token_time is not None]
        done = [r.finished_time for r in reqs if r.finished_time is not None]
        metrics = RequestMetrics(
            arrival_time=self.arrival_time,
            first_scheduled_time=min(sched) if sched else None,
            first_token_time=min(first) if first else None,
            last_token_time=max(last) if last else None,
            finished_time=max(done) if self.finished and done else None,
            num_generation_tokens=sum(r.num_output_tokens for r in reqs),
        )
        cached = [r.num_cached_tokens or 0 for r in reqs]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             [c.output() for c in self.children], self.finished,
                             max(cached), metrics)


class LLMEngine:
    """Start-up is four named steps: load the model, size the KV cache, allocate it, and
    build the scheduler side (block tables, prefix cache, KV offload)."""

    def __init__(self, args: EngineArgs) -> None:
        model_config, cache_config, scheduler_config = args.create_configs()
        offload_config = args.create_offload_config()   # validated before the model loads
        self.args = args
        self.model_config = model_config
        self.cache_config = cache_config
        self.scheduler_config: SchedulerConfig = scheduler_config
        self.tokenizer = Tokenizer.from_pretrained(model_config.tokenizer_dir)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(model_config.arch.eos_token_ids)
        device = torch.device(args.resolve_device())
        # Memory is profiled against what the device held before the weights (None: CPU).
        self.device_memory = device_memory_for(device)
        self._memory_baseline = self.device_memory.snapshot() if self.device_memory is not None else None
        self.runner = ModelRunner(model_config, cache_config, device, args.attention_backend)
        layout = self._kv_layout()
        sizing = self._size_kv_cache(layout)
        self.cache_info = self._allocate_kv_cache(layout, sizing)
        num_blocks = sizing.num_blocks
        # The prefix hash chain's root: stable across restarts and processes (the offload
        # tiers key blocks on it), distinct per model, KV dtype and block size.
        hash_root = root_hash(cache_config.prefix_caching_hash_seed,
                              f"{model_fingerprint(model_config.model)}|{self.cache_info.kv_cache_dtype}"
                              f"|{layout.block_size}")
        self.kv_offload = self._create_offload(offload_config, layout, hash_root)
        self.kv_cache_manager = KVCacheManager(
            num_blocks, layout.block_size, cache_config.enable_prefix_caching, hash_root,
            record_evictions=self.kv_offload is not None)
        self.scheduler = Scheduler(scheduler_config, self.kv_cache_manager, offload=self.kv_offload)
        self.runner.kv_transfer = self.kv_offload
        structured = args.structured_outputs_config
        self.structured_output = StructuredOutputManager(
            self.tokenizer, model_config.arch.vocab_size,
            any_whitespace=not structured.disable_any_whitespace,
            reasoning_parser=None if structured.enable_in_reasoning else structured.reasoning_parser)
        self._parents: dict[str, _Parent] = {}
        self._children: dict[str, _Child] = {}
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._num_steps = 0

    # ---- start-up steps -----------------------------------------------------
    def _kv_layout(self) -> KVLayout:
        """The cache's shape per the shared KV formula (per-layer dtypes where they differ)."""
        arch, cache = self.model_config.arch, self.cache_config
        layer_bytes = tuple(d.itemsize for d in self.runner.layer_kv_dtypes)
        return KVLayout(arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim,
                        cache.kv_dtype_bytes(self.model_config.dtype), cache.block_size,
                        layer_dtype_bytes=layer_bytes if len(set(layer_bytes)) > 1 else ())

    def _size_kv_cache(self, layout: KVLayout) -> KVCacheSizing:
        """Blocks to allocate (given, from a byte budget checked against profiling, or by
        profiling); must hold one ``max_model_len`` sequence."""
        sizing = determine_num_blocks(layout, self.cache_config, self.runner, self.scheduler_config,
                                      self.device_memory, self._memory_baseline)
        num_blocks = sizing.num_blocks
        capacity = layout.token_capacity(num_blocks)
        max_len = self.model_config.max_model_len
        if capacity < max_len:
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({num_blocks} blocks of {layout.block_size}), "
                f"fewer than max_model_len={max_len}; the largest max_model_len "
                f"that fits is {capacity}. Give the cache more memory (kv_cache_memory_bytes / "
                f"gpu_memory_utilization) or lower max_model_len.")
        return sizing

    def _allocate_kv_cache(self, layout: KVLayout, sizing: KVCacheSizing) -> KVCacheInfo:
        cache, num_blocks = self.cache_config, sizing.num_blocks
        self.runner.allocate_kv_cache(num_blocks)
        info = KVCacheInfo(
            num_gpu_blocks=num_blocks, block_size=layout.block_size,
            kv_cache_dtype=cache.kv_dtype_name(self.model_config.dtype),
            bytes_per_block=layout.bytes_per_block, kv_cache_memory_bytes=layout.memory_for_blocks(num_blocks),
            enable_prefix_caching=cache.enable_prefix_caching,
            gpu_memory_utilization=cache.gpu_memory_utilization,
            profiled_available_bytes=(sizing.profile.available_kv_bytes if sizing.profile is not None else None),
        )
        logger.info("KV cache: %d blocks x %d tokens (%s, %.2f GiB); max_model_len %d",
                    num_blocks, layout.block_size, info.kv_cache_dtype,
                    info.kv_cache_memory_bytes / (1 << 30), self.model_config.max_model_len)
        return info

    def _create_offload(self, offload_config, layout: KVLayout, hash_root: bytes):
        """The KV offload backend over the allocated cache, or None when offload is off."""
        if offload_config is None:
            return None
        from kvpilot.engine.offload import create_kv_offload

        return create_kv_offload(offload_config, kv_caches=self.runner.kv_caches,
                                 block_size=layout.block_size, hash_root=hash_root)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args)

    # ---- requests -----------------------------------------------------------
    def _prompt_ids(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, self.tokenizer.encode(prompt)
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        vocab = self.model_config.arch.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        return None, ids

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                    arrival_time: float | None = None, priority: int = 0,
                    cache_salt: str | None = None) -> None:
        """Queue a request; raises ValueError for input that can never be served."""
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self._prompt_ids(prompt)
        max_len = self.model_config.max_model_len
        if len(ids) >= max_len:
            raise ValueError(
                f"prompt is {len(ids)} tokens long, but this model's maximum context length "
                f"(max_model_len) is {max_len} tokens, which must also leave room for at least "
                f"one generated token")
        capacity = self.cache_info.token_capacity
        if len(ids) + 1 > capacity:
            raise ValueError(f"prompt of {len(ids)} tokens can never fit the KV cache ({capacity} tokens)")
        self._check_params(params)
        if params.structured_outputs is not None:   # a bad constraint fails before anything is queued
            self.structured_output.backend.compile(params.structured_outputs)
        params = params.with_stop_ids(self.eos_token_ids)
        arrival = time.time() if arrival_time is None else arrival_time
        parent = _Parent(request_id, text, ids, arrival)
        max_tokens = max_len - len(ids) if params.max_tokens is None else min(params.max_tokens, max_len - len(ids))
        stop_buffer = 0 if params.include_stop_str_in_output else max((len(s) for s in params.stop or []), default=1) - 1
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            child_params = params if params.n == 1 else params.for_child(i)
            request = Request(child_id, ids, child_params, arrival_time=arrival, priority=priority,
                              cache_salt=cache_salt, max_tokens=max_tokens)
            child = _Child(request, i, parent, IncrementalDetokenizer(
                self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens),
                [] if params.logprobs is not None else None,
                0.0 if params.logprobs is not None else None, stop_buffer)
            parent.children.append(child)
        for child in parent.children:
            self.structured_output.add_request(child.request)
            self.scheduler.add_request(child.request)
            self._children[child.request.request_id] = child
        self._parents[request_id] = parent

    def _check_params(self, params: SamplingParams) -> None:
        """ValueError for parameters this engine's limits refuse."""
        limit = self.model_config.max_logprobs
        if params.logprobs is not None and limit != -1 and params.logprobs > limit:
            raise ValueError(f"requested {params.logprobs} logprobs, more than this server's "
                             f"max_logprobs ({limit})")
        vocab = self.model_config.arch.vocab_size
        bad = [t for t in params.logit_bias or {} if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias token ids must be in [0, {vocab}); got {bad[:5]}")

    def abort_request(self, request_ids: Iterable[str]) -> None:
        """Abort requests (by the id given to add_request); unknown ids are ignored."""
        for rid in list(request_ids):
            parent = self._parents.pop(rid, None)
            if parent is None:
                continue
            for child in parent.children:
                self._finish(child, RequestStatus.FINISHED_ABORTED)

    def _finish(self, child: _Child, status: RequestStatus) -> None:
        rid = child.request.request_id
        self.scheduler.finish_request(rid, status)
        self.runner.release(rid)
        self.structured_output.remove(rid)
        self._children.pop(rid, None)
        child.finish_reason = status.finish_reason

    # ---- stepping -----------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if sched.kv_transfers:
                self.runner.execute_kv_transfers(sched.kv_transfers)
            return []
        self._num_steps += 1
        results = self.runner.execute(sched, self.structured_output.grammar_bitmask(sched))
        advanced = self.scheduler.update_from_output(sched, {k: r.token_id for k, r in results.items()})
        touched: dict[str, _Parent] = {}
        for request in advanced:
            self.structured_output.accept(request)
            child = self._children[request.request_id]
            self._process_token(child, results[request.request_id])
            touched[child.parent.request_id] = child.parent
        outputs = []
        for rid, parent in touched.items():
            outputs.append(parent.output())
            if parent.finished:
                self._parents.pop(rid, None)
        if self.kv_offload is not None and not self.scheduler.has_unfinished_requests():
            self._run_pending_kv_transfers()   # save finished requests' blocks now, not next step
        return outputs

    def _process_token(self, child: _Child, result: SampleResult) -> None:
        request = child.request
        if not child.parent.prompt_counted:
            child.parent.prompt_counted = True
            self._prompt_tokens += request.num_prompt_tokens
        self._generation_tokens += 1
        if child.logprobs is not None:
            self._record_logprobs(child, result)
        new_chars = len(child.detok.add_token(result.token_id))
        status, stop_token = check_token_stop(request, self.model_config.max_model_len)
        full = child.detok.text
        params = request.sampling_params
        if params.stop and new_chars:
            hit = find_stop_string(full, new_chars, params.stop)
            if hit is not None:
                stop, idx = hit
                full = full[: idx + len(stop)] if params.include_stop_str_in_output else full[:idx]
                status, stop_token = RequestStatus.FINISHED_STOPPED, stop
        if status is None:
            # Hold back what could still become the start of a stop string.
            child.text = full[: len(full) - child.stop_buffer] if child.stop_buffer else full
            return
        if not isinstance(stop_token, str):
            child.detok.flush()          # emit a held-back partial character, if any
            full = child.detok.text
        child.text = full
        child.stop_reason = stop_token
        request.finished_time = time.time()
        self._finish(child, status)

    def _record_logprobs(self, child: _Child, result: SampleResult) -> None:
        decode = self.tokenizer.decode
        entry = {result.token_id: Logprob(result.logprob, result.rank, decode([result.token_id], skip_special_tokens=False))}
        for rank, (tid, lp) in enumerate(result.top_logprobs or [], start=1):
            if tid not in entry:
                entry[tid] = Logprob(lp, rank, decode([tid], skip_special_tokens=False))
        child.logprobs.append(entry)
        child.cumulative_logprob += result.logprob

    # ---- introspection ------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    def get_num_unfinished_requests(self) -> int:
        return len(self._parents)

    def get_stats(self) -> EngineStats:
        kv = self.kv_cache_manager
        return EngineStats(
            num_running_reqs=self.scheduler.num_running,
            num_waiting_reqs=self.scheduler.num_waiting,
            kv_cache_usage=kv.usage,
            num_gpu_blocks=self.cache_info.num_gpu_blocks,
            num_free_blocks=kv.num_free_blocks,
            prefix_cache_queries=kv.stats.queries,
            prefix_cache_hits=kv.stats.hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self._prompt_tokens,
            computed_prompt_tokens=self.scheduler.num_computed_prompt_tokens,
            generation_tokens=self._generation_tokens,
            num_steps=self._num_steps,
            **(self.kv_offload.stats().engine_stat_fields() if self.kv_offload is not None else {}),
        )

    def reset_prefix_cache(self) -> bool:
        """Forget the device pool's cached blocks (offload tiers keep theirs)."""
        return self.kv_cache_manager.reset_prefix_cache()

    def _run_pending_kv_transfers(self) -> None:
        transfers = self.scheduler.take_kv_transfers()
        if transfers:
            self.runner.execute_kv_transfers(transfers)

    def close(self) -> None:
        """Finish background work (KV offload saves and disk writes) and release it."""
        if self.kv_offload is not None:
            self._run_pending_kv_transfers()
            self.kv_offload.close()
