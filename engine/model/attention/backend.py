"""Attention backend interface and selection (``auto | triton | cpu | torch``)."""

from __future__ import annotations

from typing import Protocol

import torch

from kvpilot.contract.constants import ATTENTION_BACKENDS
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
    """``triton``: the Triton kernels; ``torch``: the pure-torch path (the reference);
    ``cpu``: the torch path with decode rows on the compiled CPU kernel
    (``kvpilot.kernels.paged_decode_cpu``, built on first use). ``auto`` picks Triton
    on CUDA, elsewhere ``cpu`` where that kernel builds, else ``torch``."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention_backend {name!r}; expected one of {ATTENTION_BACKENDS}")
    explicit = name != "auto"
    if name == "auto":
        name = "triton" if device.type == "cuda" else "cpu"
    if name == "triton":
        from kvpilot.engine.model.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    from kvpilot.engine.model.attention.torch_backend import TorchAttentionBackend

    if name == "cpu" and device.type == "cpu":
        from kvpilot.kernels import cpu_layer_ops, paged_decode_cpu

        if paged_decode_cpu.load() is not None:
            writer = cpu_layer_ops if cpu_layer_ops.load() is not None else None
            return TorchAttentionBackend(paged_decode_cpu, name="cpu", kv_writer=writer)
        if not explicit:
            return TorchAttentionBackend()
        raise ValueError("attention_backend 'cpu' needs the CPU paged-decode kernel, which could "
                         "not be built here (see the warning above); use 'torch'")
    if name == "cpu":
        raise ValueError(f"attention_backend 'cpu' runs on CPU only; the device is {device}")
    return TorchAttentionBackend()
