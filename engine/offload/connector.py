"""KV offload (host memory, disk, LMCache) as a KV connector: the same API another engine's
KV arrives through (``kvpilot.engine.core.kv_connector``).

- Scheduler half: at admission the offload lookup (``OffloadBase.find_hit``, which fetches
  the hit into host memory there) extends the device prefix hit; the hit is synchronous
  (loaded before the step's forward). The step's saves (blocks the pool evicted, finished
  requests' blocks, written through) and loads are listed in a ``KVTransfers``, the
  connector's metadata. A finished request's blocks are never held.
- Worker half: ``start_load_kv`` runs the transfers before the forward pass, saves first
  (an evicted block may be overwritten by that very forward); nothing is asynchronous.
"""

from __future__ import annotations

from typing import Any

from kvpilot.engine.core.block_pool import BlockPool
from kvpilot.engine.core.kv_connector import KVConnectorOutput
from kvpilot.engine.core.kv_transfer import Admission, FinishedBlocks, KVTransfers
from kvpilot.engine.core.request import Request
from kvpilot.engine.kv_transfer.base import KVConnector
from kvpilot.engine.offload.base import OffloadBase


class OffloadConnectorScheduler:
    """Args:
        offload: the backend (its lookup half).
        pool: the device block pool, whose evicted cached blocks are saved.
        block_size: tokens per block.
    """

    def __init__(self, offload: OffloadBase, pool: BlockPool, block_size: int) -> None:
        self.offload = offload
        self.pool = pool
        self.block_size = block_size
        self._transfers = KVTransfers()

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        transfers = self._transfers
        transfers.add_evicted(self.pool.drain_evicted())   # a lookup may take a block saved this step
        num_blocks = self.offload.find_hit(request, num_computed_tokens // self.block_size,
                                           transfers.pending_saves)
        return num_blocks * self.block_size, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_computed_tokens: int,
                                 num_external_tokens: int) -> None:
        start = num_computed_tokens // self.block_size
        end = start + num_external_tokens // self.block_size
        self._transfers.admissions.append(Admission(request.request_id, request.num_tokens, start,
                                                    block_ids[start:end]))

    @property
    def cache_tiers(self) -> tuple[str, ...]:
        return self.offload.cache_tiers

    def hit_tiers(self, request: Request, num_blocks: int) -> dict[str, int]:
        return self.offload.hit_tiers(request.request_id, num_blocks)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        return   # nothing is asynchronous

    def build_connector_meta(self) -> KVTransfers:
        self._transfers.add_evicted(self.pool.drain_evicted())
        transfers, self._transfers = self._transfers, KVTransfers()
        return transfers

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, None]:
        """Lists the computed full blocks for a write-through save; never holds them."""
        self.offload.forget(request.request_id)
        bs = self.block_size
        num_full = min(request.num_computed_tokens // bs, len(request.block_hashes), len(block_ids))
        if num_full:
            self._transfers.add_finished(FinishedBlocks(
                request.request_id, block_ids[:num_full], request.block_hashes[:num_full],
                request.token_ids_slice(0, num_full * bs), request.cache_salt))
        return False, None

    def request_preempted(self, request: Request) -> None:
        # its blocks are saved only if the pool evicts them
        self.offload.forget(request.request_id)

    def has_pending_work(self) -> bool:
        return False   # saves listed while idle are run by the engine at once


class OffloadConnectorWorker:
    """Runs a step's offload saves and loads before its forward pass."""

    def __init__(self, offload: OffloadBase) -> None:
        self.offload = offload

    def register_kv_caches(self, kv_caches: Any) -> None:
        return   # the backend's BlockIO was built over them

    def start_load_kv(self, metadata: KVTransfers | None) -> None:
        if metadata:
            self.offload.execute(metadata)

    def save_kv(self, metadata: KVTransfers | None) -> None:
        return   # saves run first, in start_load_kv (the forward may overwrite evicted blocks)

    def get_finished(self) -> None:
        return None

    def wait(self, timeout: float) -> None:
        return

    def close(self) -> None:
        self.offload.close()


def offload_connector(offload: OffloadBase, pool: BlockPool, block_size: int) -> KVConnector:
    """The connector over an offload backend and the device pool it serves."""
    return KVConnector("offload", OffloadConnectorScheduler(offload, pool, block_size),
                       OffloadConnectorWorker(offload))
