"""Running things for the operator tests: the API emulator in a thread, the real
``kvpilot operator`` process, and kubectl.

Shared by tests/operator and e2e/: the process and kubectl helpers work against the
emulator (a kubeconfig written for it) and against a real cluster (the caller's KUBECONFIG).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import kmock
import yaml

from support.kube_emulator import KubeEmulator

T = TypeVar("T")
KUBECTL = "/usr/bin/kubectl"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def schemaless_crd(group: str, version: str, kind: str, plural: str) -> dict:
    """A CRD without a schema that makes a server serve a kind of another project (KEDA's
    ScaledObject, the Prometheus operator's PodMonitor)."""
    return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{plural}.{group}"},
            "spec": {"group": group, "scope": "Namespaced",
                     "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
                     "versions": [{"name": version, "served": True, "storage": True, "schema": {
                         "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]}}


def wait_for(probe: Callable[[], T], timeout: float = 20.0, interval: float = 0.05,
             what: str = "condition") -> T:
    """Poll ``probe`` until it returns something truthy; its last value on success."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what} (last: {value!r})")
        time.sleep(interval)


def write_kubeconfig(config: dict, directory: Path) -> Path:
    path = directory / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return path


class Kubectl:
    """The real kubectl, with its own discovery cache, against ``kubeconfig``."""

    def __init__(self, kubeconfig: Path, workdir: Path, namespace: str | None = None) -> None:
        self.kubeconfig, self.workdir, self.namespace = kubeconfig, workdir, namespace

    def __call__(self, *args: str, check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess:
        cmd = [KUBECTL, "--kubeconfig", str(self.kubeconfig), "--cache-dir", str(self.workdir / "kcache")]
        if self.namespace:
            cmd += ["--namespace", self.namespace]
        env = {**os.environ, "HOME": str(self.workdir)}
        result = subprocess.run([*cmd, *args], capture_output=True, text=True, env=env, input=stdin,
                                timeout=60)
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({result.returncode}):\n"
                                 f"{result.stdout}\n{result.stderr}")
        return result


class OperatorProcess:
    """``python -m kvpilot.engine.cli.main operator`` in a subprocess, logging to a file."""

    def __init__(self, kubeconfig: Path, log_path: Path, env: dict[str, str] | None = None,
                 args: tuple[str, ...] = ("--all-namespaces",)) -> None:
        self.kubeconfig, self.log_path = kubeconfig, log_path
        self.liveness_port = free_port()
        self.env = {**os.environ, "KUBECONFIG": str(kubeconfig), "KVPILOT_LOG_LEVEL": "DEBUG",
                    "KVPILOT_RESYNC_SECONDS": "1", **(env or {})}
        self.args = args
        self.proc: subprocess.Popen | None = None

    def start(self) -> OperatorProcess:
        liveness = f"http://127.0.0.1:{self.liveness_port}/healthz"
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvpilot.engine.cli.main", "operator", *self.args,
             "--liveness", liveness],
            env=self.env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        try:
            wait_for(self.healthy, timeout=30, interval=0.1, what="the operator's liveness endpoint")
        except BaseException:   # __exit__ does not run when __enter__ raises
            self.stop()
            raise
        return self

    def healthy(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            raise RuntimeError(f"the operator exited:\n{self.log()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.liveness_port}/healthz", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        code, self.proc = self.proc.returncode, None
        return code

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def __enter__(self) -> OperatorProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class EmulatorThread:
    """Runs a ``KubeEmulator`` on 127.0.0.1 in a background thread with its own loop.

    Tests talk to it over HTTP (kubectl, the operator) or call ``run`` to act on the
    store from the test thread.
    """

    def __init__(self, crds: list[dict] = ()) -> None:
        self._crds = list(crds)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self.emulator: KubeEmulator | None = None
        self.port: int | None = None
        self._thread = threading.Thread(target=self._main, name="kube-emulator", daemon=True)

    def __enter__(self) -> EmulatorThread:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the emulator did not start")
        return self

    def __exit__(self, *exc: Any) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        async with KubeEmulator() as emulator, kmock.Server(emulator) as server:
            for crd in self._crds:
                emulator.install_crd(crd)
            self.emulator, self.port = emulator, server.port
            self._ready.set()
            await self._stop.wait()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def run(self, fn: Callable[[KubeEmulator], T | Awaitable[T]]) -> T:
        """Call ``fn(emulator)`` on the emulator's loop (under its store lock); returns its result."""
        async def call() -> T:
            async with self.emulator._lock:
                result = fn(self.emulator)
                if asyncio.iscoroutine(result):
                    result = await result
                return result
        return asyncio.run_coroutine_threadsafe(call(), self._loop).result(10)

    def kubeconfig(self, namespace: str = "default", token: str = "emulator-token") -> dict:
        """A kubeconfig pointing at this emulator (plain HTTP; a dummy token is the cluster
        admin, one from ``KubeEmulator.service_account_token`` a ServiceAccount)."""
        return {
            "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "emulator", "user": {"token": token}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "emulator",
                                                          "namespace": namespace}}],
        }
