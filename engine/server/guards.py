"""What every HTTP request passes before a route reads it: one ASGI middleware
(``RequestGuard``) and, below it, uvicorn's HTTP protocol with a deadline on the head.

In the order a request meets them:

- ``--header-read-timeout`` (``header_timeout_protocol``): uvicorn times out idle
  kept-alive connections but not a client sending its headers a byte at a time
  ("slowloris"); the protocol arms a timer when a connection opens (and when a further
  request's first bytes arrive on it) and disarms it once the head is parsed; a head still
  incomplete at the deadline is answered ``408`` and the connection closed.
- ``--api-key``: ``Authorization: Bearer <key>`` is checked on the head alone, so a
  request without the key is answered 401 without its body being read (a route
  dependency would run only after FastAPI read and parsed the body). Every path needs the
  key but the probes, ``/kv_event_sources`` and, unless ``--metrics-require-api-key``,
  ``/metrics``; CORS preflights are answered by the CORS middleware outside this one.
- the drain (``Drain``): after SIGTERM, finish what was admitted and admit nothing new:
  every new request but the probes and metrics gets 503 with ``Retry-After`` while
  readiness (/health) turns 503, so a load balancer stops sending; ``cli`` calls
  ``Drain.begin`` and waits with ``wait_idle`` up to ``--shutdown-timeout`` seconds.
- ``--body-read-timeout``: a body not fully arrived this many seconds after the request
  began gets 408 (a client dribbling its body would otherwise hold a connection, a
  concurrency slot and, during a drain, the shutdown); the deadline covers the whole body.
- ``--max-request-body-bytes``: a ``Content-Length`` over the limit is answered 413 at
  once; a body sent without one is counted as it arrives and refused once it passes the
  limit (Starlette's own limit answers an announced oversize in plain text).

NOTE: everything here runs on the event loop (no locks): the guard, the probes and the
signal-driven drain task.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from http import HTTPStatus

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvpilot.contract.constants import LIVENESS_PATH, READINESS_PATH
from kvpilot.engine.server.errors import (
    INVALID_REQUEST,
    UNAVAILABLE,
    UNAVAILABLE_RETRY_AFTER,
    APIError,
    error_body,
    error_json_response,
)

PROBE_PATHS = frozenset({READINESS_PATH, LIVENESS_PATH})
KV_EVENT_SOURCES_PATH = "/kv_event_sources"   # served by routes_discovery
METRICS_PATH = "/metrics"
# Paths answered while draining: the probes and what monitoring reads.
UNGATED_PATHS = PROBE_PATHS | {METRICS_PATH, "/version"}
_POLL_SECONDS = 0.05


def app_path(scope: Scope) -> str:
    """The request path below ``--root-path``."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


# ---- the drain -----------------------------------------------------------------------

class Drain:
    """Whether the server drains, and how many gated requests are in flight."""

    def __init__(self) -> None:
        self.started_at: float | None = None   # monotonic time of ``begin``
        self.num_in_flight = 0

    @property
    def draining(self) -> bool:
        return self.started_at is not None

    def begin(self) -> None:
        """Refuse new requests from now on (idempotent)."""
        if self.started_at is None:
            self.started_at = time.monotonic()

    async def wait_idle(self, timeout: float) -> bool:
        """Waits until no gated request is in flight; False if ``timeout`` seconds passed first."""
        deadline = time.monotonic() + timeout
        while self.num_in_flight:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(_POLL_SECONDS)
        return True


# ---- the API key ---------------------------------------------------------------------

def open_paths(metrics_require_api_key: bool) -> frozenset[str]:
    """The paths served without the key (vLLM's router asks for ``/kv_event_sources``
    without one: ``routes_discovery``)."""
    paths = PROBE_PATHS | {KV_EVENT_SOURCES_PATH}
    return paths if metrics_require_api_key else paths | {METRICS_PATH}


def key_matches(authorization: bytes | None, expected: str) -> bool:
    """Whether an ``Authorization`` header value carries ``Bearer <expected>`` (compared in
    constant time)."""
    scheme, _, token = (authorization or b"").partition(b" ")
    return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), expected.encode())


def unauthorized() -> APIError:
    return APIError(HTTPStatus.UNAUTHORIZED,
                    "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                    type=INVALID_REQUEST, code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer", "Connection": "close"})


# ---- the body ------------------------------------------------------------------------

class BodyTooLarge(HTTPException):
    """Raised from ``receive`` once a streamed body passes the limit. An HTTPException, so
    that FastAPI's body reader passes it on to the error handlers instead of calling it
    malformed JSON."""

    def __init__(self, limit: int) -> None:
        super().__init__(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, too_large_message(limit))


def too_large_message(limit: int) -> str:
    return (f"the request body is larger than this server's limit of {limit} bytes "
            "(--max-request-body-bytes)")


class BodyReadTimedOut(HTTPException):
    """Raised from ``receive`` at the deadline (an HTTPException, for the same reason)."""

    def __init__(self, timeout: float) -> None:
        super().__init__(HTTPStatus.REQUEST_TIMEOUT,
                         f"the request body was not received within {timeout:g} s "
                         "(--body-read-timeout)", headers={"Connection": "close"})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _guarded_receive(receive: Receive, max_bytes: int | None, timeout: float | None) -> Receive:
    """``receive`` with the body's deadline and size limit (either may be None: off)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    body_done = False
    received = 0

    async def guarded() -> Message:
        nonlocal body_done, received
        if body_done:   # afterwards the app only listens for the disconnect
            return await receive()
        if deadline is None:
            message = await receive()
        else:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise BodyReadTimedOut(timeout) from None
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if max_bytes is not None and received > max_bytes:
                raise BodyTooLarge(max_bytes)
            body_done = not message.get("more_body", False)
        else:
            body_done = True
        return message

    return guarded


# ---- the middleware ------------------------------------------------------------------

class RequestGuard:
    """ASGI middleware: the API key, the drain, the body's deadline and size, in that order.

    Args:
        drain: the server's drain state.
        api_key: the key every guarded path needs (None: no key).
        unguarded: paths served without the key (``open_paths``).
        max_body_bytes: the body size limit (None: none).
        body_timeout: seconds the whole body may take (None: no deadline).
    """

    def __init__(self, app: ASGIApp, drain: Drain, api_key: str | None = None,
                 unguarded: frozenset[str] = frozenset(), max_body_bytes: int | None = None,
                 body_timeout: float | None = None) -> None:
        self.app = app
        self.drain = drain
        self.api_key = api_key
        self.unguarded = unguarded
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = app_path(scope)
        if self.api_key is not None and path not in self.unguarded:
            authorization = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), None)
            if not key_matches(authorization, self.api_key):
                await error_json_response(unauthorized())(scope, receive, send)
                return
        limit = self.max_body_bytes
        if limit is not None:
            announced = _content_length(scope)
            if announced is not None and announced > limit:
                error = APIError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, too_large_message(limit),
                                 code="request_too_large", headers={"Connection": "close"})
                await error_json_response(error)(scope, receive, send)
                return
        if limit is not None or self.body_timeout is not None:
            receive = _guarded_receive(receive, limit, self.body_timeout)
        if path in UNGATED_PATHS:
            await self.app(scope, receive, send)
            return
        drain = self.drain
        if drain.draining:
            response = JSONResponse(
                error_body("the server is shutting down; retry on another replica", UNAVAILABLE,
                           code="shutting_down"),
                status_code=HTTPStatus.SERVICE_UNAVAILABLE,
                headers={"Retry-After": UNAVAILABLE_RETRY_AFTER, "Connection": "close"})
            await response(scope, receive, send)
            return
        drain.num_in_flight += 1
        try:
            await self.app(scope, receive, send)   # returns once the response (or stream) ended
        finally:
            drain.num_in_flight -= 1


# ---- the request head ----------------------------------------------------------------

_BODY = (b'{"error": {"message": "the request head was not received in time", '
         b'"type": "invalid_request_error", "param": null, "code": "request_timeout"}}')
REQUEST_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                            b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(_BODY)) + _BODY


def base_http_protocol() -> type[asyncio.Protocol]:
    """uvicorn's ``http="auto"`` protocol class: httptools where installed, else h11."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    return AutoHTTPProtocol


def header_timeout_protocol(timeout: float,
                            base: type[asyncio.Protocol] | None = None) -> type[asyncio.Protocol]:
    """A subclass of uvicorn's HTTP protocol ``base`` (the ``auto`` one by default) that
    answers 408 and closes a connection whose request head takes over ``timeout`` s."""
    base = base or base_http_protocol()

    class HeaderTimeoutProtocol(base):   # type: ignore[valid-type, misc]
        _head_timer: asyncio.TimerHandle | None = None
        _armed_cycle: object = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm()    # the first bytes of another request on a kept-alive connection
            super().data_received(data)
            if self._head_timer is not None and self.cycle is not self._armed_cycle:
                self._disarm()   # the head is parsed: a new request cycle began

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._armed_cycle = self.cycle
            self._head_timer = self.loop.call_later(timeout, self._timed_out)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _timed_out(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                self.transport.write(REQUEST_TIMEOUT_RESPONSE)
                self.transport.close()

    HeaderTimeoutProtocol.__name__ = HeaderTimeoutProtocol.__qualname__ = f"HeaderTimeout{base.__name__}"
    return HeaderTimeoutProtocol
