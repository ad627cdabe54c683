"""Per-request block tables on top of the block pool (torch-free).

Blocks are allocated only when a request's tokens spill into a new block. Full blocks
are registered in the prefix cache as soon as the tokens they will hold are scheduled
(their KV is written by the same step's forward pass, layer by layer, before any
attention of that layer reads it, so a hit taken in the same step is still correct).

Sliding window (``release_window``, set when every layer of the model slides): blocks
wholly before the window of the first token still to compute are released when that
token is scheduled, before any new block is allocated (a prefix hit's blocks before the
window are not even taken), so a long sequence holds at most the window plus one block
(``kv_layout.blocks_held``) and a hit longer than the pool can still be admitted. A released block keeps its hash (its KV stays valid for
prefix hits until it is handed out again). Its entry stays in the request's table as a
stale id: every query of the request is past its window, so attention never reads it
(both backends start at the window's first block), and new tokens never write there.
The scheduler also releases after each step (``release_outside_window``), so a sequence
that waits a step never keeps its last chunk's dead blocks. A prefix hit on a windowed
table needs only the blocks of the last window before the hit point to be cached (the
hash chain makes each block's hash name its whole prefix); the table's entries before
them are a placeholder block (id 0), never referenced, read or written.
A model with full-attention layers as well keeps one manager per kind of layer
(``hybrid_kv_cache_manager``).

Token-granular reuse (``token_reuse``; never with a release window): the block after a hit
need not be cached whole. A block some request released (``block_donors``: a cached block,
or a request's last partial block) that continues the same prefix and shares the first
``m`` tokens of it gives those tokens' KV: the hit grows by ``m`` tokens, the request's
next new block is listed as the copy's destination (``take_token_copies``: the engine
copies before the step's forward) and the source is held (a reference, so no allocation
of the same step can take it) until the step's admissions are over. The hash chain stays
the only index of whole blocks: a destination block is registered under its own hash
once full, like any other, and KV events, offload saves and prefix hits never see a copy.

Prefix-miss reasons (``explain_misses``): each request's uncached prompt tokens are
classified at its first admission (``prefix_miss``), from a side index the pool's
evictions, the requests' releases and the admissions feed; the lookups never read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.contract.kv_layout import num_released_blocks
from kvpilot.engine.core.block_donors import BlockDonors
from kvpilot.engine.core.block_hash import BlockHash, extend_block_hashes
from kvpilot.engine.core.block_pool import BlockPool, KVCacheBlock
from kvpilot.engine.core.kv_event_log import MEDIUM_GPU, STORED, KVEventLog
from kvpilot.engine.core.kv_residency import KVResidencySampler
from kvpilot.engine.core.prefix_miss import PrefixMiss, PrefixMissExplainer, context_key
from kvpilot.engine.core.request import Request


@dataclass(slots=True)
class PrefixHit:
    """Result of a prefix-cache lookup at admission."""

    blocks: list[KVCacheBlock]
    num_tokens: int              # device hit plus offload hit
    num_offload_blocks: int = 0  # blocks after ``blocks`` that the offload tiers serve
    # Tokens of the block after the hit that the device cache holds but that are computed
    # again: a step must compute at least the last token (the whole-prompt-cached case).
    num_recomputed_tokens: int = 0
    # Token-granular reuse: (source block, tokens) whose KV fills the start of the block
    # after ``blocks`` (counted in ``num_tokens``); None when there is none.
    partial: tuple[KVCacheBlock, int] | None = None

    def extend_with_offload(self, num_blocks: int, block_size: int) -> None:
        """Adds ``num_blocks`` blocks the offload tiers hold right after the device hit
        (they replace a token-granular reuse of the block after the device hit)."""
        if num_blocks:
            self.num_offload_blocks = num_blocks
            self.partial = None
            self.num_tokens = (len(self.blocks) + num_blocks) * block_size


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0   # prompt tokens looked up (cumulative)
    hits: int = 0      # of which served from the cache


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        hash_root: BlockHash,
        record_evictions: bool = False,
        residency: KVResidencySampler | None = None,
        release_window: int | None = None,
        token_reuse: bool = False,
        explain_misses: bool = False,
        recompute_last_hit_block: bool = False,
    ) -> None:
        if release_window is not None and record_evictions:
            raise ValueError("KV offload saves whole block tables; it cannot run with blocks "
                             "released outside a sliding window")
        if release_window is not None and token_reuse:
            raise ValueError("token-granular reuse copies from blocks a sliding window may "
                             "already have released; it cannot run with a release window")
        self.block_size = block_size
        self.release_window = release_window
        # An EAGLE head's KV at a block's last position depends on the next block's first
        # token: a hit never ends on a cached block, whose last position is recomputed.
        self.recompute_last_hit_block = recompute_last_hit_block
        self.enable_caching = enable_caching
        self.hash_root = hash_root
        self.pool = BlockPool(num_blocks, enable_caching, record_evictions, residency)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        # The same tables as block ids, kept in step with req_blocks so that a step never
        # rebuilds a request's id list (the runner copies only the ids appended).
        self.req_block_ids: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}
        # Leading blocks of each request released outside the sliding window.
        self._num_released: dict[str, int] = {}
        self.stats = PrefixCacheStats()
        # Stands in a windowed table for hit blocks before the window that are not cached
        # any more (never in the pool's queue, never referenced: see the module docstring).
        self._placeholder = KVCacheBlock(0)
        self.token_reuse = token_reuse and enable_caching
        self.donors = BlockDonors() if enable_caching and (token_reuse or explain_misses) else None
        self.explainer = (PrefixMissExplainer(block_size, hash_root, self.donors,
                                              token_reuse=self.token_reuse)
                          if enable_caching and explain_misses else None)
        if self.explainer is not None:
            self.pool.on_evict = self.explainer.on_device_evict
        # This step's token-granular copies (source, destination, tokens) and their held sources.
        self._copies: list[tuple[int, int, int]] = []
        self._held: list[KVCacheBlock] = []

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def update_block_hashes(self, request: Request) -> None:
        """Hash the request's newly full blocks (prompt at admission, outputs as they come).

        Only the tokens of the blocks still to hash are read: O(new tokens) per call.
        """
        if self.enable_caching:
            bs = self.block_size
            num_full = request.num_tokens // bs
            start = len(request.block_hashes)
            if num_full > start:
                extend_block_hashes(
                    request.block_hashes, request.token_ids_slice(start * bs, num_full * bs),
                    bs, self.hash_root, request.cache_salt, first_token=start * bs,
                    lora_key=(request.lora_request.hash_extra_key
                              if request.lora_request is not None else None),
                )

    def find_prefix_hit(self, request: Request, max_blocks: int | None = None) -> PrefixHit:
        """Longest cached prefix of a request being admitted (at most ``max_blocks`` blocks).

        At most ``num_tokens - 1`` tokens can hit: the last token is always computed so
        that the step produces logits to sample from. Without a release window every block
        of the prefix must be cached; with one, only those the next query's window sees.
        """
        if not self.enable_caching:
            return PrefixHit([], 0)
        self.update_block_hashes(request)
        limit = (request.num_tokens - 1) // self.block_size
        if max_blocks is not None:
            limit = min(limit, max_blocks)
        hashes = request.block_hashes
        if self.release_window is None:
            blocks = []
            for block_hash in hashes[:limit]:
                block = self.pool.get_cached_block(block_hash)
                if block is None:
                    break
                blocks.append(block)
        else:
            blocks = self._windowed_hit(hashes, limit)
        if self.recompute_last_hit_block and blocks:
            blocks.pop()
            limit = len(blocks)
        partial = self._find_partial(request, len(blocks)) if self.token_reuse else None
        reused = partial[1] if partial is not None else 0
        recomputed = 0
        if len(blocks) == limit < len(hashes) and self.pool.get_cached_block(hashes[limit]) is not None:
            recomputed = self.block_size - reused
        return PrefixHit(blocks, len(blocks) * self.block_size + reused,
                         num_recomputed_tokens=recomputed, partial=partial)

    def _find_partial(self, request: Request, index: int) -> tuple[KVCacheBlock, int] | None:
        """A released block continuing the request's first ``index`` blocks whose KV covers
        the most leading tokens of its block ``index`` (at most up to its last token but one:
        a step computes the last), and how many; None when it would cover none."""
        start = index * self.block_size
        available = min(self.block_size, request.num_tokens - 1 - start)
        if available <= 0:
            return None
        found = self.donors.best(context_key(request, index),
                                 request.token_ids_slice(start, start + available), valid_only=True)
        if found is None or found[1] == 0:
            return None
        return found[0].block, found[1]

    def _windowed_hit(self, hashes: list[BlockHash], limit: int) -> list[KVCacheBlock]:
        """The longest hit of ``k <= limit`` blocks whose last window is cached: blocks
        ``num_released_blocks(k) .. k - 1`` present, the ones before as placeholders."""
        bs, window, get = self.block_size, self.release_window, self.pool.get_cached_block
        found: list[KVCacheBlock | None] = []
        run_start = best = 0     # run_start: first block of the run of cached blocks so far
        for i in range(limit):
            block = get(hashes[i])
            found.append(block)
            if block is None:
                run_start = i + 1
            elif num_released_blocks((i + 1) * bs, bs, window) >= run_start:
                best = i + 1
        skip = num_released_blocks(best * bs, bs, window)
        return [self._placeholder] * skip + found[skip:best]

    def record_admission(self, request: Request, hit: PrefixHit) -> None:
        """Count an admission's lookup; at a request's first admission, explain its miss."""
        self.stats.queries += request.num_tokens
        self.stats.hits += hit.num_tokens - hit.num_offload_blocks * self.block_size
        if self.explainer is not None and request.num_cached_tokens is None:
            miss = self.explainer.classify(request, hit, self.pool.cached.__contains__)
            self.explainer.record(request, miss)
            request.prefix_miss = miss

    def explain(self, request: Request) -> tuple[PrefixHit, PrefixMiss | None]:
        """The hit ``request`` would get now and why the rest would miss, changing nothing
        (no reference taken, nothing counted or recorded; offload tiers not consulted)."""
        hit = self.find_prefix_hit(request)
        miss = (self.explainer.classify(request, hit, self.pool.cached.__contains__)
                if self.explainer is not None else None)
        return hit, miss

    def num_blocks_needed(self, request: Request, num_new_tokens: int, hit: PrefixHit | None) -> int:
        """New blocks an allocation would take from the free queue (incl. revived hits)."""
        held = len(self.req_blocks.get(request.request_id, ()))
        hit_blocks = hit.blocks if hit else []
        computed = request.num_computed_tokens + (hit.num_tokens if hit else 0)
        required = -(-(computed + num_new_tokens) // self.block_size)
        # hit blocks before the window are never taken (see allocate_slots)
        skip = (0 if self.release_window is None
                else num_released_blocks(computed, self.block_size, self.release_window))
        revived = sum(1 for b in hit_blocks[skip:] if b.ref_cnt == 0)
        if hit is not None and hit.partial is not None and hit.partial[0].ref_cnt == 0:
            revived += 1   # the held source of a token-granular reuse leaves the free queue
        return max(0, required - held - len(hit_blocks)) + revived

    def can_allocate(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Whether ``allocate_slots`` would succeed (a running request's blocks outside the
        window are released first: they are dead whatever happens)."""
        if hit is None and self.release_window is not None and request.request_id in self.req_blocks:
            self.release_outside_window(request)
        return self.num_blocks_needed(request, num_new_tokens, hit) <= self.pool.num_free_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None,
                       cache_blocks: bool = True) -> bool:
        """Reserve blocks for ``num_new_tokens`` more tokens; False if they do not fit.

        ``hit`` (admission only) is the prefix-cache hit whose blocks the request takes.
        ``cache_blocks=False`` (admission only) registers none of the new blocks in the
        prefix cache: an asynchronous load fills them later, and they are registered when
        the request is next scheduled, as it runs (vLLM's delayed caching).
        """
        rid = request.request_id
        blocks = self.req_blocks.get(rid)
        if hit is None and blocks is not None:
            # A running request (the common decode case): no lookups, no hit accounting.
            if self.release_window is not None:   # first, so the pool has them back
                self._release_outside_window(rid, blocks, request.num_computed_tokens)
            total = request.num_computed_tokens + num_new_tokens
            missing = -(-total // self.block_size) - len(blocks)
            if missing > 0:
                if missing > self.pool.num_free_blocks:
                    return False
                new = self.pool.get_new_blocks(missing)
                blocks.extend(new)
                self.req_block_ids[rid].extend(b.block_id for b in new)
            if self.enable_caching and min(total, request.num_tokens) // self.block_size > \
                    self._num_registered.get(rid, 0):
                self._register_full_blocks(request, blocks, total)
            return True
        if self.num_blocks_needed(request, num_new_tokens, hit) > self.pool.num_free_blocks:
            return False
        blocks = self.req_blocks.setdefault(rid, [])
        ids = self.req_block_ids.setdefault(rid, [])
        computed = request.num_computed_tokens
        if hit is not None:
            if hit.blocks:
                # Hit blocks wholly before the window are entered in the table without a
                # reference, as if taken and released at once (stale entries, never read).
                skip = (0 if self.release_window is None else
                        num_released_blocks(computed + hit.num_tokens, self.block_size, self.release_window))
                self.pool.touch(hit.blocks[skip:])
                blocks.extend(hit.blocks)
                self._num_registered[rid] = len(hit.blocks)   # cached already (or placeholders)
                if skip:
                    self._num_released[rid] = skip
            if hit.partial is not None:   # held before any allocation could take it
                self.pool.hold(hit.partial[0])
                self._held.append(hit.partial[0])
            computed += hit.num_tokens   # offload-hit blocks are allocated below, as new ones
        total = computed + num_new_tokens
        required = -(-total // self.block_size)
        if required > len(blocks):
            blocks.extend(self.pool.get_new_blocks(required - len(blocks)))
        ids.extend(b.block_id for b in blocks[len(ids):])
        if hit is not None and hit.partial is not None:
            source, num_tokens = hit.partial
            self._copies.append((source.block_id, blocks[len(hit.blocks)].block_id, num_tokens))
        if self.enable_caching and cache_blocks:
            self._register_full_blocks(request, blocks, total)
        return True

    def release_outside_window(self, request: Request) -> None:
        """Give back the request's blocks that no query from its ``num_computed_tokens`` on
        can see (no-op without a release window or blocks)."""
        blocks = self.req_blocks.get(request.request_id)
        if blocks is not None and self.release_window is not None:
            self._release_outside_window(request.request_id, blocks, request.num_computed_tokens)

    def _release_outside_window(self, rid: str, blocks: list[KVCacheBlock], num_computed: int) -> None:
        """Give back the blocks no query from ``num_computed`` on can see (registered full
        blocks stay cached in the free queue, oldest first to be evicted)."""
        start = self._num_released.get(rid, 0)
        end = num_released_blocks(num_computed, self.block_size, self.release_window)
        if end > start:
            self.pool.free_blocks(blocks[start:end])
            self._num_released[rid] = end

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds now (its table less the blocks released outside the window)."""
        return len(self.req_blocks.get(request_id, ())) - self._num_released.get(request_id, 0)

    def _register_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        rid = request.request_id
        start = self._num_registered.get(rid, 0)
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        if num_full <= start:
            return
        self.update_block_hashes(request)
        hashes, cache = request.block_hashes, self.pool.cache_full_block
        if self.pool.events is None:
            for i in range(start, num_full):
                cache(blocks[i], hashes[i])
        else:
            self._register_and_record(request, blocks, start, num_full)
        self._num_registered[rid] = num_full

    def _register_and_record(self, request: Request, blocks: list[KVCacheBlock], start: int,
                             end: int) -> None:
        """Registers blocks ``start..end - 1`` and records one ``STORED`` per run of blocks
        registered now (a block another request registered first is not this one's)."""
        hashes, cache, bs = request.block_hashes, self.pool.cache_full_block, self.block_size
        events, group = self.pool.events, self.pool.event_group
        run_start = None
        for i in range(start, end + 1):
            if i < end and cache(blocks[i], hashes[i]):
                if run_start is None:
                    run_start = i
                continue
            if run_start is not None:
                # vLLM's extra keys: the adapter's name on every block of a LoRA request,
                # then the cache salt on a chain's first block; None when neither.
                name = request.lora_request.lora_name if request.lora_request is not None else None
                lora = (name,) if name is not None else ()
                extra = [(*lora, request.cache_salt) if j == 0 and request.cache_salt else (lora or None)
                         for j in range(run_start, i)]
                events.append((STORED, group, MEDIUM_GPU, run_start,
                               hashes[run_start - 1] if run_start else None,
                               hashes[run_start:i], request.token_ids_slice(run_start * bs, i * bs),
                               extra, name))
                run_start = None

    def free(self, request: Request) -> list[int]:
        """Release a request's blocks, tail first (so its tail is evicted first).

        Returns the request's table (block ids in table order; with a release window its
        leading entries are the stale ids of blocks released earlier).
        """
        blocks = self.req_blocks.pop(request.request_id, [])
        self.req_block_ids.pop(request.request_id, None)
        self._num_registered.pop(request.request_id, None)
        released = self._num_released.pop(request.request_id, 0)
        # Blocks registered for tokens scheduled but never computed (a request preempted in
        # the very step that scheduled it) must not stay cached, nor be saved on eviction.
        for block in blocks[request.num_computed_tokens // self.block_size:]:
            self.pool.uncache(block)
        if self.donors is not None:
            self._index_donors(request, blocks, released)
        if self.explainer is not None:
            self.explainer.on_release(blocks[released:], preempted=not request.is_finished)
        self.pool.free_blocks(reversed(blocks[released:]))
        return [b.block_id for b in blocks]

    def _index_donors(self, request: Request, blocks: list[KVCacheBlock], released: int) -> None:
        """Index the blocks a request releases with the tokens whose KV it computed in them
        (blocks already indexed, e.g. shared prefix hits, are skipped: O(new blocks))."""
        bs, computed, num_hashes = self.block_size, request.num_computed_tokens, len(request.block_hashes)
        donors = self.donors
        for i in range(released, len(blocks)):
            num_tokens = min(bs, computed - i * bs)
            if num_tokens <= 0 or i > num_hashes:
                break
            block = blocks[i]
            if block is self._placeholder or donors.is_indexed(block):
                continue
            donors.add(block, context_key(request, i), request.token_ids_slice(i * bs, i * bs + num_tokens))

    def take_token_copies(self) -> list[tuple[int, int, int]]:
        """The token-granular copies (source block, destination block, tokens) listed since
        the last call, for the engine to make before the step's forward pass; gives back the
        sources' references (call once the step's admissions are done: no allocation may
        come between this and the copies)."""
        copies, self._copies = self._copies, []
        if self._held:
            self.pool.free_blocks(self._held)
            self._held = []
        return copies

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table as ids: the live list (read it, never modify it; it
        grows as blocks are allocated and is dropped when the request's blocks are freed)."""
        return self.req_block_ids.get(request_id, [])

    def group_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The tables of the other KV cache groups: none (one table serves every layer)."""
        return ()

    def reset_prefix_cache(self) -> bool:
        if not self.pool.reset_prefix_cache():
            return False
        if self.donors is not None:
            self.donors.clear()
        if self.explainer is not None:
            self.explainer.clear()
        return True

    def attach_events(self, events: KVEventLog) -> None:
        """Record the pool's changes in ``events`` (one KV cache group: index 0)."""
        self.pool.attach_events(events, 0)
