"""The explicit per-step attention metadata: what the attention kernels and the torch path read.

It lives with the kernels (the lowest layer) so that they, their test batches and the
engine's backends share one definition without ``kernels/`` importing the engine.

A step's tokens are flattened into one varlen batch: sequence ``i`` owns query rows
``query_start_loc[i]:query_start_loc[i + 1]``. Its first ``seq_lens[i] - query_len``
tokens are already in the paged cache; the new tokens are written into the slots in
``slot_mapping`` and then every query attends causally to ``seq_lens[i]`` keys. Rows
from ``num_actual_tokens`` on are padding: their slot is ``-1`` and their KV is not stored.

Paged cache layout (one layer): ``[2, num_blocks, block_size, num_kv_heads, head_dim]``,
index 0 = K, 1 = V; the whole cache is ``[num_layers, 2, num_blocks, block_size,
num_kv_heads, head_dim]``. Token ``t`` of sequence ``i`` lives in block
``block_tables[i, t // block_size]`` at offset ``t % block_size``, i.e. in slot
``block * block_size + offset``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class AttentionMetadata:
    num_actual_tokens: int          # leading query rows that are real tokens (the rest: padding)
    query_start_loc: torch.Tensor   # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor          # [num_seqs] int32, context + new tokens
    block_tables: torch.Tensor      # [num_seqs, max_num_blocks_per_seq] int32
    slot_mapping: torch.Tensor      # [num_tokens] int64, -1 = padding (not stored)
    max_query_len: int
    # Host copies: the torch path loops over sequences and must not sync on device tensors.
    query_lens_cpu: tuple[int, ...]
    seq_lens_cpu: tuple[int, ...]
    # Host bound on seq_lens (None: unknown): lets the Triton backend pick split-KV for
    # long-context decode. A captured CUDA graph carries the bound it was captured with.
    max_seq_len: int | None = None
    # The step that calibrates fp8 KV scales (the first batch when ``calculate_kv_scales``
    # is on): every attention layer sets its scales from this batch's K and V first.
    calibrate_kv_scales: bool = False
    # The step computes some request's prompt tokens (a prefill, or a recompute from the
    # prompt): quantized-activation matmuls keep to decode tokens (``gguf_linear``), so a
    # prompt's KV is the same whether its prefix came from the cache or not, and the logits
    # of a prompt's last token (its first output) are the float ones.
    computes_prompt: bool = False
    # Scratch of the torch path for this step's sequences: what every layer would derive
    # alike from the fields above (its decode plan), built by the first layer and read by
    # the others. Not an argument, so ``dataclasses.replace`` (a KV cache group's metadata
    # with other block tables) starts with an empty one.
    torch_scratch: dict = field(default_factory=dict, init=False, repr=False, compare=False)
