"""Turns a scheduler step into tensors, runs the model and samples.

Owns the model, the paged KV cache tensor ``[num_layers, 2, num_blocks, block_size,
num_kv_heads, head_dim]`` and the persistent batch (``InputBatch``: per-request rows of
tokens, block tables, sampling parameters and seeded generators), which a step updates
with what changed rather than rebuilding from the scheduler's request objects.

A hybrid model (full-attention and sliding-window layers, ``contract.arch_config.kv_cache_groups``)
keeps each kind of layer in its own cache tensors, with their own block count, block
tables and slot mappings (KV cache group 0: full attention, 1: sliding window); each
layer reads its group's metadata.

Under tensor parallelism every rank has a runner over its own shard and its own KV
heads' cache (same block count, same block tables). The driver's (rank 0) runner alone
holds the persistent batch and samples; before each thing it does that needs the
workers (a step, the profiling step, allocating the cache) it sends them the command
through ``channel``, and they run the same thing on their shard
(``kvpilot.engine.model.parallel.worker``).

Under pipeline parallelism a rank's runner holds its stage's layers and their KV cache
only (``kv_caches[j]``: the stage's ``j``-th layer); every rank gets the step inputs from
the driver, a stage after the first takes its input from the previous stage, and the
last stage's logits come back to the driver (``parallel.pipeline``), which samples.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import numpy as np
import torch

from kvpilot.contract.arch_config import kv_cache_groups
from kvpilot.contract.kv_layout import kv_heads_per_rank
from kvpilot.engine.config import CacheConfig, ModelConfig, SchedulerConfig
from kvpilot.engine.core.scheduler import SchedulerOutput
from kvpilot.engine.model import huge_pages
from kvpilot.engine.model.attention import (
    AttentionBackend,
    AttentionMetadata,
    select_attention_backend,
)
from kvpilot.engine.model.cuda_graphs import DecodeGraphs, capture_sizes
from kvpilot.engine.model.input_batch import InputBatch
from kvpilot.engine.model.loader import load_model, prepare_for_device
from kvpilot.engine.model.parallel.group import RanksOutOfStep, TPGroup
from kvpilot.engine.model.parallel.pipeline import PipelineGroup
from kvpilot.engine.model.parallel.step_channel import Command, StepSender
from kvpilot.engine.model.sampler import SampleResult, SamplingMetadata, sample
from kvpilot.engine.model.step_inputs import StepInputBuilder, StepInputs, per_layer

TORCH_DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
}


@dataclass(slots=True)
class ModelRunnerOutput:
    """What a step produced for each request that reached its last token: one sampled
    token, or with drafts (speculative decoding) the accepted drafts and the token after
    them; and the drafts proposed for the next step."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]             # aligned with req_ids
    logprobs: dict[str, list[SampleResult]]        # per new token, for the requests that asked
    nan_req_ids: tuple[str, ...] = ()              # requests whose logits held a NaN (when counted)
    draft_token_ids: dict[str, list[int]] | None = None   # next step's drafts, by request

    def sampled(self) -> dict[str, list[int]]:
        return dict(zip(self.req_ids, self.sampled_token_ids, strict=True))


def metadata_from_seqs(seqs: list[tuple[list[int], int, list[int]]], block_size: int,
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Batch of (new token ids, tokens already cached, block ids) per sequence.

    Builds from Python lists: for one-off batches (memory profiling, tests), never per step.
    """
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts = [0]
    seq_lens = []
    for token_ids, start, block_ids in seqs:
        end = start + len(token_ids)
        input_ids += token_ids
        positions += range(start, end)
        slots += [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]
        starts.append(end - start + starts[-1])
        seq_lens.append(end)
    width = max(len(b) for _, _, b in seqs)
    table = torch.zeros((len(seqs), width), dtype=torch.int32)
    for i, (_, _, block_ids) in enumerate(seqs):
        table[i, : len(block_ids)] = torch.tensor(block_ids, dtype=torch.int32)
    query_lens = [b - a for a, b in itertools.pairwise(starts)]

    def as_tensor(values, dtype):
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    metadata = AttentionMetadata(
        num_actual_tokens=len(input_ids),
        query_start_loc=as_tensor(starts, torch.int32),
        seq_lens=as_tensor(seq_lens, torch.int32),
        block_tables=table.to(device, non_blocking=True),
        slot_mapping=as_tensor(slots, torch.int64),
        max_query_len=max(query_lens),
        query_lens_cpu=tuple(query_lens),
        seq_lens_cpu=tuple(seq_lens),
        max_seq_len=max(seq_lens),
    )
    return as_tensor(input_ids, torch.long), as_tensor(positions, torch.long), metadata


def layer_kv_dtypes(model_config: ModelConfig, cache_config: CacheConfig) -> list[torch.dtype]:
    """KV dtype of each layer: the cache dtype, except sliding-window layers kept in the
    model dtype when ``kv_cache_dtype_skip_sliding_window`` is set."""
    arch = model_config.arch
    kv = TORCH_DTYPES[cache_config.kv_dtype_name(model_config.dtype)]
    keep = set(arch.sliding_window_layers) if cache_config.kv_cache_dtype_skip_sliding_window else set()
    model_dtype = TORCH_DTYPES[model_config.dtype]
    return [model_dtype if i in keep else kv for i in range(arch.num_hidden_layers)]


class LocalForward:
    """One step's forward pass on a single device: the model over the step's tokens, then
    the logits of its sampling rows (tensor parallelism happens inside the model's
    layers). Pipeline parallelism has its own executor with the same two calls
    (``parallel.pipeline_forward.PipelineForward``); the runner picks one when built."""

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend) -> None:
        self.model = model
        self.backend = backend

    def step(self, step: StepInputs, kv_caches, metadata, graphs: DecodeGraphs | None,
             calibrate: bool, keep_hidden: bool = False):
        """The logits of ``step``'s sampling rows (None if it samples nothing); a padded
        decode step replays its captured CUDA graph. ``keep_hidden``: ``(logits, hidden
        states of every token)`` (an EAGLE head reads them)."""
        if step.padded_size is not None:
            hidden = graphs.run(step, step.padded_size)
        else:
            hidden = self.model(step.input_ids, step.positions, kv_caches, metadata, self.backend)
        logits = (self.model.compute_logits(hidden[step.logits_indices], metadata)
                  if step.logits_indices.shape[0] else None)
        return (logits, hidden) if keep_hidden else logits

    def rows(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, metadata,
             rows: torch.Tensor) -> torch.Tensor | None:
        """The logits of the hidden rows ``rows`` (repeats allowed) after a forward pass over
        the given tokens: the memory profile's worst case."""
        hidden = self.model(input_ids, positions, kv_caches, metadata, self.backend)
        return self.model.compute_logits(hidden[rows % hidden.shape[0]])


class ModelRunner:
    """Args:
        tp: this rank among its stage's tensor-parallel ranks (default: the only rank).
        channel: the driver's channel to the other ranks (None: no other ranks).
        pp: this rank's pipeline stage (default: one stage, whose ranks are ``tp``'s).
        num_microbatches: microbatches a step is cut into through the pipeline's stages
            (``parallel.microbatch``; 1: none).
        lora: the LoRA adapter registry (``kvpilot.engine.lora.registry``) whose device
            slots the model's targeted projections read; None when LoRA is off.
        count_nan_logits: report the requests whose logits hold a NaN (a device sync per
            step; ``vllm:corrupted_requests``).
        speculative_config: speculative decoding (None: off); the driver verifies drafts
            and proposes the next ones (``kvpilot.engine.spec_decode``).
    """

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig,
                 scheduler_config: SchedulerConfig, device: torch.device,
                 attention_backend: str = "auto", tp: TPGroup | None = None,
                 channel: StepSender | None = None, pp: PipelineGroup | None = None,
                 num_microbatches: int = 1, lora=None, count_nan_logits: bool = False,
                 speculative_config=None) -> None:
        self.model_config = model_config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.device = device
        self.tp = tp = tp or TPGroup()
        self.pp = pp = pp or PipelineGroup(0, 1, tp.world_size, tp)
        self.stage = stage = pp.layers(model_config.arch.num_hidden_layers)
        self.num_microbatches = num_microbatches if pp.enabled else 1
        self.channel = channel
        self.dtype = TORCH_DTYPES[model_config.dtype]
        self.kv_dtype = TORCH_DTYPES[cache_config.kv_dtype_name(model_config.dtype)]
        # this stage's layers' (every layer's with one stage); kv_caches[j] is layers[j]'s
        self.layer_kv_dtypes = layer_kv_dtypes(model_config, cache_config)[
            stage.first_layer:stage.end_layer]
        self.num_kv_heads = kv_heads_per_rank(model_config.arch.num_key_value_heads, tp.world_size)
        torch.manual_seed(model_config.seed)
        self.model = load_model(model_config.model, model_config.arch, model_config.max_model_len,
                                self.dtype, device, tp, stage, float32_q8=model_config.gguf_float32_q8)
        self.backend = select_attention_backend(attention_backend, device)
        prepare_for_device(self.model, device, self.backend, self.dtype, stage.is_last)
        if lora is not None:   # the model's targeted projections read the registry's slots
            from kvpilot.engine.lora.layers import apply_lora

            apply_lora(self.model, lora.slots)
        if self.backend.name == "cpu" and hasattr(self.model, "use_fused_decode"):
            self.model.use_fused_decode(self.dtype)   # after LoRA: wrapped layers keep their path
        self.lora = lora
        self.count_nan_logits = count_nan_logits
        if pp.enabled:
            from kvpilot.engine.model.parallel.pipeline_forward import PipelineForward

            self.forward = PipelineForward(self.model, self.backend, pp, self.dtype, device,
                                           self.num_microbatches)
        else:
            self.forward = LocalForward(self.model, self.backend)
        self.kv_caches: torch.Tensor | list[torch.Tensor] | None = None
        self.block_size = cache_config.block_size
        # KV blocks each rank allocated (checked equal across ranks at allocation)
        self.num_blocks_per_rank: list[int] = []
        # Each layer's KV cache group (a hybrid model), None: one group for all layers.
        self.layer_kv_groups = kv_cache_groups(model_config.arch, model_config.max_model_len)
        self.num_kv_groups = 1 if self.layer_kv_groups is None else 1 + max(self.layer_kv_groups)
        # The persistent batch and the step builder live on the driver only: workers get
        # each step's inputs ready-made (``parallel.step_channel``).
        self.input_batch = InputBatch(scheduler_config.max_num_seqs, model_config.max_model_len,
                                      self.block_size, model_config.arch.vocab_size, device,
                                      num_kv_groups=self.num_kv_groups) if pp.is_driver else None
        k = speculative_config.num_speculative_tokens if speculative_config is not None else 0
        self.inputs = StepInputBuilder(self.input_batch, scheduler_config.max_num_batched_tokens,
                                       device, max_logits_per_seq=1 + k) if pp.is_driver else None
        self.spec = self._spec_decoder(speculative_config) if speculative_config is not None else None
        self._keep_hidden = self.spec is not None and self.spec.needs_hidden
        # Decode-step CUDA graphs (capture_cuda_graphs); None: every step runs eagerly.
        self.graphs: DecodeGraphs | None = None
        # Calibrate fp8 scales on the first batch unless the checkpoint brought its own.
        self._calibrate_pending = cache_config.calculate_kv_scales and not self.model.loaded_kv_scales

    def _spec_decoder(self, config):
        from kvpilot.engine.spec_decode.decoder import SpecDecoder
        from kvpilot.engine.spec_decode.proposer import make_proposer

        return SpecDecoder(config, self.input_batch, make_proposer(config, self))

    def allocate_kv_cache(self, num_blocks: int, num_sliding_blocks: int | None = None) -> None:
        """Allocate the cache (on every rank: ``num_blocks`` each, checked); a hybrid model's
        sliding-window layers get ``num_sliding_blocks``."""
        if self.channel is not None:
            self.channel.send(Command.ALLOCATE, num_blocks, num_sliding_blocks or 0)
        self._allocate(num_blocks, num_sliding_blocks)
        if self.spec is not None:
            self.spec.allocate(num_blocks, self.block_size)
        counts = self.pp.world.all_gather_cpu(torch.tensor([num_blocks])).flatten().tolist()
        if len(set(counts)) != 1:
            raise RuntimeError(f"the ranks allocated different KV block counts: {counts}")
        self.num_blocks_per_rank = counts

    def _allocate(self, num_blocks: int, num_sliding_blocks: int | None = None) -> None:
        """One ``[layers, 2, blocks, block_size, kv_heads, head_dim]`` tensor per KV dtype
        and KV cache group (this rank's KV heads); a hybrid model's sliding group has
        ``num_sliding_blocks`` blocks (None: ``num_blocks``).

        Zeroed, not empty: masked-out padding slots are still multiplied by 0 weights.
        ``kv_caches[layer]`` is that layer's view whichever tensor holds it.
        """
        arch = self.model_config.arch
        dtypes = self.layer_kv_dtypes
        groups = self.layer_kv_groups or (0,) * len(dtypes)
        blocks = (num_blocks, num_blocks if num_sliding_blocks is None else num_sliding_blocks)
        if len(set(dtypes)) == 1 and len(set(groups)) == 1:
            shape = (2, num_blocks, self.block_size, self.num_kv_heads, arch.head_dim)
            self.kv_caches = self._zeros((len(dtypes), *shape), dtypes[0])
            return
        keys = list(zip(groups, dtypes, strict=True))
        tensors = {key: self._zeros((keys.count(key), 2, blocks[key[0]], self.block_size,
                                     self.num_kv_heads, arch.head_dim), key[1])
                   for key in dict.fromkeys(keys)}
        seen = dict.fromkeys(tensors, 0)
        views = []
        for key in keys:
            views.append(tensors[key][seen[key]])
            seen[key] += 1
        self.kv_caches = views

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zeroed KV cache tensor; on CPU in huge pages (``huge_pages``): a decode step's
        reads of scattered blocks then walk no 4 KiB page tables."""
        if self.device.type == "cpu":
            return huge_pages.zeros(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def capture_cuda_graphs(self) -> None:
        """Capture decode graphs over the allocated cache: CUDA with the Triton backend,
        unless ``enforce_eager``. Call once, after ``allocate_kv_cache``."""
        if (self.device.type != "cuda" or self.model_config.enforce_eager
                or self.backend.name != "triton" or self.tp.world_size > 1 or self.lora is not None
                or self.pp.enabled):
            # NOTE: under tensor parallelism every step runs eagerly (graphs would have to
            # be captured and replayed in lockstep on every rank, collectives included);
            # so does every step with LoRA on (the rows' adapter factors are per step).
            return
        sizes = [s for s in capture_sizes(self.input_batch.max_num_seqs)
                 if s <= self.inputs.input_ids.cpu.shape[0]]
        self.graphs = DecodeGraphs(self.model, self.inputs, self.kv_caches, self.backend, sizes,
                                   self.model_config.max_model_len, self.layer_kv_groups)
        self.graphs.capture()

    def update_batch(self, out: SchedulerOutput) -> list[int]:
        """Apply step ``out`` to the persistent batch (``InputBatch.update``: finished
        requests leave, preempted ones leave keeping their generators for the recompute,
        new ones join)."""
        return self.input_batch.update(out)

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, max_num_seqs: int = 1) -> None:
        """A worst-case step for memory profiling: a full token budget of prefill, then the
        sampler over ``max_num_seqs`` rows with every filter on (its float32 logits,
        probabilities and sort buffers are the peak when the vocabulary is large). The
        other ranks run it too (they sample nothing). Under pipeline parallelism every rank
        is already running it (``Command.SIZE``): each stage runs its layers, the last
        computes the logits and sends them to the driver, which samples."""
        if self.channel is not None and not self.pp.enabled:
            self.channel.send(Command.PROFILE, num_tokens, max_num_seqs)
        max_len = self.model_config.max_model_len - 1
        seqs, next_block = [], 0
        for start in range(0, num_tokens, max_len):
            n = min(max_len, num_tokens - start)
            blocks = list(range(next_block, next_block + -(-n // self.block_size)))
            next_block += len(blocks)
            seqs.append(([0] * n, 0, blocks))
        self._allocate(next_block)
        input_ids, positions, metadata = metadata_from_seqs(seqs, self.block_size, self.device)
        logits = self.forward.rows(input_ids, positions, self.kv_caches, metadata,
                                   torch.arange(max_num_seqs, device=self.device))
        self.kv_caches = None
        if logits is None:        # not the driver: nothing to sample
            return
        dev = self.device
        sample(logits, SamplingMetadata(
            max_num_seqs, random_rows=torch.arange(max_num_seqs, device=dev), all_random=True,
            temperature=torch.full((max_num_seqs,), 0.8, device=dev),
            top_k=torch.full((max_num_seqs,), 50, device=dev),
            top_p=torch.full((max_num_seqs,), 0.95, device=dev),
            min_p=torch.full((max_num_seqs,), 0.05, device=dev),
            logprobs=[(i, 0) for i in range(max_num_seqs)]))

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, token_bitmask=None) -> ModelRunnerOutput:
        """Run one step; samples a token for each request that reached its last token.

        ``token_bitmask`` (structured outputs): the allowed tokens of constrained rows, in
        the order of the step's sampling requests; see ``sample``.
        """
        rows = self.update_batch(out)
        calibrate, self._calibrate_pending = self._calibrate_pending, False
        graphs = self.graphs if not calibrate else None
        num_drafts = self.spec.write_drafts(out.scheduled, rows) if out.num_spec_tokens else None
        step = self.inputs.build(out.scheduled, rows, graphs.size_for if graphs is not None else None,
                                 num_drafts)
        if self.lora is not None:
            self._set_lora_rows(out.scheduled)
        hidden = None
        if self._keep_hidden:   # an EAGLE head: the target's hidden states (one rank)
            logits, hidden = self.forward.step(step, self.kv_caches, self.layer_metadata(step, calibrate),
                                               self.graphs, calibrate, keep_hidden=True)
        elif self.channel is None:
            logits = self.forward_step(step, calibrate)
        else:
            try:
                self.channel.send_step(self.inputs, step, calibrate)
                logits = self.forward_step(step, calibrate)
            except Exception as exc:
                raise RanksOutOfStep(f"{type(exc).__name__}: {exc}") from exc
        if logits is None:
            if self.spec is not None:   # a drafter with its own KV catches up on the prompts
                self.spec.propose(self.spec.unverified(step, out.scheduled, rows, [], hidden))
            return ModelRunnerOutput([], [], {})
        req_ids = step.sample_req_ids
        nan_req_ids = ()
        if self.count_nan_logits:   # a device sync per step: only when asked for
            nan_rows = torch.isnan(logits).any(dim=-1).nonzero().flatten().tolist()
            if num_drafts is not None:   # rows of scored positions -> their request
                nan_rows = np.searchsorted(np.cumsum(num_drafts[[s.samples for s in out.scheduled]] + 1),
                                           nan_rows, side="right").tolist()
            nan_req_ids = tuple(dict.fromkeys(req_ids[i] for i in nan_rows))
        if num_drafts is not None:
            return self._verify(logits, step, out, rows, num_drafts, token_bitmask, nan_req_ids, hidden)
        sampled = sample(logits, self.input_batch.sampling_metadata(step.sample_rows), token_bitmask)
        self.input_batch.append_sampled(step.sample_rows, sampled.token_ids)
        logprobs = {req_ids[i]: [r] for i, r in sampled.logprobs.items()}
        token_lists = [[t] for t in sampled.token_ids]
        drafts = None
        if self.spec is not None:
            drafts = self._propose(self.spec.unverified(step, out.scheduled, rows, token_lists, hidden))
        return ModelRunnerOutput(req_ids, token_lists, logprobs, nan_req_ids, drafts)

    def _verify(self, logits, step: StepInputs, out: SchedulerOutput, rows: list[int],
                num_drafts: np.ndarray, token_bitmask, nan_req_ids: tuple[str, ...],
                hidden) -> ModelRunnerOutput:
        """A step with drafts: verify them, keep the accepted tokens, propose the next."""
        verified, logprobs = self.spec.verify(logits, step, out.scheduled, rows, num_drafts,
                                              token_bitmask, hidden)
        self.input_batch.append_token_lists(step.sample_rows, verified.token_lists)
        req_ids = step.sample_req_ids
        return ModelRunnerOutput(req_ids, verified.token_lists,
                                 {req_ids[i]: r for i, r in logprobs.items()}, nan_req_ids,
                                 self._propose(verified))

    def _propose(self, verified) -> dict[str, list[int]]:
        req_ids = self.input_batch.req_ids
        return {req_ids[row]: d for row, d in self.spec.propose(verified).items()}

    def _set_lora_rows(self, scheduled) -> None:
        """Put the step's adapters in device slots and give each token row its slot (the
        rows follow ``scheduled``'s order, as the step's inputs do)."""
        loras = [s.request.lora_request for s in scheduled]
        if all(lora is None for lora in loras):
            self.lora.slots.set_token_slots(None)
            return
        slot_of = self.lora.slots_for(lora.lora_id for lora in loras if lora is not None)
        slots = np.array([-1 if lora is None else slot_of[lora.lora_id] for lora in loras], dtype=np.int64)
        counts = np.array([s.num_new_tokens for s in scheduled], dtype=np.int64)
        self.lora.slots.set_token_slots(np.repeat(slots, counts))

    def layer_metadata(self, step: StepInputs, calibrate: bool = False
                       ) -> AttentionMetadata | list[AttentionMetadata]:
        """The step's metadata for the model: one for all layers, or (a hybrid model) each
        layer's group's; ``calibrate``: the step sets the fp8 KV scales."""
        groups = step.kv_group_metadata
        if calibrate:
            groups = [dataclasses.replace(m, calibrate_kv_scales=True) for m in groups]
        return per_layer(groups, self.layer_kv_groups)

    @torch.inference_mode()
    def forward_step(self, step: StepInputs, calibrate: bool = False) -> torch.Tensor | None:
        """The forward pass of one step and the logits of its sampling rows (every rank
        runs this for every step; the logits come back on the driver, else None)."""
        return self.forward.step(step, self.kv_caches, self.layer_metadata(step, calibrate),
                                 self.graphs, calibrate)
