"""vLLM-compatible KV-cache events (``--kv-events-config``): what routers route on.

Every place a block enters or leaves a tier records one plain tuple in a
``core.kv_event_log.KVEventLog`` (the device pool: full blocks registered, hashes evicted
or dropped, prefix-cache resets; the native offload tiers: blocks put into host memory
or written to disk, and evicted there). After each step the engine calls
``KVEvents.publish_step``, which hands the step's records to the ZeroMQ publisher
(``publisher.py``); its thread turns them into vLLM's events (``translate.py``,
``wire.py``) and publishes one batch per step, with a replay socket for subscribers
that missed some. llm-d's precise prefix-cache scorer and ``vllm-router --policy
kv_aware`` consume them as they consume vLLM's.

Not announced: LMCache's tiers (its evictions cannot be observed, so consumers would keep
blocks it dropped) and disk-tier files left by an earlier run (their tokens are unknown).

May import: ``kvpilot.engine.core``, pyzmq and msgspec; never torch (it runs beside the
step loop, and the operator reads ``config``).
"""

from __future__ import annotations

import logging
import time

from kvpilot.engine.core.kv_event_log import FULL_ATTENTION, SLIDING_WINDOW, KVEventLog
from kvpilot.engine.kv_events.config import KVEventsConfig

__all__ = ["KVEvents", "KVEventsConfig", "group_specs", "start_kv_events"]

logger = logging.getLogger(__name__)


def group_specs(kv_cache_manager) -> dict[int, tuple[str, int | None]]:
    """vLLM's (kv_cache_spec_kind, sliding window) of each KV cache group of a manager."""
    groups = getattr(kv_cache_manager, "groups", None)
    if groups is not None:     # hybrid: group 0 full attention, group 1 the sliding layers
        return {i: (FULL_ATTENTION, None) if g.release_window is None
                else (SLIDING_WINDOW, g.release_window) for i, g in enumerate(groups)}
    window = kv_cache_manager.release_window
    return {0: (FULL_ATTENTION, None) if window is None else (SLIDING_WINDOW, window)}


class KVEvents:
    """The engine's side of KV events: the log its tiers record into and the publisher.

    Args:
        config: ``--kv-events-config`` (enabled, zmq publisher).
        kv_cache_manager: the scheduler's manager (plain or hybrid).
        kv_offload: the offload backend, or None.
    """

    def __init__(self, config: KVEventsConfig, kv_cache_manager, kv_offload=None) -> None:
        from kvpilot.engine.kv_events.publisher import ZmqEventPublisher
        from kvpilot.engine.kv_events.translate import EventTranslator

        self.log = KVEventLog(group_specs(kv_cache_manager))
        self.publisher = ZmqEventPublisher(
            config, EventTranslator(kv_cache_manager.block_size, self.log.group_specs))
        kv_cache_manager.attach_events(self.log)
        if kv_offload is not None:
            kv_offload.attach_events(self.log)
        logger.info("KV events: publishing on %s%s (topic %r)", self.publisher.endpoint,
                    f", replay on {self.publisher.replay_endpoint}"
                    if self.publisher.replay_endpoint else "", config.topic)

    def publish_step(self) -> None:
        """Publishes what the tiers recorded since the last call (nothing if nothing changed)."""
        records = self.log.take()
        if records or self.publisher.has_pending:
            self.publisher.publish(time.time(), records)

    def close(self) -> None:
        self.publish_step()
        self.publisher.close()


def start_kv_events(config: KVEventsConfig | None, kv_cache_manager, kv_offload=None) -> KVEvents | None:
    """The engine's KV events, or None when ``config`` does not enable them."""
    if config is None or not config.enabled:
        return None
    return KVEvents(config, kv_cache_manager, kv_offload)
