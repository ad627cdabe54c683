"""One ``LLMEngine`` stepping on its own thread beside the asyncio event loop.

The engine is single-threaded and its ``step()`` blocks for a whole model forward,
so it never runs on the event loop. The event loop hands commands (add, abort) to
the engine thread through a locked deque and a condition variable; the engine
thread delivers each request's ``RequestOutput`` deltas (``RequestOutputKind.DELTA``:
what each step added) into that request's ``asyncio.Queue`` with
``loop.call_soon_threadsafe``.

NOTE (threading invariants):
- Only the engine thread touches the engine's mutable state and ``_live``; the
  event loop reads just immutable attributes (tokenizer, configs, cache info) and
  the published ``EngineStats`` snapshot.
- ``RequestOutput``s are handed to the event loop as ``step()`` returns them: the
  engine builds fresh ``outputs`` / ``token_ids`` / ``logprobs`` lists for every
  output and never appends to a list it has returned
  (``tests/server/test_async_engine.py`` checks this). The engine thread's stats
  tracker reads an output before it is delivered; after delivery it belongs to the
  consumer, which may fold later deltas into it.
- The engine thread sleeps on the condition when it has neither commands nor
  unfinished requests, so an idle server burns no CPU.
- Each iteration is one turn of the engine core (``engine/engine_core.py``:
  apply the commands, step, the failure policy), the same code as the engine core
  process runs; this thread only waits, settles the turn's outcome with the
  consumers and delivers. A step that raises fails every live request (their
  consumers see ``RequestFailed``) and the thread keeps serving; when the core
  declares the engine dead (consecutive failed steps, a failed abort), new requests
  get ``EngineDead`` and ``healthy`` turns False.
- An engine that dies for good (``EngineDeadError``: a tensor-parallel worker died)
  is dead at once: the engine's ``on_dead`` callback (another thread) turns
  ``healthy`` False and wakes the engine thread, which fails every live and queued
  request, whether or not a step was running.
- A step that runs longer than ``hang_timeout`` (a hung kernel or collective) cannot be
  interrupted, so the watchdog thread answers for it: ``stalled`` turns True (readiness
  fails, new requests get ``EngineStalled``) and every consumer waiting gets
  ``StepTimeout``; it then aborts its request, which the engine thread applies if the
  step ever returns. The watchdog reads only ``_iteration_started`` and the consumers
  registered under the lock, never the engine or ``_live``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpilot.engine.engine_core import (
    ADAPTER_NOT_FOUND,
    FAILED,
    INVALID,
    AbortRequest,
    AddRequest,
    Command,
    EngineCore,
    LoRAOutcome,
    LoRARequest,
    Rejected,
    Turn,
)
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
from kvpilot.engine.server.latency_tracker import ABORT, ERROR, IterationStats, RequestStatsTracker

if TYPE_CHECKING:
    from kvpilot.engine.llm_engine import LLMEngine
    from kvpilot.engine.outputs import RequestOutput
    from kvpilot.engine.stats import StepStats

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Queued:
    """A command on its way to the engine thread, and who waits for its outcome."""

    command: Command
    live: RequestStream | None = None                         # an add's consumer
    future: asyncio.Future | None = None             # a LoRA command's outcome, on ``loop``
    loop: asyncio.AbstractEventLoop | None = None

    def resolve(self, result=None, error: BaseException | None = None) -> None:
        def settle() -> None:
            if self.future.done():
                return
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(result)

        with contextlib.suppress(RuntimeError):   # the loop is closed: nobody waits
            self.loop.call_soon_threadsafe(settle)


# Rejected.kind -> what the refused add's consumer raises
_REJECTION = {INVALID: RequestRejected, ADAPTER_NOT_FOUND: AdapterNotFound, FAILED: RequestFailed}


class AsyncEngine(EngineClient):
    """Runs an engine on a background thread and streams outputs to asyncio consumers.

    Args:
        build_engine: constructs the engine; called on the engine thread by ``start``.
        max_waiting_requests: requests allowed to wait for a batch slot (engine
            waiting queue plus not-yet-admitted submissions); None = unbounded.
        on_ready: called on the engine thread with the built engine, before any
            request is accepted; returns the per-iteration stats recorder (or None).
        hang_timeout: seconds one engine iteration may run before the engine counts
            as stalled (None = never).
    """

    def __init__(
        self,
        build_engine: Callable[[], LLMEngine],
        *,
        max_waiting_requests: int | None = None,
        on_ready: Callable[[LLMEngine], Callable[[IterationStats], None] | None] | None = None,
        hang_timeout: float | None = None,
    ) -> None:
        super().__init__(max_waiting_requests, hang_timeout)
        self._build_engine = build_engine
        self._on_ready = on_ready
        self._commands: deque[_Queued] = deque()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._engine: LLMEngine | None = None
        self._dead = False
        self._ready = threading.Event()
        self._done = threading.Event()  # set when the engine is ready or has failed
        self._live: dict[str, RequestStream] = {}
        self._tracker = RequestStatsTracker()
        self._record: Callable[[IterationStats], None] | None = None
        # monotonic start of the engine thread's current iteration; None while it sleeps
        self._iteration_started: float | None = None
        self._consumers: dict[str, RequestStream] = {}   # request id -> its waiting consumer
        self._watcher: threading.Thread | None = None
        self._stop_watching = threading.Event()

    # ------------------------------------------------------------ life cycle

    def start(self) -> None:
        """Starts the engine thread (which builds the engine); idempotent."""
        with self._cond:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name="kvpilot-engine", daemon=True)
            self._thread.start()
            if self._hang_timeout is not None:
                self._watcher = threading.Thread(target=self._watch, name="kvpilot-engine-watchdog",
                                                 daemon=True)
                self._watcher.start()

    async def wait_ready(self) -> None:
        """Returns once the engine serves; raises the build error if it failed."""
        while not self._done.is_set():
            await asyncio.sleep(0.05)
        if self._error is not None and not self._ready.is_set():
            raise self._error

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the engine thread and fails requests still in flight."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._stop_watching.set()
        if self._watcher is not None:
            self._watcher.join(timeout)
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def healthy(self) -> bool:
        """Built, thread alive, not declared dead."""
        thread = self._thread
        return self._ready.is_set() and not self._dead and thread is not None and thread.is_alive()

    @property
    def busy_seconds(self) -> float:
        """How long the engine thread's current iteration has run (0 while it sleeps)."""
        started = self._iteration_started
        return 0.0 if started is None else time.monotonic() - started

    @property
    def view(self) -> LLMEngine:
        """The engine, for its immutable attributes (tokenizer, model_config, cache_info)."""
        if self._engine is None:
            raise EngineNotReady("the engine is still loading")
        return self._engine

    # ------------------------------------------------------------ event-loop side

    def _forget(self, request_id: str) -> None:
        with self._cond:
            self._consumers.pop(request_id, None)

    def _submit_add(self, cmd: Add) -> None:
        with self._cond:
            if self._dead or self._stopping:
                raise EngineDead(f"the engine is not serving: {self._error or 'shutting down'}")
            if not self._ready.is_set():
                raise EngineNotReady("the engine is still loading")
            if self.stalled:
                raise EngineStalled(self.stalled_message())
            self._check_queue_locked(cmd.params.n)
            self._num_pending_adds += cmd.params.n
            self._commands.append(_Queued(AddRequest(cmd.request_id, cmd.prompt_token_ids, cmd.params,
                                                     cmd.arrival_time, cmd.priority, cmd.cache_salt,
                                                     cmd.lora_name), live=cmd.live))
            self._consumers[cmd.request_id] = cmd.live
            self._cond.notify()

    def _submit_abort(self, request_id: str) -> None:
        with self._cond:
            self._commands.append(_Queued(AbortRequest(request_id)))
            self._cond.notify()

    def _submit_lora(self, op, name, path, base_model_name, future) -> None:
        with self._cond:
            if self._dead or self._stopping:
                raise EngineDead(f"the engine is not serving: {self._error or 'shutting down'}")
            if not self._ready.is_set():
                raise EngineNotReady("the engine is still loading")
            self._commands.append(_Queued(LoRARequest(None, op, name, path, base_model_name),
                                          future=future, loop=asyncio.get_running_loop()))
            self._cond.notify()

    # ------------------------------------------------------------ watchdog thread

    def _watch(self) -> None:
        """Fails the consumers of a stalled iteration, once per iteration."""
        period = min(1.0, self._hang_timeout / 4)
        failed_iteration = None
        while not self._stop_watching.wait(period):
            started = self._iteration_started
            if started is None or started == failed_iteration or not self.stalled:
                continue
            failed_iteration = started
            with self._cond:
                waiting = list(self._consumers.values())
                self._consumers.clear()
            message = self.stalled_message()
            logger.error("%s; failing %d request(s)", message, len(waiting))
            error = StepTimeout(message)
            for live in waiting:
                live.deliver(error)

    # ------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            engine = self._build_engine()
            record = self._on_ready(engine) if self._on_ready is not None else None
        except BaseException as exc:  # noqa: BLE001 - reported through wait_ready()
            logger.error("engine failed to start: %s", exc)
            self._error = exc
            self._dead = True
            self._done.set()
            return
        self._engine = engine
        self._record = record
        scheduler_config = getattr(engine, "scheduler_config", None)
        self._max_num_seqs = getattr(scheduler_config, "max_num_seqs", None)
        on_dead = getattr(engine, "on_dead", None)
        if on_dead is not None:
            on_dead(self._declare_dead)
        self._stats = engine.get_stats()
        list_loras = getattr(engine, "list_loras", None)
        if list_loras is not None:
            self._adapters = {a.name: a for a in list_loras()}
        self._ready.set()
        self._done.set()
        try:
            self._loop(engine)
        except BaseException as exc:  # noqa: BLE001 - keep the process up, report unhealthy
            logger.exception("engine thread crashed")
            self._declare_dead(exc)
        finally:
            self._iteration_started = None
            self._fail_all(EngineDead(f"the engine stopped: {self._error}" if self._error is not None
                                      else "the engine stopped"))
            self._close(engine)

    @staticmethod
    def _close(engine: LLMEngine) -> None:
        """Lets the engine finish background work (KV offload saves, disk writes)."""
        close = getattr(engine, "close", None)
        if close is None:
            return
        try:
            close()
        except Exception:  # noqa: BLE001 - shutting down anyway
            logger.exception("closing the engine failed")

    def _loop(self, engine: LLMEngine) -> None:
        core = EngineCore(engine)
        while True:
            busy = engine.has_unfinished_requests()
            with self._cond:
                while not self._commands and not busy and not self._stopping and not self._dead:
                    self._cond.wait()
                if self._stopping or self._dead:
                    return
                commands = list(self._commands)
                self._commands.clear()
            self._iteration_started = time.monotonic()
            turn = core.turn([cmd.command for cmd in commands])
            self._settle(commands, turn)
            if turn.died_in_step:
                self._declare_dead(turn.dead)
                self._fail_all(RequestFailed(f"the engine died while serving this request: {turn.dead}"))
                return
            if turn.failed_step is not None:
                self._fail_step(*turn.failed_step)
            if turn.dead is not None:
                self._declare_dead(turn.dead)
                self._publish_stats(engine, turn.num_adds)
                return
            self._fail_requests(turn.failed_alone)
            self._deliver(turn.outputs, turn.step_stats)
            self._publish_stats(engine, turn.num_adds)
            self._iteration_started = None

    def _settle(self, commands: list[_Queued], turn: Turn) -> None:
        """The consumers' side of what the turn applied, in order: an accepted add's
        consumer is registered, a refused one hears why, an abort forgets its consumer,
        a LoRA command's future resolves."""
        for queued, (_, outcome) in zip(commands, turn.applied, strict=True):
            cmd = queued.command
            if isinstance(cmd, AbortRequest):
                if self._live.pop(cmd.request_id, None) is not None:
                    self._tracker.remove(cmd.request_id, ABORT)
            elif isinstance(outcome, LoRAOutcome):
                queued.resolve(outcome.info, outcome.error)
            elif isinstance(outcome, Rejected):
                queued.live.deliver(_REJECTION[outcome.kind](outcome.message))
            else:
                self._live[cmd.request_id] = queued.live
                self._tracker.add(cmd.request_id, cmd.params.n, cmd.arrival_time, cmd.params.max_tokens)

    def _deliver(self, outputs: list[RequestOutput], step: StepStats) -> None:
        now = time.time()
        # Digest before delivering: a delivered output belongs to its consumer.
        iteration = self._tracker.on_step(outputs, now, step)
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue  # aborted meanwhile
            live.deliver(out)
            if out.finished:
                del self._live[out.request_id]
        if self._record is not None and not iteration.empty:
            try:
                self._record(iteration)
            except Exception:  # noqa: BLE001 - metrics must never stop serving
                logger.exception("recording request metrics failed")

    def _fail_requests(self, failed: list[Rejected]) -> None:
        """Fail the requests the engine failed on their own (it aborted them)."""
        for rejected in failed:
            live = self._live.pop(rejected.request_id, None)
            if live is not None:
                live.deliver(RequestRejected(rejected.message) if rejected.kind == INVALID else
                             RequestFailed(f"the engine failed while serving this request: "
                                           f"{rejected.message}"))
                self._tracker.remove(rejected.request_id, ERROR)

    def _fail_step(self, failed: list[str], message: str) -> None:
        """Fail the requests a failed step failed (the engine core aborted them)."""
        error = RequestFailed(f"the engine failed while serving this request: {message}")
        for request_id in failed:
            live = self._live.pop(request_id, None)
            if live is not None:
                live.deliver(error)
                self._tracker.remove(request_id, ERROR)

    def _declare_dead(self, exc: BaseException) -> None:
        """Mark the engine dead (from any thread) and wake the engine thread to fail what
        is in flight."""
        with self._cond:
            if self._dead and self._error is not None:
                return
            self._dead = True
            self._error = exc
            self._cond.notify_all()
        logger.error("the engine is dead: %s", exc)

    def _publish_stats(self, engine: LLMEngine, num_adds: int) -> None:
        stats = engine.get_stats()
        with self._cond:
            self._stats = stats
            self._num_pending_adds -= num_adds

    def _fail_all(self, error: BaseException) -> None:
        with self._cond:
            commands = list(self._commands)
            self._commands.clear()
            self._dead = True
        for queued in commands:
            if queued.live is not None:
                queued.live.deliver(error)
            elif queued.future is not None:
                queued.resolve(error=error)
        for live in self._live.values():
            live.deliver(error)
        self._live.clear()
