"""The handshake side channel (ZMQ, msgpack), on ``VLLM_NIXL_SIDE_CHANNEL_HOST:PORT`` as in vLLM.

A producer runs ``SideChannelServer``: a thread answering, one message at a time,

- ``{"op": "meta"}`` -> ``{"ok": true, "meta": AgentInfo}`` (the handshake);
- ``{"op": "pin", "ids": [...]}`` -> ``{"ok": true, "pinned": [bool, ...], "agent": name}``: a
  consumer about to read a request's blocks asks the producer to keep them for the read
  (they may have expired: then it must not read, they may belong to another request by
  now); ``agent`` is the producer's NIXL agent name, new in each process, so a consumer
  notices a restart behind a known address;
- ``{"op": "release", "ids": [...]}`` -> ``{"ok": true}``: a consumer that will not read
  (its own prefix cache held everything, or its request was aborted first) frees them.

A consumer calls ``request(host, port, message, timeout)`` from its transfer thread. The
answers to ``pin`` and ``release`` come from callables the worker half supplies, which
take its lock (they run on this thread).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import msgspec
import zmq

from kvpilot.engine.kv_transfer.nixl.layout import HandshakeError

logger = logging.getLogger(__name__)

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode
POLL_MS = 200    # how often the server thread looks at its stop flag


class SideChannelServer:
    """Args:
        host, port: where to listen (``tcp://host:port``).
        meta: the handshake answer (``AgentInfo.to_wire()``).
        pin, release: handle a consumer's request ids; ``pin`` returns one bool per id.
    """

    def __init__(self, host: str, port: int, meta: dict, agent_name: str,
                 pin: Callable[[list[str]], list[bool]], release: Callable[[list[str]], None]) -> None:
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as exc:
            self._socket.close()
            raise ValueError(f"NixlConnector cannot listen on its side channel {host}:{port} ({exc}); set "
                             "VLLM_NIXL_SIDE_CHANNEL_HOST / VLLM_NIXL_SIDE_CHANNEL_PORT") from None
        self._meta = _encode({"ok": True, "meta": meta})
        self._agent_name = agent_name
        self._pin, self._release = pin, release
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvpilot-nixl-side-channel", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        socket = self._socket
        try:
            while not self._stop.is_set():
                if not socket.poll(POLL_MS):
                    continue
                identity, _, payload = socket.recv_multipart()
                socket.send_multipart([identity, b"", self._answer(payload)])
        finally:
            socket.close()

    def _answer(self, payload: bytes) -> bytes:
        try:
            message = _decode(payload)
            op = message.get("op")
            if op == "meta":
                return self._meta
            if op == "pin":
                return _encode({"ok": True, "pinned": self._pin([str(i) for i in message["ids"]]),
                                "agent": self._agent_name})
            if op == "release":
                self._release([str(i) for i in message["ids"]])
                return _encode({"ok": True})
            return _encode({"ok": False, "error": f"unknown op {op!r}"})
        except Exception as exc:  # noqa: BLE001 - a bad message gets an answer, the server goes on
            logger.warning("NIXL side channel: bad message (%s: %s)", type(exc).__name__, exc)
            return _encode({"ok": False, "error": f"{type(exc).__name__}: {exc}"})

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * POLL_MS / 1000 + 1)


def request(host: str, port: int, message: dict, timeout: float) -> dict:
    """One request/answer with a producer's side channel; HandshakeError when it does not
    answer within ``timeout`` seconds or answers with an error."""
    socket = zmq.Context.instance().socket(zmq.REQ)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(f"tcp://{host}:{port}")
        socket.send(_encode(message))
        if not socket.poll(int(timeout * 1000)):
            raise HandshakeError(f"the prefill engine's side channel at {host}:{port} did not answer within "
                                 f"{timeout:g} s (is it running? VLLM_NIXL_SIDE_CHANNEL_HOST/PORT)")
        answer = _decode(socket.recv())
    finally:
        socket.close()
    if not isinstance(answer, dict) or not answer.get("ok"):
        error = answer.get("error") if isinstance(answer, dict) else answer
        raise HandshakeError(f"the prefill engine's side channel at {host}:{port} refused {message.get('op')}: "
                             f"{error}")
    return answer
