"""What a step asks the KV offload tiers to move: the offload connector's metadata.

The offload connector's scheduler half (``kvpilot.engine.offload.connector``) fills a
``KVTransfers`` while the scheduler schedules (blocks the pool evicts, blocks of requests
that finished since the last step, offload hits of requests it admits) and it travels to
the worker half in ``SchedulerOutput.kv_connector_metadata``; the offload executor copies
the blocks before the forward pass, saves first. Plain data, no tensors: the block pool
and the KV cache manager know nothing about offloading, and the executor knows nothing
about scheduling (as vLLM's KV-connector metadata separates the two).

Invariant that makes "saves first, at the start of the next forward" safe: between the
moment a block is listed here and the runner's copy, nothing writes to that device
block (blocks are written only by loads and the forward pass).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpilot.engine.core.block_hash import BlockHash


@dataclass(slots=True)
class FinishedBlocks:
    """A finished request's computed full blocks, saved write-through.

    ``token_ids`` are the tokens those blocks hold (LMCache keys its chunks on tokens).
    """

    request_id: str
    block_ids: list[int]
    block_hashes: list[BlockHash]
    token_ids: list[int]
    cache_salt: str | None


@dataclass(slots=True)
class Admission:
    """A request admitted this step after an offload lookup.

    ``block_ids`` are the device blocks, from table index ``start_block`` on, that its
    offload hit (prefetched into host memory at lookup) is loaded into; empty when the
    tiers had nothing. ``num_prompt_tokens`` counts as offload queries.
    """

    request_id: str
    num_tokens: int
    start_block: int
    block_ids: list[int]


@dataclass(slots=True)
class KVTransfers:
    """One step's offload work, in execution order: saves (evicted, finished), then loads."""

    evicted: list[tuple[int, BlockHash]] = field(default_factory=list)   # (block_id, hash)
    finished: list[FinishedBlocks] = field(default_factory=list)
    admissions: list[Admission] = field(default_factory=list)
    # Hash -> device block of every save listed above, so a lookup in the same step can
    # take a block whose save has not run yet.
    pending_saves: dict[BlockHash, int] = field(default_factory=dict)

    def add_evicted(self, evicted: list[tuple[int, BlockHash]]) -> None:
        self.evicted.extend(evicted)
        for block_id, block_hash in evicted:
            self.pending_saves.setdefault(block_hash, block_id)

    def add_finished(self, finished: FinishedBlocks) -> None:
        self.finished.append(finished)
        for block_id, block_hash in zip(finished.block_ids, finished.block_hashes, strict=True):
            self.pending_saves.setdefault(block_hash, block_id)

    def __bool__(self) -> bool:
        return bool(self.evicted or self.finished or self.admissions)
