"""Property test: random interleavings of add / step / abort / finish keep the block
pool's books straight. A shadow cache records which token every step actually writes
into which slot (from the real scheduler output and slot arithmetic), so "a cached hash
maps to a block holding exactly those tokens" is checked against what was written.
"""

from __future__ import annotations

import itertools
import random

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpilot.engine.config import SchedulerConfig
from kvpilot.engine.core.block_hash import root_hash
from kvpilot.engine.core.kv_cache_manager import KVCacheManager
from kvpilot.engine.core.request import Request, RequestStatus
from kvpilot.engine.core.scheduler import Scheduler
from kvpilot.engine.sampling_params import SamplingParams

BLOCK = 4
NUM_BLOCKS = 14
MAX_LEN = 48
PREFIXES = [[random.Random(k).randrange(50) for _ in range(24)] for k in range(3)]


class BlockBooks(RuleBasedStateMachine):
    POLICY = "fcfs"

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK, enable_caching=True, hash_root=root_hash("t"))
        self.sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16,
                                               max_model_len=MAX_LEN, policy=self.POLICY), self.kv)
        self.ids = itertools.count()
        self.slot_tokens: dict[int, tuple[int, int]] = {}   # slot -> (position, token) written
        self.hash_prefix: dict[bytes, tuple] = {}           # hash -> (salt, prefix tokens)
        self.rng = random.Random(0)

    @rule(prefix=st.integers(0, 2), keep=st.integers(0, 24), tail=st.integers(0, 12),
          max_tokens=st.integers(1, 24), salt=st.sampled_from([None, None, "tenant-b"]),
          priority=st.integers(-2, 2))
    def add(self, prefix, keep, tail, max_tokens, salt, priority):
        tokens = PREFIXES[prefix][:keep] + [self.rng.randrange(50) for _ in range(tail)]
        if not tokens:
            tokens = [1]
        max_tokens = min(max_tokens, MAX_LEN - len(tokens))
        req = Request(f"r{next(self.ids)}", tokens, SamplingParams(max_tokens=max_tokens),
                      cache_salt=salt, max_tokens=max_tokens, priority=priority,
                      arrival_time=float(len(self.sched.requests)))
        self.sched.add_request(req)

    @rule()
    def step(self):
        out = self.sched.schedule()
        self._record_hashes()
        sampled = {}
        for s in out.scheduled:
            r = s.request
            for p in range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens):
                slot = s.block_ids[p // BLOCK] * BLOCK + p % BLOCK
                self.slot_tokens[slot] = (p, r.token_ids_slice(p, p + 1)[0])
            if s.samples:
                sampled[r.request_id] = [(r.num_tokens * 7 + len(r.request_id)) % 50]
        advanced = self.sched.update_from_output(out, sampled)
        self._record_hashes()
        for r in advanced:
            if r.num_output_tokens >= r.max_tokens or r.num_tokens >= MAX_LEN:
                self.sched.finish_requests(r.request_id, RequestStatus.FINISHED_LENGTH)

    @precondition(lambda self: self.sched.requests)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.sched.requests)))
        self.sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)

    @precondition(lambda self: self.sched.running)
    @rule(data=st.data())
    def finish(self, data):
        req = data.draw(st.sampled_from(self.sched.running))
        self.sched.finish_requests(req.request_id, RequestStatus.FINISHED_STOPPED)

    def _record_hashes(self):
        for r in self.sched.requests.values():
            for i, h in enumerate(r.block_hashes):
                entry = (r.cache_salt, tuple(r.token_ids_slice(0, (i + 1) * BLOCK)))
                assert self.hash_prefix.setdefault(h, entry) == entry, "one hash, two prefixes"

    # ---- invariants, checked after every rule ------------------------------
    @invariant()
    def ref_counts_match_block_tables(self):
        refs = [0] * NUM_BLOCKS
        for blocks in self.kv.req_blocks.values():
            for b in blocks:
                refs[b.block_id] += 1
        assert [b.ref_cnt for b in self.kv.pool.blocks] == refs
        # only running requests hold blocks
        assert set(self.kv.req_blocks) <= {r.request_id for r in self.sched.running}

    @invariant()
    def free_plus_used_is_total(self):
        free = list(self.kv.pool.free_queue)
        assert len({b.block_id for b in free}) == len(free), "block twice in the free queue"
        assert len(free) == self.kv.pool.num_free_blocks
        used = [b for b in self.kv.pool.blocks if b.ref_cnt > 0]
        assert len(free) + len(used) == NUM_BLOCKS
        assert all(b.ref_cnt == 0 for b in free)

    @invariant()
    def cached_blocks_hold_their_tokens(self):
        for h, block in self.kv.pool.cached.items():
            assert block.block_hash == h
            _, prefix = self.hash_prefix[h]
            start = len(prefix) - BLOCK
            for offset in range(BLOCK):
                slot = block.block_id * BLOCK + offset
                if block.ref_cnt == 0 or slot in self.slot_tokens:
                    assert self.slot_tokens[slot] == (start + offset, prefix[start + offset])

    @invariant()
    def idle_means_all_free(self):
        if not self.sched.requests:
            assert self.kv.pool.num_free_blocks == NUM_BLOCKS
            assert all(b.ref_cnt == 0 for b in self.kv.pool.blocks)


class PriorityBlockBooks(BlockBooks):
    """Priority preemption may pick a victim already scheduled in the same step."""

    POLICY = "priority"


BlockBooks.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
PriorityBlockBooks.TestCase.settings = BlockBooks.TestCase.settings
test_block_books = BlockBooks.TestCase
test_block_books_priority = PriorityBlockBooks.TestCase


def test_blocks_scheduled_but_never_computed_do_not_stay_cached():
    """A request preempted in the step that scheduled it (priority preemption can pick an
    already-scheduled victim) had full blocks registered for tokens that were never
    computed: freeing it must drop those registrations, so neither a prefix hit nor an
    offload save on eviction can ever see that KV."""
    kv = KVCacheManager(8, BLOCK, enable_caching=True, hash_root=root_hash("t"), record_evictions=True)
    req = Request("a", list(range(10)), SamplingParams(max_tokens=4), max_tokens=4)
    assert kv.allocate_slots(req, 4)          # step 1: tokens 0..3 scheduled ...
    req.num_computed_tokens = 4                # ... and computed
    assert kv.allocate_slots(req, 6)          # step 2: tokens 4..9 scheduled, then preempted
    computed_block, uncomputed_block = kv.req_blocks["a"][0], kv.req_blocks["a"][1]
    assert uncomputed_block.block_hash in kv.pool.cached
    kv.free(req)
    assert computed_block.block_hash in kv.pool.cached
    assert uncomputed_block.block_hash is None and len(kv.pool.cached) == 1
    kv.pool.get_new_blocks(8)                 # reuse everything: only the valid block is "saved"
    evicted = [block_id for block_id, _ in kv.pool.drain_evicted()]
    assert evicted == [computed_block.block_id]
