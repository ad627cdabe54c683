"""The engine core driven in the caller's own thread: ``LLM.generate`` and ``kvpilot generate``.

``run_to_completion(core, commands, on_output)`` hands ``commands`` (the adds of one batch)
to ``EngineCore.run`` through an in-process channel and returns once every request it
added has finished; each ``RequestOutput`` the core reports goes to ``on_output``. A
request the engine refuses or fails raises here (``RequestRejected``, a ValueError, when it
was the request's fault, else ``RequestFailed``) after the rest of the batch is aborted:
offline, one bad request stops the call that brought it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvpilot.engine.exceptions import (
    AdapterNotFound,
    EngineDeadError,
    KVTransferFailed,
    RequestFailed,
    RequestRejected,
)
from kvpilot.engine.runtime.messages import (
    ADAPTER_NOT_FOUND,
    INVALID,
    KV_TRANSFER_FAILED,
    AbortRequest,
    AddRequest,
    Command,
    Dead,
    LoRADone,
    Message,
    StepReport,
)

if TYPE_CHECKING:
    from kvpilot.engine.outputs import RequestOutput
    from kvpilot.engine.runtime.core import EngineCore


class _CallerChannel:
    """``EngineCore.run``'s channel when the caller's thread runs the loop: it closes once
    the batch's requests have all finished (or failed)."""

    def __init__(self, commands: list[AddRequest], on_output: Callable[[RequestOutput], None]) -> None:
        self._pending = {c.request_id for c in commands}
        self._inbox: list[Command] = list(commands)
        self._on_output = on_output
        self.error: BaseException | None = None

    def receive(self, wait: bool) -> list[Command] | None:
        inbox, self._inbox = self._inbox, []
        if inbox:
            return inbox
        if not self._pending:
            return None
        if wait:   # the engine is idle with requests of this batch unfinished: a bug
            self.error = self.error or RuntimeError(
                f"engine went idle with {len(self._pending)} requests unfinished")
            return None
        return []

    def send(self, message: Message) -> None:
        if isinstance(message, StepReport):
            self._on_report(message)
        elif isinstance(message, Dead):
            self._fail(EngineDeadError(message.message))
        elif isinstance(message, LoRADone) and message.error is not None:
            self._fail(message.error)

    send_dead = send   # the engine's on_dead callback: this thread is the only reader anyway

    def _on_report(self, report: StepReport) -> None:
        for rejected in report.rejected:
            error = (AdapterNotFound if rejected.kind == ADAPTER_NOT_FOUND else
                     RequestRejected if rejected.kind == INVALID else RequestFailed)
            self._fail(error(f"request {rejected.request_id}: {rejected.message}"))
        for failed in report.failed_alone:
            error = (RequestRejected if failed.kind == INVALID else
                     KVTransferFailed if failed.kind == KV_TRANSFER_FAILED else RequestFailed)
            self._fail(error(f"request {failed.request_id}: {failed.message}"))
        if report.failed_step is not None:
            self._fail(RequestFailed(f"an engine step failed: {report.failed_step[1]}"))
        for out in report.outputs:
            if out.request_id in self._pending:
                self._on_output(out)
                if out.finished:
                    self._pending.discard(out.request_id)

    def _fail(self, error: BaseException) -> None:
        """The first failure stops the batch: the rest is aborted, the call raises it."""
        if self.error is None:
            self.error = error
            self._inbox.extend(AbortRequest(rid) for rid in self._pending)
        self._pending.clear()


def run_to_completion(core: EngineCore, commands: list[AddRequest],
                      on_output: Callable[[RequestOutput], None]) -> None:
    """Run ``commands``' requests to the end on ``core``, in this thread (see the module
    docstring for errors)."""
    channel = _CallerChannel(commands, on_output)
    core.run(channel)
    if channel.error is not None:
        raise channel.error
