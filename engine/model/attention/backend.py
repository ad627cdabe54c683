"""Attention backend interface and selection (``auto | triton | torch``)."""

from __future__ import annotations

from typing import Protocol

import torch

from kvpilot.engine.core.constants import ATTENTION_BACKENDS
from kvpilot.kernels.attention_metadata import AttentionMetadata


class AttentionBackend(Protocol):
    """Stores a layer's new K/V into the paged cache, then attends over it."""

    name: str

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
        ...


def select_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """``auto`` picks Triton on CUDA and the torch path elsewhere."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention_backend {name!r}; expected one of {ATTENTION_BACKENDS}")
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        from kvpilot.engine.model.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    from kvpilot.engine.model.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()
