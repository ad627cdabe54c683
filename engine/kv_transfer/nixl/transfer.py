"""The thread that owns this engine's NIXL agent: every NIXL call happens on it.

Why a thread: on one host NIXL's UCX backend reads another process's memory with a
cross-memory-attach copy inside ``transfer()``, which returns only when the bytes are here
(tens to hundreds of milliseconds for a long prompt); a producer's side channel may take
up to the handshake timeout to answer. Neither may stall the engine's steps, so the
engine thread only queues jobs (``submit``) and collects their outcomes (``drain``).

Jobs: a ``ReadJob`` (handshake with the producer if its agent is new, pin the request's
blocks over the side channel, READ them with a notification carrying the producer's
request id, which frees them there) and a ``ReleaseJob`` (tell a producer to free blocks
no one will read). Outcomes: ``ReadDone`` per read, ``Notified`` (a producer: the request
ids its readers finished with), ``ReleaseFailed``.

A read is one NIXL transfer, except under the test hook ``KVPILOT_NIXL_TEST_READ_PAUSE``
(``settings``): then several, in block order, paused between, the notification on the
last. A read that fails part-way reports how many blocks arrived before the failure
(``ReadDone.num_arrived``): the consumer keeps those and recomputes from the first that
did not.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass

from kvpilot.engine.kv_transfer.nixl import side_channel
from kvpilot.engine.kv_transfer.nixl.layout import (
    AgentInfo,
    HandshakeError,
    Regions,
    check_compatible,
    transfer_descs,
)
from kvpilot.engine.kv_transfer.nixl.settings import READ_PAUSE_ENV, NixlSettings
from kvpilot.engine.kv_transfer.params import RemotePrefill

logger = logging.getLogger(__name__)

READ_POLL_SECONDS = 0.001      # while reads are in flight
NOTIF_POLL_SECONDS = 0.005     # a producer looks for its readers' notifications


@dataclass(frozen=True, slots=True)
class ReadJob:
    request_id: str               # this engine's request
    local_blocks: list[int]
    remote: RemotePrefill
    remote_blocks: list[int]


@dataclass(frozen=True, slots=True)
class ReleaseJob:
    remote: RemotePrefill


@dataclass(frozen=True, slots=True)
class ReadDone:
    request_id: str
    local_blocks: list[int]
    error: str | None             # None: every block arrived
    seconds: float = 0.0
    num_bytes: int = 0
    num_descriptors: int = 0
    num_arrived: int = 0          # a failed read: its first blocks that arrived intact


@dataclass(frozen=True, slots=True)
class Notified:
    request_ids: list[str]


@dataclass(frozen=True, slots=True)
class ReleaseFailed:
    remote: RemotePrefill
    error: str


@dataclass(slots=True)
class _Remote:
    info: AgentInfo
    agent_name: str


@dataclass(slots=True)
class _InFlight:
    job: ReadJob
    remote: _Remote
    start: float
    handle: object = None
    posted: int = 0               # blocks of the transfers posted (the last one may be in flight)
    arrived: int = 0              # blocks of the transfers done
    num_bytes: int = 0
    num_descriptors: int = 0


def nixl_api():
    """NIXL's Python API (PyPI ``nixl-cu12``, import name ``nixl_cu12``; ``nixl`` where the
    meta-package is installed); ImportError naming the package otherwise."""
    try:
        from nixl_cu12._api import nixl_agent, nixl_agent_config
    except ImportError:
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as exc:
            raise ImportError("NixlConnector needs NVIDIA's NIXL: pip install 'kvpilot[nixl]' "
                              f"(PyPI nixl-cu12) ({exc})") from None
    return nixl_agent, nixl_agent_config


class TransferThread:
    """Args:
        settings: the connector's settings.
        regions: this engine's KV regions; ``tensors``: the memory to register.
        local_info: this engine's handshake (its own agent metadata filled in here).
    """

    def __init__(self, settings: NixlSettings, regions: Regions, tensors, local_info: AgentInfo) -> None:
        nixl_agent, nixl_agent_config = nixl_api()
        self.settings = settings
        self.regions = regions
        # Unique per process: a consumer that sees a new name at a known address redoes
        # the handshake (the producer restarted, its memory moved).
        self.agent_name = f"{settings.engine_id}:{uuid.uuid4().hex[:8]}"
        # No NIXL progress thread: NIXL's Python API runs it without a delay, a core spinning
        # for as long as the engine lives (idle included). This thread drives progress
        # instead (``check_xfer_state`` while reading, ``get_new_notifs`` on a producer);
        # measured here, 64 MiB reads over UCX (shared memory or TCP) are no slower.
        self._agent = nixl_agent(self.agent_name, nixl_agent_config(enable_prog_thread=False,
                                                                    backends=list(settings.backends)))
        self._agent.register_memory(tensors)
        self.local_info = AgentInfo(**{**local_info.to_wire(), "agent_metadata": self._agent.get_agent_metadata()})
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._outcomes: queue.SimpleQueue = queue.SimpleQueue()
        self._progress = threading.Event()
        self._remotes: dict[tuple[str, str, int], _Remote] = {}
        self._reads: dict[str, _InFlight] = {}
        self._stop = object()
        self._thread = threading.Thread(target=self._run, name="kvpilot-nixl-transfer", daemon=True)
        self._thread.start()

    # ---- the engine thread's side ---------------------------------------------------------
    def submit(self, job: ReadJob | ReleaseJob) -> None:
        self._jobs.put(job)

    def drain(self) -> list:
        outcomes = []
        while True:
            try:
                outcomes.append(self._outcomes.get_nowait())
            except queue.Empty:
                self._progress.clear()
                return outcomes

    def wait(self, timeout: float) -> None:
        """Until an outcome is posted, or ``timeout`` seconds."""
        self._progress.wait(timeout)

    def close(self) -> None:
        self._jobs.put(self._stop)
        self._thread.join(timeout=10)

    # ---- the transfer thread ---------------------------------------------------------------
    def _post(self, outcome) -> None:
        self._outcomes.put(outcome)
        self._progress.set()

    def _run(self) -> None:
        producer = self.settings.producer
        while True:
            timeout = READ_POLL_SECONDS if self._reads else NOTIF_POLL_SECONDS if producer else None
            try:
                job = self._jobs.get(timeout=timeout)
            except queue.Empty:
                job = None
            if job is self._stop:
                return
            try:
                if job is not None:
                    self._handle(job)
                self._poll_reads()
                if producer:
                    self._poll_notifs()
            except Exception:  # noqa: BLE001 - the thread must survive anything one job does
                logger.exception("NIXL transfer thread: unexpected error")

    def _handle(self, job: ReadJob | ReleaseJob) -> None:
        if isinstance(job, ReleaseJob):
            remote = job.remote
            try:
                side_channel.request(remote.host, remote.port, {"op": "release", "ids": [remote.request_id]},
                                     self.settings.handshake_timeout_seconds)
            except HandshakeError as exc:
                self._post(ReleaseFailed(remote, str(exc)))
            return
        try:
            self._start_read(job)
        except HandshakeError as exc:
            self._post(ReadDone(job.request_id, job.local_blocks, str(exc)))
        except Exception as exc:  # noqa: BLE001 - NIXL raises its own errors (a dead peer)
            self._post(ReadDone(job.request_id, job.local_blocks, f"the NIXL read failed ({type(exc).__name__}: {exc})"))

    def _start_read(self, job: ReadJob) -> None:
        ref, timeout = job.remote, self.settings.handshake_timeout_seconds
        remote = self._handshake(ref)
        answer = side_channel.request(ref.host, ref.port, {"op": "pin", "ids": [ref.request_id]}, timeout)
        if answer.get("agent") != remote.agent_name:   # a new process at the same address
            self._forget(ref)
            raise HandshakeError(f"the prefill engine {ref.engine_id!r} restarted since the handshake; "
                                 f"request {ref.request_id!r}'s KV is gone")
        if not answer["pinned"][0]:
            raise HandshakeError(f"the prefill engine {ref.engine_id!r} no longer holds request "
                                 f"{ref.request_id!r}'s KV (its hold expired, or it was released)")
        try:
            self._post_read(job, remote)
        except Exception:
            self._handle(ReleaseJob(ref))   # pinned, never read: free it there now
            raise

    def _post_read(self, job: ReadJob, remote: _Remote) -> None:
        read = _InFlight(job, remote, time.perf_counter())
        self._post_transfer(read)
        self._reads[job.request_id] = read
        self._poll_reads()   # a transfer may be done (or failed) within the call: report it now

    def _post_transfer(self, read: _InFlight) -> None:
        """Post the read's next transfer: its remaining blocks (the test hook: at most its
        block count); the producer's notification goes with the last."""
        job, num_blocks = read.job, len(read.job.local_blocks)
        end = num_blocks if self.settings.read_pause is None else min(num_blocks,
                                                                      read.posted + self.settings.read_pause[0])
        blocks = slice(read.posted, end)
        local_rows, remote_rows = transfer_descs(self.regions, job.local_blocks[blocks], read.remote.info,
                                                 job.remote_blocks[blocks])
        agent = self._agent
        read.handle = agent.initialize_xfer("READ", agent.get_xfer_descs(local_rows, self.regions.mem_type),
                                            agent.get_xfer_descs(remote_rows, read.remote.info.mem_type),
                                            read.remote.agent_name,
                                            job.remote.request_id.encode() if end == num_blocks else b"")
        read.posted = end
        read.num_bytes += int(local_rows[:, 1].sum())
        read.num_descriptors += len(local_rows)
        try:
            agent.transfer(read.handle)
        except Exception:
            with contextlib.suppress(Exception):
                agent.release_xfer_handle(read.handle)
            raise

    def _next_transfer(self, read: _InFlight) -> str | None:
        """The test hook's pause, then the read's next transfer; why it failed, or None."""
        num_blocks, seconds = len(read.job.local_blocks), self.settings.read_pause[1]
        logger.info("request %s: paused mid-read for %g s after %d of %d blocks (test hook %s)",
                    read.job.request_id, seconds, read.arrived, num_blocks, READ_PAUSE_ENV)
        time.sleep(seconds)
        try:
            self._post_transfer(read)
        except Exception as exc:  # noqa: BLE001 - NIXL raises its own errors (a peer that died)
            return f"the NIXL read failed ({type(exc).__name__}: {exc})"
        return None

    def _handshake(self, ref: RemotePrefill) -> _Remote:
        """The producer's agent, added on first contact."""
        key = (ref.engine_id, ref.host, ref.port)
        known = self._remotes.get(key)
        if known is not None:
            return known
        answer = side_channel.request(ref.host, ref.port, {"op": "meta"}, self.settings.handshake_timeout_seconds)
        info = AgentInfo.from_wire(answer["meta"])
        if info.engine_id != ref.engine_id:
            raise HandshakeError(f"the side channel at {ref.host}:{ref.port} is engine {info.engine_id!r}, "
                                 f"not {ref.engine_id!r}")
        check_compatible(self.local_info, info)
        name = self._agent.add_remote_agent(info.agent_metadata)
        remote = self._remotes[key] = _Remote(info, name.decode() if isinstance(name, bytes) else name)
        logger.info("NIXL handshake with prefill engine %s (%s:%d) done", ref.engine_id, ref.host, ref.port)
        return remote

    def _forget(self, ref: RemotePrefill) -> None:
        remote = self._remotes.pop((ref.engine_id, ref.host, ref.port), None)
        if remote is not None:
            with contextlib.suppress(Exception):   # forgetting a dead agent may fail; it is gone anyway
                self._agent.remove_remote_agent(remote.agent_name)

    def _poll_reads(self) -> None:
        for rid, read in list(self._reads.items()):
            try:
                state = self._agent.check_xfer_state(read.handle)
            except Exception as exc:  # noqa: BLE001 - a peer that died mid-read raises here
                state, error = "ERR", f"the NIXL read failed ({type(exc).__name__}: {exc})"
            else:
                error = None if state == "DONE" else "the NIXL read failed (state ERR)"
            if state == "PROC":
                continue
            with contextlib.suppress(Exception):   # a failed read's handle may not release
                self._agent.release_xfer_handle(read.handle)
            num_blocks = len(read.job.local_blocks)
            if error is None:
                read.arrived = read.posted
                if read.arrived < num_blocks:
                    error = self._next_transfer(read)
                    if error is None:
                        continue
            del self._reads[rid]
            if error is not None and read.arrived:
                error += f" after {read.arrived} of {num_blocks} blocks arrived"
            seconds = time.perf_counter() - read.start
            self._post(ReadDone(rid, read.job.local_blocks, error, seconds, read.num_bytes, read.num_descriptors,
                                read.arrived))

    def _poll_notifs(self) -> None:
        notifs = self._agent.get_new_notifs()
        ids = [msg.decode() for messages in notifs.values() for msg in messages]
        if ids:
            self._post(Notified(ids))

    @property
    def num_reads_in_flight(self) -> int:
        return len(self._reads)
