"""The real app around an engine built in this process (the engine thread channel,
``--engine-in-process``), under uvicorn on a loopback port on a thread."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import uvicorn

from kvpilot.engine.bench.server_process import free_port
from kvpilot.engine.server.app import build_app, build_in_process_client
from kvpilot.engine.server.config import ServerConfig
from kvpilot.engine.server.metrics import make_registry


@contextlib.contextmanager
def serving(build_engine: Callable, config: ServerConfig) -> Iterator[str]:
    """Serves ``build_engine()``'s engine until the block ends; yields the base URL once
    /health answers 200. The engine is closed when the server stops."""
    _, state = build_in_process_client(build_engine, config, make_registry())
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(state), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{base_url}/health", timeout=5).status_code == 200:
                    break
            assert time.monotonic() < deadline and thread.is_alive(), "server never became ready"
            assert state.client.error is None, f"the engine failed to start: {state.client.error}"
            time.sleep(0.1)
        yield base_url
    finally:
        server.should_exit = True
        thread.join(30)
        state.client.shutdown()
