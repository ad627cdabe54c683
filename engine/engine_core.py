"""The engine core: one turn of the serving loop, written once for both transports.

A turn applies the commands that arrived (adds, aborts, LoRA loads and unloads, in
arrival order), steps the engine once if it has work, and applies the failure policy:

- a step that raises fails every request in flight (the engine aborts them) and the
  core keeps serving; ``MAX_CONSECUTIVE_STEP_FAILURES`` failed steps in a row, or an
  abort that itself fails, make the engine dead;
- an ``EngineDeadError`` from the step (a tensor-parallel worker died) makes it dead at once;
- a request a step failed for on its own (``LLMEngine.take_failed_requests``) fails alone,
  as a refused add does: a 400 when it was the request's fault (its grammar did not
  compile, or not in time), else a 500;
- an add the engine refuses fails only that request.

``EngineCore.turn`` returns what happened as data (``Turn``) and never calls back: the
transport around it decides how to tell the clients. Two transports use it — the engine
thread beside the API server's event loop (``server/async_engine.py``) and the engine
core process behind a ZeroMQ channel (``server/core_process.py``); each keeps only its
own waiting (a condition variable, a poller), its delivery and its hang watchdog.
``LLM.generate`` steps the engine directly (offline, no failure policy: errors raise).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvpilot.engine.exceptions import EngineDeadError
from kvpilot.engine.lora.registry import LoRANotFoundError

if TYPE_CHECKING:
    from kvpilot.engine.llm_engine import LLMEngine
    from kvpilot.engine.outputs import RequestOutput
    from kvpilot.engine.sampling_params import SamplingParams
    from kvpilot.engine.stats import StepStats

logger = logging.getLogger(__name__)

# Consecutive failed steps after which the engine counts as broken: one is taken as transient.
MAX_CONSECUTIVE_STEP_FAILURES = 3

# Why an add was refused (``Rejected.kind``).
INVALID = "invalid"                        # the engine raised ValueError: a 400 for the client
ADAPTER_NOT_FOUND = "adapter_not_found"    # the request named an adapter the engine does not serve
FAILED = "failed"                          # anything else: a 500


@dataclass(frozen=True, slots=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float | None = None
    priority: int = 0
    cache_salt: str | None = None
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """Load (``op`` "load") or unload an adapter; ``token`` identifies it to the transport."""

    token: Any
    op: str
    name: str
    path: str | None = None
    base_model_name: str | None = None


Command = AddRequest | AbortRequest | LoRARequest


@dataclass(frozen=True, slots=True)
class Rejected:
    """An add the engine refused; only that request fails."""

    request_id: str
    kind: str      # INVALID | ADAPTER_NOT_FOUND | FAILED
    message: str


@dataclass(frozen=True, slots=True)
class LoRAOutcome:
    command: LoRARequest
    info: Any                        # the loaded adapter's AdapterInfo (load), else None
    error: BaseException | None      # the exception the client raises, or None


@dataclass(slots=True)
class Turn:
    """What one turn did, in the order it happened."""

    applied: list[tuple[Command, Rejected | LoRAOutcome | None]] = field(default_factory=list)
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


class EngineCore:
    """Turns of the serving loop over one engine (not owned: the transport closes it)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._consecutive_failures = 0

    def turn(self, commands: list[Command]) -> Turn:
        """Apply ``commands`` in order, then step once if the engine has work."""
        turn = Turn()
        self._apply(commands, turn)
        if self.engine.has_unfinished_requests():
            turn.stepped = True
            self._step(turn)
            if turn.died_in_step:
                return turn
        turn.failed_alone = [Rejected(f.request_id, INVALID if f.invalid else FAILED, f.message)
                             for f in self.engine.take_failed_requests()]
        turn.step_stats = self.engine.take_step_stats()
        return turn

    def _apply(self, commands: list[Command], turn: Turn) -> None:
        engine = self.engine
        aborts: list[str] = []
        for cmd in commands:
            if isinstance(cmd, AbortRequest):
                aborts.append(cmd.request_id)
                turn.applied.append((cmd, None))
                continue
            if isinstance(cmd, LoRARequest):
                if aborts:   # in order: what was aborted before it goes first
                    engine.abort_request(aborts)
                    turn.num_aborts += len(aborts)
                    aborts = []
                turn.applied.append((cmd, self._lora(cmd)))
                continue
            turn.num_adds += cmd.params.n
            turn.applied.append((cmd, self._add(cmd)))
        if aborts:
            engine.abort_request(aborts)
            turn.num_aborts += len(aborts)

    def _add(self, cmd: AddRequest) -> Rejected | None:
        try:
            self.engine.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params,
                                    arrival_time=cmd.arrival_time, priority=cmd.priority,
                                    cache_salt=cmd.cache_salt, lora_name=cmd.lora_name)
        except LoRANotFoundError as exc:
            return Rejected(cmd.request_id, ADAPTER_NOT_FOUND, str(exc))
        except ValueError as exc:
            return Rejected(cmd.request_id, INVALID, str(exc))
        except Exception as exc:  # noqa: BLE001 - a broken add fails only this request
            logger.exception("add_request failed for %s", cmd.request_id)
            return Rejected(cmd.request_id, FAILED, f"{type(exc).__name__}: {exc}")
        return None

    def _lora(self, cmd: LoRARequest) -> LoRAOutcome:
        from kvpilot.engine.server.lora_commands import run_lora_command

        info, error = run_lora_command(self.engine, cmd.op, cmd.name, cmd.path, cmd.base_model_name)
        return LoRAOutcome(cmd, info, error)

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
            turn.failed_step = (failed, f"{type(exc).__name__}: {exc}")
            try:
                engine.abort_request(failed)
            except Exception as abort_exc:  # noqa: BLE001
                logger.exception("cannot abort after a failed step: the engine is broken")
                turn.dead = abort_exc
                return
            if self._consecutive_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                turn.dead = exc
