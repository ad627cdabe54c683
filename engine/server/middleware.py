"""HTTP middleware the server flags switch on: CORS and ``X-Request-Id`` headers."""

from __future__ import annotations

import uuid

from fastapi import FastAPI, Request
from starlette.middleware.cors import CORSMiddleware

from kvpilot.engine.server.config import ServerConfig
from kvpilot.engine.server.errors import REQUEST_ID_HEADER


def install_middleware(app: FastAPI, config: ServerConfig) -> None:
    """CORS as ``--allowed-origins/-methods/-headers`` and ``--allow-credentials`` say (vLLM
    always installs it, allowing everything by default), and with
    ``--enable-request-id-headers`` an ``X-Request-Id`` on every response: the client's
    own if it sent one, else a fresh id."""
    cors = config.cors
    app.add_middleware(CORSMiddleware, allow_origins=list(cors.allowed_origins),
                       allow_methods=list(cors.allowed_methods),
                       allow_headers=list(cors.allowed_headers),
                       allow_credentials=cors.allow_credentials)
    if not config.enable_request_id_headers:
        return

    @app.middleware("http")
    async def add_request_id(request: Request, call_next):
        request_id = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        response = await call_next(request)
        response.headers.setdefault(REQUEST_ID_HEADER, request_id)   # a 500 carries its own
        return response
