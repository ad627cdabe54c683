"""Token-granular reuse's copies: the first tokens of one KV block into another.

The scheduler lists ``(source block, destination block, tokens)`` (``SchedulerOutput.kv_copies``);
the engine makes the copies after the step's offload work and before its forward pass. The
bytes are copied as they are, so an fp8 cache stays exact: its scales are per layer, the
same for every block. Only this rank's cache is written, which is why the engine turns the
reuse off when the cache is split over ranks.
"""

from __future__ import annotations

import torch


def copy_block_tokens(kv_caches: torch.Tensor | list[torch.Tensor],
                      copies: list[tuple[int, int, int]]) -> None:
    """Copy the first ``n`` token slots of block ``src`` into block ``dst`` in every layer.

    Args:
        kv_caches: the runner's cache: one ``[layers, 2, blocks, block_size, kv_heads,
            head_dim]`` tensor, or per-layer ``[2, blocks, block_size, ...]`` views.
        copies: ``(src, dst, n)`` with ``src != dst`` and ``0 < n <= block_size``.
    """
    if isinstance(kv_caches, torch.Tensor):
        for src, dst, n in copies:
            kv_caches[:, :, dst, :n].copy_(kv_caches[:, :, src, :n])
        return
    for layer in kv_caches:
        for src, dst, n in copies:
            layer[:, dst, :n].copy_(layer[:, src, :n])
