"""The FastAPI application factory (no module-level app: every app owns its state)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from anyio import CapacityLimiter
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from kvpilot.engine.runtime.client import EngineClient
from kvpilot.engine.runtime.thread_channel import ThreadTransport
from kvpilot.engine.runtime.zmq_channel import ProcessTransport
from kvpilot.engine.server import (
    routes_chat,
    routes_completions,
    routes_discovery,
    routes_lora,
    routes_model,
    routes_prefix_cache,
    routes_probes,
)
from kvpilot.engine.server.config import ServerConfig
from kvpilot.engine.server.errors import install_error_handlers
from kvpilot.engine.server.guards import RequestGuard, open_paths
from kvpilot.engine.server.metrics import ServerMetrics
from kvpilot.engine.server.middleware import install_middleware
from kvpilot.engine.server.routes_probes import server_version
from kvpilot.engine.server.state import ServerState, reported_model_name
from kvpilot.engine.server.stats_logger import run_stats_logger
from kvpilot.engine.stats import EngineStats

logger = logging.getLogger(__name__)


def _metrics_recorder(config: ServerConfig, registry: CollectorRegistry,
                      stats: Callable[[], EngineStats | None]):
    """The ``on_ready`` callback creating the metrics in ``registry`` once the engine (or
    its view) is known; returns their per-iteration recorder. ``stats`` gives the
    latest snapshot at scrape time. Once they exist, the start-up heap is frozen
    (``freeze_startup_heap``)."""

    def on_ready(engine):
        _ = engine.tokenizer.max_chars_per_token   # computed here, not in the first request
        model_name = reported_model_name(config, engine.model_config.served_model_name)
        metrics = ServerMetrics(registry, model_name, engine.cache_info,
                                engine.model_config.max_model_len, stats,
                                kv_cache_metrics=engine.args.kv_cache_metrics,
                                max_loras=engine.args.max_loras if engine.args.enable_lora else None)
        freeze_startup_heap()
        return metrics.record

    return on_ready


def freeze_startup_heap() -> None:
    """Moves every object alive now (modules, the app, tokenizer, configs, the metrics)
    out of the garbage collector's reach, as vLLM's API server does after start-up.

    The collector's full passes otherwise walk those ~200,000 long-lived objects again and
    again while streams churn through short-lived ones: at 256 streams they were a good
    part of the API process's CPU per streamed token (issue 28). Frozen objects are never
    freed by the collector (reference counting still frees them), which is what
    start-up state is for.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, *gc.get_threshold()[1:])


def build_in_process_client(build_engine: Callable, config: ServerConfig,
                            registry: CollectorRegistry) -> tuple[EngineClient, ServerState]:
    """The engine core on a thread of this process (``--engine-in-process``); its metrics
    are created, in ``registry``, once the engine is built.

    Args:
        build_engine: no-argument callable returning an ``LLMEngine`` (called on the
            engine thread).
        config: server settings (waiting-queue bound, served model names, hang timeout,
            tokenizer threads).
        registry: the Prometheus registry the metrics go to.
    """
    return _client(ThreadTransport(build_engine), config, registry)


def build_core_process_client(engine_args, config: ServerConfig,
                              registry: CollectorRegistry) -> tuple[EngineClient, ServerState]:
    """The engine core in its own process (the default of ``kvpilot serve``), built from
    ``engine_args`` there; its metrics are created in ``registry`` here once it serves."""
    from kvpilot.engine.runtime.zmq_channel import CoreSpec

    level = logging.getLogger("kvpilot").getEffectiveLevel() or logging.INFO
    return _client(ProcessTransport(lambda commands, messages: CoreSpec(engine_args, commands, messages, level)),
                   config, registry)


def _client(transport, config: ServerConfig, registry: CollectorRegistry) -> tuple[EngineClient, ServerState]:
    client = EngineClient(transport, max_waiting_requests=config.max_waiting_requests,
                          on_ready=_metrics_recorder(config, registry, lambda: client.stats),
                          hang_timeout=config.engine_hang_timeout)
    return client, _state(client, config, registry)


def _state(engine: EngineClient, config: ServerConfig, registry: CollectorRegistry) -> ServerState:
    return ServerState(client=engine, config=config, registry=registry,
                       tokenizer_limiter=CapacityLimiter(config.tokenizer_threads))


def build_app(state: ServerState) -> FastAPI:
    """The HTTP app serving ``state.client``.

    The lifespan starts the engine (thread or core process; it builds the engine in the
    background, so the port opens at once and /health answers 503 until the engine
    is ready), runs the periodic stats log line, and stops the engine at shutdown.
    ``RequestGuard`` (``guards``) answers 401 to a request without the ``--api-key`` before
    its body is read, refuses new requests once ``state.drain`` began, and bounds the body's
    size and read time.
    """

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.client.start()
        interval = state.config.log_stats_interval
        stats_task = (asyncio.ensure_future(run_stats_logger(lambda: state.client.stats, interval))
                      if interval > 0 else None)
        try:
            yield
        finally:
            if stats_task is not None:
                stats_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await stats_task
            await asyncio.to_thread(state.client.shutdown)

    config = state.config
    docs = {} if not config.disable_fastapi_docs else {"openapi_url": None, "docs_url": None,
                                                        "redoc_url": None}
    app = FastAPI(title="kvpilot", version=server_version(), lifespan=lifespan,
                  description="OpenAI-compatible API of the kvpilot inference engine", **docs)
    app.state.server = state
    install_error_handlers(app)
    # inside CORS and request ids; the key before the body is read
    app.add_middleware(RequestGuard, drain=state.drain, api_key=config.api_key,
                       unguarded=open_paths(config.metrics_require_api_key),
                       max_body_bytes=config.max_request_body_bytes,
                       body_timeout=config.body_read_timeout)
    install_middleware(app, config)
    app.include_router(routes_completions.router)
    app.include_router(routes_chat.router)
    app.include_router(routes_lora.router)
    app.include_router(routes_prefix_cache.router)
    app.include_router(routes_probes.router)
    app.include_router(routes_model.router)
    app.include_router(routes_discovery.router)
    _document_400_not_422(app)
    return app


def _document_400_not_422(app: FastAPI) -> None:
    """Drops FastAPI's automatic 422 responses from /openapi.json: validation errors are
    answered with 400 and OpenAI error JSON (see errors.py), which each route documents."""
    original = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = original()
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
