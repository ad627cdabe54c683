"""An emulator and a real operator process, driven over HTTP, for the scale and fault tests.

``running(tmp, env)`` starts both; ``OperatorEnv`` creates services with plain API
requests (faster than kubectl when there are dozens), reads the emulator's store, and
counts the operator's requests (``traffic``). Each test works in namespaces of its own.
"""

from __future__ import annotations

import contextlib
import copy
import json
import time
import traceback
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from support import crd_schema, traffic
from support.chart import CHART
from support.harness import EmulatorThread, Kubectl, OperatorProcess, wait_for, write_kubeconfig
from support.kube_emulator import KubeEmulator
from support.rbac import assert_chart_grants

GROUP, VERSION, PLURAL = "serving.kvpilot.dev", "v1alpha1", "inferenceservices"
SMALL = {"model": {"uri": "hf://Qwen/Qwen3-0.6B"}, "gpu": {"type": "l4"},
         "slo": {"maxContext": 8192, "p95PromptTokens": 2048, "p95OutputTokens": 512, "concurrency": 8}}
CHILD_PLURALS = ("deployments", "services", "persistentvolumeclaims", "horizontalpodautoscalers",
                 "poddisruptionbudgets", "podmonitors", "scaledobjects")
MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"


class OperatorEnv:
    """The emulator, a kubectl for it, and the operator process."""

    def __init__(self, emu: EmulatorThread, kubectl: Kubectl, operator: OperatorProcess) -> None:
        self.emu, self.kubectl, self.operator = emu, kubectl, operator

    @property
    def emulator(self) -> KubeEmulator:
        return self.emu.emulator

    # ------------------------------------------------------------------ requests

    def request(self, method: str, path: str, body: Any = None, ctype: str = "application/json") -> dict:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.emu.url + path, data=data, method=method,
                                     headers={"Content-Type": ctype, "User-Agent": "test"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read() or b"{}")

    def namespace(self, ns: str) -> str:
        with contextlib.suppress(urllib.error.HTTPError):  # 409: it exists already
            self.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                        "metadata": {"name": ns}})
        return ns

    def create(self, ns: str, name: str, spec: dict = SMALL) -> dict:
        return self.request("POST", f"/apis/{GROUP}/{VERSION}/namespaces/{ns}/{PLURAL}",
                            {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceService",
                             "metadata": {"name": name, "namespace": ns}, "spec": spec})

    def child_path(self, plural: str, ns: str, name: str) -> str:
        base = {"deployments": "/apis/apps/v1", "services": "/api/v1"}[plural]
        return f"{base}/namespaces/{ns}/{plural}/{name}"

    # ------------------------------------------------------------------ store

    def find(self, fn: Callable[[KubeEmulator], Any]) -> Any:
        return copy.deepcopy(self.emu.run(fn))

    def cr(self, ns: str, name: str) -> dict | None:
        return self.find(lambda e: e.objects.get((GROUP, PLURAL, ns, name)))

    def children(self, ns: str, name: str) -> dict[str, dict]:
        """The service's children by kind."""
        return self.find(lambda e: {o["kind"]: o for (g, p, n, nm), o in e.objects.items()
                                    if p in CHILD_PLURALS and n == ns and any(r.get("name") == name for r in
                                            o["metadata"].get("ownerReferences") or ())})

    def condition(self, ns: str, name: str, ctype: str) -> dict | None:
        status = (self.cr(ns, name) or {}).get("status") or {}
        return next((x for x in status.get("conditions") or () if x["type"] == ctype), None)

    def wait_condition(self, ns: str, name: str, ctype: str, status: str, timeout: float = 20) -> dict:
        return wait_for(lambda: (cond := self.condition(ns, name, ctype)) and cond["status"] == status
                        and cond, timeout, what=f"{ns}/{name} {ctype}={status}")

    def reconciled(self, ns: str, name: str) -> bool:
        """Planned, with its Deployment and Service, and its status for this generation."""
        cr = self.cr(ns, name) or {}
        status = cr.get("status") or {}
        planned = any(c["type"] == "Planned" and c["status"] == "True" for c in status.get("conditions") or ())
        children = self.children(ns, name)
        return planned and status.get("observedGeneration") == cr["metadata"]["generation"] and \
            {"Deployment", "Service"} <= set(children)

    def events(self, ns: str, name: str, reason: str | None = None) -> list[dict]:
        return self.find(lambda e: [o for (g, p, n, _), o in e.objects.items()
                                    if p == "events" and g == "" and n == ns
                                    and o["involvedObject"].get("name") == name
                                    and (reason is None or o.get("reason") == reason)])

    # ------------------------------------------------------------------ traffic

    def mark(self) -> int:
        return len(traffic.requests(self.emulator))

    def operator_requests(self, since: int, ns: str | None = None) -> list:
        """The operator's requests since ``mark``, only those under ``/namespaces/<ns>/`` if given."""
        reqs = traffic.by_operator(traffic.requests(self.emulator, since))
        return [r for r in reqs if ns is None or f"/namespaces/{ns}/" in r.url.path]

    def calls(self, since: int, ns: str | None = None) -> Counter:
        return traffic.counts(self.operator_requests(since, ns))

    def quiet(self, ns: str, window: float = 1.0, timeout: float = 30) -> None:
        """Wait until the operator makes no request in ``ns`` for ``window`` seconds."""
        def still() -> bool:
            mark = self.mark()
            time.sleep(window)
            return not self.operator_requests(mark, ns)
        wait_for(still, timeout, 0, f"no operator requests in {ns}")


@contextlib.contextmanager
def running(tmp: Path, env: dict[str, str] | None = None) -> Iterator[OperatorEnv]:
    """An emulator holding the CRD, and the operator (all namespaces) watching it."""
    with EmulatorThread([crd_schema.load_crd()]) as emu:
        kubeconfig = write_kubeconfig(emu.kubeconfig(), tmp)
        operator = OperatorProcess(kubeconfig, tmp / "operator.log", env=env)
        operator.start()
        try:
            yield OperatorEnv(emu, Kubectl(kubeconfig, tmp), operator)
        finally:
            operator.stop()
            assert emu.emulator.failures == [], "".join(traceback.format_exception(emu.emulator.failures[0]))
            assert "Traceback" not in operator.log(), operator.log()[-4000:]
            # every call the operator made here, faults and all, is one the Helm chart's RBAC grants
            assert_chart_grants(emu.emulator.calls, [CHART / "ci" / "ha-off-values.yaml"])
