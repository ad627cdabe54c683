"""Where the closed-loop scenario runs: the API emulator with the test as kubelet, or a
real cluster. Both give the scenario the same few verbs; everything else it does through
``kubectl`` and Prometheus' HTTP API.

- ``EmulatedPlatform``: the emulator on loopback, the real ``kvpilot operator`` process,
  the test as ReplicaSet controller and kubelet (``kubelet.Kubelet``: real ``kvpilot
  serve`` processes), a real Prometheus whose targets follow the PodMonitor.
- ``ClusterPlatform`` (``KUBECONFIG``): a scratch namespace of a real cluster whose GPU
  nodes run the engine image (``KVPILOT_E2E_ENGINE_IMAGE``, with the demo checkpoint baked
  in by Dockerfile.engine), a Prometheus that selects the operator's PodMonitors
  (``KVPILOT_E2E_PROMETHEUS_URL``); the operator runs here and reads the engines through
  the API server's pod proxy (``KVPILOT_ENGINE_METRICS=apiserver``).
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import uuid
from pathlib import Path
from typing import Any

import yaml

from support import crd_schema
from support.harness import (
    EmulatorThread,
    Kubectl,
    OperatorProcess,
    free_port,
    schemaless_crd,
    wait_for,
    write_kubeconfig,
)
from support.kubelet import Kubelet, engine_container
from support.prometheus_sd import LocalPrometheus, PrometheusApi, podmonitor_targets

GIB = 1 << 30


class Platform:
    """What the scenario needs from where it runs (see the module docstring)."""

    kubectl: Kubectl
    prometheus: Any
    namespace: str
    operator: OperatorProcess
    metrics_port: int
    timeout: float = 60.0

    def get(self, kind: str, name: str) -> dict | None:
        run = self.kubectl("get", kind, name, "-o", "json", check=False)
        return json.loads(run.stdout) if run.returncode == 0 else None

    def events(self, name: str) -> list[dict]:
        run = self.kubectl("get", "events", "--field-selector", f"involvedObject.name={name}", "-o", "json")
        return json.loads(run.stdout)["items"]

    # the verbs each platform implements
    def first_pod(self, deployment: dict, plan: dict) -> str: ...
    def add_pod(self, deployment: dict, kv_cache_memory_bytes: int) -> str: ...
    def remove_pod(self, name: str) -> None: ...
    def engine_url(self, name: str) -> str: ...
    def scale(self, name: str, replicas: int) -> None: ...


class EmulatedPlatform(Platform):
    def __init__(self, tmp: Path, namespace: str, demo_dir: Path) -> None:
        self.tmp, self.namespace, self.demo_dir = tmp, namespace, demo_dir
        self.emu = EmulatorThread([crd_schema.load_crd(),
                                   schemaless_crd("monitoring.coreos.com", "v1", "PodMonitor", "podmonitors"),
                                   schemaless_crd("keda.sh", "v1alpha1", "ScaledObject", "scaledobjects")])
        self.kubelet: Kubelet | None = None
        self.pods = 0

    def __enter__(self) -> EmulatedPlatform:
        self.prometheus = LocalPrometheus(self.tmp).start()  # its first scrape takes seconds: start early
        self.operator: OperatorProcess | None = None
        try:
            self.emu.__enter__()
            kubeconfig = write_kubeconfig(self.emu.kubeconfig(self.namespace), self.tmp)
            self.kubectl = Kubectl(kubeconfig, self.tmp, self.namespace)
            self.metrics_port = free_port()
            self.operator = OperatorProcess(kubeconfig, self.tmp / "operator.log",
                                            env={"KVPILOT_METRICS_PORT": str(self.metrics_port)}).start()
        except BaseException:   # __exit__ does not run when __enter__ raises
            self.prometheus.stop()
            if self.emu.port is not None:
                self.emu.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.kubelet is not None:
            self.kubelet.close()
        if self.operator is not None:
            self.operator.stop()
        self.prometheus.stop()
        self.emu.__exit__(*exc)

    def _sync_targets(self) -> None:
        pods = self.emu.run(lambda e: [copy.deepcopy(o) for k, o in e.objects.items() if k[1] == "pods"])
        monitor = self.get("podmonitor", self.name)
        self.prometheus.set_targets(podmonitor_targets(monitor, pods))

    def _start(self, deployment: dict, extra_args: tuple[str, ...] = ()) -> str:
        template = deployment["spec"]["template"]
        self.pods += 1
        name = f"{deployment['metadata']['name']}-5d8f7c6b9-{'abcdefgh'[self.pods - 1] * 5}"
        self.kubelet.start(name, template["spec"], template["metadata"]["labels"], extra_args)
        return name

    def _admit(self, name: str) -> None:
        self.kubelet.admit(name)
        self._sync_targets()

    def first_pod(self, deployment: dict, plan: dict) -> str:
        self.name = deployment["metadata"]["name"]
        # The node's GPU, through the engine's test hook (engine/model/device_memory.py): as
        # much memory as the planner expects profiling to leave for the KV cache.
        total = plan["kvEstimateBytes"] / plan["gpuMemoryUtilization"] / GIB
        self.kubelet = Kubelet(self.emu, self.namespace, self.demo_dir, self.tmp,
                               {"KVPILOT_FAKE_DEVICE_MEMORY": json.dumps({"total_gib": total, "free_gib": total})})
        first = self._start(deployment)
        self._admit(first)
        return first

    def prepare_drift(self, deployment: dict, kv_cache_memory_bytes: int) -> None:
        """Start the next pod's engine now, with fewer blocks than its pod says (it loads
        while the load runs); ``add_pod`` admits it."""
        self._next = self._start(deployment, ("--kv-cache-memory-bytes", str(kv_cache_memory_bytes)))

    def add_pod(self, deployment: dict, kv_cache_memory_bytes: int) -> str:
        self._admit(self._next)
        return self._next

    def remove_pod(self, name: str) -> None:
        self.kubelet.remove(name)
        self._sync_targets()

    def engine_url(self, name: str) -> str:
        return self.kubelet.engines[name].url

    def scale(self, name: str, replicas: int) -> None:
        """What the HPA controller does, and the Deployment controller's status after it."""
        self.kubectl("scale", "deployment", name, f"--replicas={replicas}")
        generation = self.get("deployment", name)["metadata"]["generation"]
        status = {"status": {"replicas": replicas, "readyReplicas": replicas, "updatedReplicas": replicas,
                             "availableReplicas": replicas, "observedGeneration": generation}}
        self.kubectl("patch", "deployment", name, "--subresource=status", "--type", "merge",
                     "-p", json.dumps(status))


class ClusterPlatform(Platform):
    timeout = 900.0  # image pulls and model loads on real nodes

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.namespace = f"kvpilot-e2e-{uuid.uuid4().hex[:6]}"
        self.kubeconfig = Path(os.environ["KUBECONFIG"].split(os.pathsep)[0])
        self.forwards: dict[str, tuple[subprocess.Popen, str]] = {}

    def __enter__(self) -> ClusterPlatform:
        self.prometheus = PrometheusApi(os.environ["KVPILOT_E2E_PROMETHEUS_URL"])
        admin = Kubectl(self.kubeconfig, self.tmp)
        admin("create", "namespace", self.namespace)
        admin("apply", "--server-side", "-f", str(crd_schema.CRD_PATH))
        self.kubectl = Kubectl(self.kubeconfig, self.tmp, self.namespace)
        self.metrics_port = free_port()
        env = {"KVPILOT_METRICS_PORT": str(self.metrics_port), "KVPILOT_ENGINE_METRICS": "apiserver",
               "KVPILOT_RESYNC_SECONDS": "2"}
        if os.environ.get("KVPILOT_E2E_ENGINE_IMAGE"):
            env["KVPILOT_ENGINE_IMAGE"] = os.environ["KVPILOT_E2E_ENGINE_IMAGE"]
        self.operator = OperatorProcess(self.kubeconfig, self.tmp / "operator.log",
                                        args=("--namespace", self.namespace), env=env).start()
        return self

    def __exit__(self, *exc: Any) -> None:
        for process, _ in self.forwards.values():
            process.terminate()
        self.operator.stop()
        self.prometheus.stop()
        Kubectl(self.kubeconfig, self.tmp)("delete", "namespace", self.namespace, "--wait=false", check=False)

    def _ready_pods(self, selector: str) -> list[str]:
        pods = json.loads(self.kubectl("get", "pods", "-l", selector, "-o", "json").stdout)["items"]
        return [p["metadata"]["name"] for p in pods if any(
            c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or ())]

    def first_pod(self, deployment: dict, plan: dict) -> str:
        selector = ",".join(f"{k}={v}" for k, v in deployment["spec"]["selector"]["matchLabels"].items())
        return wait_for(lambda: (pods := self._ready_pods(selector)) and pods[0], self.timeout, 2,
                        "a ready engine pod")

    def prepare_drift(self, deployment: dict, kv_cache_memory_bytes: int) -> None:
        return None

    def add_pod(self, deployment: dict, kv_cache_memory_bytes: int) -> str:
        """A bare pod from the Deployment's template whose engine gets fewer blocks."""
        template = copy.deepcopy(deployment["spec"]["template"])
        container = engine_container(template["spec"])
        container["args"] = [*container["args"], "--kv-cache-memory-bytes", str(kv_cache_memory_bytes)]
        name = f"{deployment['metadata']['name']}-drift"
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, **template["metadata"]},
               "spec": template["spec"]}
        self.kubectl("apply", "--validate=false", "-f", "-", stdin=yaml.safe_dump(pod))
        wait_for(lambda: name in self._ready_pods(f"app.kubernetes.io/instance={deployment['metadata']['name']}"),
                 self.timeout, 2, f"pod {name} ready")
        return name

    def remove_pod(self, name: str) -> None:
        self.kubectl("delete", "pod", name, "--wait=true")

    def engine_url(self, name: str) -> str:
        if name not in self.forwards:
            pod = self.get("pod", name)
            port = next(p["containerPort"] for p in engine_container(pod["spec"])["ports"] if p["name"] == "http")
            process = subprocess.Popen(
                ["kubectl", "--kubeconfig", str(self.kubeconfig), "-n", self.namespace, "port-forward",
                 f"pod/{name}", f":{port}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            line = process.stdout.readline()
            local = re.search(r"127\.0\.0\.1:(\d+)", line)
            assert local, line
            self.forwards[name] = (process, f"http://127.0.0.1:{local.group(1)}")
        return self.forwards[name][1]

    def scale(self, name: str, replicas: int) -> None:
        return None  # the cluster's own controllers (the drift pod is a bare pod there)
