"""However a test session ends, the servers its tests started end with it.

Each test runs a small test file in a nested pytest (with ``support.process_hygiene``, as
pyproject loads it for the suite) whose test starts ``kvpilot serve`` through
``launch_server``, and ends that session the hard way: a pytest-timeout (its ``signal``
method, where finalizers run, and its ``thread`` method, which ends pytest with
``os._exit``), or ``kill -9`` of pytest. Either way the server's engine core is waiting
on a kernel build whose lock the outer test holds, so the session ends while the server
starts. The oracle is the process table: every process seen below the nested pytest is
gone afterwards.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from support.kernel_locks import holding_every_kernel_build

pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parents[1]
INNER = """
from pathlib import Path

from kvpilot.engine.bench.server_process import launch_server


def test_starts_a_server(tmp_path):
    launch_server(["--model", "demo", "--max-model-len", "256", "--kv-cache-memory-bytes", str(8 << 20)],
                  log_path=Path({log!r}), timeout=600)
"""
CORE = "kvpilot.engine.runtime.process"


def _nested_pytest(tmp_path: Path, timeout_s: float, method: str, env: dict[str, str]) -> subprocess.Popen:
    test_file = tmp_path / "test_inner.py"
    test_file.write_text(textwrap.dedent(INNER.format(log=str(tmp_path / "serve.log"))))
    env = {**env, "PYTHONPATH": str(TESTS), "PYTHONSAFEPATH": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "support.process_hygiene", "-p", "no:cacheprovider",
         "-o", f"timeout={timeout_s}", "-o", f"timeout_method={method}", str(test_file)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


class Descendants:
    """The processes seen below a process so far, with their command lines as first seen."""

    def __init__(self, root: subprocess.Popen) -> None:
        self.root = root
        self.seen: dict[int, tuple[psutil.Process, str]] = {}

    def look(self) -> None:
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(self.root.pid).children(recursive=True):
                if child.pid not in self.seen:
                    with contextlib.suppress(psutil.Error):
                        self.seen[child.pid] = (child, " ".join(child.cmdline()))

    def any(self, part: str) -> bool:
        return any(part in line for _, line in self.seen.values())

    def assert_all_gone(self) -> None:
        _, alive = psutil.wait_procs([proc for proc, _ in self.seen.values()], timeout=20)
        assert not alive, f"still running: {[self.seen[p.pid][1] for p in alive]}"


@pytest.mark.parametrize("method", ["signal", "thread"])
def test_a_test_that_times_out_leaves_no_server_behind(tmp_path, demo_model_dir, method, monkeypatch):
    """The server's engine core waits on a kernel build this test holds the lock of, so the
    server is still starting when the nested test's timeout fires, however slow the machine
    (with a bare 2 s timeout a loaded machine could time out before the server was spawned)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "kernels"))
    monkeypatch.delenv("KVPILOT_PREBUILT_KERNELS", raising=False)
    with holding_every_kernel_build():
        inner = _nested_pytest(tmp_path, 6, method, dict(os.environ))
        below = Descendants(inner)
        try:
            while inner.poll() is None:
                below.look()
                time.sleep(0.1)
            output = inner.stdout.read()
        finally:
            if inner.poll() is None:
                inner.kill()
            inner.wait(30)
    assert inner.returncode != 0 and "Timeout" in output, output[-3000:]
    assert below.any(" serve "), below.seen   # the server had started
    below.assert_all_gone()


def test_a_killed_session_takes_its_server_and_engine_core_along(tmp_path, demo_model_dir, monkeypatch):
    """The server's engine core waits on a kernel build this test holds the lock of (logging
    who holds it, with /health 503): a session killed then must not leave it waiting."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "kernels"))
    monkeypatch.delenv("KVPILOT_PREBUILT_KERNELS", raising=False)
    log = tmp_path / "serve.log"
    with holding_every_kernel_build():
        inner = _nested_pytest(tmp_path, 600, "signal", dict(os.environ))
        below = Descendants(inner)
        try:
            deadline = time.monotonic() + 180
            waiting = f"is being built by pid {os.getpid()} on "
            while not (log.exists() and waiting in log.read_text(errors="replace")):
                assert inner.poll() is None, inner.stdout.read()[-3000:]
                assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:] if log.exists() else ""
                below.look()
                time.sleep(0.2)
            below.look()
            assert below.any(CORE), below.seen
            inner.send_signal(signal.SIGKILL)
            inner.wait(30)
        finally:
            if inner.poll() is None:
                inner.kill()
                inner.wait(30)
    below.assert_all_gone()


def test_a_server_stopped_while_its_core_starts_exits_at_once(tmp_path, demo_model_dir, monkeypatch):
    """SIGTERM while the engine core waits on a kernel build: the core has nothing to
    finish, so the server and its core exit at once (a core that serves gets 10 s to
    finish its background work; a start-up waiting on a build would have used them all)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "kernels"))
    monkeypatch.delenv("KVPILOT_PREBUILT_KERNELS", raising=False)
    log = tmp_path / "serve.log"
    with holding_every_kernel_build(), log.open("wb") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "kvpilot.engine.cli.main", "serve", "--model", "demo", "--port", "0",
             "--max-model-len", "256", "--kv-cache-memory-bytes", str(8 << 20)],
            stdout=out, stderr=subprocess.STDOUT)
        below = Descendants(server)
        try:
            deadline = time.monotonic() + 180
            while "is being built by" not in log.read_text(errors="replace"):
                assert server.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
                below.look()
                time.sleep(0.2)
            below.look()
            assert below.any(CORE), below.seen
            started = time.monotonic()
            server.terminate()
            server.wait(30)
            took = time.monotonic() - started
        finally:
            if server.poll() is None:
                server.kill()
                server.wait(30)
    assert server.returncode == 0, log.read_text(errors="replace")[-3000:]
    assert took < 5.0, (took, log.read_text(errors="replace")[-3000:])
    below.assert_all_gone()
