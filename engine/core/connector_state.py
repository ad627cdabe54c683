"""The scheduler's bookkeeping of a KV connector's requests (torch-free).

Three kinds of request live here, outside the running list and the waiting queue:

- *parked* (``WAITING_FOR_REMOTE_KVS``, vLLM's state): admitted with an asynchronous load
  (another engine's blocks on their way). Their blocks are allocated, the blocks the load
  fills are not registered in the prefix cache yet, and they take no token budget and no
  batch slot: a step never waits for them.
- *resumed*: their load ended; they are back at the front of the waiting queue with
  ``num_computed_tokens`` covering what arrived, and are admitted on their held blocks
  (no second prefix lookup).
- *held*: finished requests whose blocks the connector keeps (a remote engine reads them,
  or a load still lands in them after an abort), freed when the connector says so.

A load whose blocks failed either recomputes from the first failed block (policy
``recompute``) or fails the request (``fail``, vLLM's default): ``apply`` returns those.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvpilot.engine.core.kv_cache_manager import PrefixHit
from kvpilot.engine.core.kv_connector import KVConnectorOutput, KVConnectorScheduler
from kvpilot.engine.core.request import Request, RequestStatus

RECOMPUTE = "recompute"


@dataclass(slots=True)
class Parked:
    """A request admitted with an async load: ``num_local_tokens`` hit the device cache,
    ``num_external_tokens`` (whole blocks right after them) are on their way."""

    request: Request
    num_local_tokens: int
    num_external_tokens: int
    num_loaded_tokens: int = 0    # set when the load ends: what arrived intact


@dataclass(slots=True)
class Applied:
    """What a connector report changes for the scheduler."""

    resumed: list[Request] = field(default_factory=list)         # back to the waiting queue
    failed: list[tuple[Request, str]] = field(default_factory=list)   # policy "fail": end them
    freed: list[Request] = field(default_factory=list)           # held blocks to free now


class ConnectorState:
    """Args:
        connector: the scheduler half.
        block_size: tokens per block.
        block_table: a request's block table by id (the KV cache manager's ``block_ids``).
        load_failure_policy: ``recompute`` or ``fail`` (a block load that failed).
    """

    def __init__(self, connector: KVConnectorScheduler, block_size: int,
                 block_table: Callable[[str], list[int]], load_failure_policy: str = RECOMPUTE) -> None:
        self.connector = connector
        self.block_size = block_size
        self.block_table = block_table
        self.recompute = load_failure_policy == RECOMPUTE
        self.parked: dict[str, Parked] = {}
        self.resumed: dict[str, Parked] = {}
        self.held: dict[str, Request] = {}
        self.num_expired = 0          # held sends freed by their timeout (cumulative)
        self.num_failed_loads = 0     # requests whose async load failed in part or whole
        self.num_recomputed_tokens = 0   # tokens whose load failed and were computed instead

    # ---- admission ---------------------------------------------------------------------
    def lookup(self, request: Request, hit: PrefixHit) -> bool | None:
        """Extends ``hit`` with what the connector supplies; whether that arrives
        asynchronously (None: the connector cannot tell yet, pass the request over)."""
        # whole blocks: a token-granular reuse of the next block is not the connector's
        num_external, load_async = self.connector.get_num_new_matched_tokens(
            request, len(hit.blocks) * self.block_size)
        if num_external is None:
            return None
        if num_external:
            hit.extend_with_offload(num_external // self.block_size, self.block_size)
        return load_async and num_external > 0

    def allocated(self, request: Request, hit: PrefixHit, block_ids: list[int]) -> None:
        external = hit.num_offload_blocks * self.block_size
        self.connector.update_state_after_alloc(request, block_ids, hit.num_tokens - external, external)

    def park(self, request: Request, hit: PrefixHit) -> None:
        external = hit.num_offload_blocks * self.block_size
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.num_computed_tokens = hit.num_tokens - external
        self.parked[request.request_id] = Parked(request, hit.num_tokens - external, external)

    # ---- a request's end ------------------------------------------------------------------
    def release(self, request: Request, block_ids: list[int]) -> bool:
        """Tell the connector ``request`` leaves (finished, aborted or preempted); True
        when it holds the blocks (do not free them now)."""
        rid = request.request_id
        self.parked.pop(rid, None)
        self.resumed.pop(rid, None)
        if not request.is_finished:
            self.connector.request_preempted(request)
            return False
        hold, params = self.connector.request_finished(request, block_ids)
        request.kv_transfer_params_out = params
        if hold:
            self.held[rid] = request
        return hold

    # ---- the worker half's report ------------------------------------------------------------
    def apply(self, output: KVConnectorOutput) -> Applied:
        applied = Applied()
        self.connector.update_connector_output(output)
        self.num_expired += output.num_expired
        for rid in output.finished_sending | output.finished_recving:
            request = self.held.pop(rid, None)
            if request is not None:
                applied.freed.append(request)
        for rid in output.finished_recving:
            parked = self.parked.pop(rid, None)
            if parked is None:
                continue
            request = parked.request
            loaded = self._loaded_tokens(parked, output.failed_block_ids)
            if loaded < parked.num_external_tokens:
                self.num_failed_loads += 1
                if not self.recompute:
                    reason = output.failures.get(rid, "a KV block load failed")
                    applied.failed.append((request, reason))
                    continue
                self.num_recomputed_tokens += parked.num_external_tokens - loaded
            parked.num_loaded_tokens = loaded
            request.num_computed_tokens = parked.num_local_tokens + loaded
            request.status = RequestStatus.WAITING
            self.resumed[rid] = parked
            applied.resumed.append(request)
        return applied

    def _loaded_tokens(self, parked: Parked, failed_block_ids: set[int]) -> int:
        """Tokens of the load that arrived intact: up to its first failed block."""
        if not failed_block_ids:
            return parked.num_external_tokens
        bs = self.block_size
        first, count = parked.num_local_tokens // bs, parked.num_external_tokens // bs
        table = self.block_table(parked.request.request_id)
        for i in range(first, first + count):
            if table[i] in failed_block_ids:
                return (i - first) * bs
        return parked.num_external_tokens

    @property
    def num_parked(self) -> int:
        return len(self.parked)

    def has_pending_work(self) -> bool:
        return bool(self.parked or self.held) or self.connector.has_pending_work()
