"""The real operator process against the API emulator: replicas spanning nodes.

Without the LeaderWorkerSet API the 405B example gets ``Degraded=MissingAPI`` naming it,
and nothing is built; once kubernetes-sigs/lws's CRD is installed (its v0.10.0 schema, so
the emulator admits each LeaderWorkerSet as a real API server would) the operator builds
one group of two 8-GPU pods and its headless Service; replicas and the autoscaler act on
groups.
"""

from __future__ import annotations

import copy
import json

import pytest
import yaml

from support import crd_schema
from support.engine_workload import LWS_CRD_PATH, engine_container, lws_errors
from support.harness import wait_for

pytestmark = pytest.mark.slow

EXAMPLE = yaml.safe_load(next(p for p in crd_schema.EXAMPLES if p.stem == "llama-405b-fp8-two-nodes").read_text())
NAME, GROUP = "llama-405b", "llama-405b-group"


def _spec(**changes) -> dict:
    spec = copy.deepcopy(EXAMPLE["spec"])
    spec.pop("apiKeySecretRef")
    spec["model"].pop("credentialsSecretRef")
    for key, value in changes.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    return spec


def _lws(cluster) -> dict | None:
    return cluster.obj("leaderworkersets", GROUP)


def _gpus(template: dict) -> str:
    return engine_container(template)["resources"]["limits"]["nvidia.com/gpu"]


def test_no_lws_api_a_condition_and_nothing_built_then_the_group(own_cluster):
    cluster = own_cluster
    cluster.apply(NAME, _spec())
    cluster.wait_condition(NAME, "Planned", "True")
    degraded = cluster.wait_condition(NAME, "Degraded", "True")
    assert degraded["reason"] == "MissingAPI"
    assert "leaderworkerset.x-k8s.io/v1" in degraded["message"]
    cluster.settle(3)
    assert cluster.children(NAME) == {}                 # nothing half-built: no Deployment in its place
    assert cluster.condition(NAME, "Ready")["status"] == "False"

    # the API appears: the group is built
    cluster.kubectl("create", "--validate=false", "-f", str(LWS_CRD_PATH))
    lws = wait_for(lambda: _lws(cluster), 30, what="the LeaderWorkerSet")
    assert lws_errors({k: v for k, v in lws.items() if k != "status"}) == []
    group = lws["spec"]["leaderWorkerTemplate"]
    assert (lws["spec"]["replicas"], group["size"], group["restartPolicy"]) == (1, 2, "RecreateGroupOnPodRestart")
    assert _gpus(group["leaderTemplate"]) == _gpus(group["workerTemplate"]) == "8"
    leader_args = engine_container(group["leaderTemplate"])["args"]
    assert leader_args[leader_args.index("--pipeline-parallel-size") + 1] == "2"
    assert leader_args[leader_args.index("--tensor-parallel-size") + 1] == "8"
    children = wait_for(lambda: (ch := cluster.children(NAME)) and {"LeaderWorkerSet", "Service"} <= set(ch)
                        and ch, what="the group's children")
    assert "Deployment" not in children
    # two Services (the group's headless one and the client's), applied one after the other
    headless = wait_for(lambda: cluster.obj("services", GROUP), 30, what="the headless Service")
    assert headless["spec"]["clusterIP"] == "None"
    client = wait_for(lambda: cluster.obj("services", NAME), 30, what="the client Service")
    assert client["spec"]["selector"].items() <= group["leaderTemplate"]["metadata"]["labels"].items()
    assert not client["spec"]["selector"].items() <= group["workerTemplate"]["metadata"]["labels"].items()
    cluster.wait_condition(NAME, "Degraded", "False")
    plan = cluster.cr(NAME)["status"]["plan"]
    assert (plan["pipelineParallelSize"], plan["tensorParallelSize"], plan["gpusPerNode"]) == (2, 8, 8)


def test_replicas_and_the_autoscaler_act_on_groups(own_cluster):
    cluster = own_cluster
    cluster.kubectl("create", "--validate=false", "-f", str(LWS_CRD_PATH))
    # 128 sequences: one replica of two nodes holds them
    cluster.apply(NAME, _spec(slo={"concurrency": 128}))
    cluster.wait_condition(NAME, "Planned", "True")
    lws = wait_for(lambda: _lws(cluster), 30, what="the LeaderWorkerSet")
    assert (lws["spec"]["replicas"], lws["spec"]["leaderWorkerTemplate"]["size"]) == (1, 2)
    # kubectl scale on the InferenceService: two groups of two pods (64 sequences each still need two nodes)
    cluster.kubectl("scale", "inferenceservice", NAME, "--replicas=2")
    lws = wait_for(lambda: (o := _lws(cluster)) and o["spec"]["replicas"] == 2 and o, 30, what="two groups")
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert cluster.obj("deployments", NAME) is None
    # the autoscaler: the HPA targets the LeaderWorkerSet, whose count it then owns
    cluster.kubectl("patch", "inferenceservice", NAME, "--type", "merge", "-p", json.dumps(
        {"spec": {"replicas": None, "autoscaling": {"mode": "hpa", "minReplicas": 1, "maxReplicas": 4}}}))
    hpa = wait_for(lambda: cluster.obj("horizontalpodautoscalers", NAME), 30, what="the HPA")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "leaderworkerset.x-k8s.io/v1",
                                             "kind": "LeaderWorkerSet", "name": GROUP}
    cluster.kubectl("scale", "leaderworkerset", GROUP, "--replicas=3")     # as the HPA would, through /scale
    cluster.settle(3)
    assert _lws(cluster)["spec"]["replicas"] == 3                           # left to the autoscaler
    assert _lws(cluster)["spec"]["leaderWorkerTemplate"]["size"] == 2
