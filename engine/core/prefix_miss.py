"""Why a request's prompt tokens missed the prefix cache, decided when it is admitted
(torch-free).

The prefix cache serves a prompt up to its first block whose hash it does not hold (or,
with token-granular reuse, a few tokens into that block). Everything from there on is
computed, for one reason, read from a bounded side index at admission:

- ``evicted_capacity`` / ``evicted_preemption`` / ``evicted_offload_full``: that block's
  hash was cached here and evicted (an allocation took its block; the block was last
  released by a preempted request; the offload tier it went to dropped it), with the
  eviction's age;
- ``different_cache_salt`` / ``different_lora_adapter``: the chain's first block missed,
  but the same first-block tokens were admitted under another cache salt or adapter (both
  are part of the first block's hash, so the chains never meet);
- ``divergence``: the prefix before the block was seen here and continued differently: the
  miss starts at token position P where the tokens first differ from what the cache held
  (the cached continuation's tokens are kept, so the text around P can be shown);
- ``never_seen``: nothing of this block's prefix continuation was seen here (a cold
  replica, or the request went to another replica than the one holding it);
- ``last_partial_block``: every full block hit; the tokens after the last full block are
  never hashed (a block-granular cache cannot hold them);
- ``last_token``: the whole prompt was cached; a step computes at least the last token to
  sample from, and (without token-granular reuse) the rest of the block holding it;
- ``too_short``: the prompt fits in one block, so no block of it can ever hit.

Multimodal extra keys do not exist in kvpilot (text-only), so that reason never occurs.

The side index never changes what hits: the explainer only reads the pool and records
what the pool, the offload tiers and the scheduler tell it. Its memory is bounded: at
most ``max_evictions`` eviction records and ``max_first_blocks`` first-block variants
(oldest dropped first), and one preemption mark per device block.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpilot.engine.core.block_donors import BlockDonors
from kvpilot.engine.core.block_hash import BlockHash, hash_block_tokens

if TYPE_CHECKING:
    from kvpilot.engine.core.block_pool import KVCacheBlock
    from kvpilot.engine.core.kv_cache_manager import PrefixHit
    from kvpilot.engine.core.request import Request

NEVER_SEEN = "never_seen"
EVICTED_CAPACITY = "evicted_capacity"
EVICTED_PREEMPTION = "evicted_preemption"
EVICTED_OFFLOAD_FULL = "evicted_offload_full"
DIFFERENT_CACHE_SALT = "different_cache_salt"
DIFFERENT_LORA_ADAPTER = "different_lora_adapter"
DIVERGENCE = "divergence"
LAST_PARTIAL_BLOCK = "last_partial_block"
LAST_TOKEN = "last_token"
TOO_SHORT = "too_short"
MISS_REASONS = (NEVER_SEEN, EVICTED_CAPACITY, EVICTED_PREEMPTION, EVICTED_OFFLOAD_FULL,
                DIFFERENT_CACHE_SALT, DIFFERENT_LORA_ADAPTER, DIVERGENCE, LAST_PARTIAL_BLOCK,
                LAST_TOKEN, TOO_SHORT)
EVICTED = {"capacity": EVICTED_CAPACITY, "preemption": EVICTED_PREEMPTION,
           "offload_full": EVICTED_OFFLOAD_FULL}

DEFAULT_MAX_EVICTIONS = 65536
DEFAULT_MAX_FIRST_BLOCKS = 16384
MAX_VARIANTS_PER_FIRST_BLOCK = 4


@dataclass(frozen=True, slots=True)
class PrefixMiss:
    """The uncached prompt tokens of one request and why they missed.

    Args:
        reason: one of ``MISS_REASONS``.
        num_tokens: prompt tokens computed for that reason (all of the uncached ones).
        position: the token position where the miss starts; for a divergence, the first
            position whose token differs from what the cache held there.
        hit_tokens: prompt tokens served from the caches.
        evicted_age_s: for an eviction, seconds between it and the admission (None when
            not known).
        block_start: for a divergence, the position of the first token of the block the
            cached continuation fills.
        seen_token_ids: for a divergence, the tokens the cache held from ``block_start``
            on (another request's: operator-facing only).
        other_adapters: for a different adapter, the adapters the first block was seen
            under (None: the base model).
    """

    reason: str
    num_tokens: int
    position: int
    hit_tokens: int
    evicted_age_s: float | None = None
    block_start: int | None = None
    seen_token_ids: tuple[int, ...] = ()
    other_adapters: tuple[str | None, ...] = ()


class EvictionLog:
    """The most recent evictions by block hash: when, and why (a bounded LRU map)."""

    def __init__(self, max_entries: int = DEFAULT_MAX_EVICTIONS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries = max_entries
        self._clock = clock
        self._entries: OrderedDict[BlockHash, tuple[float, str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, block_hash: BlockHash, cause: str) -> None:
        entries = self._entries
        entries[block_hash] = (self._clock(), cause)
        entries.move_to_end(block_hash)
        if len(entries) > self.max_entries:
            entries.popitem(last=False)

    def get(self, block_hash: BlockHash) -> tuple[float, str] | None:
        return self._entries.get(block_hash)

    def clear(self) -> None:
        self._entries.clear()


def first_block_key(request: Request) -> Hashable:
    """The context key of a chain's first block: what its hash takes besides its tokens
    and the root (the cache salt and the LoRA key; ``block_hash.extend_block_hashes``)."""
    lora = request.lora_request
    return ("root", request.cache_salt, lora.hash_extra_key if lora is not None else None)


def context_key(request: Request, index: int) -> Hashable:
    """The prefix block ``index`` of ``request`` continues (``block_donors``' key)."""
    return request.block_hashes[index - 1] if index else first_block_key(request)


class PrefixMissExplainer:
    """Classifies admitted requests' misses and keeps the side index that needs.

    Args:
        block_size: tokens per block.
        hash_root: the hash chain's root (the first block's hash without salt or adapter
            is recomputed from it for salted and adapter requests).
        donors: released blocks by the prefix they continue (shared with token-granular
            reuse; ``block_donors``).
        max_evictions / max_first_blocks: the side index's bounds.
        clock: seconds, monotonic.
        token_reuse: the prompt's last partial block can hit as well (a miss there has a
            reason beyond ``last_partial_block``).
    """

    def __init__(self, block_size: int, hash_root: BlockHash, donors: BlockDonors,
                 max_evictions: int = DEFAULT_MAX_EVICTIONS,
                 max_first_blocks: int = DEFAULT_MAX_FIRST_BLOCKS,
                 clock: Callable[[], float] = time.monotonic, token_reuse: bool = False) -> None:
        self.block_size = block_size
        self.token_reuse = token_reuse
        self.hash_root = hash_root
        self.donors = donors
        self.evictions = EvictionLog(max_evictions, clock)
        self.max_first_blocks = max_first_blocks
        self._clock = clock
        # first-block tokens (as the base model's unsalted hash) -> {(salt, lora key, lora name)}
        self._first_blocks: OrderedDict[BlockHash, dict[tuple, None]] = OrderedDict()
        self._preempted: set[int] = set()   # blocks last released by a preempted request
        self.miss_tokens: dict[str, int] = dict.fromkeys(MISS_REASONS, 0)

    # ---- what the pool, the offload tiers and the manager report -------------------
    def on_device_evict(self, block: KVCacheBlock) -> None:
        """The pool evicts ``block``'s hash (an allocation took the block)."""
        preempted = block.block_id in self._preempted
        if preempted:
            self._preempted.discard(block.block_id)
        self.evictions.record(block.block_hash, "preemption" if preempted else "capacity")

    def on_offload_evict(self, block_hash: BlockHash) -> None:
        """An offload tier dropped ``block_hash`` to make room (it was full)."""
        self.evictions.record(block_hash, "offload_full")

    def on_release(self, blocks: list[KVCacheBlock], preempted: bool) -> None:
        """A request released ``blocks``: a preempted one marks them, a finished one clears
        the marks (a later eviction of a marked block is blamed on the preemption)."""
        if preempted:
            self._preempted.update(b.block_id for b in blocks if b.block_hash is not None)
        elif self._preempted:
            self._preempted.difference_update(b.block_id for b in blocks)

    def clear(self) -> None:
        """The prefix cache was reset: what it held is gone, not evicted."""
        self.evictions.clear()
        self._preempted.clear()

    # ---- classification --------------------------------------------------------------
    def _neutral_first_block(self, request: Request) -> BlockHash:
        """The first block's hash as an unsalted base-model request would have it."""
        if request.cache_salt is None and request.lora_request is None:
            return request.block_hashes[0]
        return hash_block_tokens(self.hash_root, request.token_ids_slice(0, self.block_size))

    def classify(self, request: Request, hit: PrefixHit,
                 is_cached: Callable[[BlockHash], bool]) -> PrefixMiss | None:
        """Why ``request``'s prompt tokens beyond ``hit`` are computed (None: none are).

        ``request.block_hashes`` must cover its full blocks (the lookup hashed them);
        ``is_cached(hash)``: whether the device pool holds that hash now.
        """
        bs = self.block_size
        num_prompt = request.num_prompt_tokens
        hit_tokens = min(hit.num_tokens, num_prompt)
        missed = num_prompt - hit_tokens
        if missed <= 0:
            return None
        if num_prompt <= bs:
            return PrefixMiss(TOO_SHORT, missed, hit_tokens, hit_tokens)
        num_hit_blocks = len(hit.blocks) + hit.num_offload_blocks
        limit = (num_prompt - 1) // bs
        if num_hit_blocks >= limit:
            if num_prompt % bs:
                return ((self._tail_miss(request, limit, hit_tokens, missed) if self.token_reuse else None)
                        or PrefixMiss(LAST_PARTIAL_BLOCK, missed, hit_tokens, hit_tokens))
            if is_cached(request.block_hashes[limit]):
                return PrefixMiss(LAST_TOKEN, missed, hit_tokens, hit_tokens)
        return self._block_miss(request, min(num_hit_blocks, limit), hit_tokens, missed)

    def _block_miss(self, request: Request, index: int, hit_tokens: int, missed: int) -> PrefixMiss:
        """Block ``index`` (full, not served) is where the miss starts."""
        evicted = self.evictions.get(request.block_hashes[index])
        if evicted is not None:
            when, cause = evicted
            return PrefixMiss(EVICTED[cause], missed, hit_tokens, hit_tokens,
                              evicted_age_s=max(0.0, self._clock() - when))
        if index == 0:
            variant = self._other_variant(request)
            if variant is not None:
                return PrefixMiss(variant[0], missed, 0, hit_tokens, other_adapters=variant[1])
        bs = self.block_size
        start = index * bs
        found = self.donors.best(context_key(request, index),
                                 request.token_ids_slice(start, start + bs), valid_only=False)
        if found is None:
            return PrefixMiss(NEVER_SEEN, missed, hit_tokens, hit_tokens)
        entry, shared = found
        if shared >= bs:
            # Those very tokens were held here: the block was evicted (its record is gone).
            return PrefixMiss(EVICTED_CAPACITY, missed, hit_tokens, hit_tokens)
        return PrefixMiss(DIVERGENCE, missed, max(hit_tokens, start + shared), hit_tokens,
                          block_start=start, seen_token_ids=entry.token_ids)

    def _tail_miss(self, request: Request, index: int, hit_tokens: int, missed: int) -> PrefixMiss | None:
        """With token-granular reuse, the prompt's tail after its last full block (block
        ``index``) can hit too: what stopped it, or None when nothing continued that prefix."""
        start = index * self.block_size
        available = request.num_prompt_tokens - 1 - start
        found = self.donors.best(context_key(request, index),
                                 request.token_ids_slice(start, start + available), valid_only=False)
        if found is None:
            return None
        entry, shared = found
        if shared < available:
            return PrefixMiss(DIVERGENCE, missed, max(hit_tokens, start + shared), hit_tokens,
                              block_start=start, seen_token_ids=entry.token_ids)
        if hit_tokens >= request.num_prompt_tokens - 1:
            return PrefixMiss(LAST_TOKEN, missed, hit_tokens, hit_tokens)
        return PrefixMiss(EVICTED_CAPACITY, missed, hit_tokens, hit_tokens)   # its block was reused

    def _other_variant(self, request: Request) -> tuple[str, tuple[str | None, ...]] | None:
        """(reason, adapters) when the first block's tokens were admitted under another
        salt or adapter, and never under this request's own."""
        variants = self._first_blocks.get(self._neutral_first_block(request))
        if not variants:
            return None
        lora = request.lora_request
        mine = (request.cache_salt, lora.hash_extra_key if lora is not None else None)
        others = [v for v in variants if v[:2] != mine]
        if len(others) < len(variants):
            return None   # seen under these very keys: not a salt or adapter question
        if any(v[1] == mine[1] for v in others):
            return DIFFERENT_CACHE_SALT, ()
        if any(v[0] == mine[0] for v in others):
            return DIFFERENT_LORA_ADAPTER, tuple(dict.fromkeys(v[2] for v in others))
        return DIFFERENT_CACHE_SALT, ()

    def record(self, request: Request, miss: PrefixMiss | None) -> None:
        """Count ``miss`` and remember the request's first block under its salt and adapter."""
        if miss is not None:
            self.miss_tokens[miss.reason] += miss.num_tokens
        if request.num_prompt_tokens < self.block_size:
            return
        key = self._neutral_first_block(request)
        lora = request.lora_request
        variant = (request.cache_salt, lora.hash_extra_key if lora is not None else None,
                   lora.lora_name if lora is not None else None)
        variants = self._first_blocks.get(key)
        if variants is None:
            variants = self._first_blocks[key] = {}
            if len(self._first_blocks) > self.max_first_blocks:
                self._first_blocks.popitem(last=False)
        else:
            self._first_blocks.move_to_end(key)
        variants.pop(variant, None)
        variants[variant] = None
        if len(variants) > MAX_VARIANTS_PER_FIRST_BLOCK:
            del variants[next(iter(variants))]
