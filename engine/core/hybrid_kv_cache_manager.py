"""Block tables for a model that mixes full-attention and sliding-window layers (torch-free).

vLLM's hybrid KV cache manager idea, as two pools: the full-attention layers and the
sliding-window layers each keep their own paged KV tensors, block pool and block table
per request (group 0: full attention, group 1: sliding window). The full group holds
every block of a sequence; the sliding group releases the blocks outside the window
(``KVCacheManager`` with a release window), so a long sequence holds at most the window
plus one block there. The sliding pool is sized so that it never limits admission
(``kv_layout.sliding_pool_blocks``); the rest of the KV memory is the full pool, whose
blocks are the engine's ``num_gpu_blocks``.

- Admission and allocation check every group before taking anything from any group.
- Prefix caching: both groups register the same block hashes. The full group needs the
  whole chain of a hit; the sliding group only the blocks of the last window before the
  hit point. The hit used is the longest that both serve.
- Preemption and finishing free every group.
- ``usage`` (``vllm:kv_cache_usage_perc``) is the fuller group's fraction of blocks in
  use (1.0: some group cannot allocate); ``num_free_blocks`` and ``pool`` are the full
  group's (the unit of capacity).

KV offload saves whole block tables: a hybrid model refuses it at start. So does
token-granular reuse (a copy would have to fill both groups' blocks, and the sliding
group's sources may already be released) and prefix-miss reasons (not explained here).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.engine.core.block_hash import BlockHash
from kvpilot.engine.core.block_pool import BlockPool
from kvpilot.engine.core.kv_cache_manager import KVCacheManager, PrefixCacheStats, PrefixHit
from kvpilot.engine.core.kv_event_log import KVEventLog
from kvpilot.engine.core.kv_residency import KVResidencySampler
from kvpilot.engine.core.request import Request

FULL_GROUP, SLIDING_GROUP = 0, 1


@dataclass(slots=True)
class HybridPrefixHit(PrefixHit):
    """A hit usable by both groups: ``blocks`` / ``num_tokens`` are the full group's;
    ``group_hits`` holds each group's own blocks (the sliding group's with placeholders
    before its window)."""

    group_hits: tuple[PrefixHit, ...] = ()


class HybridKVCacheManager:
    """The scheduler's KV cache manager for a hybrid model (``KVCacheManager``'s interface).

    Args:
        num_blocks: blocks of the full-attention pool.
        num_sliding_blocks: blocks of the sliding-window pool.
        sliding_window: the sliding layers' window (tokens).
        The others as ``KVCacheManager``'s (the residency sampler follows the full pool).
    """

    def __init__(self, num_blocks: int, num_sliding_blocks: int, block_size: int, enable_caching: bool,
                 hash_root: BlockHash, sliding_window: int,
                 residency: KVResidencySampler | None = None) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_root = hash_root
        self.release_window = sliding_window
        self.full = KVCacheManager(num_blocks, block_size, enable_caching, hash_root, residency=residency)
        self.sliding = KVCacheManager(num_sliding_blocks, block_size, enable_caching, hash_root,
                                      release_window=sliding_window)
        self.groups = (self.full, self.sliding)     # by group index
        self.stats = PrefixCacheStats()
        self.token_reuse = False
        self.explainer = None

    @property
    def pool(self) -> BlockPool:
        return self.full.pool

    @property
    def usage(self) -> float:
        return max(g.pool.usage for g in self.groups)

    @property
    def num_free_blocks(self) -> int:
        return self.full.pool.num_free_blocks

    def update_block_hashes(self, request: Request) -> None:
        self.full.update_block_hashes(request)   # one list of hashes serves both groups

    def find_prefix_hit(self, request: Request) -> HybridPrefixHit:
        full = self.full.find_prefix_hit(request)
        sliding = self.sliding.find_prefix_hit(request, max_blocks=len(full.blocks))
        num_blocks = len(sliding.blocks)
        blocks = full.blocks[:num_blocks]
        num_tokens = num_blocks * self.block_size
        recomputed = full.num_recomputed_tokens if num_blocks == len(full.blocks) else 0
        return HybridPrefixHit(blocks, num_tokens, num_recomputed_tokens=recomputed,
                               group_hits=(PrefixHit(blocks, num_tokens), sliding))

    def record_admission(self, request: Request, hit: PrefixHit) -> None:
        self.stats.queries += request.num_tokens
        self.stats.hits += hit.num_tokens

    def _group_hits(self, hit: PrefixHit | None) -> tuple[PrefixHit | None, ...]:
        if hit is None:
            return (None,) * len(self.groups)
        if not isinstance(hit, HybridPrefixHit):
            raise TypeError("a hybrid model's prefix hit comes from its own find_prefix_hit")
        return hit.group_hits

    def can_allocate(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        return all(g.can_allocate(request, num_new_tokens, h)
                   for g, h in zip(self.groups, self._group_hits(hit), strict=True))

    def allocate_slots(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Reserve blocks in every group, or in none (False) when one group lacks them."""
        hits = self._group_hits(hit)
        if not self.can_allocate(request, num_new_tokens, hit):
            return False
        for group, group_hit in zip(self.groups, hits, strict=True):
            if not group.allocate_slots(request, num_new_tokens, group_hit):
                raise RuntimeError(f"group allocation failed after its check ({request.request_id})")
        return True

    def take_token_copies(self) -> list[tuple[int, int, int]]:
        return []   # no token-granular reuse (module docstring)

    def release_outside_window(self, request: Request) -> None:
        self.sliding.release_outside_window(request)

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds in the full group (``groups[i].num_held_blocks``: each)."""
        return self.full.num_held_blocks(request_id)

    def free(self, request: Request) -> list[int]:
        """Free every group's blocks; returns the full group's table."""
        self.sliding.free(request)
        return self.full.free(request)

    def block_ids(self, request_id: str) -> list[int]:
        return self.full.block_ids(request_id)

    def group_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The sliding group's table (live list, same length as the full group's)."""
        return (self.sliding.block_ids(request_id),)

    def reset_prefix_cache(self) -> bool:
        if any(g.pool.num_free_blocks != g.pool.num_blocks for g in self.groups):
            return False
        return all([g.reset_prefix_cache() for g in self.groups])

    def attach_events(self, events: KVEventLog) -> None:
        """Record each group's pool changes in ``events`` under its group index."""
        for idx, group in enumerate(self.groups):
            group.pool.attach_events(events, idx)
