"""The test plays the ReplicaSet controller and the kubelet for engine pods on loopback.

For each engine pod it creates the Pod object (the Deployment's template labels, the
engine container as written, ``podIP``, ``Running`` and ``Ready`` once ``/health``
answers) and runs the container's command as a real process. Each pod gets its own
loopback address (127.0.0.1, 127.0.0.2, ...), as each pod has its own IP, so that every
engine listens on the port the Deployment names.

The process runs exactly the container's command and args, with three documented swaps
that only a node could make real:

- ``--model``: the path the engine image holds the demo checkpoint at
  (``DEMO_MODEL_IN_IMAGE``, baked in by Dockerfile.engine) becomes the demo checkpoint
  built locally for the test session;
- ``--host 0.0.0.0``: the pod's own address (its network namespace, here loopback);
- claims: each PersistentVolumeClaim named in ``claims`` (claim name -> a local directory,
  the claim's volume on this node) is mounted where the engine container's
  ``volumeMounts`` say (``subPath`` and ``readOnly`` included), in the process's own mount
  namespace and root (``support.pod_root``), so the pod's paths resolve in the process
  unchanged, on its command line (``--lora-modules``) and in what clients send it (the
  operator's ``POST /v1/load_lora_adapter``). Other volumes are the node's own files.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvpilot.engine.model.models.demo import DEMO_MODEL_NAME
from kvpilot.operator import constants as c

from support.pod_root import Mount, wrap

# Where Dockerfile.engine builds the demo checkpoint (ensure_demo_model("/opt/kvpilot")).
DEMO_MODEL_IN_IMAGE = f"/opt/kvpilot/{DEMO_MODEL_NAME}"


def swap_flag(args: list[str], flag: str, value: str) -> list[str]:
    """``args`` with the value of ``flag`` replaced (the flag must be there)."""
    out = list(args)
    out[out.index(flag) + 1] = value
    return out


def engine_container(pod_spec: dict) -> dict:
    return next(ct for ct in pod_spec["containers"] if ct["name"] == c.ENGINE_CONTAINER)


@dataclass
class EngineProcess:
    name: str
    ip: str
    port: int
    process: subprocess.Popen
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{self.port}"

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class Kubelet:
    """Engine pods of one namespace as processes, with their Pod objects in the emulator.

    Args:
        emu: the ``EmulatorThread`` holding the Pod objects.
        namespace: the pods' namespace.
        demo_dir: the local demo checkpoint that replaces ``DEMO_MODEL_IN_IMAGE``.
        workdir: where the engines' logs go.
        env: extra environment of every engine (the node's "GPU", say).
        claims: PersistentVolumeClaim name -> the local directory holding its volume
            (mounted as the pod says: see the module docstring).
    """

    emu: Any
    namespace: str
    demo_dir: Path
    workdir: Path
    env: dict[str, str] = field(default_factory=dict)
    claims: dict[str, Path] = field(default_factory=dict)
    engines: dict[str, EngineProcess] = field(default_factory=dict)
    _pending: dict[str, tuple[dict, dict]] = field(default_factory=dict)  # started, not admitted yet

    def command(self, container: dict, ip: str) -> list[str]:
        """The process of ``container`` on this node (see the module docstring for the swaps)."""
        args = swap_flag(container["args"], "--model", str(self.demo_dir))
        assert container["args"][container["args"].index("--model") + 1] == DEMO_MODEL_IN_IMAGE
        args = swap_flag(args, "--host", ip)
        executable = shutil.which(container["command"][0], path=str(Path(sys.executable).parent))
        return [executable, *container["command"][1:], *args]

    def mounts(self, pod_spec: dict) -> list[Mount]:
        """The engine container's mounts of the claims in ``claims``."""
        claims = {v["name"]: self.claims[v["persistentVolumeClaim"]["claimName"]]
                  for v in pod_spec.get("volumes") or ()
                  if (v.get("persistentVolumeClaim") or {}).get("claimName") in self.claims}
        return [Mount(m["mountPath"], claims[m["name"]] / m.get("subPath", ""), bool(m.get("readOnly")))
                for m in engine_container(pod_spec).get("volumeMounts") or () if m["name"] in claims]

    def start(self, name: str, pod_spec: dict, labels: dict[str, str],
              extra_args: tuple[str, ...] = ()) -> EngineProcess:
        """Start pod ``name``'s engine (its Pod object is stored once it is healthy: ``admit``).

        ``extra_args`` are appended to the process's command line only, not to the Pod
        object: a node whose engine does not run what the pod says (forced drift).
        """
        ip = f"127.0.0.{len(self.engines) + 1}"
        container = engine_container(pod_spec)
        port = next(p["containerPort"] for p in container["ports"] if p["name"] == "http")
        log_path = self.workdir / f"{name}.log"
        command = [*self.command(container, ip), *extra_args]
        mounts = self.mounts(pod_spec)
        if mounts:
            command = wrap(command, mounts, self.workdir / f"{name}.root")
        with log_path.open("wb") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env})
        engine = EngineProcess(name, ip, port, process, log_path)
        self.engines[name] = engine
        self._pending[name] = (copy.deepcopy(pod_spec), dict(labels))
        return engine

    def wait_healthy(self, name: str, timeout: float = 120) -> None:
        """Wait until pod ``name``'s engine answers ``/health`` with 200 (its Pod object is
        not stored yet: nothing in the cluster knows the pod is there)."""
        engine = self.engines[name]
        deadline = time.monotonic() + timeout
        while True:
            if engine.process.poll() is not None:
                raise RuntimeError(f"engine {name} exited:\n{engine.log_tail()}")
            try:
                if httpx.get(f"{engine.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine {name} not healthy after {timeout} s:\n{engine.log_tail()}")
            time.sleep(0.2)

    def admit(self, name: str, timeout: float = 120) -> dict:
        """Wait until pod ``name``'s engine is healthy, then store its Pod object as Ready."""
        self.wait_healthy(name, timeout)
        engine = self.engines[name]
        spec, labels = self._pending.pop(name)
        body = {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": self.namespace, "labels": labels}, "spec": spec}
        status = {"phase": "Running", "podIP": engine.ip, "podIPs": [{"ip": engine.ip}],
                  "conditions": [{"type": t, "status": "True"} for t in
                                 ("PodScheduled", "Initialized", "ContainersReady", "Ready")],
                  "containerStatuses": [{"name": ct["name"], "ready": True, "restartCount": 0,
                                         "image": ct["image"], "imageID": "", "started": True,
                                         "state": {"running": {}}} for ct in spec["containers"]]}

        def store(e):
            pods = e.types[("", "v1", "pods")]
            e._store_create(pods, self.namespace, body)
            return e._write(pods, self.namespace, name, "status", "PATCH", "application/merge-patch+json",
                            {"status": status})
        return self.emu.run(store)

    def remove(self, name: str) -> None:
        """Delete pod ``name``: its object, then its process."""
        self.emu.run(lambda e: e._delete(e.types[("", "v1", "pods")], self.namespace, name))
        self._stop(self.engines.pop(name))

    @staticmethod
    def _stop(engine: EngineProcess) -> None:
        if engine.process.poll() is None:
            engine.process.terminate()
            try:
                engine.process.wait(15)
            except subprocess.TimeoutExpired:
                engine.process.kill()
                engine.process.wait(5)

    def close(self) -> None:
        for engine in self.engines.values():
            self._stop(engine)
        self.engines.clear()
