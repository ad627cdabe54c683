"""The engine core in its own process: scheduling and model execution off the HTTP
server's interpreter, so that HTTP parsing, JSON and SSE framing never take the GIL
from the step loop.

Started by ``core_client.CoreClient`` as ``python -m kvpilot.engine.server.core_process``
with its ``CoreSpec`` on stdin (a length-prefixed pickle; unlike multiprocessing's
spawn this never re-runs the caller's main script). It builds the ``LLMEngine`` (with
tensor parallelism it is the driver, rank 0, and starts the workers), reports READY
with what the API process needs (or START_FAILED with the error), then loops
(``CoreProcessLoop.run``): take every command that arrived, run one turn of the engine
core (``engine/engine_core.py``: apply, step, failure policy), send one STEP
message with all the step's deltas and the stats snapshot (``core_messages``).

What runs here beside the model: detokenization, stop strings and structured-output
grammars, because they decide when a request ends and so when its KV blocks are
freed, in the very step that produced the token (as ``LLM.generate`` does).

Stopping: the API process keeps the write end of this process's stdin open. End of
file there (the API process closed it to shut down, or died) makes the core finish its
background work (KV offload saves) and exit. The failure policy is the engine
core's, the same as for the in-process engine thread: a step that raises fails the
requests in flight (``failed`` in STEP) and the core keeps serving; three in a row, a
failed abort or an ``EngineDeadError`` (a tensor-parallel worker died) send DEAD and end
the process.
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
    Turn,
)
from kvpilot.engine.server.core_messages import (
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

if TYPE_CHECKING:
    from kvpilot.engine.engine_args import EngineArgs
    from kvpilot.engine.exceptions import EngineDeadError
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


class CoreProcessLoop:
    """The core process's transport around ``EngineCore``: wait on the command socket
    and on stdin, run one turn, send its outcome.

    Args:
        engine: the engine (the caller closes it when the loop ends).
        commands: PULL socket of the API's command lists.
        results: PUSH socket to the API.
        parent_fd: stdin; readable at end of file when the API process is gone.
    """

    def __init__(self, engine: LLMEngine, commands: zmq.Socket, results: zmq.Socket,
                 parent_fd: int) -> None:
        self.engine = engine
        self._core = EngineCore(engine)
        self._commands = commands
        self._results = results
        self._parent_fd = parent_fd
        self._poller = zmq.Poller()
        self._poller.register(commands, zmq.POLLIN)
        self._poller.register(parent_fd, zmq.POLLIN)

    def run(self) -> None:
        """Serve until the API process goes away or the engine dies."""
        engine = self.engine
        while True:
            events = dict(self._poller.poll(0 if engine.has_unfinished_requests() else None))
            if self._parent_fd in events and not os.read(self._parent_fd, 1 << 16):
                logger.info("the API process closed the channel; the engine core stops")
                return
            commands = self._drain() if self._commands in events else []
            turn = self._core.turn(commands)
            for command, outcome in turn.applied:
                if isinstance(outcome, LoRAOutcome):
                    self._results.send(pack((LORA_DONE, command.token, outcome.info, outcome.error)))
            if turn.died_in_step:
                self.send_dead(str(turn.dead))
                return
            failed = turn.failed_step
            # requests a step failed for on their own: reported like a failed add
            rejected = [(r.request_id, _WIRE_KIND[r.kind], r.message) for r in turn.rejected]
            rejected += [(r.request_id, _WIRE_KIND[r.kind], r.message) for r in turn.failed_alone]
            if turn.dead is not None:
                if failed is not None:   # the requests it failed learn why before DEAD
                    self._send_step(turn, rejected, failed)
                self.send_dead(f"{type(turn.dead).__name__}: {turn.dead}")
                return
            if turn.stepped or turn.num_adds or turn.num_aborts:
                self._send_step(turn, rejected, failed)

    def _send_step(self, turn: Turn, rejected: list[tuple], failed) -> None:
        self._results.send(pack((STEP, encode_outputs(turn.outputs), self.engine.get_stats(),
                                 turn.step_stats, turn.num_adds, rejected, failed)), copy=False)

    def _drain(self) -> list[Command]:
        commands: list[Command] = []
        while True:
            try:
                commands.extend(_command(row) for row in unpack(self._commands.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return commands

    def send_dead(self, message: str) -> None:
        logger.error("the engine is dead: %s", message)
        self._results.send(pack((DEAD, message)))


# Rejected.kind -> a rejected row's second field on the wire (``core_messages``)
_WIRE_KIND = {INVALID: True, ADAPTER_NOT_FOUND: LORA_NOT_FOUND, FAILED: False}


def _command(row: tuple) -> Command:
    """A command row of the wire (``core_messages``) as the engine core's command."""
    if row[0] == ABORT:
        return AbortRequest(row[1])
    if row[0] == LORA:
        return LoRARequest(*row[1:])
    _, request_id, prompt_token_ids, params, arrival_time, priority, cache_salt, lora_name = row
    return AddRequest(request_id, prompt_token_ids, params, arrival_time, priority, cache_salt, lora_name)


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
        CoreProcessLoop(engine, commands, results, parent_fd).run()
    finally:
        try:
            engine.close()
        finally:
            context.destroy(linger=LINGER_MS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
