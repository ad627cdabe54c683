"""CUDA graphs for decode steps: one captured forward per batch size, replayed per step.

A decode step of a small model on a GPU is dominated by launching its kernels (a few
hundred per forward). Capturing the forward once per batch size and replaying it costs
one launch. The graph reads its inputs from the persistent buffers of
``StepInputBuilder`` (the attention metadata are views of them) and writes its hidden
states into a static output, so a step only writes the buffers and replays.

Sizes (``capture_sizes``, as vLLM picks them): 1, 2, 4, then multiples of 8 up to
``max_num_seqs``. A decode batch of ``n`` sequences replays the smallest size ``>= n``,
its padding rows inert (slot -1: nothing stored; query length 0: nothing attended).
Prefill and mixed steps, and batches above the largest size, run eagerly;
``enforce_eager`` turns graphs off. Capture needs the Triton attention backend (the torch
path reads host-side lengths that a graph cannot refresh).

A hybrid model's layers read their KV cache group's slot mapping and block table: each
group's static metadata is a view of that group's buffers, refilled by every step too.

Without CUDA the same object runs the padded forward eagerly (``replay`` calls the
model): that is how the padding and static-buffer logic is tested on CPU.
"""

from __future__ import annotations

import bisect
import logging

import torch

from kvpilot.engine.model.step_inputs import StepInputBuilder, StepInputs, per_layer
from kvpilot.kernels.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, 16, 24, ... up to ``max_num_seqs`` (<= 512)."""
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, top + 1, 8))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


class DecodeGraphs:
    """Captured (CUDA) or padded-eager (CPU) decode forwards, by batch size.

    Args:
        model: the engine's model (``forward(input_ids, positions, kv_caches, metadata, backend)``).
        inputs: the step-input builder whose buffers the graphs read.
        kv_caches: the allocated KV cache (its storage must not move afterwards).
        backend: the attention backend.
        sizes: batch sizes to capture.
        max_seq_len: host bound baked into each graph's metadata (picks split-KV).
        layer_kv_groups: each layer's KV cache group (a hybrid model), None: one group.
    """

    def __init__(self, model, inputs: StepInputBuilder, kv_caches, backend, sizes: list[int],
                 max_seq_len: int, layer_kv_groups: tuple[int, ...] | None = None) -> None:
        self.model = model
        self.inputs = inputs
        self.kv_caches = kv_caches
        self.backend = backend
        self.sizes = sorted(sizes)
        self.max_seq_len = max_seq_len
        self.layer_kv_groups = layer_kv_groups
        self.device = inputs.device
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}

    def size_for(self, num_seqs: int) -> int | None:
        """The captured size a decode batch of ``num_seqs`` replays, or None (run eagerly)."""
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def _static_metadata(self, size: int) -> AttentionMetadata | list[AttentionMetadata]:
        """Views of the builder's buffers: one metadata, or each layer's group's."""
        b = self.inputs
        groups = [AttentionMetadata(
            num_actual_tokens=size,
            query_start_loc=b.query_start_loc.device[:size + 1],
            seq_lens=b.seq_lens.device[:size],
            block_tables=tables.device[:size],
            slot_mapping=slots.device[:size],
            max_query_len=1,
            query_lens_cpu=(1,) * size,
            seq_lens_cpu=(self.max_seq_len,) * size,
            max_seq_len=self.max_seq_len,
        ) for slots, tables in zip((b.slot_mapping, *b.group_slot_mappings),
                                   (b.block_tables, *b.group_block_tables), strict=True)]
        return per_layer(groups, self.layer_kv_groups)

    def _forward(self, size: int) -> torch.Tensor:
        b = self.inputs
        return self.model(b.input_ids.device[:size], b.positions.device[:size], self.kv_caches,
                          self._static_metadata(size), self.backend)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size (largest first, sharing one memory pool); CUDA only."""
        if self.device.type != "cuda":
            return
        b = self.inputs
        # Inert contents while capturing: nothing stored, every row attends one key.
        for slots in (b.slot_mapping, *b.group_slot_mappings):
            slots.device.fill_(-1)
        for tables in (b.block_tables, *b.group_block_tables):
            tables.device.zero_()
        b.seq_lens.device.fill_(1)
        b.input_ids.device.zero_()
        b.positions.device.zero_()
        torch.arange(b.query_start_loc.device.shape[0], out=b.query_start_loc.device)
        pool = None
        for size in reversed(self.sizes):
            self._forward(size)                  # warm-up: compiles the kernels outside capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(size)
            pool = graph.pool()
            self._graphs[size] = graph
            self._outputs[size] = out
        torch.cuda.synchronize(self.device)
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def run(self, step: StepInputs, size: int) -> torch.Tensor:
        """Hidden states of a decode step whose inputs were built with ``pad_to=size``."""
        graph = self._graphs.get(size)
        if graph is None:   # not captured (CPU): the same padded forward, eagerly
            return self.model(step.input_ids, step.positions, self.kv_caches,
                              per_layer(step.kv_group_metadata, self.layer_kv_groups), self.backend)
        graph.replay()
        return self._outputs[size]
