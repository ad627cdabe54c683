"""The host-memory (CPU) tier: block hash -> payload, LRU, bounded by bytes.

Payloads are the flat ``uint8`` tensors of ``BlockIO`` (pinned memory on CUDA). The
store only keeps references: a payload evicted here stays alive while a planned load
still holds it, so an eviction can never invalidate a hit that was already granted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from kvpilot.engine.core.block_hash import BlockHash
from kvpilot.engine.core.kv_event_log import MEDIUM_CPU, OFFLOADED, REMOVED, KVEventLog


class HostStore:
    """LRU map of block payloads (least recently used first).

    Args:
        capacity_bytes: most payload bytes kept (0 keeps nothing).
        bytes_per_block: size of one payload.
    """

    def __init__(self, capacity_bytes: int, bytes_per_block: int) -> None:
        if capacity_bytes < 0 or bytes_per_block < 1:
            raise ValueError("capacity_bytes must be >= 0 and bytes_per_block >= 1")
        self.capacity_bytes = capacity_bytes
        self.bytes_per_block = bytes_per_block
        self.capacity_blocks = capacity_bytes // bytes_per_block
        self._blocks: OrderedDict[BlockHash, torch.Tensor] = OrderedDict()
        self.events: KVEventLog | None = None   # KV events: blocks in and out (None = off)
        # called with each hash dropped to make room (the prefix-miss explainer; None = off)
        self.on_evict: Callable[[BlockHash], None] | None = None

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._blocks

    @property
    def used_bytes(self) -> int:
        return len(self._blocks) * self.bytes_per_block

    def get(self, block_hash: BlockHash) -> torch.Tensor | None:
        """The payload (now most recently used), or None."""
        payload = self._blocks.get(block_hash)
        if payload is not None:
            self._blocks.move_to_end(block_hash)
        return payload

    def put(self, block_hash: BlockHash, payload: torch.Tensor) -> int:
        """Inserts (or refreshes) a payload; returns how many blocks were evicted for it."""
        if payload.numel() != self.bytes_per_block:
            raise ValueError(f"payload of {payload.numel()} bytes, expected {self.bytes_per_block}")
        if self.capacity_blocks == 0:
            return 0
        events = self.events
        if events is not None and block_hash not in self._blocks:
            events.append((OFFLOADED, MEDIUM_CPU, block_hash))
        self._blocks[block_hash] = payload
        self._blocks.move_to_end(block_hash)
        evicted = 0
        while len(self._blocks) > self.capacity_blocks:
            gone, _ = self._blocks.popitem(last=False)
            if events is not None:
                events.append((REMOVED, 0, MEDIUM_CPU, gone))
            if self.on_evict is not None:
                self.on_evict(gone)
            evicted += 1
        return evicted
