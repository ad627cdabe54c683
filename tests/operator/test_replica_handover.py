"""Switching ``spec.autoscaling.mode`` on a running service never shrinks it.

The real operator against the API emulator, which defaults a Deployment's missing
``spec.replicas`` to 1 as the API server does. Every version of the Deployment the
emulator stored after the switch is checked, so a drop that lasts a single write is seen.

- none -> hpa: the operator stops managing the count without removing it (the HPA takes
  over from the count the service had);
- hpa -> none: the operator inherits the count the autoscaler had reached and keeps it
  until ``kubectl scale kvis`` sets one.
"""

from __future__ import annotations

import json
import re

import pytest
import yaml

from kvpilot.operator import constants as c

from support import crd_schema
from support.chart import CHART
from support.harness import EmulatorThread, Kubectl, OperatorProcess, wait_for, write_kubeconfig
from support.rbac import assert_chart_grants

pytestmark = pytest.mark.slow
NS = "handover"
SPEC = {"model": {"uri": "hf://Qwen/Qwen3-0.6B"}, "gpu": {"type": "l4"},
        "slo": {"maxContext": 8192, "p95PromptTokens": 2048, "p95OutputTokens": 512, "concurrency": 8}}
HPA = {"mode": "hpa", "minReplicas": 1, "maxReplicas": 6}


class Env:
    def __init__(self, emu: EmulatorThread, kubectl: Kubectl, operator: OperatorProcess) -> None:
        self.emu, self.kubectl, self.operator = emu, kubectl, operator

    def apply(self, name: str, spec: dict) -> None:
        obj = {"apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": name, "namespace": NS},
               "spec": spec}
        self.kubectl("apply", "--validate=false", "-f", "-", stdin=yaml.safe_dump(obj))

    def patch(self, name: str, spec: dict) -> None:
        self.kubectl("patch", "inferenceservice", name, "--type", "merge", "-p", json.dumps({"spec": spec}))

    def versions(self, name: str) -> list[dict]:
        """Every stored version of the Deployment ``name``, oldest first."""
        return self.emu.run(lambda e: e.history("apps", "deployments", NS, name))

    def deployment(self, name: str) -> dict | None:
        versions = self.versions(name)
        return versions[-1] if versions else None

    def has_hpa(self, name: str) -> bool:
        return bool(self.emu.run(lambda e: ("autoscaling", "horizontalpodautoscalers", NS, name) in e.objects))

    def settle(self, passes: int = 3) -> None:
        """Wait for ``passes`` more reconcile passes (of any service; the resync is 1 s here)."""
        def runs() -> int:
            return len(re.findall(r"\] reconcile pass \d+ done", self.operator.log()))
        start = runs()
        wait_for(lambda: runs() >= start + passes, 20, 0.1, "observer passes")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("handover")
    with EmulatorThread([crd_schema.load_crd()]) as emu:
        kubeconfig = write_kubeconfig(emu.kubeconfig(NS), tmp)
        with OperatorProcess(kubeconfig, tmp / "operator.log") as operator:
            yield Env(emu, Kubectl(kubeconfig, tmp, NS), operator)
            log = operator.log()
        assert emu.emulator.failures == []
        assert "Traceback" not in log, log[-4000:]
        assert_chart_grants(emu.emulator.calls, [CHART / "ci" / "ha-off-values.yaml"])


def _replicas(deployment: dict) -> int:
    return deployment["spec"]["replicas"]


def _last_applied(deployment: dict) -> dict:
    return json.loads(deployment["metadata"]["annotations"][c.ANNOTATION_LAST_APPLIED])


def test_switching_on_an_autoscaler_keeps_the_replica_count(env):
    env.apply("grow", {**SPEC, "replicas": 3})
    wait_for(lambda: (d := env.deployment("grow")) and _replicas(d) == 3, what="3 replicas")
    mark = len(env.versions("grow"))
    env.patch("grow", {"autoscaling": HPA})
    wait_for(lambda: env.has_hpa("grow"), what="the HPA")
    env.settle()
    after = env.versions("grow")[mark:]
    assert after, "the operator never rewrote the Deployment (its last-applied must change)"
    assert [_replicas(d) for d in after] == [3] * len(after)
    assert "replicas" not in _last_applied(after[-1])["spec"]  # the HPA owns it now


def test_switching_off_the_autoscaler_keeps_what_it_reached(env):
    env.apply("shrink", {**SPEC, "autoscaling": HPA})
    wait_for(lambda: env.has_hpa("shrink") and env.deployment("shrink"), what="the HPA and Deployment")
    planned = _replicas(env.deployment("shrink"))
    assert planned < 5
    env.kubectl("patch", "deployment", "shrink", "--subresource=scale", "--type", "merge",
                "-p", '{"spec":{"replicas":5}}')  # what the HPA controller does under load
    mark = len(env.versions("shrink"))
    env.patch("shrink", {"autoscaling": {"mode": "none"}})
    wait_for(lambda: not env.has_hpa("shrink"), what="the HPA removed")
    env.settle()
    after = env.versions("shrink")[mark:]
    assert after and [_replicas(d) for d in after] == [5] * len(after)
    final = after[-1]
    assert final["metadata"]["annotations"][c.ANNOTATION_INHERITED_REPLICAS] == "5"
    assert _last_applied(final)["spec"]["replicas"] == 5  # the operator owns the count again

    # An explicit count wins over the inherited one, and the annotation goes.
    env.kubectl("scale", "inferenceservice", "shrink", "--replicas=2")
    final = wait_for(lambda: (d := env.deployment("shrink")) and _replicas(d) == 2 and d, what="2 replicas")
    wait_for(lambda: c.ANNOTATION_INHERITED_REPLICAS not in
             (env.deployment("shrink")["metadata"].get("annotations") or {}), what="annotation removed")
    # ... and autoscaling back on takes over from 2, not from 1.
    mark = len(env.versions("shrink"))
    env.patch("shrink", {"autoscaling": HPA})
    wait_for(lambda: env.has_hpa("shrink"), what="the HPA again")
    env.settle()
    assert [_replicas(d) for d in env.versions("shrink")[mark:]] == \
        [2] * len(env.versions("shrink")[mark:])
