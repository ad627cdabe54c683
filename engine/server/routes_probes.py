"""The probes and the service's own routes: ``/health``, ``/livez``, ``/version``, ``/metrics``.

``/livez`` (liveness) answers from the event loop alone, never waiting on the engine,
so only a wedged process or a dead engine fails it; ``/health`` (readiness, as vLLM's)
is 503 while the engine loads, while the server drains after SIGTERM, when the engine
is dead, and while an engine step has run past ``--engine-hang-timeout``.
"""

from __future__ import annotations

from http import HTTPStatus
from importlib import metadata

from fastapi import APIRouter, Depends, Response
from fastapi.responses import JSONResponse
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

from kvpilot.contract.constants import LIVENESS_PATH, READINESS_PATH
from kvpilot.engine.server.errors import UNAVAILABLE, error_body
from kvpilot.engine.server.protocol import ErrorResponse, VersionResponse
from kvpilot.engine.server.state import ServerState, not_serving_message, server_state

router = APIRouter()


def server_version() -> str:
    try:
        return metadata.version("kvpilot")
    except metadata.PackageNotFoundError:
        return "unknown"


@router.get(READINESS_PATH, response_class=Response, responses={
    200: {"description": "ready: the engine is built and making progress, the server not draining"},
    503: {"model": ErrorResponse,
          "description": "loading, draining, engine dead, or an engine step past the hang timeout"}})
async def health(state: ServerState = Depends(server_state)) -> Response:
    problem = (("the server is shutting down", "shutting_down") if state.drain.draining
               else state.engine_problem())
    if problem is None:
        return Response(status_code=HTTPStatus.OK)
    message, code = problem
    return JSONResponse(error_body(message, UNAVAILABLE, code=code),
                        status_code=HTTPStatus.SERVICE_UNAVAILABLE)


@router.get(LIVENESS_PATH, response_class=Response, responses={
    200: {"description": "the process serves HTTP (also while loading, draining or stalled)"},
    503: {"model": ErrorResponse, "description": "the engine is dead: restart the process"}})
async def livez(state: ServerState = Depends(server_state)) -> Response:
    engine = state.client
    if engine.error is not None and not engine.healthy:
        return JSONResponse(error_body(not_serving_message(engine.error), UNAVAILABLE,
                                       code="engine_dead"),
                            status_code=HTTPStatus.SERVICE_UNAVAILABLE)
    return Response(status_code=HTTPStatus.OK)


@router.get("/version", response_model=VersionResponse)
async def version() -> VersionResponse:
    return VersionResponse(version=server_version())


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_PLAIN_0_0_4: {}},
                             "description": "Prometheus text exposition format 0.0.4"}})
async def metrics(state: ServerState = Depends(server_state)) -> Response:
    # Always the classic text format, whatever the scraper's Accept header: it keeps the
    # vllm: names intact, while prometheus_client's OpenMetrics encoder rewrites ':' to '_'.
    return Response(generate_latest(state.registry),
                    headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})
