"""A router finds a replica's KV events by asking the replica (``routes_discovery``), as
vLLM's router does for ``kv_aware`` without static sources: ``/get_server_info`` names the
model and block size (behind the API key), ``/kv_event_sources`` the endpoints (without
it). A subscriber that only follows what discovery said, rewriting the bind host to the
worker's as the router does, receives the events of a request sent to the replica and
replays them from the discovered replay endpoint. (Events off: a 404,
tests/server/test_openai_api.py.)"""

from __future__ import annotations

import json
from urllib.parse import urlsplit

import httpx
import pytest
import zmq

from kvpilot.engine.bench.server_process import free_port, launch_server

from support.abuse import demo_model_flags
from support.kv_event_subscriber import receive, replay, subscribe
from support.vllm_kv_events import BlockStored, decode_strict

pytestmark = pytest.mark.slow

KEY = "discovery-key"
MODEL = "kvpilot-demo"


def _router_endpoint(endpoint: str, worker_url: str) -> str:
    """What vllm-router connects to: a bind host (``*``, ``0.0.0.0``) becomes the worker's."""
    scheme, rest = endpoint.split("://", 1)
    host, port = rest.rsplit(":", 1)
    if host in ("*", "0.0.0.0", "[::]"):
        host = urlsplit(worker_url).hostname
    return f"{scheme}://{host}:{port}"


def test_a_router_discovers_and_follows_the_replicas_events(tmp_path):
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{free_port()}",
              "replay_endpoint": f"tcp://*:{free_port()}", "topic": "kv"}
    flags = [*demo_model_flags(MODEL), "--api-key", KEY, "--max-model-len", "1024",
             "--kv-cache-memory-bytes", "32Mi", "--kv-events-config", json.dumps(config),
             "--uvicorn-log-level", "warning", "--disable-log-stats"]
    ctx = zmq.Context()
    with launch_server(flags, log_path=tmp_path / "serve.log", timeout=300) as server, \
            httpx.Client(base_url=server.base_url, timeout=60) as http:
        assert http.get("/get_server_info").status_code == 401
        info = http.get("/get_server_info", headers={"Authorization": f"Bearer {KEY}"}).json()
        assert info["model_id"] == MODEL and info["kv_block_size"] == 16
        sources = http.get("/kv_event_sources").json()          # no key, as the router asks
        assert set(sources) == {"0"}
        source = sources["0"]
        # the fields vllm-router checks before it subscribes
        assert (source["publisher"], source["encoding"], source["schema_version"],
                source["enable_kv_cache_events"]) == ("zmq", "msgpack", 1, True)
        assert source["topic"] == "kv"
        sock = subscribe(ctx, _router_endpoint(source["endpoint"], server.base_url), b"kv")
        prompt = " ".join(f"word{i}" for i in range(60))          # several full blocks
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        for _ in range(20):       # the subscription starts asynchronously: send until one lands
            assert http.post("/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
            if sock.poll(500):
                break
            body["prompt"] += " more"
        topic, seq, payload = receive(sock)
        assert topic == b"kv"
        stored = [e for e in decode_strict(payload).events if isinstance(e, BlockStored)]
        assert stored and stored[0].block_size == info["kv_block_size"]
        replayed = replay(ctx, _router_endpoint(source["replay_endpoint"], server.base_url), seq,
                          topic=b"kv")
        assert replayed[0] == (seq, payload)
        sock.close(linger=0)
    ctx.destroy(linger=0)

