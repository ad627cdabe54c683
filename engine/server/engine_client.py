"""What the routes see of an engine, wherever it runs: ``generate`` as an async stream of
deltas, health, the latest stats snapshot and the waiting-queue bound.

Two clients implement it: ``AsyncEngine`` (the engine on a thread of the server's own
process, ``--engine-in-process``) and ``CoreClient`` (the engine core in its own
process, the default of ``kvpilot serve``). Each supplies how a request reaches the
engine (``_submit_add`` / ``_submit_abort``); outputs reach the request's
``asyncio.Queue`` as ``RequestOutput`` deltas or as an exception to raise.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpilot.engine.engine_core import MAX_CONSECUTIVE_STEP_FAILURES  # noqa: F401 - clients' import
from kvpilot.engine.sampling_params import RequestOutputKind

if TYPE_CHECKING:
    from kvpilot.engine.outputs import RequestOutput
    from kvpilot.engine.sampling_params import SamplingParams
    from kvpilot.engine.stats import EngineStats


class EngineNotReady(RuntimeError):
    """The engine is still being built."""


class EngineDead(RuntimeError):
    """The engine failed to build, broke down or is shutting down."""


class QueueFull(RuntimeError):
    """The waiting queue is at ``max_waiting_requests``."""


class RequestRejected(ValueError):
    """The engine refused the request (``add_request`` raised ValueError)."""


class AdapterNotFound(RequestRejected):
    """The request names a LoRA adapter the engine does not serve (any more)."""


class RequestFailed(RuntimeError):
    """The engine raised while serving the request."""


class StepTimeout(RequestFailed):
    """The engine step serving the request ran past ``hang_timeout``."""


class EngineStalled(RuntimeError):
    """A step has run past ``hang_timeout``; no request is accepted until it returns."""


@dataclass(slots=True)
class RequestStream:
    """A request whose consumer waits on ``queue`` (of deltas, or an exception to raise)."""

    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    prompt_token_ids: list[int]

    def deliver(self, item: Any) -> None:
        """Hand ``item`` over from any thread; a closed loop means nobody listens any more."""
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


@dataclass(slots=True)
class Add:
    """One request on its way to the engine."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    arrival_time: float
    live: RequestStream
    priority: int = 0
    lora_name: str | None = None


def num_waiting(stats: EngineStats | None, pending: int, max_num_seqs: int | None) -> int:
    """Sequences that will wait for a batch slot: the engine's waiting queue (one entry per
    sequence: a request with ``n`` > 1 is ``n`` of them) plus the sequences submitted that
    it has not taken in yet beyond its free batch slots. A burst arrives
    faster than a step takes; free slots count only while nothing waits in the engine
    (else blocks are short)."""
    if stats is None:
        return pending
    free = 0
    if stats.num_waiting_reqs == 0 and max_num_seqs is not None:
        free = max(0, max_num_seqs - stats.num_running_reqs)
    return stats.num_waiting_reqs + max(0, pending - free)


class EngineClient(abc.ABC):
    """The shared half of an engine client: ``generate``, ``stats``, the 429 check, the
    stall rule and the failure reason.

    Subclasses set ``_stats`` (under ``_cond``) as snapshots arrive, count the sequences
    of submitted adds (``n`` each) in ``_num_pending_adds`` until a snapshot reflects them, set ``_error`` when the engine
    fails, and implement ``busy_seconds``, ``_submit_add`` and ``_submit_abort``.
    """

    def __init__(self, max_waiting_requests: int | None, hang_timeout: float | None = None) -> None:
        self._max_waiting = max_waiting_requests
        self._hang_timeout = hang_timeout
        self._cond = threading.Condition()
        self._stats: EngineStats | None = None
        self._num_pending_adds = 0
        self._max_num_seqs: int | None = None
        self._error: BaseException | None = None
        # The LoRA adapters as the engine last confirmed them (name -> AdapterInfo); a
        # name leaves at once when its unload is submitted (then new requests get 404).
        self._adapters: dict = {}
        self._unloaded: set[str] = set()   # adapters unloaded since (their requests get 404)

    @property
    def lora_adapters(self) -> dict:
        """The served LoRA adapters by name (``kvpilot.engine.lora.registry.AdapterInfo``)."""
        return self._adapters

    async def load_lora(self, name: str, path: str, base_model_name: str | None = None):
        """Load a PEFT adapter in the engine; returns its ``AdapterInfo``. Raises
        RequestRejected (bad checkpoint, name taken, LoRA off), EngineNotReady / EngineDead."""
        info = await self._lora_command("load", name, path, base_model_name)
        self._adapters[name] = info
        self._unloaded.discard(name)
        return info

    def was_unloaded(self, name: str) -> bool:
        """Whether ``name`` is an adapter unloaded (and not loaded again) since start-up."""
        return name in self._unloaded

    async def unload_lora(self, name: str) -> None:
        """Unload an adapter: new requests for it fail at once (``AdapterNotFound``), those
        already submitted finish with it. Raises AdapterNotFound for an unknown name."""
        if name not in self._adapters:
            raise AdapterNotFound(f"The lora adapter '{name}' cannot be found.")
        del self._adapters[name]
        self._unloaded.add(name)
        await self._lora_command("unload", name, None, None)

    async def _lora_command(self, op: str, name: str, path: str | None,
                            base_model_name: str | None):
        """Send a load / unload to the engine, in order with the requests; its result."""
        future = asyncio.get_running_loop().create_future()
        self._submit_lora(op, name, path, base_model_name, future)
        return await future

    def _submit_lora(self, op: str, name: str, path: str | None, base_model_name: str | None,
                     future: asyncio.Future) -> None:
        """Hand a LoRA load / unload to the engine (from the event loop); its outcome (an
        ``AdapterInfo``, None, or an exception) resolves ``future``."""
        raise EngineNotReady("this engine client does not serve LoRA adapters")

    @property
    @abc.abstractmethod
    def busy_seconds(self) -> float:
        """How long the engine has gone without progress while it has work (0 when idle)."""

    @property
    def stalled(self) -> bool:
        """No progress for more than ``hang_timeout`` with work pending."""
        return self._hang_timeout is not None and self.busy_seconds > self._hang_timeout

    def stalled_message(self) -> str:
        return (f"the engine has made no progress for {self.busy_seconds:.1f} s with requests "
                f"pending (--engine-hang-timeout {self._hang_timeout:g})")

    @property
    def error(self) -> BaseException | None:
        """Why the engine failed to build or died, if it did."""
        return self._error

    @property
    def stats(self) -> EngineStats | None:
        """The latest stats snapshot (None before the engine is built); ``num_waiting_reqs``
        includes submissions the engine has not taken in yet beyond the free batch slots."""
        with self._cond:
            stats = self._stats
            if stats is None or not self._num_pending_adds:
                return stats
            waiting = self._num_waiting_locked()
        return dataclasses.replace(stats, num_waiting_reqs=waiting)

    def _num_waiting_locked(self, extra: int = 0) -> int:
        return num_waiting(self._stats, self._num_pending_adds + extra, self._max_num_seqs)

    def _check_queue_locked(self, num_sequences: int) -> None:
        """QueueFull if ``num_sequences`` more sequences would have to wait beyond the bound."""
        if (self._max_waiting is not None
                and self._num_waiting_locked(num_sequences) > self._max_waiting):
            raise QueueFull(f"{self._num_waiting_locked()} sequences are waiting for a batch "
                            f"slot and this request adds {num_sequences} (the limit is "
                            f"{self._max_waiting})")

    def check_room(self, num_sequences: int) -> None:
        """QueueFull if an API request adding ``num_sequences`` sequences (its prompts × n)
        would pass the waiting bound: checked once for the whole request, before any of
        its engine requests is submitted."""
        with self._cond:
            self._check_queue_locked(num_sequences)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_name: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Submits a request and yields its outputs as deltas until it finishes.

        Each output holds what the request gained since the previous one (text, token
        ids, logprobs per choice; ``RequestOutputKind.DELTA``), whatever ``params``
        asked for. Deltas that pile up while the consumer is busy are folded into one,
        so a slow consumer gets fewer, larger outputs. Closing or cancelling the
        iterator before the request finishes aborts it in the engine, freeing its blocks.

        Raises (on the first iteration): EngineNotReady, EngineDead, EngineStalled,
        QueueFull, RequestRejected; later RequestFailed if the engine breaks mid-request
        (StepTimeout if a step runs past the hang timeout).
        """
        live = RequestStream(asyncio.Queue(), asyncio.get_running_loop(), prompt_token_ids)
        if params.output_kind is not RequestOutputKind.DELTA:
            params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        self._submit_add(Add(request_id, prompt_token_ids, params, cache_salt,
                             time.time() if arrival_time is None else arrival_time, live, priority,
                             lora_name))
        finished = False
        try:
            while True:
                item = await live.queue.get()
                while not isinstance(item, BaseException) and not live.queue.empty():
                    later = live.queue.get_nowait()
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
            self._forget(request_id)
            if not finished:
                self._submit_abort(request_id)

    def _forget(self, request_id: str) -> None:  # noqa: B027 (an optional hook, not abstract)
        """The consumer of ``request_id`` stopped listening (whatever the reason)."""

    @abc.abstractmethod
    def _submit_add(self, add: Add) -> None:
        """Hand a new request to the engine (from the event loop)."""

    @abc.abstractmethod
    def _submit_abort(self, request_id: str) -> None:
        """Ask the engine to drop ``request_id`` (from the event loop)."""
