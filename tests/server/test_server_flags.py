"""Front-end flags at work: the real app in-process around the session's engine (root
path, docs, CORS, request ids, request logs, chat template flags, priority and logprob
limits, logit_bias), and TLS through a real uvicorn server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import threading
import time

import httpx
import pytest

from kvpilot.engine.bench.server_process import free_port
from kvpilot.engine.server.app import build_app, build_in_process_client
from kvpilot.engine.server.args import make_serve_parser
from kvpilot.engine.server.cli import uvicorn_config
from kvpilot.engine.server.config import ChatConfig, CORSConfig, ServerConfig
from kvpilot.engine.server.metrics import make_registry

pytestmark = pytest.mark.slow

CHAT = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 1}


def run_app(engine, config: ServerConfig, scenario, root_path: str = "") -> None:
    """Runs ``await scenario(client)`` against the app serving ``engine`` with ``config``;
    ``root_path`` is what uvicorn puts into each request's scope."""
    async_engine, state = build_in_process_client(lambda: engine, config, make_registry())
    app = build_app(state)

    async def main() -> None:
        async_engine.start()
        await async_engine.wait_ready()
        transport = httpx.ASGITransport(app=app, root_path=root_path)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            await scenario(client)

    try:
        asyncio.run(main())
    finally:
        async_engine.shutdown()
    assert not engine.has_unfinished_requests()


def test_root_path_and_docs(offline_llm):
    ns = make_serve_parser().parse_args(["--root-path", "/llm"])
    root_path = uvicorn_config(ns, app=None).root_path

    async def behind_proxy(c: httpx.AsyncClient) -> None:
        assert (await c.get("/openapi.json")).json()["servers"] == [{"url": "/llm"}]
        assert "/llm/openapi.json" in (await c.get("/docs")).text
        assert (await c.get("/llm/v1/models")).status_code == 200   # the proxy kept the prefix

    run_app(offline_llm.llm_engine, ServerConfig(), behind_proxy, root_path=root_path)

    async def no_docs(c: httpx.AsyncClient) -> None:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert (await c.get(path)).status_code == 404, path
        assert (await c.get("/v1/models")).status_code == 200

    run_app(offline_llm.llm_engine, ServerConfig(disable_fastapi_docs=True), no_docs)


def _preflight(origin: str) -> dict:
    return {"Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type"}


def test_cors_defaults_allow_all_and_lists_restrict(offline_llm):
    async def allow_all(c: httpx.AsyncClient) -> None:
        pre = await c.options("/v1/completions", headers=_preflight("https://b.example"))
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "*"
        got = await c.get("/v1/models", headers={"Origin": "https://b.example"})
        assert got.headers["access-control-allow-origin"] == "*"

    run_app(offline_llm.llm_engine, ServerConfig(), allow_all)

    cors = CORSConfig(allowed_origins=("https://a.example",), allowed_methods=("POST",),
                      allowed_headers=("content-type",), allow_credentials=True)

    async def restricted(c: httpx.AsyncClient) -> None:
        ok = await c.options("/v1/completions", headers=_preflight("https://a.example"))
        assert ok.status_code == 200
        assert ok.headers["access-control-allow-origin"] == "https://a.example"
        assert ok.headers["access-control-allow-credentials"] == "true"
        assert (await c.options("/v1/completions",
                                headers=_preflight("https://b.example"))).status_code == 400
        wrong_method = {**_preflight("https://a.example"), "Access-Control-Request-Method": "PUT"}
        assert (await c.options("/v1/completions", headers=wrong_method)).status_code == 400

    run_app(offline_llm.llm_engine, ServerConfig(cors=cors), restricted)


def test_request_id_headers(offline_llm):
    async def scenario(c: httpx.AsyncClient) -> None:
        echoed = await c.get("/v1/models", headers={"X-Request-Id": "abc-123"})
        assert echoed.headers["x-request-id"] == "abc-123"
        fresh = (await c.get("/health")).headers["x-request-id"]
        assert len(fresh) == 32 and fresh != (await c.get("/health")).headers["x-request-id"]

    run_app(offline_llm.llm_engine, ServerConfig(enable_request_id_headers=True), scenario)

    async def without(c: httpx.AsyncClient) -> None:
        assert "x-request-id" not in (await c.get("/health")).headers

    run_app(offline_llm.llm_engine, ServerConfig(), without)


def test_request_log_lines(offline_llm, caplog):
    body = {"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}

    async def scenario(c: httpx.AsyncClient) -> None:
        assert (await c.post("/v1/completions", json=body)).status_code == 200

    with caplog.at_level(logging.INFO, logger="kvpilot.engine.server.generation"):
        run_app(offline_llm.llm_engine, ServerConfig(enable_log_requests=True, max_log_len=8),
                scenario)
        lines = [r.getMessage() for r in caplog.records if "Received request" in r.getMessage()]
        assert len(lines) == 1
        assert "prompt: 'The capi'" in lines[0] and "(5 tokens)" in lines[0]
        assert "max_tokens=2" in lines[0]
        caplog.clear()
        run_app(offline_llm.llm_engine, ServerConfig(), scenario)
        assert not [r for r in caplog.records if "Received request" in r.getMessage()]


def test_chat_template_flag_and_default_kwargs(offline_llm):
    tok = offline_llm.get_tokenizer()
    chat = ChatConfig(chat_template="{{ greeting }}: {{ messages[-1].content | upper }}",
                      default_template_kwargs={"greeting": "hi"})

    async def scenario(c: httpx.AsyncClient) -> None:
        tokens = (await c.post("/tokenize", json={"messages": CHAT["messages"]})).json()["tokens"]
        assert tok.decode(tokens) == "hi: HELLO THERE"
        used = (await c.post("/v1/chat/completions", json=CHAT)).json()["usage"]
        assert used["prompt_tokens"] == len(tok.encode("hi: HELLO THERE", add_special_tokens=False))
        over = {**CHAT, "chat_template_kwargs": {"greeting": "good morning to you"}}
        used = (await c.post("/v1/chat/completions", json=over)).json()["usage"]
        assert used["prompt_tokens"] == len(tok.encode("good morning to you: HELLO THERE",
                                                       add_special_tokens=False))

    run_app(offline_llm.llm_engine, ServerConfig(chat=chat), scenario)


def test_priority_logprobs_and_logit_bias_through_the_api(offline_llm):
    tok = offline_llm.get_tokenizer()

    async def scenario(c: httpx.AsyncClient) -> None:
        fcfs = await c.post("/v1/completions", json={"prompt": "x", "priority": 3})
        assert fcfs.status_code == 400 and fcfs.json()["error"]["param"] == "priority"
        too_many = await c.post("/v1/completions", json={"prompt": "x", "logprobs": 21})
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "logprobs"
        assert "--max-logprobs" in too_many.json()["error"]["message"]
        forced = await c.post("/v1/completions", json={
            "prompt": "x", "max_tokens": 3, "temperature": 1.0, "seed": 3,
            "logit_bias": {"42": 100}})
        assert forced.json()["choices"][0]["text"] == tok.decode([42] * 3)
        for bias in ({"abc": 1}, {"42": 101}, {str(10**7): 1}):
            bad = await c.post("/v1/completions", json={"prompt": "x", "logit_bias": bias})
            assert bad.status_code == 400, bias
        assert bad.json()["error"]["message"].startswith("logit_bias token ids must be in")

    run_app(offline_llm.llm_engine, ServerConfig(), scenario)


def test_tls_and_access_log_flags(offline_llm, tmp_path):
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    key_file, cert_file, ca_file = tmp_path / "key.pem", tmp_path / "cert.pem", tmp_path / "ca.pem"
    cert.private_key_pem.write_to_path(str(key_file))
    cert.cert_chain_pems[0].write_to_path(str(cert_file))
    ca.cert_pem.write_to_path(str(ca_file))
    port = free_port()
    ns = make_serve_parser().parse_args([
        "--host", "127.0.0.1", "--port", str(port), "--ssl-keyfile", str(key_file),
        "--ssl-certfile", str(cert_file), "--disable-uvicorn-access-log",
        "--uvicorn-log-level", "warning"])
    async_engine, state = build_in_process_client(lambda: offline_llm.llm_engine, ServerConfig(),
                                             make_registry())
    config = uvicorn_config(ns, build_app(state))
    assert config.access_log is False
    import uvicorn

    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        context = ssl.create_default_context(cafile=str(ca_file))
        with httpx.Client(verify=context, timeout=10) as client:
            while True:
                with contextlib.suppress(httpx.TransportError):
                    if client.get(f"https://127.0.0.1:{port}/health").status_code == 200:
                        break
                assert time.monotonic() < deadline, "TLS server never became healthy"
                time.sleep(0.2)
            models = client.get(f"https://127.0.0.1:{port}/v1/models").json()
            assert models["data"][0]["id"] == "kvpilot-demo"
        with pytest.raises(httpx.TransportError):   # plain HTTP is not served
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    finally:
        server.should_exit = True
        thread.join(30)
        async_engine.shutdown()
