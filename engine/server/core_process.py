"""The engine core in its own process: scheduling and model execution off the HTTP
server's interpreter, so that HTTP parsing, JSON and SSE framing never take the GIL
from the step loop.

Started by ``core_client.CoreClient`` as ``python -m kvpilot.engine.server.core_process``
with its ``CoreSpec`` on stdin (a length-prefixed pickle; unlike multiprocessing's
spawn this never re-runs the caller's main script). It builds the ``LLMEngine`` (with
tensor parallelism it is the driver, rank 0, and starts the workers), reports READY
with what the API process needs (or START_FAILED with the error), then loops
(``EngineCore.run``): take every command that arrived, step once, send one STEP
message with all the step's deltas and the stats snapshot (``core_wire``).

What runs here beside the model: detokenization, stop strings and structured-output
grammars, because they decide when a request ends and so when its KV blocks are
freed, in the very step that produced the token (as ``LLM.generate`` does).

Stopping: the API process keeps the write end of this process's stdin open. End of
file there (the API process closed it to shut down, or died) makes the core finish its
background work (KV offload saves) and exit. Failures follow the in-process engine
thread: a step that raises fails the requests in flight (``failed`` in STEP) and the
core keeps serving; three in a row, a failed abort or an ``EngineDeadError`` (a
tensor-parallel worker died) send DEAD and end the process.
"""

from __future__ import annotations

import logging
import os
import pickle
import struct
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

from kvpilot.engine.exceptions import EngineDeadError
from kvpilot.engine.lora.registry import LoRANotFoundError
from kvpilot.engine.server.core_wire import (
    ABORT,
    DEAD,
    LORA,
    LORA_DONE,
    LORA_NOT_FOUND,
    READY,
    START_FAILED,
    STEP,
    CoreInfo,
    encode_outputs,
    pack,
    unpack,
)
from kvpilot.engine.server.engine_client import MAX_CONSECUTIVE_STEP_FAILURES

if TYPE_CHECKING:
    from kvpilot.engine.engine_args import EngineArgs
    from kvpilot.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

# How long a closing socket may try to deliver what it holds (the API may be gone).
LINGER_MS = 2000
SPEC_HEADER = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class CoreSpec:
    """What the core process is started with."""

    engine_args: EngineArgs
    input_address: str    # commands from the API process (it binds, the core connects)
    output_address: str   # messages to the API process
    log_level: int


def encode_spec(spec: CoreSpec) -> bytes:
    data = pickle.dumps(spec)
    return SPEC_HEADER.pack(len(data)) + data


def _read_exactly(fd: int, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            raise EOFError("stdin closed before the core's spec was read")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_spec(fd: int) -> CoreSpec:
    (size,) = SPEC_HEADER.unpack(_read_exactly(fd, SPEC_HEADER.size))
    return pickle.loads(_read_exactly(fd, size))


class EngineCore:
    """The step loop over one built engine and the two sockets.

    Args:
        engine: the engine (owned: closed when the loop ends).
        commands: PULL socket of the API's command lists.
        results: PUSH socket to the API.
        parent_fd: stdin; readable at end of file when the API process is gone.
    """

    def __init__(self, engine: LLMEngine, commands: zmq.Socket, results: zmq.Socket,
                 parent_fd: int) -> None:
        self.engine = engine
        self._commands = commands
        self._results = results
        self._parent_fd = parent_fd
        self._poller = zmq.Poller()
        self._poller.register(commands, zmq.POLLIN)
        self._poller.register(parent_fd, zmq.POLLIN)

    def run(self) -> None:
        """Serve until the API process goes away or the engine dies."""
        engine = self.engine
        consecutive_failures = 0
        while True:
            events = dict(self._poller.poll(0 if engine.has_unfinished_requests() else None))
            if self._parent_fd in events and not os.read(self._parent_fd, 1 << 16):
                logger.info("the API process closed the channel; the engine core stops")
                return
            num_adds, rejected, num_aborts = (self._apply(self._drain())
                                              if self._commands in events else (0, [], 0))
            outputs, failed, stepped = [], None, engine.has_unfinished_requests()
            if stepped:
                try:
                    outputs = engine.step()
                    consecutive_failures = 0
                except EngineDeadError as exc:
                    self.send_dead(str(exc))
                    return
                except Exception as exc:  # noqa: BLE001 - fail the batch, keep serving
                    consecutive_failures += 1
                    logger.exception("engine step failed; failing %d request(s)",
                                     engine.get_num_unfinished_requests())
                    failed = self._fail_step(exc)
                    if failed is None or consecutive_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                        self.send_dead(f"{type(exc).__name__}: {exc}")
                        return
            # requests a step failed for on their own: reported like a failed add
            rejected += [(rid, False, text) for rid, text in engine.take_failed_requests()]
            if stepped or num_adds or num_aborts:
                self._results.send(pack((STEP, encode_outputs(outputs), engine.get_stats(),
                                         engine.take_step_stats(), num_adds, rejected, failed)),
                                   copy=False)

    def _drain(self) -> list[tuple]:
        commands: list[tuple] = []
        while True:
            try:
                commands.extend(unpack(self._commands.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return commands

    def _apply(self, commands: list[tuple]) -> tuple[int, list[tuple], int]:
        """Adds and aborts in arrival order; returns (sequences added: ``n`` per add,
        rejected adds, aborts)."""
        engine = self.engine
        num_adds, rejected, aborts = 0, [], []
        for cmd in commands:
            if cmd[0] == ABORT:
                aborts.append(cmd[1])
                continue
            if cmd[0] == LORA:
                if aborts:   # in order: what was aborted before it goes first
                    engine.abort_request(aborts)
                    aborts = []
                self._lora(*cmd[1:])
                continue
            _, request_id, prompt_token_ids, params, arrival_time, priority, cache_salt, lora_name = cmd
            num_adds += params.n
            try:
                engine.add_request(request_id, prompt_token_ids, params, arrival_time=arrival_time,
                                   priority=priority, cache_salt=cache_salt, lora_name=lora_name)
            except LoRANotFoundError as exc:
                rejected.append((request_id, LORA_NOT_FOUND, str(exc)))
            except ValueError as exc:
                rejected.append((request_id, True, str(exc)))
            except Exception as exc:  # noqa: BLE001 - a broken add fails only this request
                logger.exception("add_request failed for %s", request_id)
                rejected.append((request_id, False, f"{type(exc).__name__}: {exc}"))
        if aborts:
            engine.abort_request(aborts)
        return num_adds, rejected, len(aborts)

    def _lora(self, op_id: int, op: str, name: str, path: str | None, base_model_name: str | None) -> None:
        """Apply a LoRA load / unload and report its outcome at once."""
        from kvpilot.engine.server.lora_commands import run_lora_command

        info, error = run_lora_command(self.engine, op, name, path, base_model_name)
        self._results.send(pack((LORA_DONE, op_id, info, error)))

    def _fail_step(self, exc: Exception) -> tuple[list[str], str] | None:
        """Abort every request after a failed step; None if even that fails."""
        failed = list(self.engine.output_processor.parents)
        try:
            self.engine.abort_request(failed)
        except Exception:  # noqa: BLE001
            logger.exception("cannot abort after a failed step: the engine is broken")
            return None
        return failed, f"{type(exc).__name__}: {exc}"

    def send_dead(self, message: str) -> None:
        logger.error("the engine is dead: %s", message)
        self._results.send(pack((DEAD, message)))


def _report_death_at_once(context: zmq.Context, address: str):
    """The engine's ``on_dead`` callback (another thread, maybe while a step is blocked):
    tell the API process now, through a socket of its own (sockets are single-threaded)."""
    lock = threading.Lock()

    def report(error: EngineDeadError) -> None:
        with lock:
            socket = context.socket(zmq.PUSH)
            socket.setsockopt(zmq.LINGER, LINGER_MS)
            socket.connect(address)
            socket.send(pack((DEAD, str(error))))
            socket.close()

    return report


def main() -> int:
    parent_fd = sys.stdin.fileno()
    spec = read_spec(parent_fd)
    logging.basicConfig(level=spec.log_level,
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    context = zmq.Context()
    results = context.socket(zmq.PUSH)
    results.setsockopt(zmq.LINGER, LINGER_MS)
    results.connect(spec.output_address)
    commands = context.socket(zmq.PULL)
    commands.setsockopt(zmq.LINGER, 0)
    commands.connect(spec.input_address)
    try:
        from kvpilot.engine.llm_engine import LLMEngine

        engine = LLMEngine(spec.engine_args)
    except BaseException as exc:  # noqa: BLE001 - reported to the API process
        logger.error("the engine failed to start: %s", exc)
        results.send(pack((START_FAILED, type(exc).__name__, str(exc), isinstance(exc, ValueError))))
        context.destroy(linger=LINGER_MS)
        return 1
    engine.on_dead(_report_death_at_once(context, spec.output_address))
    info = CoreInfo(engine.model_config, engine.scheduler_config, engine.cache_info, os.getpid(),
                    tuple(engine.list_loras()))
    results.send(pack((READY, info, engine.get_stats())))
    try:
        EngineCore(engine, commands, results, parent_fd).run()
    finally:
        try:
            engine.close()
        finally:
            context.destroy(linger=LINGER_MS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
