"""The real operator process against the API emulator: the InferencePool of each service.

The Gateway API inference extension's InferencePool CRD (``inferencepool_crd.yaml``, its
v1.0 schema and CEL rules) is installed with the real kubectl in the middle of a test, so
the emulator admits each pool the operator writes as a real API server would. Tests that
install it get a cluster of their own (``own_cluster``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpilot.operator import constants as c
from kvpilot.operator.resources.inference_pool import ENGINE_TYPE_LABEL

from support.harness import wait_for
from support.operator_cluster import NS

pytestmark = pytest.mark.slow

INFERENCE_POOL_CRD = Path(__file__).resolve().parent / "inferencepool_crd.yaml"
POOL_API = "/apis/inference.networking.k8s.io/v1"


def _calls(cluster) -> list[tuple[str, str]]:
    """(method, path) of every request the emulator has answered."""
    def read(e):
        return [(getattr(r.method, "value", str(r.method)).upper(), r.url.path) for r in list(e)]
    return cluster.emu.run(read)


def _pool(cluster, name: str) -> dict | None:
    return cluster.obj("inferencepools", name)


def test_no_inference_pool_is_attempted_without_the_api(cluster):
    children = cluster.create("unrouted")
    cluster.settle(2)
    calls = _calls(cluster)
    assert ("GET", POOL_API) in calls                                  # discovery is asked each pass
    assert [call for call in calls if "/inferencepools" in call[1]] == []  # and nothing else is tried
    assert "InferencePool" not in children
    assert children["Deployment"]["spec"]["template"]["metadata"]["labels"][ENGINE_TYPE_LABEL] == "vllm"


def test_the_pool_is_created_updated_and_deleted_with_the_service(own_cluster):
    cluster = own_cluster
    cluster.create("routed")
    cluster.kubectl("apply", "--validate=false", "-f", str(INFERENCE_POOL_CRD))  # the API appears
    pool = wait_for(lambda: _pool(cluster, "routed"), what="the InferencePool")
    deployment = cluster.children("routed")["Deployment"]
    template = deployment["spec"]["template"]
    selector = pool["spec"]["selector"]["matchLabels"]
    assert selector == deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= template["metadata"]["labels"].items()  # the engine pods are its members
    (port,) = template["spec"]["containers"][0]["ports"]
    assert pool["spec"]["targetPorts"] == [{"number": port["containerPort"]}] == [{"number": 8000}]
    assert pool["spec"]["endpointPickerRef"] == {"group": "", "kind": "Service", "name": "routed-epp",
                                                 "port": {"number": 9002}, "failureMode": "FailClose"}
    (ref,) = pool["metadata"]["ownerReferences"]
    assert (ref["kind"], ref["uid"], ref["controller"]) == (c.KIND, cluster.cr("routed")["metadata"]["uid"], True)

    # the engine port and the endpoint picker change: the pool follows
    cluster.kubectl("patch", "inferenceservice", "routed", "--type", "merge", "-p", json.dumps({"spec": {
        "port": 8080, "routing": {"inferencePool": {"endpointPickerRef": {
            "name": "shared-epp", "port": 9102, "failureMode": "FailOpen"}}}}}))
    pool = wait_for(lambda: (p := _pool(cluster, "routed"))["spec"]["targetPorts"] == [{"number": 8080}] and p,
                    what="the new port")
    assert pool["spec"]["endpointPickerRef"] == {"group": "", "kind": "Service", "name": "shared-epp",
                                                 "port": {"number": 9102}, "failureMode": "FailOpen"}
    container = cluster.children("routed")["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["ports"][0]["containerPort"] == 8080
    assert container["args"][container["args"].index("--port") + 1] == "8080"

    # routing off: deleted; on again: back
    cluster.kubectl("patch", "inferenceservice", "routed", "--type", "merge",
                    "-p", json.dumps({"spec": {"routing": {"inferencePool": {"enabled": False}}}}))
    wait_for(lambda: _pool(cluster, "routed") is None, what="the pool deleted")
    assert ("DELETE", f"{POOL_API}/namespaces/{NS}/inferencepools/routed") in _calls(cluster)
    cluster.kubectl("patch", "inferenceservice", "routed", "--type", "merge",
                    "-p", json.dumps({"spec": {"routing": None}}))
    wait_for(lambda: _pool(cluster, "routed"), what="the pool back")

    # the service goes: its pool goes with it (owner reference, garbage collection)
    cluster.kubectl("delete", "inferenceservice", "routed", "--wait=false")
    wait_for(lambda: _pool(cluster, "routed") is None, what="the pool garbage-collected with its owner")
