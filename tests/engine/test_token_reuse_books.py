"""Token-granular reuse keeps the block pool's books (the property test of
``test_block_accounting_property`` with reuse on): the shadow cache applies each step's
copies as the engine does (before the step's writes), and every running request's
computed positions must hold its own tokens, whether they were written, hit or copied.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from hypothesis import settings
from hypothesis.stateful import invariant

from kvpilot.engine.config import SchedulerConfig
from kvpilot.engine.core.block_hash import root_hash
from kvpilot.engine.core.kv_cache_manager import KVCacheManager
from kvpilot.engine.core.scheduler import Scheduler

# The base machine, read from its own test file (the test modules are no package).
_spec = importlib.util.spec_from_file_location(
    "block_accounting_machine", Path(__file__).with_name("test_block_accounting_property.py"))
_base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_base)
BLOCK, MAX_LEN, NUM_BLOCKS, BlockBooks = _base.BLOCK, _base.MAX_LEN, _base.NUM_BLOCKS, _base.BlockBooks

COPIED = {"copies": 0, "tokens": 0}


class TokenReuseBooks(BlockBooks):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK, enable_caching=True, hash_root=root_hash("t"),
                                 token_reuse=True, explain_misses=True)
        self.sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16,
                                               max_model_len=MAX_LEN, policy=self.POLICY), self.kv)
        schedule = self.sched.schedule

        def schedule_and_copy():
            out = schedule()
            for src, dst, n in out.kv_copies:
                assert src != dst and 0 < n < BLOCK + 1
                for offset in range(n):
                    self.slot_tokens[dst * BLOCK + offset] = self.slot_tokens[src * BLOCK + offset]
                COPIED["copies"] += 1
                COPIED["tokens"] += n
            return out

        self.sched.schedule = schedule_and_copy

    @invariant()
    def computed_positions_hold_their_own_tokens(self):
        for r in self.sched.running:
            table = self.kv.block_ids(r.request_id)
            for p in range(r.num_computed_tokens):
                slot = table[p // BLOCK] * BLOCK + p % BLOCK
                assert self.slot_tokens.get(slot) == (p, r.token_ids_slice(p, p + 1)[0]), (r.request_id, p)

    @invariant()
    def no_source_stays_held(self):
        assert not self.kv._held and not self.kv._copies


class PriorityTokenReuseBooks(TokenReuseBooks):
    POLICY = "priority"


TokenReuseBooks.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
PriorityTokenReuseBooks.TestCase.settings = TokenReuseBooks.TestCase.settings
test_token_reuse_books = TokenReuseBooks.TestCase
test_token_reuse_books_priority = PriorityTokenReuseBooks.TestCase


def test_the_books_saw_copies():
    """The runs above exercised reuse at all (a property that never copies proves nothing)."""
    if COPIED["copies"] == 0:   # run alone: drive one machine by hand
        machine = TokenReuseBooks()
        machine.add(prefix=0, keep=10, tail=0, max_tokens=2, salt=None, priority=0)
        for _ in range(6):
            machine.step()
        machine.add(prefix=0, keep=11, tail=3, max_tokens=2, salt=None, priority=0)
        machine.step()
        machine.computed_positions_hold_their_own_tokens()
    assert COPIED["copies"] > 0 and COPIED["tokens"] > 0
