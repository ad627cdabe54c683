"""What the routes share: the async engine, the server config and the metrics registry."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import TypeVar

import anyio.to_thread
from anyio import CapacityLimiter
from fastapi import Request
from prometheus_client import CollectorRegistry

from kvpilot.engine.runtime.client import EngineClient
from kvpilot.engine.server.config import ServerConfig
from kvpilot.engine.server.errors import NOT_FOUND, UNAVAILABLE, UNAVAILABLE_RETRY_AFTER, APIError
from kvpilot.engine.server.guards import Drain
from kvpilot.engine.server.prompts import LengthLimit

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ServerState:
    """Per-app state, reached from a route as ``request.app.state.server``."""

    client: EngineClient   # the engine core's client (on a thread of this process, or in its own)
    config: ServerConfig
    registry: CollectorRegistry
    tokenizer_limiter: CapacityLimiter
    drain: Drain = field(default_factory=Drain)
    created: int = field(default_factory=lambda: int(time.time()))

    async def run_blocking(self, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` on a worker thread, at most ``--tokenizer-threads`` at a time: for
        tokenizing, templating and detokenizing, which would stall every stream on the
        event loop (the tokenizers library releases the GIL while it encodes)."""
        return await anyio.to_thread.run_sync(fn, *args, limiter=self.tokenizer_limiter)

    @property
    def length_limit(self) -> LengthLimit:
        """What a prompt's character count alone proves about fitting the context."""
        engine = self.client.view
        return LengthLimit(engine.model_config.max_model_len, engine.tokenizer.max_chars_per_token)

    def engine_problem(self) -> tuple[str, str] | None:
        """Why the engine cannot take requests now, as ``(message, code)``; None when it can."""
        engine = self.client
        if not engine.healthy:
            if engine.error is not None:
                return not_serving_message(engine.error), "engine_dead"
            return "the engine is loading", "engine_loading"
        if engine.stalled:
            return engine.stalled_message(), "engine_stalled"
        return None

    @property
    def model_name(self) -> str:
        """The name reported in responses and in the metrics' ``model_name`` label."""
        return reported_model_name(self.config, self.client.view.model_config.served_model_name)

    @property
    def model_names(self) -> tuple[str, ...]:
        return self.config.served_model_names or (self.model_name,)

    def check_model(self, name: str | None) -> str:
        """Returns the name to report; raises 404 for a model this server does not serve.

        404 with ``code: model_not_found``, as OpenAI and vLLM answer (the ``openai`` SDK
        raises ``NotFoundError``); the message lists what this server does serve. A LoRA
        adapter's name is served under its own name; one unloaded at run time is the same
        404 (a model that went away).
        """
        adapters = self.client.lora_adapters
        if name is not None and name in adapters:
            return name
        if name is not None and self.client.was_unloaded(name):
            raise APIError(HTTPStatus.NOT_FOUND, f"The model `{name}` does not exist.",
                           type=NOT_FOUND, param="model", code="model_not_found")
        if name is not None and name not in self.model_names:
            served = ", ".join((*self.model_names, *adapters))
            raise APIError(HTTPStatus.NOT_FOUND,
                           f"The model `{name}` does not exist; this server serves: {served}",
                           type=NOT_FOUND, param="model", code="model_not_found")
        return self.model_name


def reported_model_name(config: ServerConfig, engine_model_name: str) -> str:
    """The name reported in responses and in the metrics' ``model_name`` label: the first
    served name, else ``engine_model_name`` (the engine's own served model name)."""
    return config.served_model_names[0] if config.served_model_names else engine_model_name


def lora_name(state: ServerState, model: str | None) -> str | None:
    """The LoRA adapter a request's ``model`` names, None for the base model."""
    return model if model is not None and model in state.client.lora_adapters else None


def not_serving_message(error: BaseException) -> str:
    """Why a dead engine does not serve, as /health and the 503 of other routes say it."""
    return f"the engine is not serving: {type(error).__name__}: {error}"


async def server_state(request: Request) -> ServerState:
    """FastAPI dependency: the app's state, whatever the engine's condition (async: FastAPI
    runs a plain function dependency on a worker thread, a thread hop per request)."""
    return request.app.state.server


async def ready_state(request: Request) -> ServerState:
    """FastAPI dependency: the app's state once the engine serves; 503 before that (async,
    as ``server_state``: it only reads flags)."""
    state: ServerState = request.app.state.server
    problem = state.engine_problem()
    if problem is not None:
        message, code = problem
        if code == "engine_loading":
            message = "the engine is still loading; retry shortly"
        raise APIError(HTTPStatus.SERVICE_UNAVAILABLE, message, type=UNAVAILABLE, code=code,
                       headers={"Retry-After": UNAVAILABLE_RETRY_AFTER})
    return state
