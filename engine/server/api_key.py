"""``--api-key``: ASGI middleware checking ``Authorization: Bearer <key>`` before anything
else reads the request (as vLLM's API server does).

A per-route dependency would run only after FastAPI has read and JSON-parsed the body,
so unauthenticated clients could make the server read and parse large bodies. Here the
key is checked on the request head alone: a request without the key is answered 401
without reading its body. Every path needs the key but the probes (``/health``,
``/livez``), ``/kv_event_sources`` and, unless ``--metrics-require-api-key``, ``/metrics``; CORS preflights
(``OPTIONS``) are answered by the CORS middleware outside this one.
"""

from __future__ import annotations

import secrets
from http import HTTPStatus

from starlette.types import ASGIApp, Receive, Scope, Send

from kvpilot.contract.constants import LIVENESS_PATH, READINESS_PATH
from kvpilot.engine.server.drain import app_path
from kvpilot.engine.server.errors import INVALID_REQUEST, APIError, error_json_response

PROBE_PATHS = frozenset({READINESS_PATH, LIVENESS_PATH})
KV_EVENT_SOURCES_PATH = "/kv_event_sources"   # served by routes_discovery
METRICS_PATH = "/metrics"


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


class APIKeyGuard:
    """ASGI middleware: 401 for an HTTP request without the key, its body unread."""

    def __init__(self, app: ASGIApp, api_key: str, unguarded: frozenset[str]) -> None:
        self.app = app
        self.api_key = api_key
        self.unguarded = unguarded

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or app_path(scope) in self.unguarded:
            await self.app(scope, receive, send)
            return
        authorization = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), None)
        if not key_matches(authorization, self.api_key):
            await error_json_response(unauthorized())(scope, receive, send)
            return
        await self.app(scope, receive, send)
