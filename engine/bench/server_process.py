"""Start ``kvpilot serve`` as a child process and wait until it is healthy.

Used by ``kvpilot bench serve --launch`` and by the server tests.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


def stop_process(process: subprocess.Popen, timeout: float) -> int:
    """SIGTERM ``process``, SIGKILL it if it is still there after ``timeout`` s; its exit status."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout)
    return process.returncode


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass
class LaunchedServer:
    """A running ``kvpilot serve`` child process.

    ``health_codes`` records every /health status seen while waiting (connection
    failures as 0), which shows the 503-while-loading phase.
    """

    process: subprocess.Popen
    base_url: str
    log_path: Path
    health_codes: list[int] = field(default_factory=list)

    def log_tail(self, num_lines: int = 60) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-num_lines:])

    def stop(self, timeout: float = 15.0) -> int:
        """Terminates the server (SIGTERM, then SIGKILL); returns its exit status."""
        return stop_process(self.process, timeout)

    def __enter__(self) -> LaunchedServer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def launch_server(serve_args: list[str], *, host: str = "127.0.0.1", port: int | None = None,
                  log_path: Path | None = None, timeout: float = 300.0,
                  env: dict[str, str] | None = None) -> LaunchedServer:
    """Starts ``kvpilot serve --host HOST --port PORT *serve_args`` and waits for /health 200.

    Args:
        serve_args: further ``kvpilot serve`` flags.
        host, port: where to listen (a free loopback port by default).
        log_path: file receiving the server's stdout and stderr (a temp file by default).
        timeout: seconds to wait for health.
        env: extra environment variables for the child.

    Raises:
        RuntimeError: the server exited or did not become healthy in time (the
            message ends with its log). The server is stopped whenever this function
            raises, an interruption included.
    """
    port = port or free_port(host)
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix="kvpilot-serve-", suffix=".log")
        os.close(fd)
        log_path = Path(name)
    cmd = [sys.executable, "-m", "kvpilot.engine.cli.main", "serve", "--host", host,
           "--port", str(port), *serve_args]
    with log_path.open("wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, **(env or {})})
    server = LaunchedServer(process, f"http://{host}:{port}", log_path)
    try:
        _wait_healthy(server, timeout)
    except BaseException:   # not healthy in time, or interrupted (Ctrl-C, a test's timeout)
        server.stop()
        raise
    return server


def _wait_healthy(server: LaunchedServer, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=5.0) as client:
        while True:
            if server.process.poll() is not None:
                raise RuntimeError(f"kvpilot serve exited with status {server.process.returncode}:\n"
                                   f"{server.log_tail()}")
            try:
                code = client.get(f"{server.base_url}/health").status_code
            except httpx.TransportError:
                code = 0
            server.health_codes.append(code)
            if code == 200:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"kvpilot serve was not healthy after {timeout:.0f} s:\n"
                                   f"{server.log_tail()}")
            time.sleep(0.2)
