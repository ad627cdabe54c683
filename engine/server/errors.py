"""OpenAI-style error responses: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the server reports, including FastAPI's own validation and routing
errors, goes through here so that clients (the ``openai`` SDK) always see one shape.
"""

from __future__ import annotations

import logging
import uuid
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
NOT_FOUND = "not_found_error"
RATE_LIMIT = "rate_limit_error"
SERVER_ERROR = "server_error"
UNAVAILABLE = "service_unavailable"
# The header carrying a request's id (the client's, with --enable-request-id-headers; a 500's).
REQUEST_ID_HEADER = "X-Request-Id"
# Seconds a 503 (loading, draining, a broken or stalled engine) asks clients to wait.
UNAVAILABLE_RETRY_AFTER = "5"


class APIError(Exception):
    """An error with an HTTP status, reported to the client as OpenAI error JSON.

    Args:
        status_code: HTTP status.
        message: human-readable explanation (shown by the openai SDK).
        type: OpenAI error type, e.g. ``invalid_request_error``.
        param: the request field at fault, if any.
        code: a machine-readable code, e.g. ``model_not_found``.
        headers: extra response headers (``Retry-After`` on 429).
    """

    def __init__(self, status_code: int, message: str, *, type: str = INVALID_REQUEST,
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(HTTPStatus.BAD_REQUEST, message, param=param, code=code)


def internal_error(request_id: str, what: str = "internal server error",
                   code: str = "internal_error") -> APIError:
    """A 500 saying ``what`` failed in general terms, with the request id to find the details
    in the server log (never the exception's text, file names or a traceback)."""
    return APIError(HTTPStatus.INTERNAL_SERVER_ERROR,
                    f"{what} (request id {request_id}; the server log has the details)",
                    type=SERVER_ERROR, code=code, headers={REQUEST_ID_HEADER: request_id})


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    """The OpenAI error JSON object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_json_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)


def _field_path(loc: tuple) -> list[str]:
    # loc looks like ("body", "messages", 0, "role"); drop the "body" / "query" root.
    if loc and loc[0] in ("body", "query", "path", "header"):
        loc = loc[1:]
    return [str(p) for p in loc]


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The first error's location and message; ``param`` is the top-level field at fault."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    path = _field_path(tuple(first.get("loc", ())))
    msg = first.get("msg", "invalid value")
    text = f"{'.'.join(path)}: {msg}" if path else msg
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more error(s))"
    return text, (path[0] if path else None)


async def _on_api_error(_: Request, exc: APIError) -> JSONResponse:
    return error_json_response(exc)


async def _on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    message, param = _validation_message(exc)
    return error_json_response(APIError(HTTPStatus.BAD_REQUEST, message, param=param))


async def _on_http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    status = exc.status_code
    kind = NOT_FOUND if status == HTTPStatus.NOT_FOUND else (
        INVALID_REQUEST if status < 500 else SERVER_ERROR)
    code = {HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "request_too_large",
            HTTPStatus.REQUEST_TIMEOUT: "request_timeout"}.get(status)
    return error_json_response(APIError(status, str(exc.detail), type=kind, code=code,
                                        headers=getattr(exc, "headers", None)))


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    request_id = request.headers.get(REQUEST_ID_HEADER) or f"http-{uuid.uuid4().hex}"
    logger.error("request %s: unhandled error while serving %s %s", request_id, request.method,
                 request.url.path, exc_info=exc)
    return error_json_response(internal_error(request_id))


def install_error_handlers(app: FastAPI) -> None:
    """Routes every error class through the OpenAI error JSON (validation errors become 400)."""
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)
