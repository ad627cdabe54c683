"""The NixlConnector's worker half, on the engine thread.

- Producer: a finished request's blocks are *held* (``start_load_kv`` sees it in the step's
  metadata) until a consumer's READ notification names it, a consumer releases it, or the
  lease (``kv_lease_duration``) ends it unread (``kvpilot:nixl_num_kv_expired_reqs``). A
  consumer pins a held request before reading; pinning moves its end to
  ``kv_read_timeout`` from then, and an expired request can no longer be pinned, so a
  consumer never reads blocks given to another request. The hold table is shared with the
  side channel's thread under a lock.
- Consumer: the step's pulls and releases go to the transfer thread (``transfer``); their
  outcomes come back as ``finished_recving`` and, for a failed read, its blocks from the
  first that did not arrive in ``failed_block_ids``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from kvpilot.engine.core.kv_connector import KVConnectorOutput
from kvpilot.engine.kv_transfer.nixl.layout import AgentInfo, Regions
from kvpilot.engine.kv_transfer.nixl.metadata import NixlStepMetadata
from kvpilot.engine.kv_transfer.nixl.settings import NixlSettings
from kvpilot.engine.kv_transfer.nixl.side_channel import SideChannelServer
from kvpilot.engine.kv_transfer.nixl.transfer import (
    Notified,
    ReadDone,
    ReadJob,
    ReleaseFailed,
    ReleaseJob,
    TransferThread,
)
from kvpilot.engine.kv_transfer.stats import KVTransferStats, TransferCounters

logger = logging.getLogger(__name__)


class HeldRequests:
    """Producer: request id -> monotonic deadline of its hold (thread-safe)."""

    def __init__(self, read_timeout: float) -> None:
        self._lock = threading.Lock()
        self._deadline: dict[str, float] = {}
        self._done: set[str] = set()     # read or released, not yet reported
        self._read_timeout = read_timeout

    def hold(self, request_id: str, seconds: float) -> None:
        with self._lock:
            self._deadline[request_id] = time.monotonic() + seconds

    def pin(self, request_ids: list[str]) -> list[bool]:
        """A consumer is about to read (side-channel thread)."""
        now = time.monotonic()
        with self._lock:
            pinned = []
            for rid in request_ids:
                ok = rid in self._deadline and rid not in self._done and self._deadline[rid] > now
                if ok:
                    self._deadline[rid] = now + self._read_timeout
                pinned.append(ok)
            return pinned

    def done(self, request_ids: list[str]) -> None:
        """Read (notified) or released: free at the next report (any thread)."""
        with self._lock:
            self._done.update(r for r in request_ids if r in self._deadline)

    def take_finished(self) -> tuple[set[str], int]:
        """The holds that ended (read, released or expired) and how many of them expired."""
        now = time.monotonic()
        with self._lock:
            expired = {rid for rid, deadline in self._deadline.items() if deadline <= now and rid not in self._done}
            finished = self._done | expired
            for rid in finished:
                del self._deadline[rid]
            self._done = set()
            return finished, len(expired)

    def __len__(self) -> int:
        with self._lock:
            return len(self._deadline)


class NixlConnectorWorker:
    """Args:
        settings: the connector's settings.
        regions, tensors: this engine's KV cache (``layout.kv_regions``).
        local_info: this engine's handshake, without the agent metadata (filled in here).
    """

    def __init__(self, settings: NixlSettings, regions: Regions, tensors, local_info: AgentInfo) -> None:
        self.settings = settings
        self.counters = TransferCounters("kv_both" if settings.producer and settings.consumer
                                         else "kv_producer" if settings.producer else "kv_consumer")
        self.held = HeldRequests(settings.read_timeout_seconds)
        self._transfer = TransferThread(settings, regions, tensors, local_info)
        self._side_channel = None
        self._reads_in_flight = 0
        if settings.producer:
            try:
                self._side_channel = SideChannelServer(
                    settings.side_channel_host, settings.side_channel_port, self._transfer.local_info.to_wire(),
                    self._transfer.agent_name, self.held.pin, self.held.done)
            except BaseException:
                self._transfer.close()
                raise
        logger.info("NixlConnector %s: %s%s", settings.engine_id, self.counters.role,
                    f", side channel {settings.side_channel_host}:{settings.side_channel_port}"
                    if settings.producer else "")

    def register_kv_caches(self, kv_caches: Any) -> None:
        return   # registered when built (``factory``): the agent needs them before its handshake

    def start_load_kv(self, metadata: NixlStepMetadata | None) -> None:
        if not metadata:
            return
        for request_id in metadata.reqs_to_send:
            self.held.hold(request_id, self.settings.lease_seconds)
        for recv in metadata.reqs_to_recv:
            self._reads_in_flight += 1
            self._transfer.submit(ReadJob(recv.request_id, recv.local_block_ids, recv.remote, recv.remote_block_ids))
        for remote in metadata.reqs_to_release:
            self._transfer.submit(ReleaseJob(remote))

    def save_kv(self, metadata: NixlStepMetadata | None) -> None:
        return   # nothing to save: a consumer reads the producer's blocks where they are

    def get_finished(self) -> KVConnectorOutput:
        output = KVConnectorOutput()
        for outcome in self._transfer.drain():
            if isinstance(outcome, ReadDone):
                self._read_done(outcome, output)
            elif isinstance(outcome, Notified):
                self.held.done(outcome.request_ids)
            elif isinstance(outcome, ReleaseFailed):
                self.counters.failed_notifications += 1
                logger.warning("could not release request %s on prefill engine %s: %s",
                               outcome.remote.request_id, outcome.remote.engine_id, outcome.error)
        if self.settings.producer:
            output.finished_sending, output.num_expired = self.held.take_finished()
            if output.num_expired:
                self.counters.expired += output.num_expired
                logger.warning("%d request(s)' KV held for a decode engine expired unread after %g s "
                               "(kv_lease_duration)", output.num_expired, self.settings.lease_seconds)
        return output

    def _read_done(self, done: ReadDone, output: KVConnectorOutput) -> None:
        self._reads_in_flight -= 1
        output.finished_recving.add(done.request_id)
        if done.error is None:
            self.counters.transferred(done.seconds, done.num_bytes, done.num_descriptors, len(done.local_blocks))
            return
        self.counters.failed_transfers += 1
        self.counters.blocks_received += done.num_arrived   # kept; the rest is recomputed or fails
        output.failed_block_ids.update(done.local_blocks[done.num_arrived:])
        output.failures[done.request_id] = f"the KV transfer from the prefill engine failed: {done.error}"
        logger.warning("request %s: KV load of %d of %d blocks failed: %s", done.request_id,
                       len(done.local_blocks) - done.num_arrived, len(done.local_blocks), done.error)

    def wait(self, timeout: float) -> None:
        self._transfer.wait(timeout)   # an outcome (a read done, a notification) wakes it early

    def stats(self) -> KVTransferStats:
        return self.counters.snapshot(len(self.held))

    def close(self) -> None:
        if self._side_channel is not None:
            self._side_channel.close()
        self._transfer.close()
