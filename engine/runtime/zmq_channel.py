"""The engine core in its own process (the default of ``kvpilot serve``): HTTP parsing, JSON
and SSE framing in the API process never take the GIL from the step loop.

``ProcessTransport`` (the API process's end) binds a ZeroMQ PUSH socket for command lists
in a private directory (ipc), makes a Unix socket pair for the core's messages, starts
``python -m kvpilot.engine.runtime.process`` with its ``CoreSpec`` on stdin and the pair's
other end inherited, and keeps the write end of that stdin open as the core's lifeline: end
of file there (the API process closed it, or died) makes the core finish its background
work and exit. A monitor thread waits for the core process; its end, whatever the cause,
reaches the client as ``Dead`` (a moment later, so that a message the core sent first is
read first).

The core's messages (a ``StepReport`` per step: one per token of a stream) take the hot
path, so they skip ZeroMQ: the core writes length-prefixed frames (``FRAME_HEADER``) to its
end of the pair with one system call, and the API process's event loop reads its end
directly (``loop.add_reader``, ``FrameReader``). Through ZeroMQ each message crossed an I/O
thread in each process: two more threads to wake per token on a machine whose cores the
step's threads already keep busy. Commands (one per request) stay on ZeroMQ, whose queue
lets the event loop send without ever blocking.

``CoreEnd`` (the core's end) waits on the command socket and on stdin. Messages are
pickled; a ``StepReport``'s outputs travel as flat rows of builtins (no per-request
objects, no prompt token ids: the client knows those), which the API end turns back into
``RequestOutput``s.

NOTE: both processes run the same kvpilot, so pickle's class references (stats, configs,
``SamplingParams``) resolve on both sides; nothing here is read from an untrusted peer
(the command socket is the API process's own, in a private directory; the message socket
is a pair shared only with the core it started).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq

from kvpilot.engine.exceptions import describe_exit
from kvpilot.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvpilot.engine.runtime.messages import Command, Dead, Message, StepReport

if TYPE_CHECKING:
    from kvpilot.engine.engine_args import EngineArgs

logger = logging.getLogger(__name__)

# How long after the core process ends its death is declared (messages it sent first are
# read first: they say why).
EXIT_GRACE_S = 0.05
# a StepReport on the wire: (_STEP, rows, stats, step_stats, num_adds, rejected, failed_alone,
# failed_step)
_STEP = "step"
# a frame's length, before it: the spec on the core's stdin, each message on the message socket
FRAME_HEADER = struct.Struct("<Q")
# Room asked for in the core's send buffer for messages the API process has not read yet,
# so that a busy event loop does not stall the step loop at once (the kernel grants at most
# net.core.wmem_max, ~200 KiB by default, doubled).
SEND_BUFFER_BYTES = 4 << 20
RECEIVE_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class CoreSpec:
    """What the core process is started with."""

    engine_args: EngineArgs
    input_address: str    # commands from the API process (it binds, the core connects)
    output_fd: int        # messages to the API process: the core's end of a socket pair (inherited)
    log_level: int


def frame(data: bytes) -> bytes:
    """``data`` as one frame: its length (``FRAME_HEADER``), then the bytes."""
    return FRAME_HEADER.pack(len(data)) + data


def encode_spec(spec: CoreSpec) -> bytes:
    return frame(pickle.dumps(spec))


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
    (size,) = FRAME_HEADER.unpack(_read_exactly(fd, FRAME_HEADER.size))
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

    def __init__(self, spec_for: Callable[[str, int], CoreSpec]) -> None:
        """``spec_for(commands_address, message_fd)``: the spec the core starts with."""
        self._spec_for = spec_for
        self._process: subprocess.Popen | None = None
        self._dir: str | None = None
        self._context: zmq.Context | None = None
        self._commands: zmq.Socket | None = None
        self._messages: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def start(self, loop: asyncio.AbstractEventLoop, on_message: Callable[[Message], None]) -> None:
        self._dir = tempfile.mkdtemp(prefix="kvpilot-core-")
        commands = f"ipc://{self._dir}/commands"
        self._context = zmq.Context()
        self._commands = self._context.socket(zmq.PUSH)
        self._commands.setsockopt(zmq.LINGER, 0)
        self._commands.setsockopt(zmq.SNDHWM, 0)   # never block the event loop
        self._commands.bind(commands)
        self._messages, core_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._messages.setblocking(False)
        # PYTHONSAFEPATH: the working directory must not shadow the standard library
        env = {**os.environ, "PYTHONSAFEPATH": "1"}
        with core_end:   # the core holds its own copy from here on
            self._process = subprocess.Popen([sys.executable, "-m", "kvpilot.engine.runtime.process"],
                                             stdin=subprocess.PIPE, env=env, pass_fds=(core_end.fileno(),))
            with contextlib.suppress(BrokenPipeError):   # it died at once: the monitor says how
                self._process.stdin.write(encode_spec(self._spec_for(commands, core_end.fileno())))
                self._process.stdin.flush()
        logger.info("engine core process started (pid %d)", self._process.pid)
        self._loop = loop
        loop.add_reader(self._messages.fileno(), self._read, FrameReader(), on_message)
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
        if self._messages is not None:
            self._stop_reading()
            self._messages.close()
        if self._commands is not None:
            self._commands.close(linger=0)
        if self._context is not None:
            self._context.term()

    def _read(self, frames: FrameReader, on_message: Callable[[Message], None]) -> None:
        """What the core wrote since the last call (the event loop calls it when the socket
        is readable), message by message."""
        try:
            data = self._messages.recv(RECEIVE_CHUNK_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:   # reset: the core is gone, and the monitor says so
            data = b""
        if not data:      # the core closed its end: it exited
            self._stop_reading()
            return
        for frame in frames.feed(data):
            try:
                message = decode_message(frame)
            except Exception:  # noqa: BLE001 - one bad message must not stop the reader
                logger.exception("a message from the engine core could not be read")
                continue
            on_message(message)

    def _stop_reading(self) -> None:
        if self._loop is not None and not self._loop.is_closed() and self._messages.fileno() >= 0:
            self._loop.remove_reader(self._messages.fileno())

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
        self._messages = socket.socket(fileno=spec.output_fd)
        self._messages.setblocking(True)
        self._messages.set_inheritable(False)   # a worker process it starts must not hold it open
        with contextlib.suppress(OSError):   # a smaller buffer only stalls the loop sooner
            self._messages.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        self._commands = context.socket(zmq.PULL)
        self._commands.setsockopt(zmq.LINGER, 0)
        self._commands.connect(spec.input_address)
        self._parent_fd = parent_fd
        self._poller = zmq.Poller()
        self._poller.register(self._commands, zmq.POLLIN)
        self._poller.register(parent_fd, zmq.POLLIN)
        self._send_lock = threading.Lock()   # frames from two threads never interleave

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
        self._write(encode_message(message))

    def send_dead(self, message: Dead) -> None:
        """From another thread (the engine's ``on_dead``, maybe while a step is blocked)."""
        self._write(pack(message))

    def close(self) -> None:
        """Closes both sockets; a message already written stays readable at the API's end."""
        self._commands.close(linger=0)
        self._messages.close()

    def _write(self, data: bytes) -> None:
        with self._send_lock:
            try:
                self._messages.sendall(frame(data))
            except (BrokenPipeError, ConnectionResetError):
                # the API process is gone: nobody reads, and its lifeline's end stops the loop
                logger.debug("a message to the API process was dropped: it is gone")


class FrameReader:
    """Splits the message socket's byte stream back into its frames (``FRAME_HEADER``'s
    length, then that many bytes), however the reads cut it."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """The frames that ``data`` completes, in order; a partial one waits for more."""
        buffer = self._buffer
        buffer += data
        frames, start, header = [], 0, FRAME_HEADER.size
        while len(buffer) - start >= header:
            (length,) = FRAME_HEADER.unpack_from(buffer, start)
            end = start + header + length
            if end > len(buffer):
                break
            frames.append(bytes(buffer[start + header:end]))
            start = end
        del buffer[:start]
        return frames
