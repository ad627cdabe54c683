"""Pieces every router uses: documented responses."""

from __future__ import annotations

from http import HTTPStatus

from kvpilot.engine.server.protocol import ErrorResponse

# nginx's "client closed request": logged for requests whose client went away.
CLIENT_CLOSED = 499
# A streamed response's media type (server-sent events).
SSE_MEDIA_TYPE = "text/event-stream"

ERROR_RESPONSES: dict[int | str, dict] = {
    int(HTTPStatus.BAD_REQUEST): {"model": ErrorResponse, "description": "invalid request or unknown model"},
    int(HTTPStatus.UNAUTHORIZED): {"model": ErrorResponse, "description": "missing or wrong API key"},
    int(HTTPStatus.TOO_MANY_REQUESTS): {"model": ErrorResponse,
                                        "description": "waiting queue full; see Retry-After"},
    int(HTTPStatus.SERVICE_UNAVAILABLE): {"model": ErrorResponse,
                                          "description": "engine loading or broken"},
}


def generation_responses(description: str) -> dict[int | str, dict]:
    """The documented responses of a generation route: ``description`` of its 200 (JSON,
    or an event stream with ``stream=true``) and the error responses."""
    return {**ERROR_RESPONSES, 200: {"content": {SSE_MEDIA_TYPE: {}}, "description": description}}
