"""The API server's client of the engine core, over either channel.

``EngineClient`` runs on the event loop: ``generate`` submits a request and yields its
outputs as deltas, ``stats`` is the latest snapshot, ``check_room`` the 429 check,
``load_lora`` / ``unload_lora`` runtime adapters, ``healthy`` / ``error`` / ``stalled``
what the probes say. Commands go out once per event-loop turn, as one list; each message
from the core is handled as it arrives: a ``StepReport``'s outputs are digested by the
latency tracker (the request metrics are recorded in this process) and delivered into the
requests' queues, its rejections and failures become the consumers' exceptions.

The transport is ``thread_channel.ThreadTransport`` (the core on a thread of this process,
``--engine-in-process``) or ``zmq_channel.ProcessTransport`` (the core in its own process,
the default); this client does not know which.

Failure: a ``Dead`` message (the core's policy, a tensor-parallel worker's death, the core
process's end) marks the engine dead: every request in flight fails with ``RequestFailed``,
new ones with ``EngineDead``, /health answers 503. The one watchdog is here, at the
client's end of the channel, so that it also sees a core that cannot report on itself
(stopped, wedged): when requests are in flight and the core has reported no progress for
``hang_timeout`` seconds, the engine is ``stalled`` (readiness fails, new requests get
``EngineStalled``) and the waiting consumers get ``StepTimeout`` (and abort); the next
report ends the stall.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvpilot.engine.exceptions import (
    AdapterNotFound,
    EngineDead,
    EngineDeadError,
    EngineNotReady,
    EngineStalled,
    KVTransferFailed,
    QueueFull,
    RequestFailed,
    RequestRejected,
    StepTimeout,
)
from kvpilot.engine.runtime.latency_tracker import ABORT, ERROR, IterationStats, RequestStatsTracker
from kvpilot.engine.runtime.messages import (
    ADAPTER_NOT_FOUND,
    INVALID,
    KV_TRANSFER_FAILED,
    AbortRequest,
    AddRequest,
    Command,
    Dead,
    ExplainDone,
    ExplainPrefix,
    LoRACommand,
    LoRADone,
    Message,
    Ready,
    StartFailed,
    StepReport,
)
from kvpilot.engine.sampling_params import RequestOutputKind

if TYPE_CHECKING:
    from kvpilot.engine.engine_args import EngineArgs
    from kvpilot.engine.outputs import RequestOutput
    from kvpilot.engine.runtime.messages import CoreInfo
    from kvpilot.engine.sampling_params import SamplingParams
    from kvpilot.engine.stats import EngineStats
    from kvpilot.engine.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class Transport(Protocol):
    pid: int | None

    def start(self, loop: asyncio.AbstractEventLoop, on_message: Callable[[Message], None]) -> None:
        """Start the core; its messages reach ``on_message`` on ``loop``."""

    def send(self, commands: list[Command]) -> None: ...

    def close(self, timeout: float) -> None:
        """Stop the core (from any thread); it finishes its background work first."""


@dataclass(frozen=True, slots=True)
class EngineView:
    """The engine as the routes read it: its configs and cache layout, and this process's
    tokenizer (requests are tokenized here)."""

    args: EngineArgs
    model_config: Any
    scheduler_config: Any
    cache_info: Any
    tokenizer: Tokenizer


def build_view(info: CoreInfo) -> EngineView:
    """The view of the core's engine, with its tokenizer when it is in this process."""
    from kvpilot.engine.text.tokenizer import Tokenizer

    tokenizer = info.tokenizer or Tokenizer.from_pretrained(info.model_config.tokenizer_dir)
    return EngineView(info.engine_args, info.model_config, info.scheduler_config, info.cache_info, tokenizer)


@dataclass(slots=True)
class RequestStream:
    """A request whose consumer waits on ``queue`` (of deltas, or an exception to raise)."""

    queue: asyncio.Queue
    prompt_token_ids: list[int]


def num_waiting(stats: EngineStats | None, pending: int, max_num_seqs: int | None) -> int:
    """Sequences that will wait for a batch slot: the engine's waiting queue (one entry per
    sequence: a request with ``n`` > 1 is ``n`` of them) plus the sequences submitted that
    it has not taken in yet beyond its free batch slots. A burst arrives faster than a step
    takes; free slots count only while nothing waits in the engine (else blocks are short)."""
    if stats is None:
        return pending
    free = 0
    if stats.num_waiting_reqs == 0 and max_num_seqs is not None:
        free = max(0, max_num_seqs - stats.num_running_reqs)
    return stats.num_waiting_reqs + max(0, pending - free)


_REJECTION = {INVALID: RequestRejected, ADAPTER_NOT_FOUND: AdapterNotFound}


class EngineClient:
    """Args:
        transport: the channel to the engine core (started by ``start``).
        max_waiting_requests: sequences allowed to wait for a batch slot; None = unbounded.
        on_ready: called with the ``EngineView`` once the core serves; returns the
            per-iteration stats recorder (or None).
        hang_timeout: seconds without progress, requests in flight, before the engine
            counts as stalled (None = never).
    """

    def __init__(self, transport: Transport, *,
                 max_waiting_requests: int | None = None,
                 on_ready: Callable[[EngineView], Callable[[IterationStats], None] | None] | None = None,
                 hang_timeout: float | None = None) -> None:
        self._transport = transport
        self._max_waiting = max_waiting_requests
        self._on_ready = on_ready
        self._hang_timeout = hang_timeout
        self._lock = threading.Lock()   # stats and pending adds: read by scrapes on other threads
        self._stats: EngineStats | None = None
        self._num_pending_adds = 0
        self._num_rejected = 0   # API requests check_room refused
        self._max_num_seqs: int | None = None
        self._error: BaseException | None = None
        self._view: EngineView | None = None
        self._ready = False
        self._dead = False
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done: asyncio.Event | None = None
        self._outbox: list[Command] = []
        self._flush_scheduled = False
        self._live: dict[str, RequestStream] = {}
        self._tracker = RequestStatsTracker()
        self._record: Callable[[IterationStats], None] | None = None
        # monotonic time of the last progress report while requests are in flight
        self._last_progress: float | None = None
        # The watchdog failed a stall's requests and the core has not reported since: it
        # stays stalled (readiness 503, adds refused) even with no request left.
        self._stall_reported = False
        self._watchdog: asyncio.Task | None = None
        self._ops: dict[int, asyncio.Future] = {}
        self._next_op = 0
        # The LoRA adapters as the engine last confirmed them (name -> AdapterInfo); a name
        # leaves at once when its unload is submitted (then new requests get 404).
        self._adapters: dict = {}
        self._unloaded: set[str] = set()

    # ------------------------------------------------------------ life cycle

    def start(self) -> None:
        """Starts the core (which builds the engine); idempotent. Call on the event loop
        that will serve the requests."""
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._done = asyncio.Event()
        self._transport.start(self._loop, self._on_message)
        if self._hang_timeout is not None:
            self._watchdog = self._loop.create_task(self._watch_progress())

    async def wait_ready(self) -> None:
        """Returns once the engine serves; raises the build error if it failed."""
        while self._done is None:
            await asyncio.sleep(0.05)
        await self._done.wait()
        if not self._ready:
            raise self._error or EngineDead("the engine core stopped")

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the core and fails requests still in flight. Callable from any thread."""
        if self._loop is None or self._stopping:
            return
        self._stopping = True
        # a core still starting has no work to finish, and its start can wait minutes on
        # a kernel build: it is stopped at once rather than after ``timeout``
        self._transport.close(timeout if self._ready else 0.0)
        with contextlib.suppress(RuntimeError):   # the loop is closed already
            self._loop.call_soon_threadsafe(self._release)

    def _release(self) -> None:
        self._fail_all(EngineDead("the engine stopped"))
        if self._watchdog is not None:
            self._watchdog.cancel()
        release = getattr(self._transport, "release", None)
        if release is not None:
            release()

    @property
    def healthy(self) -> bool:
        """Built, serving, not declared dead."""
        return self._ready and not self._dead and not self._stopping

    @property
    def error(self) -> BaseException | None:
        """Why the engine failed to build or died, if it did."""
        return self._error

    @property
    def view(self) -> EngineView:
        if self._view is None:
            raise EngineNotReady("the engine is still loading")
        return self._view

    @property
    def pid(self) -> int | None:
        """The engine core's process id (this process's when it runs on a thread)."""
        return self._transport.pid

    @property
    def busy_seconds(self) -> float:
        """How long requests have been in flight without a progress report (0 when idle)."""
        last = self._last_progress
        if last is None or not (self._live or self._stall_reported):
            return 0.0
        return time.monotonic() - last

    @property
    def stalled(self) -> bool:
        """No progress for more than ``hang_timeout`` with work pending."""
        return self._hang_timeout is not None and self.busy_seconds > self._hang_timeout

    def stalled_message(self) -> str:
        return (f"the engine has made no progress for {self.busy_seconds:.1f} s with requests "
                f"pending (--engine-hang-timeout {self._hang_timeout:g})")

    async def _watch_progress(self) -> None:
        """Fails the consumers waiting on a stalled core, once per stall; they abort."""
        period = min(1.0, self._hang_timeout / 4)
        failed_at = None
        while True:
            await asyncio.sleep(period)
            if not self.stalled or self._last_progress == failed_at:
                continue
            failed_at = self._last_progress
            self._stall_reported = True
            message = self.stalled_message()
            logger.error("%s; failing %d request(s)", message, len(self._live))
            for consumer in self._live.values():
                consumer.queue.put_nowait(StepTimeout(message))

    # ------------------------------------------------------------ stats and admission

    @property
    def stats(self) -> EngineStats | None:
        """The latest stats snapshot (None before the engine is built); ``num_waiting_reqs``
        includes submissions the engine has not taken in yet beyond the free batch slots."""
        with self._lock:
            stats = self._stats
            if stats is None:
                return None
            waiting = self._num_waiting_locked() if self._num_pending_adds else stats.num_waiting_reqs
            rejected = self._num_rejected
        return dataclasses.replace(stats, num_waiting_reqs=waiting,
                                   admission_rejections_max_waiting_requests=rejected)

    def _num_waiting_locked(self, extra: int = 0) -> int:
        return num_waiting(self._stats, self._num_pending_adds + extra, self._max_num_seqs)

    def _check_queue_locked(self, num_sequences: int) -> None:
        if (self._max_waiting is not None
                and self._num_waiting_locked(num_sequences) > self._max_waiting):
            raise QueueFull(f"{self._num_waiting_locked()} sequences are waiting for a batch "
                            f"slot and this request adds {num_sequences} (the limit is "
                            f"{self._max_waiting})")

    def check_room(self, num_sequences: int) -> None:
        """QueueFull if an API request adding ``num_sequences`` sequences (its prompts × n)
        would pass the waiting bound: checked once for the whole request, before any of
        its engine requests is submitted."""
        with self._lock:
            try:
                self._check_queue_locked(num_sequences)
            except QueueFull:
                self._num_rejected += 1   # vllm:admission_rejections: one per API request
                raise

    def _check_serving(self) -> None:
        if self._dead or self._stopping:
            raise EngineDead(f"the engine is not serving: {self._error or 'shutting down'}")
        if not self._ready:
            raise EngineNotReady("the engine is still loading")

    # ------------------------------------------------------------ requests

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       *, cache_salt: str | None = None, arrival_time: float | None = None,
                       priority: int = 0, lora_name: str | None = None) -> AsyncIterator[RequestOutput]:
        """Submits a request and yields its outputs as deltas until it finishes.

        Each output holds what the request gained since the previous one (text, token
        ids, logprobs per choice; ``RequestOutputKind.DELTA``), whatever ``params``
        asked for. Deltas that pile up while the consumer is busy are folded into one,
        so a slow consumer gets fewer, larger outputs. Closing or cancelling the
        iterator before the request finishes aborts it in the engine, freeing its blocks.

        Raises (on the first iteration): EngineNotReady, EngineDead, EngineStalled,
        QueueFull, RequestRejected; later RequestFailed if the engine breaks mid-request
        (StepTimeout if it makes no progress for the hang timeout).
        """
        if params.output_kind is not RequestOutputKind.DELTA:
            params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        arrival = time.time() if arrival_time is None else arrival_time
        stream = self._submit_add(AddRequest(request_id, prompt_token_ids, params, arrival, priority,
                                             cache_salt, lora_name))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                while not isinstance(item, BaseException) and not stream.queue.empty():
                    later = stream.queue.get_nowait()
                    if isinstance(later, BaseException):
                        item = later
                    else:
                        item.add(later)
                if isinstance(item, BaseException):
                    # The engine side already forgot a failed request, not a timed-out one.
                    finished = not isinstance(item, StepTimeout)
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._submit_abort(request_id)

    def _submit_add(self, add: AddRequest) -> RequestStream:
        self._check_serving()
        with self._lock:
            if self.stalled:
                raise EngineStalled(self.stalled_message())
            self._check_queue_locked(add.params.n)
            self._num_pending_adds += add.params.n
        if not self._live:
            self._last_progress = time.monotonic()
        stream = RequestStream(asyncio.Queue(), add.prompt)
        self._live[add.request_id] = stream
        self._tracker.add(add.request_id, add.params.n, add.arrival_time, add.params.max_tokens)
        self._send(add)
        return stream

    def _submit_abort(self, request_id: str) -> None:
        if self._live.pop(request_id, None) is None:
            return
        self._tracker.remove(request_id, ABORT)
        self._send(AbortRequest(request_id))

    def _send(self, command: Command) -> None:
        """Queue a command; the queue goes out as one list at the end of this loop turn."""
        self._outbox.append(command)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        commands, self._outbox = self._outbox, []
        if not commands or self._stopping:
            return
        try:
            self._transport.send(commands)
        except Exception as exc:  # noqa: BLE001 - the requests fail, the server goes on
            logger.exception("sending %d command(s) to the engine core failed", len(commands))
            for command in commands:
                if isinstance(command, AddRequest):
                    self._fail_request(command.request_id, RequestFailed(f"{type(exc).__name__}: {exc}"))

    # ------------------------------------------------------------ LoRA adapters

    @property
    def lora_adapters(self) -> dict:
        """The served LoRA adapters by name (``kvpilot.engine.lora.registry.AdapterInfo``)."""
        return self._adapters

    def was_unloaded(self, name: str) -> bool:
        """Whether ``name`` is an adapter unloaded (and not loaded again) since start-up."""
        return name in self._unloaded

    async def load_lora(self, name: str, path: str, base_model_name: str | None = None):
        """Load a PEFT adapter in the engine; returns its ``AdapterInfo``. Raises
        RequestRejected (bad checkpoint, name taken, LoRA off), EngineNotReady / EngineDead."""
        info = await self._lora_command("load", name, path, base_model_name)
        self._adapters[name] = info
        self._unloaded.discard(name)
        return info

    async def unload_lora(self, name: str) -> None:
        """Unload an adapter: new requests for it fail at once (``AdapterNotFound``), those
        already submitted finish with it. Raises AdapterNotFound for an unknown name."""
        if name not in self._adapters:
            raise AdapterNotFound(f"The lora adapter '{name}' cannot be found.")
        del self._adapters[name]
        self._unloaded.add(name)
        await self._lora_command("unload", name, None, None)

    async def _lora_command(self, op: str, name: str, path: str | None, base_model_name: str | None):
        """Send a load / unload to the engine, in order with the requests; its result."""
        return await self._command(lambda token: LoRACommand(token, op, name, path, base_model_name))

    async def explain_prefix(self, prompt_token_ids: list[int], cache_salt: str | None = None,
                             lora_name: str | None = None) -> dict:
        """Why the prompt would miss the engine's prefix cache now (``LLMEngine.explain_prefix``);
        raises RequestRejected (an adapter not loaded), EngineNotReady / EngineDead."""
        return await self._command(lambda token: ExplainPrefix(token, prompt_token_ids, cache_salt,
                                                               lora_name))

    async def _command(self, make: Callable[[int], Command]):
        """Send the command ``make(token)`` in order with the requests; await its answer."""
        self._check_serving()
        future = self._loop.create_future()
        self._next_op += 1
        self._ops[self._next_op] = future
        self._send(make(self._next_op))
        return await future

    # ------------------------------------------------------------ messages

    def _on_message(self, message: Message) -> None:
        try:
            if isinstance(message, StepReport):
                self._on_step(message)
            elif isinstance(message, LoRADone | ExplainDone):
                future = self._ops.pop(message.token, None)
                if future is not None and not future.done():
                    if message.error is not None:
                        future.set_exception(message.error)
                    else:
                        future.set_result(message.info if isinstance(message, LoRADone)
                                          else message.explanation)
            elif isinstance(message, Dead):
                if not self._ready:
                    self._start_failed(RuntimeError(message.message))
                self._declare_dead(EngineDeadError(message.message))
            elif isinstance(message, Ready):
                self._loop.create_task(self._on_ready_message(message))
            elif isinstance(message, StartFailed):
                self._start_failed(ValueError(message.message) if message.invalid
                                   else RuntimeError(f"{message.error_type}: {message.message}"))
        except Exception:  # noqa: BLE001 - one bad message must not stop the client
            logger.exception("handling a %s from the engine core failed", type(message).__name__)

    async def _on_ready_message(self, ready: Ready) -> None:
        info = ready.info
        try:
            view = await asyncio.to_thread(build_view, info)
            record = self._on_ready(view) if self._on_ready is not None else None
        except Exception as exc:  # noqa: BLE001 - reported through wait_ready()
            self._start_failed(exc)
            return
        self._view, self._record = view, record
        self._max_num_seqs = info.scheduler_config.max_num_seqs
        self._adapters = {a.name: a for a in info.lora_adapters}
        with self._lock:
            self._stats = ready.stats
        self._ready = True
        self._done.set()
        logger.info("engine core ready (pid %d)", info.pid)

    def _start_failed(self, exc: BaseException) -> None:
        logger.error("engine failed to start: %s", exc)
        if self._error is None:
            self._error = exc
        self._dead = True
        self._done.set()

    def _on_step(self, report: StepReport) -> None:
        live, tracker = self._live, self._tracker
        for rejected in report.rejected:   # never accepted: not a request that failed
            consumer = live.pop(rejected.request_id, None)
            tracker.discard(rejected.request_id)
            if consumer is not None:
                consumer.queue.put_nowait(_REJECTION.get(rejected.kind, RequestFailed)(rejected.message))
        for failed in report.failed_alone:
            self._fail_request(failed.request_id, RequestRejected(failed.message)
                               if failed.kind == INVALID else KVTransferFailed(failed.message)
                               if failed.kind == KV_TRANSFER_FAILED else
                               RequestFailed(f"the engine failed while serving this request: "
                                             f"{failed.message}"))
        if report.failed_step is not None:
            request_ids, text = report.failed_step
            error = RequestFailed(f"the engine failed while serving this request: {text}")
            for request_id in request_ids:
                self._fail_request(request_id, error)
        outputs, consumers = [], []
        for out in report.outputs:
            consumer = live.get(out.request_id)
            if consumer is None:
                continue   # aborted meanwhile
            out.prompt_token_ids = consumer.prompt_token_ids
            outputs.append(out)
            consumers.append(consumer)
        # Digest before delivering: a delivered output belongs to its consumer.
        iteration = tracker.on_step(outputs, time.time(), report.step_stats)
        for out, consumer in zip(outputs, consumers, strict=True):
            consumer.queue.put_nowait(out)
            if out.finished:
                del live[out.request_id]
        with self._lock:
            self._stats = report.stats
            self._num_pending_adds -= report.num_adds
        self._last_progress = time.monotonic()
        self._stall_reported = False
        if self._record is not None and not iteration.empty:
            try:
                self._record(iteration)
            except Exception:  # noqa: BLE001 - metrics must never stop serving
                logger.exception("recording request metrics failed")

    def _declare_dead(self, exc: BaseException) -> None:
        """Mark the engine dead and fail every request in flight (the first reason wins)."""
        if self._stopping or (self._dead and self._error is not None):
            return
        self._dead = True
        self._error = exc
        logger.error("the engine is dead: %s", exc)
        self._fail_all(RequestFailed(f"the engine died while serving this request: {exc}"))

    def _fail_request(self, request_id: str, error: BaseException) -> None:
        consumer = self._live.pop(request_id, None)
        if consumer is not None:
            consumer.queue.put_nowait(error)
            self._tracker.remove(request_id, ERROR)

    def _fail_all(self, error: BaseException) -> None:
        ops, self._ops = self._ops, {}
        for future in ops.values():
            if not future.done():
                future.set_exception(EngineDead(str(error)))
        live, self._live = self._live, {}
        for request_id, consumer in live.items():
            consumer.queue.put_nowait(error)
            self._tracker.remove(request_id, ERROR)
