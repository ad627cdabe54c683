"""The KV-connector API's scheduler half: KV from outside this step's pool (torch-free).

One mechanism brings KV into the device pool from anywhere else, in vLLM v1's shape
(``vllm/distributed/kv_transfer/kv_connector/v1/base.py``): the KV offload tiers (host
memory, disk, LMCache) and another engine (disaggregated prefill and decode over NIXL)
are both connectors. A connector has two halves:

- the scheduler half (``KVConnectorScheduler``, here) answers at admission how many of a
  request's tokens after its device prefix hit it can supply, and whether they arrive
  within the step (offload) or asynchronously (a remote engine); hears which blocks were
  allocated for them; decides at a request's end whether its blocks are held for a
  reader elsewhere (returning the ``kv_transfer_params`` a client passes on); and builds
  each step's metadata, which travels to the worker half in ``SchedulerOutput``;
- the worker half (``kvpilot.engine.kv_transfer.base.KVConnectorWorker``) owns the
  transfers: it registers the KV cache, starts the step's loads before the forward,
  saves after it, and reports (``KVConnectorOutput``) which async loads and held sends
  finished and which block loads failed.

The scheduler's bookkeeping of requests whose KV is in flight (``WAITING_FOR_REMOTE_KVS``)
and of finished requests whose blocks a connector holds is ``connector_state``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from kvpilot.engine.core.request import Request

# The tier a connector's tokens come from (vLLM's ``CacheHitSource`` names, the ``source``
# label of vllm:prompt_tokens_cached_by_source): the offload tiers' host memory and disk,
# or a store that does not say (LMCache, another engine over NIXL).
HOST, DISK, EXTERNAL_UNSPECIFIED = "host", "disk", "external_unspecified"


@dataclass(slots=True)
class KVConnectorOutput:
    """What the worker half reports since its previous report.

    ``finished_sending``: finished requests whose held blocks may be freed (read by the
    remote engine, released by it, or expired). ``finished_recving``: requests whose
    async load ended, successfully or not. ``failed_block_ids``: device blocks whose
    load failed (reported no later than their request's ``finished_recving``), with
    ``failures`` saying why per request. ``num_expired``: of ``finished_sending``, held
    sends freed by their timeout.
    """

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_block_ids: set[int] = field(default_factory=set)
    failures: dict[str, str] = field(default_factory=dict)
    num_expired: int = 0

    def __bool__(self) -> bool:
        return bool(self.finished_sending or self.finished_recving or self.failed_block_ids)


class KVConnectorScheduler(Protocol):
    """The scheduler half of a KV connector (see the module docstring)."""

    # The tiers ``hit_tiers`` may name (the engine reports a counter for each).
    cache_tiers: tuple[str, ...]

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens after the first ``num_computed_tokens`` (the device prefix hit, whole
        blocks) that the connector supplies, in whole blocks, leaving the prompt's last
        token to compute; and whether they arrive asynchronously (between steps). None:
        not known yet, ask again at a later step (the request keeps its place)."""

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_computed_tokens: int, num_external_tokens: int) -> None:
        """``request`` was admitted: ``block_ids`` is its block table (read it, never keep
        it), whose blocks from ``num_computed_tokens // block_size`` on receive the
        ``num_external_tokens`` the connector promised (0: nothing to load)."""

    def hit_tiers(self, request: Request, num_blocks: int) -> dict[str, int]:
        """The first ``num_blocks`` blocks the connector supplied to ``request`` (at its
        first admission) by the tier that served them (``HOST``, ``DISK``,
        ``EXTERNAL_UNSPECIFIED``)."""

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """What the worker half reported (before the scheduler applies it)."""

    def build_connector_meta(self) -> Any:
        """The work the worker half does this step (None: nothing); resets what was listed."""

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """``request`` finished (or was aborted), its blocks not yet freed: whether the
        connector now holds them (freed once a ``KVConnectorOutput`` lists the request in
        ``finished_sending`` or ``finished_recving``), and the ``kv_transfer_params`` to
        return to the client (None: none)."""

    def request_preempted(self, request: Request) -> None:
        """``request`` was preempted (its blocks are freed now)."""

    def has_pending_work(self) -> bool:
        """Whether the connector has transfers listed or in flight that need steps."""
