"""Copies whole KV blocks between the paged cache and host memory.

A block's *payload* is one flat ``uint8`` host tensor of ``bytes_per_block`` bytes: for
each layer in order, that layer's ``[2, block_size, num_kv_heads, head_dim]`` slice of
the block, as raw bytes. Working in bytes makes every layer dtype (fp8 included, which
has no arithmetic on CPU) and per-layer mixes of dtypes the same case, and lets the disk
tier store payloads as they are.

On CUDA the host side is pinned memory and device-to-host copies are asynchronous:
``gather`` returns a CUDA event that completes when the payloads hold the data. Host-side
readers wait for it: the disk writer, LMCache's store, and ``scatter`` (which stacks
payloads on the CPU before copying them to the device).
"""

from __future__ import annotations

import torch


class BlockIO:
    """Gathers / scatters block payloads of one paged KV cache.

    Args:
        kv_caches: the runner's cache: one ``[layers, 2, blocks, block_size, kv_heads,
            head_dim]`` tensor, or a list of per-layer ``[2, blocks, ...]`` views.
    """

    def __init__(self, kv_caches: torch.Tensor | list[torch.Tensor]) -> None:
        layers = list(kv_caches) if isinstance(kv_caches, list) else list(kv_caches.unbind(0))
        if not layers:
            raise ValueError("the KV cache has no layers")
        # Per layer: a uint8 view [2, num_blocks, bytes of one K (or V) block].
        self._layers = [layer.view(torch.uint8).view(2, layer.shape[1], -1) for layer in layers]
        self._layer_bytes = [2 * u8.shape[2] for u8 in self._layers]
        self.bytes_per_block = sum(self._layer_bytes)
        self.device = layers[0].device
        self._pin = self.device.type == "cuda"
        self._last_copy_out = None   # CUDA event of the newest device-to-host copy

    def gather(self, block_ids: list[int]) -> tuple[list[torch.Tensor], object | None]:
        """Copies blocks out; returns (one payload per block, a CUDA event or None)."""
        n = len(block_ids)
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        out = torch.empty((n, self.bytes_per_block), dtype=torch.uint8, device=self.device)
        offset = 0
        for layer, size in zip(self._layers, self._layer_bytes, strict=True):
            picked = layer.index_select(1, idx)                           # [2, n, X]
            out[:, offset:offset + size].view(n, 2, -1).copy_(picked.transpose(0, 1))
            offset += size
        # One tensor per block, not views of one batch: the host tier evicts blocks one by
        # one, and a view would keep its whole batch alive.
        payloads = [torch.empty(self.bytes_per_block, dtype=torch.uint8, pin_memory=self._pin)
                    for _ in range(n)]
        for payload, row in zip(payloads, out.unbind(0), strict=True):
            payload.copy_(row, non_blocking=self._pin)
        if not self._pin:
            return payloads, None
        event = torch.cuda.Event()
        event.record()
        self._last_copy_out = event
        return payloads, event

    def scatter(self, block_ids: list[int], payloads: list[torch.Tensor]) -> None:
        """Copies payloads into blocks (ordered on the current stream before later work)."""
        if len(block_ids) != len(payloads):
            raise ValueError(f"{len(block_ids)} block ids for {len(payloads)} payloads")
        n = len(block_ids)
        if self._last_copy_out is not None:
            # The CPU reads payloads below; one may still be arriving from the device
            # (saved this very step). Events complete in order, so the newest covers all.
            self._last_copy_out.synchronize()
            self._last_copy_out = None
        batch = torch.empty((n, self.bytes_per_block), dtype=torch.uint8, pin_memory=self._pin)
        torch.stack(payloads, out=batch)
        src = batch.to(self.device, non_blocking=True)
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        offset = 0
        for layer, size in zip(self._layers, self._layer_bytes, strict=True):
            part = src[:, offset:offset + size].view(n, 2, -1).transpose(0, 1)   # [2, n, X]
            layer.index_copy_(1, idx, part)
            offset += size
