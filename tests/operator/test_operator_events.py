"""The operator acts on watch events: drift is repaired and APIs are discovered without polling.

The operator here runs with a one-hour resync, so nothing in these tests can come from a
periodic pass: every repair is driven by the watch event of the child that changed.
"""

from __future__ import annotations

import re
import time

import pytest
import yaml

from kvpilot.operator import constants as c

from support.harness import wait_for
from support.operator_env import JSON_PATCH, OperatorEnv, running

pytestmark = pytest.mark.slow
PODMONITOR_DISCOVERY = "/apis/monitoring.coreos.com/v1"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with running(tmp_path_factory.mktemp("events"), {"KVPILOT_RESYNC_SECONDS": "3600"}) as env:
        yield env


def _resync_passes(env: OperatorEnv, ns: str) -> int:
    return len(re.findall(rf"\[{ns}/[^\]]+\] reconcile pass \d+ starting \(resync\)", env.operator.log()))


def _timed(env: OperatorEnv, change, restored, what: str) -> float:
    started = time.monotonic()
    change()
    wait_for(restored, 10, 0.01, what)
    return time.monotonic() - started


def test_drift_is_repaired_from_watch_events_within_a_second(env):
    ns = env.namespace("drift")
    env.create(ns, "svc")
    wait_for(lambda: env.reconciled(ns, "svc"), what="svc reconciled")
    env.quiet(ns)
    before = env.children(ns, "svc")
    args = before["Deployment"]["spec"]["template"]["spec"]["containers"][0]["args"]
    mark = env.mark()

    def deployment():
        return env.children(ns, "svc").get("Deployment")

    deleted = _timed(env, lambda: env.request("DELETE", env.child_path("deployments", ns, "svc")),
                     lambda: (d := deployment()) and d["metadata"]["uid"] != before["Deployment"]["metadata"]["uid"]
                     and d["spec"]["template"]["spec"]["containers"][0]["args"] == args,
                     "the Deployment re-created")
    tampered = _timed(env, lambda: env.request("PATCH", env.child_path("services", ns, "svc"), [
        {"op": "replace", "path": "/spec/ports/0/port", "value": 9999}], JSON_PATCH),
                      lambda: env.children(ns, "svc")["Service"]["spec"]["ports"][0]["port"] == 80,
                      "the Service port restored")
    # Without the managed-by label the Deployment leaves the operator's watch (DELETED there);
    # the operator finds it again by name and puts the label back.
    unlabelled = _timed(env, lambda: env.kubectl("-n", ns, "label", "deployment", "svc", f"{c.LABEL_MANAGED_BY}-"),
                        lambda: (deployment()["metadata"]["labels"] or {}).get(c.LABEL_MANAGED_BY) == c.MANAGER,
                        "the managed-by label restored")
    print(f"\ndrift repair through watch events: deleted Deployment {deleted:.2f}s, "
          f"tampered Service {tampered:.2f}s, unlabelled Deployment {unlabelled:.2f}s (kubectl included)")
    assert max(deleted, tampered) < 2.0 and unlabelled < 3.0
    assert _resync_passes(env, ns) == 0  # every pass came from an event
    reads = [key for key in env.calls(mark, ns) if key[0] in ("get", "list")]
    assert reads == [("get", "apps/deployments")], reads  # only the unlabelled one: looked up by name


def test_discovery_is_asked_once_and_again_only_when_a_crd_changes(env):
    ns = env.namespace("disco")

    def asked(since: int) -> int:  # by the operator's client (kopf rescans a group whose CRDs change)
        return sum(1 for r in env.operator_requests(since) if r.url.path == PODMONITOR_DISCOVERY
                   and r.headers.get("User-Agent") == "kvpilot-operator")

    mark = env.mark()
    for i in range(6):
        env.create(ns, f"svc-{i}")
    wait_for(lambda: all(env.reconciled(ns, f"svc-{i}") for i in range(6)), what="6 services")
    assert asked(mark) <= 1  # 0 when an earlier test already asked

    crd = {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
           "metadata": {"name": "podmonitors.monitoring.coreos.com"},
           "spec": {"group": "monitoring.coreos.com", "scope": "Namespaced",
                    "names": {"kind": "PodMonitor", "plural": "podmonitors", "singular": "podmonitor"},
                    "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                        "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]}}
    mark = env.mark()
    env.kubectl("apply", "--validate=false", "-f", "-", stdin=yaml.safe_dump(crd))
    try:
        wait_for(lambda: all("PodMonitor" in env.children(ns, f"svc-{i}") for i in range(6)),
                 what="a PodMonitor for every existing service")
        assert asked(mark) == 1  # the CRD event made the operator ask once more, not per service
    finally:
        mark = env.mark()
        env.kubectl("delete", "crd", crd["metadata"]["name"])
        wait_for(lambda: asked(mark) == 1, what="discovery asked again after the CRD went")
        env.quiet(ns)
    assert asked(mark) == 1
    for i in range(6):
        env.request("DELETE", f"/apis/serving.kvpilot.dev/v1alpha1/namespaces/{ns}/inferenceservices/svc-{i}")
