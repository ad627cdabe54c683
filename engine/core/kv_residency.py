"""Sampled KV block residency: how long blocks live, sit idle and wait to be reused (torch-free).

With ``--kv-cache-metrics``, a block handed out by the pool is followed with probability
``sample_rate`` (``--kv-cache-metrics-sample``) until it is handed out again, which ends
its previous life (the pool's lazy eviction). What is measured, in seconds of
``time.monotonic``:

- lifetime: from allocation to eviction;
- idle before eviction: from the last time a request released it (or took it as a
  prefix hit) to eviction;
- reuse gap: from the block's previous use (allocation or prefix hit) to a prefix hit,
  reported at the hit (a hot prefix block that is never evicted still shows its reuse).

Each hook is a dict lookup for an unsampled block, and nothing at all when the sampler
is off (the pool holds None), so the cost stays negligible.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockResidency:
    """One observation of a sampled block: its eviction (``lifetime_seconds`` and
    ``idle_seconds`` set) or a reuse (``reuse_gap_seconds`` set)."""

    lifetime_seconds: float | None = None
    idle_seconds: float | None = None
    reuse_gap_seconds: float | None = None


@dataclass(slots=True)
class _Tracked:
    allocated: float
    last_use: float
    last_release: float | None = None


class KVResidencySampler:
    """Follows a random sample of blocks through the pool's hooks.

    Args:
        sample_rate: probability (0, 1] that an allocated block is followed.
        seed: the sampling RNG's seed (one RNG per sampler; no global state).
        clock: seconds, monotonic.
    """

    def __init__(self, sample_rate: float, seed: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"kv cache metrics sample rate must be in (0, 1], got {sample_rate}")
        self.sample_rate = sample_rate
        self._rng = random.Random(seed)
        self._clock = clock
        self._tracked: dict[int, _Tracked] = {}
        self._events: list[BlockResidency] = []

    def on_allocate(self, block_id: int) -> None:
        """The pool handed ``block_id`` out: the end of its previous life, maybe a new one."""
        now = self._clock()
        old = self._tracked.pop(block_id, None)
        if old is not None:
            idle_from = old.last_release if old.last_release is not None else old.last_use
            self._events.append(BlockResidency(lifetime_seconds=now - old.allocated,
                                               idle_seconds=max(0.0, now - idle_from)))
        if self.sample_rate >= 1.0 or self._rng.random() < self.sample_rate:
            self._tracked[block_id] = _Tracked(allocated=now, last_use=now)

    def on_hit(self, block_id: int) -> None:
        """A prefix hit took the block: one reuse gap."""
        tracked = self._tracked.get(block_id)
        if tracked is None:
            return
        now = self._clock()
        self._events.append(BlockResidency(reuse_gap_seconds=now - tracked.last_use))
        tracked.last_use = now
        tracked.last_release = None

    def on_release(self, block_id: int) -> None:
        """The block's last reference was dropped (it joined the free queue)."""
        tracked = self._tracked.get(block_id)
        if tracked is not None:
            tracked.last_release = self._clock()

    def drain(self) -> list[BlockResidency]:
        """Evictions and reuses since the last call, oldest first."""
        events, self._events = self._events, []
        return events
