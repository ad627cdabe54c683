"""``--max-request-body-bytes``: a body over the limit gets 413 with OpenAI error JSON.

Checked twice, both before the body is stored: a ``Content-Length`` over the limit is
answered at once, without reading the body; a body sent without one (chunked) is counted
as it arrives and refused once it passes the limit. (Starlette's own body limit answers
an announced oversize with plain text, whatever the app's error handlers say.)
"""

from __future__ import annotations

from http import HTTPStatus

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvpilot.engine.server.errors import APIError, error_json_response


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` once a streamed body passes the limit. An HTTPException, so
    that FastAPI's body reader passes it on to the error handlers instead of calling it
    malformed JSON."""

    def __init__(self, limit: int) -> None:
        super().__init__(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, too_large_message(limit))


def too_large_message(limit: int) -> str:
    return (f"the request body is larger than this server's limit of {limit} bytes "
            "(--max-request-body-bytes)")


class BodyLimit:
    """ASGI middleware refusing HTTP request bodies over ``max_bytes``."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        announced = _content_length(scope)
        if announced is not None and announced > self.max_bytes:
            error = APIError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, too_large_message(self.max_bytes),
                             code="request_too_large", headers={"Connection": "close"})
            await error_json_response(error)(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, counting_receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
