"""One step's model inputs, gathered from the persistent batch into persistent buffers.

Every per-step input (token ids, positions, slot mapping, sequence lengths, query
starts, block tables) has one preallocated host buffer (pinned on CUDA) and, on a
device, one preallocated device twin. A step writes the first ``n`` entries with
vectorised numpy gathers over the scheduled rows and copies just those to the device;
the attention metadata is views of the device buffers. Because the buffers never move,
a CUDA graph captured over them replays with whatever the next step wrote
(``pad_for``: a decode batch padded to a captured size, padding rows inert: slot -1 so
nothing is stored, query length 0 so no attention runs).

A hybrid model (several KV cache groups, see ``core.hybrid_kv_cache_manager``) has a slot
mapping and a block table per group; each group's metadata shares every other buffer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from kvpilot.engine.core.scheduler import ScheduledRequest
from kvpilot.engine.model.input_batch import InputBatch
from kvpilot.kernels.attention_metadata import AttentionMetadata


class StagedBuffer:
    """A host array and its device twin (the same tensor on CPU)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        on_cuda = device.type == "cuda"
        self.cpu = torch.zeros(shape, dtype=dtype, pin_memory=on_cuda)
        self.np = self.cpu.numpy()
        self.device = self.cpu if device.type == "cpu" else torch.zeros(shape, dtype=dtype, device=device)

    def to_device(self, n: int, width: int | None = None) -> torch.Tensor:
        """The first ``n`` rows (and ``width`` columns) on the device."""
        src = self.cpu[:n] if width is None else self.cpu[:n, :width]
        dst = self.device[:n] if width is None else self.device[:n, :width]
        if dst.data_ptr() != src.data_ptr():
            dst.copy_(src, non_blocking=True)
        return dst


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor           # [num_tokens] long
    positions: torch.Tensor           # [num_tokens] long
    metadata: AttentionMetadata
    # [num_logits] rows of the hidden states to compute logits for: one per sampling
    # request, or with drafts (speculative decoding) 1 + its drafts, in request order
    logits_indices: torch.Tensor
    sample_rows: np.ndarray           # persistent-batch rows of those, in the same order
    sample_req_ids: list[str]
    padded_size: int | None = None    # a decode batch padded to this captured size
    # The other KV cache groups' metadata (group 1, ...): their slot mappings and block
    # tables, the rest shared with ``metadata``; empty with one group.
    group_metadata: tuple[AttentionMetadata, ...] = ()

    @property
    def kv_group_metadata(self) -> tuple[AttentionMetadata, ...]:
        """Every KV cache group's metadata, by group index."""
        return (self.metadata, *self.group_metadata)


def per_layer(group_metadata: Sequence[AttentionMetadata],
              layer_kv_groups: tuple[int, ...] | None) -> AttentionMetadata | list[AttentionMetadata]:
    """What the model takes from metadata by KV cache group: the one metadata (one group),
    or each layer's group's (``layer_kv_groups``, a hybrid model)."""
    if layer_kv_groups is None:
        return group_metadata[0]
    return [group_metadata[g] for g in layer_kv_groups]


class StepInputBuilder:
    """Builds ``StepInputs`` for up to ``max_num_tokens`` tokens of ``batch``'s rows;
    ``max_logits_per_seq``: logits rows a request may need in one step (1 + its most drafts)."""

    def __init__(self, batch: InputBatch, max_num_tokens: int, device: torch.device,
                 max_logits_per_seq: int = 1) -> None:
        self.batch = batch
        self.device = device
        seqs = batch.max_num_seqs
        self.input_ids = StagedBuffer((max_num_tokens,), torch.long, device)
        self.positions = StagedBuffer((max_num_tokens,), torch.long, device)
        self.slot_mapping = StagedBuffer((max_num_tokens,), torch.long, device)
        self.seq_lens = StagedBuffer((seqs,), torch.int32, device)
        self.query_start_loc = StagedBuffer((seqs + 1,), torch.int32, device)
        self.block_tables = StagedBuffer((seqs, batch.max_blocks_per_seq), torch.int32, device)
        self.logits_indices = StagedBuffer((seqs * max_logits_per_seq,), torch.long, device)
        num_groups = len(batch.block_tables)
        # Groups 1.. of a hybrid model (group 0's are slot_mapping and block_tables).
        self.group_slot_mappings = [StagedBuffer((max_num_tokens,), torch.long, device)
                                    for _ in range(1, num_groups)]
        self.group_block_tables = [StagedBuffer((seqs, batch.max_blocks_per_seq), torch.int32, device)
                                   for _ in range(1, num_groups)]

    def build(self, scheduled: list[ScheduledRequest], rows: list[int],
              pad_for: Callable[[int], int | None] | None = None,
              num_drafts: np.ndarray | None = None) -> StepInputs:
        """Inputs for ``scheduled``, whose batch rows are ``rows`` (``InputBatch.update``
        put them there; building reads the batch, never changes it).

        The requests that sample are those whose ``ScheduledRequest.samples`` holds: the
        same rule orders the structured-output bitmask's rows, so logits and bitmask rows
        cannot disagree. ``pad_for(n)``: for a pure decode batch of ``n`` sequences, the
        size to pad it to (a captured CUDA graph's) or None; prefill and mixed batches
        are never padded. ``num_drafts`` (speculative decoding): each entry's scored drafts
        (the last of its new tokens); a sampling entry then gets a logits row at each of
        them and at its last token.
        """
        num_blocks = self.batch.num_blocks
        computed, num_new, sampling = [], [], []
        width, prompt = 0, False
        for s, row in zip(scheduled, rows, strict=True):
            if s.num_computed_tokens < s.request.num_prompt_tokens:
                prompt = True
            computed.append(s.num_computed_tokens)
            num_new.append(s.num_new_tokens)
            sampling.append(s.samples)
            if num_blocks[row] > width:
                width = num_blocks[row]
        return self.build_arrays(np.array(rows, dtype=np.int64), np.array(computed, dtype=np.int64),
                                 np.array(num_new, dtype=np.int64), np.array(sampling, dtype=bool),
                                 width, pad_for, num_drafts, computes_prompt=prompt)

    def build_arrays(self, rows_np: np.ndarray, computed_np: np.ndarray, query_lens: np.ndarray,
                     sampling: np.ndarray, width: int,
                     pad_for: Callable[[int], int | None] | None = None,
                     num_drafts: np.ndarray | None = None, token_offset: int = 0,
                     computes_prompt: bool = False) -> StepInputs:
        """``build`` from arrays: per sequence its batch row, tokens already cached, tokens
        to compute and whether it samples (its last token's logits); ``width``: the most
        blocks any of the rows holds. ``token_offset``: the input at position ``p`` is the
        row's token at ``p + token_offset`` (an EAGLE head reads the next token at each
        position); the KV slots are position ``p``'s. ``computes_prompt``: some tokens are a
        prompt's (``AttentionMetadata.computes_prompt``)."""
        batch = self.batch
        n = len(rows_np)
        ends = np.cumsum(query_lens)
        total = int(ends[-1])
        if total == n:          # pure decode: one token per sequence
            token_rows, positions = rows_np, computed_np
        else:
            token_rows = np.repeat(rows_np, query_lens)
            positions = np.arange(total) + np.repeat(computed_np - (ends - query_lens), query_lens)
        seq_lens = computed_np + query_lens
        bs = batch.block_size
        pad_to = pad_for(n) if pad_for is not None and total == n else None
        if pad_to is not None and pad_to < n:
            raise ValueError(f"cannot pad a decode batch of {n} sequences to {pad_to}")
        num_seqs = n if pad_to is None else pad_to
        num_tokens = total if pad_to is None else pad_to

        self.input_ids.np[:total] = batch.token_ids[token_rows, positions + token_offset if token_offset
                                                    else positions]
        self.positions.np[:total] = positions
        table_width = width if pad_to is None else batch.max_blocks_per_seq
        block_index, offset = positions // bs, positions % bs
        for table, slot_buf, table_buf in zip(
                batch.block_tables, (self.slot_mapping, *self.group_slot_mappings),
                (self.block_tables, *self.group_block_tables), strict=True):
            slots = slot_buf.np
            slots[:total] = table[token_rows, block_index]
            slots[:total] *= bs
            slots[:total] += offset
            table_buf.np[:n, :table_width] = table[rows_np, :table_width]
            if pad_to is not None and pad_to > n:
                slots[n:pad_to] = -1
                table_buf.np[n:pad_to] = 0
        self.seq_lens.np[:n] = seq_lens
        starts = self.query_start_loc.np
        starts[0] = 0
        starts[1:n + 1] = ends
        if pad_to is not None and pad_to > n:
            self.input_ids.np[n:pad_to] = 0
            self.positions.np[n:pad_to] = 0
            self.seq_lens.np[n:pad_to] = 0
            starts[n + 1:pad_to + 1] = total

        sample_positions = np.flatnonzero(sampling)
        num_sampling = len(sample_positions)
        if num_drafts is None:
            self.logits_indices.np[:num_sampling] = ends[sample_positions] - 1
        else:
            indices = scored_positions(ends[sample_positions], num_drafts[sample_positions])
            num_sampling = len(indices)
            self.logits_indices.np[:num_sampling] = indices
        query_lens_cpu = tuple(query_lens.tolist())
        metadata = AttentionMetadata(
            num_actual_tokens=total,
            query_start_loc=self.query_start_loc.to_device(num_seqs + 1),
            seq_lens=self.seq_lens.to_device(num_seqs),
            block_tables=self.block_tables.to_device(num_seqs, table_width),
            slot_mapping=self.slot_mapping.to_device(num_tokens),
            max_query_len=max(query_lens_cpu),
            query_lens_cpu=query_lens_cpu + (0,) * (num_seqs - n),
            seq_lens_cpu=tuple(seq_lens.tolist()) + (0,) * (num_seqs - n),
            max_seq_len=int(seq_lens.max()),
            computes_prompt=computes_prompt,
        )
        group_metadata = tuple(
            replace(metadata, block_tables=tables.to_device(num_seqs, table_width),
                    slot_mapping=slots.to_device(num_tokens))
            for slots, tables in zip(self.group_slot_mappings, self.group_block_tables, strict=True))
        sample_rows = rows_np[sample_positions]
        req_ids = batch.req_ids
        return StepInputs(
            input_ids=self.input_ids.to_device(num_tokens),
            positions=self.positions.to_device(num_tokens),
            metadata=metadata,
            logits_indices=self.logits_indices.to_device(num_sampling),
            sample_rows=sample_rows,
            sample_req_ids=[req_ids[r] for r in sample_rows.tolist()],
            padded_size=pad_to,
            group_metadata=group_metadata,
        )


def scored_positions(ends: np.ndarray, num_drafts: np.ndarray) -> np.ndarray:
    """Token indices of a step's scored positions: for each sampling request (whose tokens
    end before ``ends``), its last ``num_drafts + 1`` tokens: its last real token and its
    drafts, whose logits verify the drafts and give the token after them."""
    counts = num_drafts + 1
    firsts = np.repeat(ends - counts, counts)
    return firsts + np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
