"""What a router discovers about this server: ``GET /get_server_info`` and
``GET /kv_event_sources`` (the routes vLLM's router reads for its ``kv_aware`` policy when
it finds workers itself, from ``--worker-urls`` or Kubernetes service discovery, rather
than from static ``--kv-event-source`` flags).

``/get_server_info`` (behind the API key, as the router asks for it with one) names the
served model and the KV block size, the router's cache identity. ``/kv_event_sources``
maps each data-parallel rank (kvpilot serves rank ``"0"``) to its KV-event endpoints,
with the ``publisher`` / ``encoding`` / ``schema_version`` the router checks before it
subscribes; a bind endpoint (``tcp://*:5557``) is rewritten by the router to the worker's
host, so the port must be a fixed one (an ephemeral ``*`` port cannot be discovered).
It is served without the API key because the router asks for it without one; it
reveals only the ZeroMQ endpoints, which the engine's NetworkPolicy admits the router
pods to anyway. 404 when KV events are off (the router then scores the worker on load).
"""

from __future__ import annotations

from http import HTTPStatus

from fastapi import APIRouter, Depends

from kvpilot.engine.server.errors import NOT_FOUND, APIError
from kvpilot.engine.server.guards import KV_EVENT_SOURCES_PATH
from kvpilot.engine.server.state import ServerState, ready_state

# The version of the event payload kvpilot publishes (vLLM's map form), as the router reads it.
KV_EVENT_SCHEMA_VERSION = 1

router = APIRouter()


@router.get("/get_server_info")
async def server_info(state: ServerState = Depends(ready_state)) -> dict:
    view = state.client.view
    return {"model_id": state.model_name, "model_path": view.model_config.model,
            "kv_block_size": view.cache_info.block_size}


@router.get(KV_EVENT_SOURCES_PATH)
async def kv_event_sources(state: ServerState = Depends(ready_state)) -> dict:
    config = state.client.view.args.kv_events_config
    if config is None or not config.enabled:
        raise APIError(HTTPStatus.NOT_FOUND, "KV-cache events are off (--kv-events-config)",
                       type=NOT_FOUND, code="kv_events_disabled")
    return {"0": {"endpoint": config.endpoint, "replay_endpoint": config.replay_endpoint,
                  "topic": config.topic, "hwm": config.hwm, "buffer_steps": config.buffer_steps,
                  "publisher": "zmq", "encoding": "msgpack",
                  "schema_version": KV_EVENT_SCHEMA_VERSION, "enable_kv_cache_events": True}}
