"""The API process's side of an engine core running in its own process (``core_process``).

``CoreClient`` starts the core (``python -m kvpilot.engine.server.core_process``, its
spec on stdin, the write end of stdin kept open as the core's lifeline), binds two
ZeroMQ sockets in a private directory (ipc), and serves the routes as ``AsyncEngine``
does: ``generate`` streams deltas, ``stats`` is the latest snapshot, ``healthy`` and
``error`` say whether the engine serves. Everything on this side runs on the event
loop: commands are sent once per loop turn as one list, each STEP message is decoded,
digested by the latency tracker (metrics are recorded here, in this process's
Prometheus registry) and delivered straight into the requests' queues.

Failure: a DEAD message (a tensor-parallel worker died, the engine broke) or the core
process ending (a monitor thread waits for it) marks the engine dead at once: every
request in flight fails with ``RequestFailed``, new ones with ``EngineDead``, /health
answers 503. ``shutdown`` closes the lifeline; the core finishes background work and
exits, and is terminated if it does not within the timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from kvpilot.engine.exceptions import EngineDeadError, describe_exit
from kvpilot.engine.server.core_messages import (
    ABORT,
    ADD,
    DEAD,
    LORA,
    LORA_DONE,
    LORA_NOT_FOUND,
    READY,
    START_FAILED,
    STEP,
    CoreInfo,
    decode_output,
    pack,
    unpack,
)
from kvpilot.engine.server.core_process import CoreSpec, encode_spec
from kvpilot.engine.server.engine_client import (
    AdapterNotFound,
    Add,
    EngineClient,
    EngineDead,
    EngineNotReady,
    EngineStalled,
    RequestFailed,
    RequestRejected,
    RequestStream,
    StepTimeout,
)
from kvpilot.engine.server.latency_tracker import ABORT as ABORT_REASON
from kvpilot.engine.server.latency_tracker import ERROR, IterationStats, RequestStatsTracker

if TYPE_CHECKING:
    from kvpilot.engine.engine_args import EngineArgs
    from kvpilot.engine.stats import EngineStats, StepStats
    from kvpilot.engine.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# How long after the core process ends its death is declared (messages it sent first
# are read first: they say why).
EXIT_GRACE_S = 0.05


@dataclass(frozen=True, slots=True)
class EngineView:
    """The engine as the routes read it (``state.client.view``) when it runs elsewhere:
    its configs and cache layout, and this process's own tokenizer (requests are
    tokenized here; constraints are parsed here and compiled by the core)."""

    args: EngineArgs
    model_config: Any
    scheduler_config: Any
    cache_info: Any
    tokenizer: Tokenizer


def build_view(info: CoreInfo, engine_args: EngineArgs) -> EngineView:
    """This process's tokenizer for the core's engine."""
    from kvpilot.engine.text.tokenizer import Tokenizer

    model_config = info.model_config
    tokenizer = Tokenizer.from_pretrained(model_config.tokenizer_dir)
    return EngineView(engine_args, model_config, info.scheduler_config, info.cache_info, tokenizer)


class CoreClient(EngineClient):
    """Runs the engine core in a child process and streams its outputs to asyncio consumers.

    Args:
        engine_args: what the core builds its ``LLMEngine`` from.
        max_waiting_requests: requests allowed to wait for a batch slot; None = unbounded.
        on_ready: called with the ``EngineView`` once the core serves; returns the
            per-iteration stats recorder (or None).
        hang_timeout: seconds the core may go without reporting a step while requests
            are in flight before it counts as stalled (None = never): readiness fails,
            new requests get ``EngineStalled``, the waiting ones ``StepTimeout`` (and are
            aborted), as with the in-process engine.
    """

    def __init__(self, engine_args: EngineArgs, *, max_waiting_requests: int | None = None,
                 on_ready: Callable[[EngineView], Callable[[IterationStats], None] | None] | None = None,
                 hang_timeout: float | None = None) -> None:
        super().__init__(max_waiting_requests, hang_timeout)
        # monotonic time of the last step report while requests are in flight; None when idle
        self._last_progress: float | None = None
        # The watchdog failed the requests of a stall and the core has not reported a step
        # since: it stays stalled (readiness 503, adds refused) even with no request left.
        self._stall_reported = False
        self._watchdog: asyncio.Task | None = None
        self._engine_args = engine_args
        self._on_ready = on_ready
        self._view: EngineView | None = None
        self._dead = False
        self._stopping = False
        self._ready = False
        self._done: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._process: subprocess.Popen | None = None
        self._dir: str | None = None
        self._context: zmq.Context | None = None
        self._async_context: zmq.asyncio.Context | None = None
        self._results: zmq.asyncio.Socket | None = None
        self._commands: zmq.Socket | None = None
        self._reader: asyncio.Task | None = None
        self._outbox: list[tuple] = []
        self._flush_scheduled = False
        self._live: dict[str, RequestStream] = {}
        self._tracker = RequestStatsTracker()
        self._record: Callable[[IterationStats], None] | None = None
        self._lora_ops: dict[int, asyncio.Future] = {}   # LoRA load / unload awaiting the core
        self._next_lora_op = 0

    # ------------------------------------------------------------ life cycle

    def start(self) -> None:
        """Starts the core process (which builds the engine); idempotent. Call on the
        event loop that will serve the requests."""
        if self._process is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._done = asyncio.Event()
        self._dir = tempfile.mkdtemp(prefix="kvpilot-core-")
        results_address, commands_address = (f"ipc://{self._dir}/results", f"ipc://{self._dir}/commands")
        self._async_context = zmq.asyncio.Context()
        self._results = self._async_context.socket(zmq.PULL)
        self._results.setsockopt(zmq.LINGER, 0)
        self._results.bind(results_address)
        self._context = zmq.Context()
        self._commands = self._context.socket(zmq.PUSH)
        self._commands.setsockopt(zmq.LINGER, 0)
        self._commands.setsockopt(zmq.SNDHWM, 0)   # never block the event loop
        self._commands.bind(commands_address)
        spec = CoreSpec(self._engine_args, commands_address, results_address,
                        logging.getLogger("kvpilot").getEffectiveLevel() or logging.INFO)
        # PYTHONSAFEPATH: the working directory must not shadow the standard library
        env = {**os.environ, "PYTHONSAFEPATH": "1"}
        self._process = subprocess.Popen([sys.executable, "-m", "kvpilot.engine.server.core_process"],
                                         stdin=subprocess.PIPE, env=env)
        with contextlib.suppress(BrokenPipeError):   # it died at once: the monitor says how
            self._process.stdin.write(encode_spec(spec))
            self._process.stdin.flush()
        logger.info("engine core process started (pid %d)", self._process.pid)
        self._reader = asyncio.ensure_future(self._read())
        if self._hang_timeout is not None:
            self._watchdog = asyncio.ensure_future(self._watch_progress())
        threading.Thread(target=self._watch, args=(self._process, self._loop),
                         name="kvpilot-core-monitor", daemon=True).start()

    async def wait_ready(self) -> None:
        """Returns once the engine serves; raises the build error if it failed."""
        while self._done is None:
            await asyncio.sleep(0.05)
        await self._done.wait()
        if not self._ready:
            raise self._error or EngineDead("the engine core stopped")

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the core (closing its lifeline; terminated after ``timeout``) and fails
        requests still in flight. Callable from any thread."""
        process = self._process
        if process is None or self._stopping:
            return
        self._stopping = True
        with contextlib.suppress(OSError):
            process.stdin.close()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.terminate()
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._close_channel)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def _close_channel(self) -> None:
        self._fail_all(EngineDead("the engine stopped"))
        for task in (self._reader, self._watchdog):
            if task is not None:
                task.cancel()
        for socket in (self._results, self._commands):
            if socket is not None:
                socket.close(linger=0)
        self._context.term()
        self._async_context.term()

    @property
    def healthy(self) -> bool:
        """Built, core process running, not declared dead."""
        return self._ready and not self._dead and not self._stopping

    @property
    def busy_seconds(self) -> float:
        """How long requests have been in flight without a step report (0 when idle)."""
        last = self._last_progress
        if last is None or not (self._live or self._stall_reported):
            return 0.0
        return time.monotonic() - last

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

    @property
    def view(self) -> EngineView:
        """The engine's configs, this process's tokenizer and grammar compiler."""
        if self._view is None:
            raise EngineNotReady("the engine is still loading")
        return self._view

    @property
    def pid(self) -> int | None:
        """The core process's id (None before ``start``)."""
        return self._process.pid if self._process is not None else None

    # ------------------------------------------------------------ commands

    def _submit_add(self, add: Add) -> None:
        with self._cond:
            if self._dead or self._stopping:
                raise EngineDead(f"the engine is not serving: {self._error or 'shutting down'}")
            if not self._ready:
                raise EngineNotReady("the engine is still loading")
            if self.stalled:
                raise EngineStalled(self.stalled_message())
            self._check_queue_locked(add.params.n)
            self._num_pending_adds += add.params.n
        if not self._live:
            self._last_progress = time.monotonic()
        self._live[add.request_id] = add.live
        self._tracker.add(add.request_id, add.params.n, add.arrival_time, add.params.max_tokens)
        self._send((ADD, add.request_id, add.prompt_token_ids, add.params, add.arrival_time,
                    add.priority, add.cache_salt, add.lora_name))

    def _submit_lora(self, op, name, path, base_model_name, future) -> None:
        if self._dead or self._stopping:
            raise EngineDead(f"the engine is not serving: {self._error or 'shutting down'}")
        if not self._ready:
            raise EngineNotReady("the engine is still loading")
        self._next_lora_op += 1
        self._lora_ops[self._next_lora_op] = future
        self._send((LORA, self._next_lora_op, op, name, path, base_model_name))

    def _submit_abort(self, request_id: str) -> None:
        if self._live.pop(request_id, None) is None:
            return
        self._tracker.remove(request_id, ABORT_REASON)
        self._send((ABORT, request_id))

    def _send(self, command: tuple) -> None:
        """Queue a command; the queue goes out as one message at the end of this loop turn."""
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
            self._commands.send(pack(commands), copy=False)
        except Exception as exc:  # noqa: BLE001 - the requests fail, the server goes on
            logger.exception("sending %d command(s) to the engine core failed", len(commands))
            for command in commands:
                if command[0] == ADD:
                    self._fail_request(command[1], RequestFailed(f"{type(exc).__name__}: {exc}"))

    # ------------------------------------------------------------ results

    async def _read(self) -> None:
        while True:
            message = unpack(await self._results.recv())
            kind = message[0]
            try:
                if kind == STEP:
                    self._on_step(*message[1:])
                elif kind == READY:
                    await self._on_ready_message(message[1], message[2])
                elif kind == START_FAILED:
                    _, type_name, text, is_value_error = message
                    self._on_start_failed(ValueError(text) if is_value_error
                                          else RuntimeError(f"{type_name}: {text}"))
                elif kind == DEAD:
                    self._declare_dead(EngineDeadError(message[1]))
                elif kind == LORA_DONE:
                    _, op_id, info, error = message
                    future = self._lora_ops.pop(op_id, None)
                    if future is not None and not future.done():
                        if error is not None:
                            future.set_exception(error)
                        else:
                            future.set_result(info)
            except Exception:  # noqa: BLE001 - one bad message must not stop the reader
                logger.exception("handling a %s message from the engine core failed", kind)

    async def _on_ready_message(self, info: CoreInfo, stats: EngineStats) -> None:
        try:
            view = await asyncio.to_thread(build_view, info, self._engine_args)
            record = self._on_ready(view) if self._on_ready is not None else None
        except Exception as exc:  # noqa: BLE001 - reported through wait_ready()
            self._on_start_failed(exc)
            return
        self._view, self._record = view, record
        self._max_num_seqs = info.scheduler_config.max_num_seqs
        self._adapters = {a.name: a for a in info.lora_adapters}
        with self._cond:
            self._stats = stats
        self._ready = True
        self._done.set()
        logger.info("engine core ready (pid %d)", info.pid)

    def _on_start_failed(self, exc: BaseException) -> None:
        logger.error("engine failed to start: %s", exc)
        if self._error is None:
            self._error = exc
        self._dead = True
        self._done.set()

    def _on_step(self, rows: list[tuple], stats: EngineStats, step: StepStats, num_adds: int,
                 rejected: list[tuple], failed: tuple[list[str], str] | None) -> None:
        live, tracker = self._live, self._tracker
        for request_id, is_value_error, text in rejected:
            consumer = live.pop(request_id, None)
            tracker.discard(request_id)
            if consumer is not None:
                consumer.queue.put_nowait(
                    AdapterNotFound(text) if is_value_error == LORA_NOT_FOUND
                    else RequestRejected(text) if is_value_error else RequestFailed(text))
        if failed is not None:
            request_ids, text = failed
            error = RequestFailed(f"the engine failed while serving this request: {text}")
            for request_id in request_ids:
                self._fail_request(request_id, error)
        outputs, consumers = [], []
        for row in rows:
            consumer = live.get(row[0])
            if consumer is None:
                continue   # aborted meanwhile
            outputs.append(decode_output(row, consumer.prompt_token_ids))
            consumers.append(consumer)
        # Digest before delivering: a delivered output belongs to its consumer.
        iteration = tracker.on_step(outputs, time.time(), step)
        for out, consumer in zip(outputs, consumers, strict=True):
            consumer.queue.put_nowait(out)
            if out.finished:
                del live[out.request_id]
        with self._cond:
            self._stats = stats
            self._num_pending_adds -= num_adds
        self._last_progress = time.monotonic()
        self._stall_reported = False
        if self._record is not None and not iteration.empty:
            try:
                self._record(iteration)
            except Exception:  # noqa: BLE001 - metrics must never stop serving
                logger.exception("recording request metrics failed")

    # ------------------------------------------------------------ failure

    def _watch(self, process: subprocess.Popen, loop: asyncio.AbstractEventLoop) -> None:
        """Monitor thread: report the core process's end to the event loop, a moment
        later, so that a START_FAILED or DEAD message it sent first is read first."""
        code = process.wait()
        with contextlib.suppress(RuntimeError):   # the loop is closed: nobody listens
            loop.call_soon_threadsafe(loop.call_later, EXIT_GRACE_S, self._core_exited, process, code)

    def _core_exited(self, process: subprocess.Popen, code: int) -> None:
        if self._stopping:
            return
        error = EngineDeadError(f"the engine core process (pid {process.pid}) {describe_exit(code)}")
        if not self._ready:
            self._on_start_failed(self._error or RuntimeError(str(error)))
        self._declare_dead(error)

    def _declare_dead(self, exc: BaseException) -> None:
        """Mark the engine dead and fail every request in flight (first reason wins)."""
        if self._dead and self._error is not None:
            return
        with self._cond:
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
        ops, self._lora_ops = self._lora_ops, {}
        for future in ops.values():
            if not future.done():
                future.set_exception(EngineDead(str(error)))
        live, self._live = self._live, {}
        for request_id, consumer in live.items():
            consumer.queue.put_nowait(error)
            self._tracker.remove(request_id, ERROR)
