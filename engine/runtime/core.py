"""The engine core: the one loop that steps the engine, for every way of running it.

``EngineCore.run(channel)`` is the loop: take the commands that arrived (adds, aborts, LoRA
loads and unloads, in arrival order), apply them, step the engine once if it has work,
report what happened, and wait when there is nothing to do. The server's engine thread
(``thread_channel``), the engine core process (``zmq_channel``), ``LLM.generate`` and
``kvpilot generate`` (``inproc``) all run it; they differ only in their channel.

The failure policy, applied in ``turn``:

- a step that raises fails every request in flight (the core aborts them) and the core
  keeps serving; ``MAX_CONSECUTIVE_STEP_FAILURES`` failed steps in a row, or an abort
  that itself fails, make the engine dead;
- an ``EngineDeadError`` from the step (a tensor-parallel worker died) makes it dead at
  once, and so does the engine's own ``on_dead`` report, from another thread, even
  while a step is blocked;
- a request a step failed for on its own (``LLMEngine.take_failed_requests``) fails
  alone, as a refused add does: ``INVALID`` when it was the request's fault (a grammar
  that did not compile), else ``FAILED``.

The core never calls back into a client: a turn's outcome goes out as a message
(``messages``), and the client turns it into its consumers' results and errors.
Watching for a core that makes no progress is the client's (``client.EngineClient``):
a stopped or wedged core cannot report its own hang.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kvpilot.engine.exceptions import (
    AdapterNotFound,
    EngineDeadError,
    RequestFailed,
    RequestRejected,
)
from kvpilot.engine.lora.registry import LoRANotFoundError
from kvpilot.engine.runtime.messages import (
    ADAPTER_NOT_FOUND,
    FAILED,
    INVALID,
    KV_TRANSFER_FAILED,
    MAX_CONSECUTIVE_STEP_FAILURES,
    AbortRequest,
    AddRequest,
    Command,
    Dead,
    ExplainDone,
    ExplainPrefix,
    LoRACommand,
    LoRADone,
    Message,
    Rejected,
    StepReport,
)

if TYPE_CHECKING:
    from kvpilot.engine.llm_engine import LLMEngine
    from kvpilot.engine.outputs import RequestOutput
    from kvpilot.engine.stats import StepStats

logger = logging.getLogger(__name__)


class CoreChannel(Protocol):
    """The core's end of a channel."""

    def receive(self, wait: bool) -> list[Command] | None:
        """The commands that arrived since the last call; with ``wait`` (the engine is
        idle) block until there is one. None: the channel closed, the loop ends."""

    def send(self, message: Message) -> None:
        """Deliver ``message`` to the client (from the loop's thread)."""

    def send_dead(self, message: Dead) -> None:
        """Deliver ``message`` from any thread, even while the loop is blocked in a step."""


@dataclass(slots=True)
class Turn:
    """What one turn did, in the order it happened."""

    applied: list[tuple[Command, Rejected | LoRADone | ExplainDone | None]] = field(default_factory=list)
    num_adds: int = 0                # sequences added (``n`` per accepted or refused add)
    num_aborts: int = 0
    stepped: bool = False
    outputs: list[RequestOutput] = field(default_factory=list)
    failed_alone: list[Rejected] = field(default_factory=list)   # accepted, then failed alone
    failed_step: tuple[list[str], str] | None = None   # every request a failed step failed
    step_stats: StepStats | None = None
    dead: BaseException | None = None   # the engine can never serve again
    died_in_step: bool = False          # dead by EngineDeadError (a worker died), not by policy

    @property
    def rejected(self) -> list[Rejected]:
        return [outcome for _, outcome in self.applied if isinstance(outcome, Rejected)]

    @property
    def eventful(self) -> bool:
        """Whether a client has anything to learn from this turn."""
        return bool(self.stepped or self.num_adds or self.num_aborts or self.failed_alone
                    or self.failed_step)


class EngineCore:
    """The loop and the failure policy over one engine (not owned: the caller closes it)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._consecutive_failures = 0
        self.dead: BaseException | None = None
        self._channel: CoreChannel | None = None
        engine.on_dead(self._on_dead)

    def run(self, channel: CoreChannel) -> None:
        """Serve ``channel`` until it closes or the engine dies."""
        if self.dead is not None:
            channel.send(Dead(describe(self.dead)))
            return
        self._channel = channel
        try:
            self._loop(channel)
        finally:
            self._channel = None

    def _on_dead(self, exc: BaseException) -> None:
        """The engine's death, reported from another thread (maybe while a step is blocked)."""
        channel = self._channel
        if channel is not None:
            channel.send_dead(Dead(str(exc)))

    def _loop(self, channel: CoreChannel) -> None:
        engine = self.engine
        while True:
            commands = channel.receive(wait=not engine.has_unfinished_requests())
            if commands is None:
                return
            turn = self.turn(commands)
            for _, outcome in turn.applied:
                if isinstance(outcome, LoRADone | ExplainDone):
                    channel.send(outcome)
            if turn.died_in_step:
                channel.send(Dead(str(turn.dead)))
                return
            if turn.eventful:   # a dead engine's last failed step is reported before its death
                channel.send(self.report(turn))
            if turn.dead is not None:
                channel.send(Dead(describe(turn.dead)))
                return

    def report(self, turn: Turn) -> StepReport:
        return StepReport(turn.outputs, self.engine.get_stats(), turn.step_stats, turn.num_adds,
                          turn.rejected, turn.failed_alone, turn.failed_step)

    def turn(self, commands: list[Command]) -> Turn:
        """Apply ``commands`` in order, then step once if the engine has work."""
        turn = Turn()
        self._apply(commands, turn)
        if self.engine.has_unfinished_requests():
            turn.stepped = True
            self._step(turn)
            if turn.died_in_step:
                self.dead = turn.dead
                return turn
        turn.failed_alone = [Rejected(f.request_id, INVALID if f.invalid else
                                      KV_TRANSFER_FAILED if f.kv_transfer else FAILED, f.message)
                             for f in self.engine.take_failed_requests()]
        turn.step_stats = self.engine.take_step_stats()
        if turn.dead is not None:
            self.dead = turn.dead
        return turn

    def _apply(self, commands: list[Command], turn: Turn) -> None:
        engine = self.engine
        aborts: list[str] = []
        for cmd in commands:
            if isinstance(cmd, AbortRequest):
                aborts.append(cmd.request_id)
                turn.applied.append((cmd, None))
                continue
            if aborts:   # in order: what was aborted before an add or a LoRA command goes first
                engine.abort_request(aborts)
                turn.num_aborts += len(aborts)
                aborts = []
            if isinstance(cmd, LoRACommand):
                turn.applied.append((cmd, self._lora(cmd)))
                continue
            if isinstance(cmd, ExplainPrefix):
                turn.applied.append((cmd, self._explain(cmd)))
                continue
            turn.num_adds += cmd.params.n
            turn.applied.append((cmd, self._add(cmd)))
        if aborts:
            engine.abort_request(aborts)
            turn.num_aborts += len(aborts)

    def _add(self, cmd: AddRequest) -> Rejected | None:
        try:
            self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params,
                                    arrival_time=cmd.arrival_time, priority=cmd.priority,
                                    cache_salt=cmd.cache_salt, lora_name=cmd.lora_name)
        except LoRANotFoundError as exc:
            return Rejected(cmd.request_id, ADAPTER_NOT_FOUND, str(exc))
        except ValueError as exc:
            return Rejected(cmd.request_id, INVALID, str(exc))
        except Exception as exc:  # noqa: BLE001 - a broken add fails only this request
            logger.exception("add_request failed for %s", cmd.request_id)
            return Rejected(cmd.request_id, FAILED, describe(exc))
        return None

    def _lora(self, cmd: LoRACommand) -> LoRADone:
        """A load returns the new adapter's ``AdapterInfo``; the error is what the client raises."""
        engine = self.engine
        try:
            if cmd.op == "load":
                engine.add_lora(cmd.name, cmd.path, cmd.base_model_name)
                return LoRADone(cmd.token, next(a for a in engine.list_loras() if a.name == cmd.name), None)
            if cmd.op == "unload":
                engine.remove_lora(cmd.name)
                return LoRADone(cmd.token, None, None)
            raise ValueError(f"unknown LoRA command {cmd.op!r}")
        except LoRANotFoundError as exc:
            return LoRADone(cmd.token, None, AdapterNotFound(str(exc)))
        except ValueError as exc:
            return LoRADone(cmd.token, None, RequestRejected(str(exc)))
        except Exception as exc:  # noqa: BLE001 - a broken load fails only the command
            logger.exception("LoRA %s of %r failed", cmd.op, cmd.name)
            return LoRADone(cmd.token, None, RequestFailed(describe(exc)))

    def _explain(self, cmd: ExplainPrefix) -> ExplainDone:
        try:
            return ExplainDone(cmd.token, self.engine.explain_prefix(
                cmd.prompt, cache_salt=cmd.cache_salt, lora_name=cmd.lora_name), None)
        except ValueError as exc:
            return ExplainDone(cmd.token, None, RequestRejected(str(exc)))
        except Exception as exc:  # noqa: BLE001 - a broken explanation fails only itself
            logger.exception("explaining a prefix-cache miss failed")
            return ExplainDone(cmd.token, None, RequestFailed(describe(exc)))

    def _step(self, turn: Turn) -> None:
        engine = self.engine
        try:
            turn.outputs = engine.step()
            self._consecutive_failures = 0
            return
        except EngineDeadError as exc:
            logger.error("engine died; failing %d request(s): %s",
                         engine.get_num_unfinished_requests(), exc)
            turn.dead, turn.died_in_step = exc, True
            return
        except Exception as exc:  # noqa: BLE001 - fail the batch, keep serving
            self._consecutive_failures += 1
            failed = engine.unfinished_request_ids()
            logger.exception("engine step failed; failing %d request(s)", len(failed))
            turn.failed_step = (failed, describe(exc))
            try:
                engine.abort_request(failed)
            except Exception as abort_exc:  # noqa: BLE001
                logger.exception("cannot abort after a failed step: the engine is broken")
                turn.dead = abort_exc
                return
            if self._consecutive_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                turn.dead = exc


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
