"""The engine: add requests, step, collect outputs. Single-threaded by design.

``step()`` is the whole data flow: ``scheduler.schedule()`` -> ``runner.execute()`` ->
``scheduler.update_from_output()`` -> detokenize and check stops -> outputs. A KV connector
(offload tiers, another engine: ``kv_transfer``) reports what its transfers finished at the
step's start and does the step's loads before the forward.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvpilot.engine import kv_side
from kvpilot.engine.config import SchedulerConfig
from kvpilot.engine.core.block_hash import root_hash
from kvpilot.engine.core.kv_residency import KVResidencySampler
from kvpilot.engine.core.request import Request, RequestStatus
from kvpilot.engine.core.scheduler import Scheduler
from kvpilot.engine.engine_args import EngineArgs, model_fingerprint
from kvpilot.engine.exceptions import EngineDeadError
from kvpilot.engine.kv_cache_setup import (
    allocate_kv_cache,
    kv_layout,
    size_kv_cache,
)
from kvpilot.engine.kv_events import start_kv_events
from kvpilot.engine.lora.startup import allocate_slots, start_lora
from kvpilot.engine.lora.startup import device_bytes as lora_device_bytes
from kvpilot.engine.model.device_memory import device_memory_for
from kvpilot.engine.model.kv_copy import copy_block_tokens
from kvpilot.engine.model.parallel.group import RanksOutOfStep
from kvpilot.engine.model.runner import ModelRunner
from kvpilot.engine.output_processor import OutputProcessor
from kvpilot.engine.outputs import RequestOutput
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.stats import EngineStats, OptionalParts, StepStats, engine_stats, lora_stats
from kvpilot.engine.structured_output import StructuredOutputManager
from kvpilot.engine.structured_output.cpu_share import StepThreadShare
from kvpilot.engine.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from kvpilot.engine.model.parallel.workers import WorkerGroup

logger = logging.getLogger(__name__)

# Longest an idle engine sleeps waiting for a compiling grammar (new commands wait as long).
GRAMMAR_POLL_SECONDS = 0.02
# Longest an engine with only KV transfers in flight (or held) waits for them per step (idem;
# a transfer's end wakes it earlier).
CONNECTOR_POLL_SECONDS = 0.01


@dataclass(frozen=True, slots=True)
class FailedRequest:
    """A request the engine failed on its own (see ``LLMEngine.take_failed_requests``)."""

    request_id: str
    message: str
    invalid: bool     # the request's own fault (e.g. its grammar): a 400 for the client
    kv_transfer: bool = False   # its KV could not be loaded from another engine


class LLMEngine:
    """Start-up is named steps: start the tensor-parallel workers (if any), load the model,
    size the KV cache, allocate it, and build the scheduler side (block tables, prefix
    cache, KV offload). With ``tensor_parallel_size > 1`` or ``pipeline_parallel_size > 1``
    this process is rank 0 (stage 0's first rank): it schedules and samples for all ranks
    (``kvpilot.engine.model.parallel``); ``num_blocks_per_rank`` is what each rank's KV
    budget holds for its own stage's layers (the group allocates the minimum)."""

    def __init__(self, args: EngineArgs) -> None:
        model_config, cache_config, scheduler_config = args.create_configs()
        offload_config = args.create_offload_config()   # validated before the model loads
        self.kv_transfer_config = args.create_kv_transfer_config()
        self.speculative_config = args.create_speculative_config()
        self.lora_config = args.create_lora_config()
        parallel_config = args.create_parallel_config(model_config.arch)
        self.args = args
        self.model_config = model_config
        self.cache_config = cache_config
        self.scheduler_config: SchedulerConfig = scheduler_config
        self.parallel_config = parallel_config
        self.tokenizer = Tokenizer.from_pretrained(model_config.tokenizer_dir)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(model_config.arch.eos_token_ids)
        device = torch.device(parallel_config.devices[0])
        # Memory is profiled against what the device held before the weights (None: CPU).
        self.device_memory = device_memory_for(device)
        self._memory_baseline = self.device_memory.snapshot() if self.device_memory is not None else None
        self.workers = self._start_workers()
        try:
            self._start(device, offload_config)
        except BaseException as exc:
            if self.workers is None:
                raise
            death = self.workers.death()   # a worker's own error says more than a broken pipe
            self.workers.close(graceful=False)   # they may be mid-command: no goodbye
            if death is None:
                raise
            raise death from exc

    def _start(self, device: torch.device, offload_config) -> None:
        args, model_config, cache_config = self.args, self.model_config, self.cache_config
        scheduler_config = self.scheduler_config
        workers = self.workers
        self.lora, self._lora_counters = start_lora(self.lora_config, model_config, device)
        self.runner = ModelRunner(model_config, cache_config, scheduler_config, device,
                                  args.attention_backend, tp=workers.group if workers else None,
                                  channel=workers.channel if workers else None,
                                  pp=workers.pipeline if workers else None,
                                  num_microbatches=self.parallel_config.num_microbatches,
                                  lora=self.lora, count_nan_logits=args.compute_nans_in_logits,
                                  speculative_config=self.speculative_config)
        layout = kv_layout(self.runner, model_config, cache_config, scheduler_config)
        if self.runner.spec is not None and self.runner.spec.kv_bytes_per_token:
            # a draft model's / EAGLE head's KV lives in the same blocks
            layout = dataclasses.replace(layout, extra_bytes_per_token=self.runner.spec.kv_bytes_per_token)
        sizing, self.num_blocks_per_rank = size_kv_cache(
            layout, self.runner, model_config, cache_config, scheduler_config, self.parallel_config,
            self.device_memory, self._memory_baseline, lora_device_bytes(self.lora_config, model_config))
        if self.lora is not None:   # its slots before the KV cache takes the rest
            allocate_slots(self.lora, self.lora_config)
        self.cache_info = allocate_kv_cache(layout, sizing, self.runner, model_config, cache_config,
                                            per_gpu=workers is not None)
        num_blocks = sizing.num_blocks
        self._token_capacity = self.cache_info.token_capacity   # read by every add
        # The prefix hash chain's root: stable across restarts and processes (the offload
        # tiers key blocks on it), distinct per model, KV dtype and block size.
        hash_root = root_hash(cache_config.prefix_caching_hash_seed,
                              f"{model_fingerprint(model_config.model)}|{self.cache_info.kv_cache_dtype}"
                              f"|{layout.block_size}")
        self.kv_offload = kv_side.create_offload(offload_config, self.runner.kv_caches, layout, hash_root)
        self._residency = (KVResidencySampler(args.kv_cache_metrics_sample, seed=args.seed)
                           if args.kv_cache_metrics else None)
        spec = self.speculative_config
        self.kv_cache_manager = kv_side.build_kv_cache_manager(
            layout, num_blocks, model_config, kv_side.ManagerOptions(
                prefix_caching=cache_config.enable_prefix_caching, hash_root=hash_root,
                token_granular_reuse=args.token_granular_reuse, explain_misses=args.explain_prefix_misses,
                split_over_ranks=workers is not None, draft_keeps_kv=spec is not None and spec.uses_model,
                recompute_last_hit_block=spec is not None and spec.is_eagle),
            self.kv_offload, self._residency)
        self.kv_connector = kv_side.create_connector(
            self.kv_offload, self.kv_transfer_config, self.runner.kv_caches, self.kv_cache_manager, layout,
            hash_root, self.parallel_config, self.cache_info)
        connector = self.kv_connector
        self.scheduler = Scheduler(scheduler_config, self.kv_cache_manager,
                                   connector=connector.scheduler if connector is not None else None,
                                   load_failure_policy=connector.load_failure_policy if connector else "recompute",
                                   num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
                                   num_lookahead_tokens=spec.num_lookahead_tokens if spec else 0)
        self.kv_events = start_kv_events(args.kv_events_config, self.kv_cache_manager, self.kv_offload)
        self._failed_requests: list[FailedRequest] = []   # see take_failed_requests
        structured = args.structured_outputs_config
        self.structured_output = StructuredOutputManager(
            self.tokenizer, model_config.arch.vocab_size,
            any_whitespace=not structured.disable_any_whitespace,
            reasoning_parser=None if structured.enable_in_reasoning else structured.reasoning_parser,
            compile_timeout=structured.compile_timeout)
        self._thread_share = StepThreadShare(device)
        self.output_processor = OutputProcessor(self.tokenizer, model_config.max_model_len,
                                                scheduler_config.stream_interval)
        self._num_steps = 0
        self._iteration_tokens: list[int] = []
        self._cost_model = (kv_side.step_cost_model(model_config, self.parallel_config, layout)
                            if args.enable_mfu_metrics else None)
        self._estimated = [0, 0, 0]   # flops, read bytes, write bytes (per GPU, cumulative)

    # ---- start-up steps -----------------------------------------------------
    def _start_workers(self) -> WorkerGroup | None:
        """Ranks 1..N-1 (their own processes), loading their shards while this one loads."""
        parallel = self.parallel_config
        if parallel.world_size == 1:
            return None
        from kvpilot.engine.model.parallel.workers import WorkerGroup

        return WorkerGroup(model_config=self.model_config, cache_config=self.cache_config,
                           scheduler_config=self.scheduler_config, parallel_config=parallel,
                           attention_backend=self.args.attention_backend)

    # ---- adapters -------------------------------------------------------------
    def add_lora(self, name: str, path: str, base_model_name: str | None = None):
        """Load a PEFT adapter under ``name``; ValueError (``LoRACheckpointError``,
        ``LoRAExistsError``) when it cannot be served. Returns its ``LoRARequest``."""
        if self.lora is None:
            raise ValueError("LoRA is not enabled (start the engine with enable_lora)")
        return self.lora.add(name, path, base_model_name)

    def remove_lora(self, name: str) -> None:
        """Unload ``name``: new requests for it fail; those running finish with it."""
        if self.lora is None:
            raise ValueError("LoRA is not enabled (start the engine with enable_lora)")
        self.lora.remove(name)

    def list_loras(self) -> list:
        """The loaded adapters (``registry.AdapterInfo``)."""
        return [] if self.lora is None else self.lora.adapters()

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
                    cache_salt: str | None = None, lora_name: str | None = None) -> None:
        """Queue a request; raises ValueError for input that can never be served.

        ``lora_name``: the adapter to run it under (None: the base model);
        ``LoRANotFoundError`` (a ValueError) when no adapter of that name is loaded."""
        if request_id in self.output_processor.parents:   # its outputs are still being built
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self._prompt_ids(prompt)
        max_len = self.model_config.max_model_len
        if len(ids) >= max_len:
            raise ValueError(
                f"prompt is {len(ids)} tokens long, but this model's maximum context length "
                f"(max_model_len) is {max_len} tokens, which must also leave room for at least "
                f"one generated token")
        capacity = self._token_capacity
        if len(ids) + 1 > capacity:
            raise ValueError(f"prompt of {len(ids)} tokens can never fit the KV cache ({capacity} tokens)")
        self._check_params(params)
        if lora_name is not None and self.lora is None:
            raise ValueError(f"the request names LoRA adapter {lora_name!r} but LoRA is not enabled")
        if lora_name is not None and lora_name not in self.lora:
            from kvpilot.engine.lora.registry import LoRANotFoundError

            raise LoRANotFoundError(f"The model `{lora_name}` does not exist.")
        if params.kv_transfer_params is not None:
            self._check_kv_transfer_params(params)
        params = params.with_stop_ids(self.eos_token_ids)
        arrival = time.time() if arrival_time is None else arrival_time
        max_tokens = max_len - len(ids) if params.max_tokens is None else min(params.max_tokens, max_len - len(ids))
        lora = self._acquire_adapter(lora_name, params.n)
        sequences = [Request(request_id if params.n == 1 else f"{request_id}#{i}", ids,
                             params if params.n == 1 else params.for_child(i), arrival_time=arrival,
                             priority=priority, cache_salt=cache_salt, max_tokens=max_tokens,
                             lora_request=lora, parent_id=request_id)
                     for i in range(params.n)]
        self.output_processor.add_request(request_id, text, ids, arrival, params, sequences)
        for request in sequences:
            if lora is not None:
                self._lora_counters.added(lora_name)
            waits = (params.structured_outputs is not None
                     and self.structured_output.add_request(request))
            self.scheduler.add_request(request, waiting_for_grammar=waits)

    def _acquire_adapter(self, lora_name: str | None, n: int):
        """The adapter's ``LoRARequest``, one reference per sequence (dropped as each finishes)."""
        if lora_name is None:
            return None
        lora = None
        for _ in range(n):
            lora = self.lora.acquire(lora_name)
        return lora

    def _check_params(self, params: SamplingParams) -> None:
        """ValueError for parameters this engine's limits refuse, or that would fail the
        step for the whole batch (token ids outside the vocabulary, more logprobs than it
        holds): such a request is refused before it is scheduled."""
        vocab = self.model_config.arch.vocab_size
        limit = self.model_config.max_logprobs
        limit = vocab if limit == -1 else min(limit, vocab)
        if params.logprobs is not None and params.logprobs > limit:
            raise ValueError(f"requested {params.logprobs} logprobs, more than this server's "
                             f"max_logprobs ({limit})")
        for name, ids in (("logit_bias", params.logit_bias or {}),
                          ("stop_token_ids", params.stop_token_ids or ())):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{name} token ids must be in [0, {vocab}); got {bad[:5]}")

    def _check_kv_transfer_params(self, params: SamplingParams) -> None:
        """ValueError for ``kv_transfer_params`` this engine's connector cannot honour."""
        from kvpilot.engine.kv_transfer.params import check_kv_transfer_params

        check_kv_transfer_params(params.kv_transfer_params, self.kv_transfer_config, params.n)

    def abort_request(self, request_ids: Iterable[str]) -> None:
        """Abort requests (by the id given to add_request); unknown ids are ignored."""
        self._release(self.scheduler.abort_requests(list(request_ids)))

    def _release(self, finished: list[Request]) -> None:
        """What finished requests held beside their blocks (the scheduler freed those; the
        runner drops their batch rows at the next step): their output state, adapter
        references and grammars."""
        for request in finished:
            self.output_processor.finish(request)
            lora = request.lora_request
            if lora is not None:
                self.lora.release(lora)
                self._lora_counters.finished(request)
            if self.structured_output.active:
                self.structured_output.remove(request.request_id)

    # ---- stepping -----------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduling + model step; returns the outputs the requests' kinds ask for."""
        outputs = self._step()
        if self.kv_events is not None:   # what the step changed after scheduling (frees, offload)
            self.kv_events.publish_step()
        return outputs

    def _step(self) -> list[RequestOutput]:
        structured = self.structured_output
        connector = self.kv_connector
        if connector is not None:   # what the transfers finished since the last step
            self._apply_connector_output(connector.worker.get_finished())
        if structured.active:
            self._thread_share.update(structured.compiling)   # a compile's CPUs (cpu_share.py)
            # grammars that compiled (or failed, or are too late)
            ready, failed_compiles = structured.poll()
            for request in ready:
                self.scheduler.grammar_ready(request)
            self._fail_requests({r.parent_id: exc for r, exc in failed_compiles})
        sched = self.scheduler.schedule()
        if self.kv_events is not None:
            # As vLLM's scheduler does: the blocks this step registers are announced before
            # its forward, so a router sends the next request with their prefix here now.
            self.kv_events.publish_step()
        if connector is not None:   # its loads (offload: saves too), before the forward reads them
            connector.worker.start_load_kv(sched.kv_connector_metadata)
        if sched.kv_copies:   # token-granular reuse, after the connector's saves and loads (a
            copy_block_tokens(self.runner.kv_caches, sched.kv_copies)   # destination may be saved now)
        if sched.is_empty:
            self.runner.update_batch(sched)   # the preempted and finished leave it
            if structured.active and structured.num_waiting:   # only grammars to wait for:
                structured.wait(GRAMMAR_POLL_SECONDS)           # no busy loop meanwhile
            elif connector is not None and self.scheduler.has_connector_work():
                connector.worker.wait(CONNECTOR_POLL_SECONDS)  # only transfers: idem
            return []
        self._num_steps += 1
        self._iteration_tokens.append(sched.num_scheduled_tokens)
        if self._cost_model is not None:
            cost = self._cost_model.step((s.num_new_tokens, s.num_computed_tokens + s.num_new_tokens)
                                         for s in sched.scheduled)
            self._estimated[0] += cost.flops
            self._estimated[1] += cost.read_bytes
            self._estimated[2] += cost.write_bytes
        result = self._execute(sched, structured.grammar_bitmask(sched) if structured.active else None)
        if connector is not None:
            connector.worker.save_kv(sched.kv_connector_metadata)
        advanced = self.scheduler.update_from_output(sched, result.sampled(), result.nan_req_ids)
        failed: dict[str, BaseException] = {}    # parent request id -> why it failed
        if structured.active:
            for request in advanced:
                try:
                    structured.accept(request)
                except Exception as exc:  # noqa: BLE001 - fails this request only
                    failed[request.parent_id] = exc
        output = self.output_processor
        for status, (stop_reasons, kept) in _by_status(output.process(advanced, result.logprobs, failed)).items():
            self._release(self.scheduler.finish_requests(stop_reasons, status, stop_reasons, kept))
        outputs = output.outputs(failed)
        self._fail_requests(failed)
        if result.draft_token_ids:
            self._set_drafts(result.draft_token_ids)
        if connector is not None and not self.scheduler.has_unfinished_requests():
            self._run_pending_kv_transfers()   # save finished requests' blocks now, not next step
        return outputs

    def _set_drafts(self, drafts: dict[str, list[int]]) -> None:
        """The drafts proposed for the running requests' next step; a constrained
        request's are cut at the first token its grammar refuses."""
        if self.structured_output.active:
            drafts = self.structured_output.trim_drafts(drafts, self.scheduler.requests)
        self.scheduler.update_draft_token_ids(drafts)

    def _apply_connector_output(self, output) -> None:
        """Free held blocks, resume requests whose KV arrived, fail those whose load failed
        under the ``fail`` policy (alone: the rest of the batch goes on)."""
        from kvpilot.engine.exceptions import KVTransferFailed

        failed = self.scheduler.update_connector_output(output)
        if failed:
            self._fail_requests({r.parent_id: KVTransferFailed(reason) for r, reason in failed})

    def _execute(self, sched, bitmask):
        """The runner's step. With workers, a dead worker or a failure while the ranks ran
        the step together (they may be out of step) is the engine's death, raised as
        ``EngineDeadError``; a failure on this rank alone (sampling) fails only the step."""
        if self.workers is None:
            return self.runner.execute(sched, bitmask)
        self.workers.check()
        try:
            return self.runner.execute(sched, bitmask)
        except RanksOutOfStep as exc:
            raise self.workers.dead_error(exc.__cause__ or exc) from exc

    # ---- health ---------------------------------------------------------------
    @property
    def dead_error(self) -> EngineDeadError | None:
        """Why the engine can no longer serve (a tensor-parallel worker died), else None."""
        return self.workers.failure if self.workers is not None else None

    def on_dead(self, callback) -> None:
        """Call ``callback(EngineDeadError)`` as soon as the engine dies (from another
        thread, possibly while a step is blocked); never called for a one-rank engine."""
        if self.workers is not None:
            self.workers.on_failure(callback)

    # ---- introspection ------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        """Unfinished requests, or KV transfers that need steps to end (held blocks
        waiting for their remote reader, loads in flight)."""
        return self.scheduler.has_unfinished_requests() or self.scheduler.has_connector_work()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished

    def unfinished_request_ids(self) -> list[str]:
        """The ids (as given to ``add_request``) of the requests not finished yet."""
        return self.scheduler.unfinished_request_ids()

    def get_stats(self) -> EngineStats:
        lora = (lora_stats(self.lora, self.lora_config.max_loras, self.scheduler, self._lora_counters)
                if self.lora is not None else None)
        parts = OptionalParts(
            kv_connector=self.kv_connector, kv_offload=self.kv_offload,
            count_nans=self.args.compute_nans_in_logits,
            estimated=self._estimated if self._cost_model is not None else None, lora=lora)
        return engine_stats(self.scheduler, self.kv_cache_manager, self.output_processor,
                            num_gpu_blocks=self.cache_info.num_gpu_blocks, num_steps=self._num_steps,
                            parts=parts)

    def explain_prefix(self, prompt: str | list[int], cache_salt: str | None = None,
                       lora_name: str | None = None) -> dict:
        """Why ``prompt`` would miss the prefix cache now (``prefix_explain.explanation``),
        changing nothing. ValueError for a prompt or adapter the engine would refuse."""
        from kvpilot.engine.prefix_explain import explanation

        _, ids = self._prompt_ids(prompt)
        lora = None
        if lora_name is not None:
            if self.lora is None or lora_name not in self.lora:
                raise ValueError(f"no LoRA adapter {lora_name!r} is loaded")
            lora = self.lora.request_for(lora_name)
        request = Request("explain", ids, SamplingParams(max_tokens=1), cache_salt=cache_salt,
                          lora_request=lora)
        hit, miss = self.kv_cache_manager.explain(request) if self.cache_config.enable_prefix_caching \
            else (None, None)
        return explanation(ids, hit, miss, self.kv_cache_manager.block_size, self.tokenizer,
                           caching=self.cache_config.enable_prefix_caching,
                           explained=getattr(self.kv_cache_manager, "explainer", None) is not None)

    def _fail_requests(self, failed: dict[str, BaseException]) -> None:
        """Abort the requests a step failed for on their own (their grammar, detokenizing,
        stop checks), keeping the rest of the batch; ``take_failed_requests`` reports them.
        A ``ValueError`` (a constraint that does not compile, or not in time) is the
        request's own fault."""
        from kvpilot.engine.exceptions import KVTransferFailed

        for request_id, exc in failed.items():
            invalid = isinstance(exc, ValueError)
            kv_transfer = isinstance(exc, KVTransferFailed)
            if invalid or kv_transfer:
                logger.warning("request %s %s: %s", request_id, "refused" if invalid else "failed", exc)
            else:
                logger.error("request %s failed in an engine step (the rest of the batch goes on)",
                             request_id, exc_info=exc)
            self.abort_request([request_id])
            message = str(exc) if invalid or kv_transfer else f"{type(exc).__name__}: {exc}"
            self._failed_requests.append(FailedRequest(request_id, message, invalid, kv_transfer))

    def take_failed_requests(self) -> list[FailedRequest]:
        """The requests aborted since the previous call because the engine failed for
        them alone; the caller fails them, and only them."""
        failed, self._failed_requests = self._failed_requests, []
        return failed

    def take_step_stats(self) -> StepStats:
        """What the steps since the previous call did (tokens per step, sampled KV block
        lives); the engine forgets it once taken."""
        tokens, self._iteration_tokens = self._iteration_tokens, []
        residency = self._residency.drain() if self._residency is not None else []
        return StepStats(tuple(tokens), tuple(residency))

    def reset_prefix_cache(self) -> bool:
        """Forget the device pool's cached blocks (offload tiers keep theirs)."""
        done = self.kv_cache_manager.reset_prefix_cache()
        if self.kv_events is not None:
            self.kv_events.publish_step()
        return done

    def _run_pending_kv_transfers(self) -> None:
        metadata = self.scheduler.take_connector_metadata()
        if metadata:
            self.kv_connector.worker.start_load_kv(metadata)

    def close(self) -> None:
        """Finish background work (KV offload saves and disk writes) and release it; stop
        the tensor-parallel workers."""
        self.structured_output.close()
        try:
            if self.kv_connector is not None:
                self._run_pending_kv_transfers()
                self.kv_connector.worker.close()
            if self.kv_events is not None:
                self.kv_events.close()
        finally:
            if self.workers is not None:
                self.workers.close()


def _by_status(stops: list[tuple[Request, RequestStatus, int | str | None, int]]) -> dict:
    """Per finishing status, its requests' stop reasons and kept output tokens by id, in order."""
    by_status: dict[RequestStatus, tuple[dict[str, int | str | None], dict[str, int]]] = {}
    for request, status, stop_reason, num_output_tokens in stops:
        reasons, kept = by_status.setdefault(status, ({}, {}))
        reasons[request.request_id] = stop_reason
        kept[request.request_id] = num_output_tokens
    return by_status
