"""The ZeroMQ publisher of KV-event batches, on its own thread (vLLM's protocol).

- PUB socket (``endpoint``): one message per engine step that changed a tier,
  ``[topic, seq, payload]`` with ``seq`` an 8-byte big-endian counter from 0 and
  ``payload`` an msgpack ``KVEventBatch`` (``wire.py``).
- ROUTER socket (``replay_endpoint``, optional): a client (REQ or DEALER) sends its start
  sequence number as 8 big-endian bytes; it gets ``[topic, seq, payload]`` for every
  buffered batch from there on (the last ``buffer_steps``), then the end marker ``[b"",
  -1 as 8 signed big-endian bytes, b""]`` (vLLM's current framing; vLLM's router rejects
  replies without the topic frame).

The step loop never waits on the publisher: ``publish`` appends the step's records to a
bounded deque (no lock, no wake-up), and when it is full keeps them (merged with the next
steps' records) until there is room, so nothing is lost and nothing stalls. The
thread owns both sockets (ZeroMQ sockets are not thread-safe), translates records into
events (``translate.py``), encodes, sends and serves replays. A PUB socket never blocks:
past ``hwm`` queued messages ZeroMQ drops them for that slow subscriber, which can ask
the replay socket for what it missed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import msgspec
import zmq

from kvpilot.engine.kv_events.config import KVEventsConfig
from kvpilot.engine.kv_events.translate import EventTranslator
from kvpilot.engine.kv_events.wire import KVEventBatch

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_IDLE_MS = 5       # how long the idle thread waits (for a replay request) before looking again
_SHUTDOWN = object()


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard, IPv6-any, ipc or inproc endpoint; connect to others."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))

# Events per published batch: a step with more (a prefix-cache reset re-announcing the
# lower tiers, a long prompt's first step) is sent as several batches, since vLLM's router
# refuses a batch of more than 4,096 events.
MAX_EVENTS_PER_BATCH = 4096


class ZmqEventPublisher:
    """Publishes each step's records as one batch.

    Args:
        config: endpoints, buffer and queue sizes, topic.
        translator: records -> events (owned by the publisher thread from now on).
        data_parallel_rank: stamped into every batch (kvpilot runs no data parallelism: 0).

    Raises ValueError when a socket cannot be bound or connected (the address in use, a
    malformed endpoint), before the engine serves anything.
    """

    def __init__(self, config: KVEventsConfig, translator: EventTranslator,
                 data_parallel_rank: int = 0) -> None:
        self.config = config
        self._translator = translator
        self._rank = data_parallel_rank
        self._topic = config.topic.encode()
        # A deque, not a queue.Queue: appending takes no lock and wakes no thread, so the
        # step loop never waits on the publisher's thread (which polls it).
        self._queue: deque = deque()
        self._pending: tuple[float, list[tuple]] | None = None   # records the queue had no room for
        self._num_handed = 0       # batches appended to the queue (step loop)
        self._num_done = 0         # batches the thread has finished with
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.num_published = 0
        self.endpoint: str | None = None          # as bound (a wildcard port resolved)
        self.replay_endpoint: str | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise ValueError(f"--kv-events-config: cannot open the event sockets "
                             f"({self._error})") from self._error

    # ---- the step loop's side ---------------------------------------------------
    @property
    def has_pending(self) -> bool:
        """Whether records wait for room in the queue (they go with the next ``publish``)."""
        return self._pending is not None

    def publish(self, ts: float, records: list[tuple]) -> None:
        """Hands one step's records (never blocks: past ``max_queue_size`` waiting batches
        they are merged into one pending batch that goes once there is room)."""
        if self._pending is not None:
            ts, earlier = self._pending
            records = earlier + records
            self._pending = None
        if not records:
            return
        if len(self._queue) >= self.config.max_queue_size:
            self._pending = (ts, records)
            return
        self._num_handed += 1
        self._queue.append((ts, records))

    def wait_published(self, timeout: float = 30.0) -> None:
        """Waits until every batch handed so far is sent (tests, shutdown)."""
        if self._pending is not None:
            ts, records = self._pending
            self._pending = None
            self._num_handed += 1
            self._queue.append((ts, records))
        deadline = time.monotonic() + timeout
        while self._num_done < self._num_handed and self._thread.is_alive():
            if time.monotonic() > deadline:
                raise TimeoutError("KV events: the publisher thread is not keeping up")
            time.sleep(0.001)

    def close(self, timeout: float = 5.0) -> None:
        """Publishes what is queued (and pending), then stops the thread and closes the sockets."""
        if not self._thread.is_alive():
            return
        try:
            self.wait_published(timeout)
        except TimeoutError:
            logger.warning("KV events: closing with batches unpublished")
        self._queue.append(_SHUTDOWN)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("KV events: the publisher thread did not stop within %.0f s", timeout)

    # ---- the publisher thread -------------------------------------------------
    def _run(self) -> None:
        ctx = zmq.Context()
        pub = replay = None
        try:
            try:
                pub, replay = self._open(ctx)
            except zmq.ZMQError as exc:
                self._error = exc
                return
            finally:
                self._ready.set()
            self._loop(pub, replay)
        finally:
            for sock in (pub, replay):
                if sock is not None:
                    sock.close(linger=0)
            ctx.term()

    def _open(self, ctx: zmq.Context) -> tuple[zmq.Socket, zmq.Socket | None]:
        pub = ctx.socket(zmq.PUB)
        replay = None
        try:
            pub.set_hwm(self.config.hwm)
            if binds(self.config.endpoint):
                pub.bind(self.config.endpoint)
                self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                pub.connect(self.config.endpoint)
                self.endpoint = self.config.endpoint
            if self.config.replay_endpoint is not None:
                replay = ctx.socket(zmq.ROUTER)
                replay.bind(self.config.replay_endpoint)
                self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError:
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)
            raise
        return pub, replay

    def _loop(self, pub: zmq.Socket, replay: zmq.Socket | None) -> None:
        encoder = msgspec.msgpack.Encoder()
        seq = 0
        while True:
            if not self._queue:
                # Idle: wait (without the GIL) for a replay request, or just a moment.
                if replay is not None:
                    if replay.poll(_IDLE_MS):
                        self._serve_replay(replay)
                else:
                    time.sleep(_IDLE_MS / 1000)
                continue
            item = self._queue.popleft()
            if item is _SHUTDOWN:
                return
            try:
                ts, records = item
                events = self._translator.translate(records)
                for start in range(0, len(events), MAX_EVENTS_PER_BATCH):
                    payload = encoder.encode(KVEventBatch(
                        ts=ts, events=events[start:start + MAX_EVENTS_PER_BATCH],
                        data_parallel_rank=self._rank))
                    pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                    self._buffer.append((seq, payload))
                    seq += 1
                    self.num_published = seq
            except Exception:  # noqa: BLE001 - events are advisory: never take the engine down
                logger.exception("KV events: a batch could not be published")
            finally:
                self._num_done += 1
            if replay is not None and replay.poll(0):
                self._serve_replay(replay)

    def _serve_replay(self, replay: zmq.Socket) -> None:
        frames = replay.recv_multipart()
        # [identity, empty delimiter, start seq] from a REQ (or a DEALER that adds the delimiter)
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV events: ignoring a malformed replay request (%d frames)", len(frames))
            return
        identity, _, start = frames
        start_seq = int.from_bytes(start, "big")
        # Each reply is [identity, delimiter, topic, seq, payload], the live message's frames
        # behind the ROUTER's two (vLLM's current framing, which vLLM's router requires);
        # the end marker has an empty topic and payload.
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                replay.send_multipart((identity, b"", self._topic, seq.to_bytes(8, "big"), payload))
        replay.send_multipart((identity, b"", b"", END_SEQ, b""))
