"""KV cache blocks, the free queue and the prefix-cache map (torch-free).

A block is either *used* (``ref_cnt > 0``: referenced by that many running requests'
block tables) or *free* (``ref_cnt == 0``: in the free queue). A free block may still
hold a block hash, meaning its KV is valid and can be revived by a prefix-cache hit;
it loses the hash only when it is handed out again (lazy eviction).

Eviction order: the free queue is least-recently-freed first. A finished request's
blocks are appended tail first, so its last blocks (least likely to be shared) go
before its first blocks, and everything freed earlier goes before both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from kvpilot.engine.core.block_hash import BlockHash
from kvpilot.engine.core.kv_event_log import CLEARED, MEDIUM_GPU, REMOVED, KVEventLog
from kvpilot.engine.core.kv_residency import KVResidencySampler


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free", "gen")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        # Times the pool handed the block out: an allocation is the only write to a block
        # no request references, so an unchanged ``gen`` means unchanged KV (block_donors).
        self.gen = 0
        # Links of the free queue; both None when the block is not in it.
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list threaded through the blocks: O(1) popleft, append and remove.

    Removal from the middle is what a prefix-cache hit on a free block needs, which is
    why a deque does not do.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)   # sentinels
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def popleft(self) -> KVCacheBlock:
        first = self._head.next_free
        if first is None or first is self._tail:
            raise RuntimeError("no free KV cache blocks")
        self.remove(first)
        return first

    def __iter__(self) -> Iterator[KVCacheBlock]:
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free


class BlockPool:
    """Owns every block, their ref counts and the hash -> block map.

    Args:
        num_blocks: blocks in the device cache.
        enable_caching: keep full blocks' hashes for prefix hits.
        record_evictions: keep a list of evicted cached blocks for ``drain_evicted``
            (the KV offload tiers save them); off, evictions are not recorded at all.
        residency: follows sampled blocks' lives (``--kv-cache-metrics``); None = off.

    ``events`` (set by ``attach_events``; None = off) gets a record each time a hash leaves
    ``cached`` and on a reset; the KV cache manager records the blocks it registers, since
    only it knows their tokens (``cache_full_block`` says which it did register).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 record_evictions: bool = False,
                 residency: KVResidencySampler | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        self.record_evictions = record_evictions
        # (block_id, block_hash) of cached blocks evicted since the last drain: their KV is
        # still in the block until the next forward pass overwrites it.
        self._evicted: list[tuple[int, BlockHash]] = []
        self.residency = residency
        self.events: KVEventLog | None = None
        self.event_group = 0
        self.on_evict: Callable[[KVCacheBlock], None] | None = None

    def attach_events(self, events: KVEventLog, group_idx: int) -> None:
        """Record this pool's changes in ``events`` as KV cache group ``group_idx``."""
        self.events, self.event_group = events, group_idx

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by running requests (0..1)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, reviving free ones."""
        residency = self.residency
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1
            if residency is not None:
                residency.on_hit(block.block_id)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        new = []
        residency = self.residency
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.gen += 1
            block.ref_cnt = 1
            if residency is not None:
                residency.on_allocate(block.block_id)
            new.append(block)
        return new

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash) is block:
            if self.record_evictions:
                self._evicted.append((block.block_id, block.block_hash))
            if self.events is not None:
                self.events.append((REMOVED, self.event_group, MEDIUM_GPU, block.block_hash))
            if self.on_evict is not None:
                self.on_evict(block)
            del self.cached[block.block_hash]
        block.block_hash = None

    def hold(self, block: KVCacheBlock) -> None:
        """Take a reference on a block some step will read (a token-granular reuse's
        source), reviving it from the free queue without counting a prefix hit; give it
        back with ``free_blocks``."""
        if block.ref_cnt == 0:
            self.free_queue.remove(block)
        block.ref_cnt += 1

    def drain_evicted(self) -> list[tuple[int, BlockHash]]:
        """The (block_id, block_hash) evicted since the last call, oldest first."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Register a full block under its hash (first writer wins on duplicates); True
        when it was registered now."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True

    def uncache(self, block: KVCacheBlock) -> None:
        """Drop a block's hash registration without eviction side effects (its KV is invalid)."""
        if block.block_hash is not None and self.cached.get(block.block_hash) is block:
            if self.events is not None:
                self.events.append((REMOVED, self.event_group, MEDIUM_GPU, block.block_hash))
            del self.cached[block.block_hash]
        block.block_hash = None

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the queue in order."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"{block} freed more often than referenced")
            if block.ref_cnt == 0:
                self.free_queue.append(block)
                if self.residency is not None:
                    self.residency.on_release(block.block_id)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        if self.events is not None:
            self.events.append((CLEARED,))
        return True
