"""Graceful drain: after SIGTERM, finish what was admitted and admit nothing new.

``DrainGate`` (ASGI middleware) counts the requests in flight and, once ``Drain.begin``
was called, answers every new request but the probes and metrics with 503 and
``Retry-After``; readiness (/health) turns 503 at the same moment, so a load balancer
stops sending. ``cli`` calls ``begin`` on SIGTERM, waits with ``wait_idle`` up to
``--shutdown-timeout`` seconds, then lets uvicorn stop.

NOTE: everything here runs on the event loop (no locks needed): the gate, the probes
and the signal-driven drain task.
"""

from __future__ import annotations

import asyncio
import time
from http import HTTPStatus

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from kvpilot.contract.constants import LIVENESS_PATH, READINESS_PATH
from kvpilot.engine.server.errors import UNAVAILABLE, UNAVAILABLE_RETRY_AFTER, error_body

# Paths answered while draining: the probes and what monitoring reads.
UNGATED_PATHS = frozenset({READINESS_PATH, LIVENESS_PATH, "/metrics", "/version"})
_POLL_SECONDS = 0.05


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


class DrainGate:
    """ASGI middleware: counts gated requests; while draining, refuses new ones with 503."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or app_path(scope) in UNGATED_PATHS:
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            response = JSONResponse(
                error_body("the server is shutting down; retry on another replica", UNAVAILABLE,
                           code="shutting_down"),
                status_code=HTTPStatus.SERVICE_UNAVAILABLE,
                headers={"Retry-After": UNAVAILABLE_RETRY_AFTER, "Connection": "close"})
            await response(scope, receive, send)
            return
        self.drain.num_in_flight += 1
        try:
            await self.app(scope, receive, send)   # returns once the response (or stream) ended
        finally:
            self.drain.num_in_flight -= 1


def app_path(scope: Scope) -> str:
    """The request path below ``--root-path``."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path
