"""The explicit per-step attention metadata handed to every attention layer.

A step's tokens are flattened into one varlen batch: sequence ``i`` owns query rows
``query_start_loc[i]:query_start_loc[i + 1]``. Its first ``context_lens[i]`` tokens
are already in the paged cache; the new tokens are written into the slots in
``slot_mapping`` (``-1`` marks a padding token whose KV is not stored) and then every
query attends causally to ``seq_lens[i] = context_lens[i] + query_len`` keys.

Paged cache layout (one layer): ``[2, num_blocks, block_size, num_kv_heads, head_dim]``,
index 0 = K, 1 = V; the whole cache is ``[num_layers, 2, num_blocks, block_size,
num_kv_heads, head_dim]``. Token ``t`` of sequence ``i`` lives in block
``block_tables[i, t // block_size]`` at offset ``t % block_size``, i.e. in slot
``block * block_size + offset``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    num_actual_tokens: int          # query rows that are real tokens (rest is padding)
    query_start_loc: torch.Tensor   # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor          # [num_seqs] int32, context + new tokens
    context_lens: torch.Tensor      # [num_seqs] int32, tokens already cached before this step
    block_tables: torch.Tensor      # [num_seqs, max_num_blocks_per_seq] int32
    slot_mapping: torch.Tensor      # [num_tokens] int64, -1 = padding (not stored)
    max_query_len: int
    max_seq_len: int
    # Host copies: the torch path loops over sequences and must not sync on device tensors.
    query_lens_cpu: tuple[int, ...]
    seq_lens_cpu: tuple[int, ...]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_all_decode(self) -> bool:
        return self.max_query_len == 1
