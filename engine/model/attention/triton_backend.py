"""Attention through the Triton kernels (``attention_backend = triton``).

Used by default on CUDA; with ``TRITON_INTERPRET=1`` set before triton is first imported
it also runs on CPU through the interpreter (slowly), which is how the engine is checked
through the kernels without a GPU. The kernels are imported when this backend is built,
so selecting the torch backend never imports triton.
"""

from __future__ import annotations

import torch

from kvpilot.kernels.attention_metadata import AttentionMetadata


class TritonAttentionBackend:
    """Stores the step's K/V with the KV-store kernel, then runs unified paged attention."""

    name = "triton"

    def __init__(self) -> None:
        from kvpilot.kernels.kv_store import store_kv_cache
        from kvpilot.kernels.unified_attention import unified_attention

        self._store = store_kv_cache
        self._attend = unified_attention

    def forward(
        self,
        query: torch.Tensor,      # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,        # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,      # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,   # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        k_scale: torch.Tensor,    # [] float32, 1.0 unless the KV cache is fp8
        v_scale: torch.Tensor,
        sliding_window: int | None = None,   # attend to the last this many keys (None: all)
    ) -> torch.Tensor:            # [num_tokens, num_heads, head_dim]
        if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
            raise ValueError("kv_cache must be one layer's [2, num_blocks, block_size, "
                             f"num_kv_heads, head_dim], got {tuple(kv_cache.shape)}")
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        self._store(key, value, key_cache, value_cache, metadata.slot_mapping, k_scale, v_scale)
        return self._attend(
            query, key_cache, value_cache, metadata.block_tables, metadata.seq_lens,
            metadata.query_start_loc, metadata.max_query_len, scale, k_scale, v_scale,
            max_seq_len=metadata.max_seq_len, sliding_window=sliding_window,
        )
