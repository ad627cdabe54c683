"""Pieces every router uses: documented responses and the API-key check."""

from __future__ import annotations

import secrets
from http import HTTPStatus

from fastapi import Request

from kvpilot.engine.server import sse
from kvpilot.engine.server.errors import INVALID_REQUEST, APIError
from kvpilot.engine.server.protocol import ErrorResponse

# nginx's "client closed request": logged for requests whose client went away.
CLIENT_CLOSED = 499

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
    return {**ERROR_RESPONSES, 200: {"content": {sse.MEDIA_TYPE: {}}, "description": description}}


def check_api_key(request: Request) -> None:
    """FastAPI dependency: 401 unless ``Authorization: Bearer <key>`` matches ``--api-key``."""
    expected = request.app.state.server.config.api_key
    if expected is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(),
                                                                 expected.encode()):
        raise APIError(HTTPStatus.UNAUTHORIZED,
                       "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                       type=INVALID_REQUEST, code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
