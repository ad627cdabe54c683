"""The driver -> workers command channel: a fixed header, then (for a step) flat int64 inputs.

Every command is one broadcast of ``HEADER_LEN`` int64 over the control group: the
command and its integer arguments. A step adds one broadcast of a flat int64 payload:
the step's token ids, positions, slot mapping, sequence lengths, query starts, block
tables and logits rows (then, for a hybrid model, each further KV cache group's slot
mapping and block tables), straight out of the driver's persistent host buffers
(``StepInputBuilder``) into each worker's own persistent buffers, whose device twins
become the worker's ``StepInputs``. Two broadcasts of tensors per step, whatever the
batch holds: no Python object is pickled, and workers never see requests.
"""

from __future__ import annotations

import enum
from dataclasses import replace

import numpy as np
import torch

from kvpilot.engine.model.parallel.group import TPGroup
from kvpilot.engine.model.step_inputs import StagedBuffer, StepInputBuilder, StepInputs
from kvpilot.kernels.attention_metadata import AttentionMetadata

HEADER_LEN = 10


class Command(enum.IntEnum):
    STEP = 1          # num_tokens, num_seqs, table width, num logits rows, num actual tokens,
                      # max query len, max seq len, calibrate kv scales, computes a prompt;
                      # then the payload
    PROFILE = 2       # max_num_batched_tokens, max_num_seqs: the memory-profiling step
    ALLOCATE = 3      # num_blocks, a hybrid model's windowed-pool blocks (0: none): allocate the KV cache
    SHUTDOWN = 4
    SIZE = 5          # pipeline parallelism: every rank sizes its own stage's KV cache, then the
                      # minimum over the ranks (memory_profiling.stage_num_blocks)


def _payload_len(num_tokens: int, num_seqs: int, width: int, num_logits: int, num_groups: int = 1) -> int:
    """int64 entries of a step's payload (``num_groups``: KV cache groups, each with its
    slot mapping and block tables)."""
    return 3 * num_tokens + 2 * num_seqs + 1 + num_seqs * width + num_logits \
        + (num_groups - 1) * (num_tokens + num_seqs * width)


class StepSender:
    """The driver's end: broadcasts commands and step inputs to the workers."""

    def __init__(self, tp: TPGroup) -> None:
        self.tp = tp
        self.header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        self._header = self.header.numpy()
        self.payload = torch.zeros(4096, dtype=torch.int64)    # grows to the largest step

    def send(self, command: Command, *args: int) -> None:
        self._header[:] = 0
        self._header[0] = command
        self._header[1:1 + len(args)] = args
        self.tp.broadcast_from_driver(self.header)

    def send_step(self, builder: StepInputBuilder, step: StepInputs, calibrate: bool) -> None:
        """``step`` (just built by ``builder``) to every worker."""
        meta = step.metadata
        num_tokens = step.input_ids.shape[0]
        num_seqs, width = meta.block_tables.shape
        num_logits = step.logits_indices.shape[0]
        groups = list(zip(builder.group_slot_mappings, builder.group_block_tables, strict=True))
        size = _payload_len(num_tokens, num_seqs, width, num_logits, 1 + len(groups))
        if size > self.payload.shape[0]:
            self.payload = torch.zeros(2 * size, dtype=torch.int64)
        flat = self.payload.numpy()
        pos = 0
        parts = [builder.input_ids.np[:num_tokens], builder.positions.np[:num_tokens],
                 builder.slot_mapping.np[:num_tokens], builder.seq_lens.np[:num_seqs],
                 builder.query_start_loc.np[:num_seqs + 1],
                 builder.block_tables.np[:num_seqs, :width].reshape(-1),
                 builder.logits_indices.np[:num_logits]]
        for slots, tables in groups:
            parts += [slots.np[:num_tokens], tables.np[:num_seqs, :width].reshape(-1)]
        for values in parts:
            flat[pos:pos + len(values)] = values
            pos += len(values)
        self.send(Command.STEP, num_tokens, num_seqs, width, num_logits, meta.num_actual_tokens,
                  meta.max_query_len, -1 if meta.max_seq_len is None else meta.max_seq_len, int(calibrate),
                  int(meta.computes_prompt))
        self.tp.broadcast_from_driver(self.payload[:size])


class StepReceiver:
    """A worker's end: receives commands; unpacks steps into persistent buffers."""

    def __init__(self, tp: TPGroup, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int,
                 device: torch.device, num_kv_groups: int = 1) -> None:
        self.tp = tp
        self.header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        self.payload = torch.zeros(_payload_len(max_num_tokens, max_num_seqs, max_blocks_per_seq,
                                                max_num_seqs, num_kv_groups), dtype=torch.int64)
        self.input_ids = StagedBuffer((max_num_tokens,), torch.long, device)
        self.positions = StagedBuffer((max_num_tokens,), torch.long, device)
        self.slot_mapping = StagedBuffer((max_num_tokens,), torch.long, device)
        self.seq_lens = StagedBuffer((max_num_seqs,), torch.int32, device)
        self.query_start_loc = StagedBuffer((max_num_seqs + 1,), torch.int32, device)
        self.block_tables = StagedBuffer((max_num_seqs, max_blocks_per_seq), torch.int32, device)
        self.logits_indices = StagedBuffer((max_num_seqs,), torch.long, device)
        self.group_slot_mappings = [StagedBuffer((max_num_tokens,), torch.long, device)
                                    for _ in range(1, num_kv_groups)]
        self.group_block_tables = [StagedBuffer((max_num_seqs, max_blocks_per_seq), torch.int32, device)
                                   for _ in range(1, num_kv_groups)]

    def recv(self) -> tuple[Command, list[int]]:
        """The next command and its arguments (blocks until the driver sends one)."""
        values = self.tp.broadcast_from_driver(self.header).tolist()
        return Command(values[0]), values[1:]

    def recv_step(self, args: list[int]) -> tuple[StepInputs, bool]:
        """The payload of a STEP command whose header arguments are ``args``."""
        (num_tokens, num_seqs, width, num_logits, num_actual, max_query_len, max_seq_len, calibrate,
         computes_prompt) = args[:9]
        groups = list(zip(self.group_slot_mappings, self.group_block_tables, strict=True))
        size = _payload_len(num_tokens, num_seqs, width, num_logits, 1 + len(groups))
        flat = self.tp.broadcast_from_driver(self.payload[:size]).numpy()
        pos = 0

        def take(n: int) -> np.ndarray:
            nonlocal pos
            pos += n
            return flat[pos - n:pos]

        self.input_ids.np[:num_tokens] = take(num_tokens)
        self.positions.np[:num_tokens] = take(num_tokens)
        self.slot_mapping.np[:num_tokens] = take(num_tokens)
        seq_lens = self.seq_lens.np[:num_seqs]
        seq_lens[:] = take(num_seqs)
        starts = self.query_start_loc.np[:num_seqs + 1]
        starts[:] = take(num_seqs + 1)
        self.block_tables.np[:num_seqs, :width] = take(num_seqs * width).reshape(num_seqs, width)
        self.logits_indices.np[:num_logits] = take(num_logits)
        for slots, tables in groups:
            slots.np[:num_tokens] = take(num_tokens)
            tables.np[:num_seqs, :width] = take(num_seqs * width).reshape(num_seqs, width)
        metadata = AttentionMetadata(
            num_actual_tokens=num_actual,
            query_start_loc=self.query_start_loc.to_device(num_seqs + 1),
            seq_lens=self.seq_lens.to_device(num_seqs),
            block_tables=self.block_tables.to_device(num_seqs, width),
            slot_mapping=self.slot_mapping.to_device(num_tokens),
            max_query_len=max_query_len,
            query_lens_cpu=tuple(np.diff(starts).tolist()),
            seq_lens_cpu=tuple(seq_lens.tolist()),
            max_seq_len=None if max_seq_len < 0 else max_seq_len,
            computes_prompt=bool(computes_prompt),
        )
        step = StepInputs(input_ids=self.input_ids.to_device(num_tokens),
                          positions=self.positions.to_device(num_tokens), metadata=metadata,
                          logits_indices=self.logits_indices.to_device(num_logits),
                          sample_rows=np.empty(0, dtype=np.int64), sample_req_ids=[],
                          group_metadata=tuple(
                              replace(metadata, block_tables=tables.to_device(num_seqs, width),
                                      slot_mapping=slots.to_device(num_tokens))
                              for slots, tables in groups))
        return step, bool(calibrate)
