"""The engine core in its own process, behind two ZeroMQ sockets (the default of
``kvpilot serve``): HTTP parsing, JSON and SSE framing in the API process never take the
GIL from the step loop.

``ProcessTransport`` (the API process's end) binds a PUSH socket for command lists and a
PULL socket for messages in a private directory (ipc), starts ``python -m
kvpilot.engine.runtime.process`` with its ``CoreSpec`` on stdin, and keeps the write end of
that stdin open as the core's lifeline: end of file there (the API process closed it, or
died) makes the core finish its background work and exit. A monitor thread waits for the
core process; its end, whatever the cause, reaches the client as ``Dead`` (a moment later,
so that a message the core sent first is read first).

``CoreEnd`` (the core's end) waits on the command socket and on stdin. Messages are
pickled; a ``StepReport``'s outputs travel as flat rows of builtins (no per-request
objects, no prompt token ids: the client knows those), which the API end turns back into
``RequestOutput``s.

NOTE: both processes run the same kvpilot, so pickle's class references (stats, configs,
``SamplingParams``) resolve on both sides; nothing here is read from an untrusted peer
(the sockets are the API process's own, in a private directory).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from kvpilot.engine.exceptions import describe_exit
from kvpilot.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvpilot.engine.runtime.messages import Command, Dead, Message, StepReport

if TYPE_CHECKING:
    from kvpilot.engine.engine_args import EngineArgs

logger = logging.getLogger(__name__)

# How long a closing socket may try to deliver what it holds (the other side may be gone).
LINGER_MS = 2000
# How long after the core process ends its death is declared (messages it sent first are
# read first: they say why).
EXIT_GRACE_S = 0.05
# a StepReport on the wire: (_STEP, rows, stats, step_stats, num_adds, rejected, failed_alone,
# failed_step)
_STEP = "step"
SPEC_HEADER = struct.Struct("<Q")   # the spec's length, before it on the core's stdin


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


def pack(message: Any) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def encode_message(message: Message) -> bytes:
    if isinstance(message, StepReport):
        return pack((_STEP, encode_outputs(message.outputs), message.stats, message.step_stats,
                     message.num_adds, message.rejected, message.failed_alone, message.failed_step))
    return pack(message)


def decode_message(data: bytes) -> Message:
    message = pickle.loads(data)
    if isinstance(message, tuple) and message[0] == _STEP:
        _, rows, stats, step_stats, num_adds, rejected, failed_alone, failed_step = message
        return StepReport([decode_output(row) for row in rows], stats, step_stats, num_adds,
                          rejected, failed_alone, failed_step)
    return message


def encode_outputs(outputs: list[RequestOutput]) -> list[tuple]:
    """One flat row per output: ``(request_id, finished, num_cached_tokens, metrics,
    choices, prefix_miss, kv_transfer_params)``, each choice a tuple of ``CompletionOutput``'s
    fields in order."""
    rows = []
    for out in outputs:
        m = out.metrics
        choices = [(c.index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs,
                    c.finish_reason, c.stop_reason) for c in out.outputs]
        # The prefix miss travels with a request's first output (it holds every token so
        # far) and its last, not with every step's delta.
        miss = out.prefix_miss
        if miss is not None and not out.finished and \
                m.num_generation_tokens != sum(len(c[2]) for c in choices):
            miss = None
        rows.append((out.request_id, out.finished, out.num_cached_tokens,
                     (m.arrival_time, m.first_scheduled_time, m.first_token_time,
                      m.last_token_time, m.finished_time, m.num_generation_tokens,
                      m.num_preemptions), choices, miss, out.kv_transfer_params))
    return rows


def decode_output(row: tuple) -> RequestOutput:
    """The ``RequestOutput`` a row of ``encode_outputs`` came from, without its prompt (text
    None, token ids None: the client attaches the ids it sent)."""
    (request_id, finished, num_cached_tokens, metrics, choices, prefix_miss,
     kv_transfer_params) = row
    return RequestOutput(request_id, None, None, [CompletionOutput(*c) for c in choices],
                         finished, num_cached_tokens, RequestMetrics(*metrics), prefix_miss,
                         kv_transfer_params)


class ProcessTransport:
    """The API process's end: starts the core process and carries messages both ways."""

    def __init__(self, spec_for: Callable[[str, str], CoreSpec]) -> None:
        """``spec_for(commands_address, results_address)``: the spec the core starts with."""
        self._spec_for = spec_for
        self._process: subprocess.Popen | None = None
        self._dir: str | None = None
        self._context: zmq.Context | None = None
        self._async_context: zmq.asyncio.Context | None = None
        self._results: zmq.asyncio.Socket | None = None
        self._commands: zmq.Socket | None = None
        self._reader: asyncio.Task | None = None
        self._stopping = False

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def start(self, loop: asyncio.AbstractEventLoop, on_message: Callable[[Message], None]) -> None:
        self._dir = tempfile.mkdtemp(prefix="kvpilot-core-")
        results, commands = f"ipc://{self._dir}/results", f"ipc://{self._dir}/commands"
        self._async_context = zmq.asyncio.Context()
        self._results = self._async_context.socket(zmq.PULL)
        self._results.setsockopt(zmq.LINGER, 0)
        self._results.bind(results)
        self._context = zmq.Context()
        self._commands = self._context.socket(zmq.PUSH)
        self._commands.setsockopt(zmq.LINGER, 0)
        self._commands.setsockopt(zmq.SNDHWM, 0)   # never block the event loop
        self._commands.bind(commands)
        # PYTHONSAFEPATH: the working directory must not shadow the standard library
        env = {**os.environ, "PYTHONSAFEPATH": "1"}
        self._process = subprocess.Popen([sys.executable, "-m", "kvpilot.engine.runtime.process"],
                                         stdin=subprocess.PIPE, env=env)
        with contextlib.suppress(BrokenPipeError):   # it died at once: the monitor says how
            self._process.stdin.write(encode_spec(self._spec_for(commands, results)))
            self._process.stdin.flush()
        logger.info("engine core process started (pid %d)", self._process.pid)
        self._reader = loop.create_task(self._read(on_message))
        threading.Thread(target=self._monitor, args=(self._process, loop, on_message),
                         name="kvpilot-core-monitor", daemon=True).start()

    def send(self, commands: list[Command]) -> None:
        if not self._stopping:
            self._commands.send(pack(commands), copy=False)

    def close(self, timeout: float) -> None:
        """Closes the lifeline (the core finishes its background work and exits; terminated
        after ``timeout``). Callable from any thread."""
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
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def release(self) -> None:
        """Closes the sockets (on the event loop, after ``close``)."""
        if self._reader is not None:
            self._reader.cancel()
        for socket in (self._results, self._commands):
            if socket is not None:
                socket.close(linger=0)
        if self._context is not None:
            self._context.term()
            self._async_context.term()

    async def _read(self, on_message: Callable[[Message], None]) -> None:
        while True:
            data = await self._results.recv()
            try:
                message = decode_message(data)
            except Exception:  # noqa: BLE001 - one bad message must not stop the reader
                logger.exception("a message from the engine core could not be read")
                continue
            on_message(message)

    def _monitor(self, process: subprocess.Popen, loop: asyncio.AbstractEventLoop,
                 on_message: Callable[[Message], None]) -> None:
        """Reports the core process's end to the event loop, a moment later."""
        code = process.wait()
        if self._stopping:
            return
        dead = Dead(f"the engine core process (pid {process.pid}) {describe_exit(code)}")
        with contextlib.suppress(RuntimeError):   # the loop is closed: nobody listens
            loop.call_soon_threadsafe(loop.call_later, EXIT_GRACE_S, on_message, dead)


class CoreEnd:
    """The core process's end: the command socket and stdin in, the message socket out."""

    def __init__(self, context: zmq.Context, spec: CoreSpec, parent_fd: int) -> None:
        self._context = context
        self._address = spec.output_address
        self._results = context.socket(zmq.PUSH)
        self._results.setsockopt(zmq.LINGER, LINGER_MS)
        self._results.connect(spec.output_address)
        self._commands = context.socket(zmq.PULL)
        self._commands.setsockopt(zmq.LINGER, 0)
        self._commands.connect(spec.input_address)
        self._parent_fd = parent_fd
        self._poller = zmq.Poller()
        self._poller.register(self._commands, zmq.POLLIN)
        self._poller.register(parent_fd, zmq.POLLIN)
        self._dead_lock = threading.Lock()

    def receive(self, wait: bool) -> list[Command] | None:
        events = dict(self._poller.poll(None if wait else 0))
        if self._parent_fd in events and not os.read(self._parent_fd, 1 << 16):
            logger.info("the API process closed the channel; the engine core stops")
            return None
        if self._commands not in events:
            return []
        commands: list[Command] = []
        while True:
            try:
                commands.extend(pickle.loads(self._commands.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return commands

    def send(self, message: Message) -> None:
        self._results.send(encode_message(message), copy=False)

    def send_dead(self, message: Dead) -> None:
        """From another thread (the engine's ``on_dead``, maybe while a step is blocked):
        through a socket of its own, sockets being single-threaded."""
        with self._dead_lock:
            socket = self._context.socket(zmq.PUSH)
            socket.setsockopt(zmq.LINGER, LINGER_MS)
            socket.connect(self._address)
            socket.send(pack(message))
            socket.close()
