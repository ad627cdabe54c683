"""Blocks whose KV a new request can copy token by token: the index behind token-granular
reuse and behind the "divergence at token P" miss explanation (torch-free).

vLLM's hash chain stays the index of whole blocks. This one answers the question the
chain cannot: "which blocks continue this prefix, and with which tokens?" An entry is a
block its request released (finished or preempted), the prefix it continues (its
*context key*: the hash of the block before it, or for a chain's first block the cache
salt and LoRA key, which the chain puts in block 0's extra keys) and the tokens whose KV
it held when released: a whole block (``block_size`` tokens, hashed or not) or the
request's last partial block (never hashed, never a prefix hit).

An entry is valid while its block keeps the KV it had: ``KVCacheBlock.gen`` counts the
times the pool handed the block out, and only an allocation writes to a block that is
not referenced, so an entry whose ``gen`` still matches its block's reads exactly the
recorded tokens' KV. Stale entries still say what the cache held there (for explanations)
but are never copied from.

Bounded: one entry per block (a block indexed again replaces its entry) and at most
``max_per_key`` entries per context key, the oldest dropped first; a lookup compares the
wanted tokens with at most that many entries.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from kvpilot.engine.core.block_pool import KVCacheBlock

DEFAULT_MAX_PER_KEY = 8


@dataclass(slots=True)
class DonorEntry:
    block: KVCacheBlock
    gen: int                     # block.gen when indexed
    key: Hashable                # the prefix the block continues
    token_ids: tuple[int, ...]   # the tokens whose KV the block held (1..block_size)

    @property
    def valid(self) -> bool:
        return self.block.gen == self.gen


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class BlockDonors:
    """Released blocks by the prefix they continue.

    Args:
        max_per_key: entries kept per context key (newest first to survive).
    """

    def __init__(self, max_per_key: int = DEFAULT_MAX_PER_KEY) -> None:
        if max_per_key < 1:
            raise ValueError(f"max_per_key must be >= 1, got {max_per_key}")
        self.max_per_key = max_per_key
        self._by_block: dict[int, DonorEntry] = {}
        # key -> block ids, oldest first (dict: ordered, O(1) removal)
        self._by_key: dict[Hashable, dict[int, None]] = {}

    def __len__(self) -> int:
        return len(self._by_block)

    def is_indexed(self, block: KVCacheBlock) -> bool:
        """Whether ``block`` has a valid entry (its KV unchanged since it was indexed)."""
        entry = self._by_block.get(block.block_id)
        return entry is not None and entry.gen == block.gen

    def add(self, block: KVCacheBlock, key: Hashable, token_ids: Sequence[int]) -> None:
        """Index ``block`` as continuing ``key`` with KV for ``token_ids`` (its first tokens)."""
        old = self._by_block.get(block.block_id)
        if old is not None:
            self._unlink(old)
        entry = DonorEntry(block, block.gen, key, tuple(token_ids))
        self._by_block[block.block_id] = entry
        ids = self._by_key.setdefault(key, {})
        ids[block.block_id] = None
        if len(ids) > self.max_per_key:
            self._unlink(self._by_block[next(iter(ids))])

    def _unlink(self, entry: DonorEntry) -> None:
        del self._by_block[entry.block.block_id]
        ids = self._by_key[entry.key]
        del ids[entry.block.block_id]
        if not ids:
            del self._by_key[entry.key]

    def entries(self, key: Hashable) -> list[DonorEntry]:
        """The entries continuing ``key``, newest first (valid and stale)."""
        ids = self._by_key.get(key)
        if not ids:
            return []
        return [self._by_block[i] for i in reversed(ids)]

    def best(self, key: Hashable, token_ids: Sequence[int], valid_only: bool) -> tuple[DonorEntry, int] | None:
        """The entry continuing ``key`` that shares the most leading tokens with
        ``token_ids`` (ties: the newest), and that many tokens (maybe 0: the continuations
        differ from the first token); None when there is no entry. ``valid_only``: only
        entries whose block still holds that KV."""
        best: tuple[DonorEntry, int] | None = None
        for entry in self.entries(key):
            if valid_only and not entry.valid:
                continue
            n = common_prefix_len(entry.token_ids, token_ids)
            if best is None or n > best[1]:
                best = (entry, n)
        return best

    def clear(self) -> None:
        self._by_block.clear()
        self._by_key.clear()
