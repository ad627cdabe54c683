"""One emulator, one kubectl and one real operator process (``kvpilot operator``): the
``Cluster`` the operator tests drive (their fixtures are in tests/operator/conftest.py).

Objects are created and changed with the real kubectl, observed in the emulator's store,
and writes are counted at the emulator.
"""

from __future__ import annotations

import contextlib
import copy
import re
import time
from collections.abc import Iterator
from pathlib import Path

import yaml

from kvpilot.operator import constants as c

from support import crd_schema, kube_scheduler
from support.chart import CHART
from support.harness import EmulatorThread, Kubectl, OperatorProcess, wait_for, write_kubeconfig
from support.rbac import assert_chart_grants

NS = "team-a"
CHILD_PLURALS = ("deployments", "services", "persistentvolumeclaims", "horizontalpodautoscalers",
                 "poddisruptionbudgets", "podmonitors", "scaledobjects", "prometheusrules",
                 "serviceaccounts", "networkpolicies", "leaderworkersets")
SMALL = {"model": {"uri": "hf://Qwen/Qwen3-0.6B"}, "gpu": {"type": "l4"},
         "slo": {"maxContext": 8192, "p95PromptTokens": 2048, "p95OutputTokens": 512, "concurrency": 8}}
INFEASIBLE = {"model": {"uri": "hf://Qwen/Qwen3-32B"}, "gpu": {"type": "l4"},
              "slo": {"maxContext": 32768, "p95PromptTokens": 16000, "p95OutputTokens": 1000,
                      "concurrency": 64}}


class Cluster:
    """The emulator, kubectl and the operator of this module."""

    def __init__(self, emu: EmulatorThread, kubectl: Kubectl, operator: OperatorProcess) -> None:
        self.emu, self.kubectl, self.operator = emu, kubectl, operator

    def obj(self, plural: str, name: str, ns: str = NS) -> dict | None:
        def find(e):
            return next((o for (g, p, n, nm), o in e.objects.items() if p == plural and n == ns and nm == name),
                        None)
        return copy.deepcopy(self.emu.run(find))

    def cr(self, name: str) -> dict | None:
        return self.obj("inferenceservices", name)

    def children(self, name: str) -> dict[str, dict]:
        def find(e):
            return {o["kind"]: o for (g, p, n, nm), o in e.objects.items()
                    if p in CHILD_PLURALS and n == NS and
                    (o["metadata"].get("labels") or {}).get(c.LABEL_INSTANCE) == name}
        return copy.deepcopy(self.emu.run(find))

    def condition(self, name: str, ctype: str) -> dict | None:
        cr = self.cr(name) or {}
        return next((x for x in (cr.get("status") or {}).get("conditions") or () if x["type"] == ctype), None)

    def wait_condition(self, name: str, ctype: str, status: str, timeout: float = 20) -> dict:
        return wait_for(lambda: (cond := self.condition(name, ctype)) and cond["status"] == status and cond,
                        timeout, what=f"{name} {ctype}={status}")

    def apply(self, name: str, spec: dict, labels: dict | None = None) -> None:
        obj = {"apiVersion": c.API_VERSION, "kind": c.KIND,
               "metadata": {"name": name, "namespace": NS, **({"labels": labels} if labels else {})},
               "spec": spec}
        self.kubectl("apply", "--validate=false", "-f", "-", stdin=yaml.safe_dump(obj))

    def add(self, plural: str, body: dict, ns: str | None = NS) -> dict:
        """Store ``body`` as the test code (a node joining, a pod the ReplicaSet made)."""
        return self.emu.run(lambda e: e._store_create(
            next(t for t in e.types.values() if t.group == "" and t.plural == plural), ns, body))

    def add_node(self, node: dict) -> dict:
        return self.emu.run(lambda e: kube_scheduler.add_node(e, node))

    def remove(self, plural: str, name: str, ns: str | None = NS) -> None:
        self.emu.run(lambda e: e._delete(next(t for t in e.types.values() if t.group == "" and t.plural == plural),
                                         ns, name))

    def engine_pod(self, name: str, pod_name: str) -> dict:
        """Store the pod the ReplicaSet would make from ``name``'s Deployment (Pending, unbound)."""
        template = copy.deepcopy(self.children(name)["Deployment"]["spec"]["template"])
        return self.add("pods", {"apiVersion": "v1", "kind": "Pod", "metadata": {**template["metadata"],
                                                                                "name": pod_name},
                                 "spec": template["spec"]})

    def schedule(self) -> dict:
        """One round of the emulated kube-scheduler (``support.kube_scheduler``)."""
        return self.emu.run(kube_scheduler.schedule)

    def writes(self) -> int:
        return len(self.emu.emulator.writes)

    def writes_since(self, mark: int) -> list:
        return self.emu.emulator.writes[mark:]

    def events(self, name: str) -> list[dict]:
        def find(e):
            return [o for (g, p, n, nm), o in e.objects.items()
                    if p == "events" and g == "" and o["involvedObject"].get("name") == name]
        return copy.deepcopy(self.emu.run(find))

    def timer_runs(self) -> int:
        return len(re.findall(r"\] reconcile pass \d+ done", self.operator.log()))

    def settle(self, runs: int = 2) -> None:
        """Wait until reconcile passes (the 1 s resync, of any service) have run ``runs`` more times."""
        start = self.timer_runs()
        wait_for(lambda: self.timer_runs() >= start + runs, 20, 0.1, "observer timer runs")

    def create(self, name: str, spec: dict = SMALL) -> dict[str, dict]:
        """Applies a planned InferenceService; returns its children once the Deployment and
        the Service exist."""
        self.apply(name, spec)
        self.wait_condition(name, "Planned", "True")
        return wait_for(lambda: (ch := self.children(name)) and {"Deployment", "Service"} <= set(ch) and ch,
                        what=f"{name}'s children")

    def delete_all(self) -> None:
        """Deletes every InferenceService (and foreign object a test made) in the namespace and
        waits until the finalizers are released and the children garbage-collected."""
        def names(e) -> list[str]:
            return [nm for (g, p, n, nm) in e.objects if p == "inferenceservices" and n == NS]
        for name in self.emu.run(names):
            self.kubectl("delete", "inferenceservice", name, "--wait=false", check=False)
        wait_for(lambda: not self.emu.run(names), what="every InferenceService deleted")

        def leftovers(e) -> list:
            return [k for k, o in e.objects.items() if k[1] in CHILD_PLURALS and k[2] == NS]
        wait_for(lambda: not self.emu.run(leftovers), what="every child garbage-collected")

    def quiesce(self, window: float = 2.5) -> None:
        """Wait until a ``window`` (over two resync periods) passes without any write."""
        def quiet() -> bool:
            mark = self.writes()
            time.sleep(window)
            return self.writes() == mark
        wait_for(quiet, 30, 0, "a quiet cluster")


@contextlib.contextmanager
def running_cluster(tmp: Path, env: dict[str, str] | None = None) -> Iterator[Cluster]:
    """An emulator holding the CRD, and the operator watching it (``env``: its KVPILOT_*
    settings beside the harness's)."""
    with EmulatorThread([crd_schema.load_crd()]) as emu:
        kubeconfig = write_kubeconfig(emu.kubeconfig(NS), tmp)
        kubectl = Kubectl(kubeconfig, tmp, NS)
        operator = OperatorProcess(kubeconfig, tmp / "operator.log", env=env)
        operator.start()
        try:
            yield Cluster(emu, kubectl, operator)
        finally:
            operator.stop()
            assert emu.emulator.failures == []
            assert "Traceback" not in operator.log(), operator.log()[-4000:]
            # every call of every scenario here is one the Helm chart's RBAC grants
            assert_chart_grants(emu.emulator.calls, [CHART / "ci" / "ha-off-values.yaml"])
