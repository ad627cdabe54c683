"""The real operator process against the API emulator: a disaggregated InferenceService.

crds/examples/disaggregated-rag.yaml applied with kubectl: the operator builds the prefill
and the decode pool (each Deployment's pods labelled with their role and started with their
KV transfer role), each pool's autoscaler (KEDA for prefill, an HPA for decode), and vLLM's
router in P/D mode discovering the pools by label; status carries the planner's
prefill:decode ratio with its derivation, both pools' replicas, and Ready only once each
pool has a ready replica. Dropping ``spec.disaggregation`` goes back to one Deployment.
"""

from __future__ import annotations

import copy
import json

import pytest
import yaml

from kvpilot.contract.kv_transfer import KV_CONSUMER, KV_PRODUCER, NIXL_CONNECTOR
from kvpilot.engine.server.args import make_serve_parser
from kvpilot.operator import constants as c

from support import crd_schema
from support.harness import schemaless_crd, wait_for

pytestmark = pytest.mark.slow

(EXAMPLE_PATH,) = crd_schema.DISAGGREGATED
EXAMPLE = yaml.safe_load(EXAMPLE_PATH.read_text())
NAME = EXAMPLE["metadata"]["name"]
ROLES = {"prefill": KV_PRODUCER, "decode": KV_CONSUMER}


def _container(deployment: dict) -> dict:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _ready(cluster, name: str) -> None:
    """Mark a Deployment's replicas ready, as its controller and the kubelet would."""
    deployment = cluster.obj("deployments", name)
    n = deployment["spec"]["replicas"]
    status = {"status": {"replicas": n, "readyReplicas": n, "updatedReplicas": n,
                         "observedGeneration": deployment["metadata"]["generation"]}}
    cluster.kubectl("patch", "deployment", name, "--subresource=status", "--type", "merge", "-p", json.dumps(status))


def test_the_disaggregated_example_runs_two_pools_behind_the_pd_router(own_cluster):
    cluster = own_cluster   # it installs KEDA's CRD
    cluster.kubectl("create", "--validate=false", "-f", "-",
                    stdin=yaml.safe_dump(schemaless_crd("keda.sh", "v1alpha1", "ScaledObject", "scaledobjects")))
    cluster.apply(NAME, copy.deepcopy(EXAMPLE["spec"]))
    planned = cluster.wait_condition(NAME, "Planned", "True")
    assert "disaggregated: prefill:decode 7:2" in planned["message"]

    pools = {role: wait_for(lambda role=role: cluster.obj("deployments", f"{NAME}-{role}"), what=f"the {role} pool")
             for role in ROLES}
    for role, kv_role in ROLES.items():
        deployment = pools[role]
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert labels["llm-d.ai/role"] == role and labels[c.LABEL_COMPONENT] == "engine"
        config = make_serve_parser().parse_args(_container(deployment)["args"]).kv_transfer_config
        assert (config.kv_connector, config.kv_role) == (NIXL_CONNECTOR, kv_role)
    assert (pools["prefill"]["spec"]["replicas"], pools["decode"]["spec"]["replicas"]) == (7, 2)
    assert cluster.obj("deployments", NAME) is None      # no plain engine Deployment
    keda = wait_for(lambda: cluster.obj("scaledobjects", f"{NAME}-prefill"), what="the prefill pool's ScaledObject")
    assert keda["spec"]["scaleTargetRef"]["name"] == f"{NAME}-prefill"
    hpa = wait_for(lambda: cluster.obj("horizontalpodautoscalers", f"{NAME}-decode"), what="the decode pool's HPA")
    assert hpa["spec"]["scaleTargetRef"]["name"] == f"{NAME}-decode"

    router = wait_for(lambda: cluster.obj("deployments", f"{NAME}-router"), what="the router")
    args = _container(router)["args"]
    assert "--vllm-pd-disaggregation" in args and args[args.index("--kv-connector") + 1] == "nixl"
    for role in ROLES:
        flag = args.index(f"--{role}-selector")
        selector = dict(a.split("=", 1) for a in args[flag + 1:flag + 5])
        assert selector == pools[role]["spec"]["selector"]["matchLabels"]

    cr = wait_for(lambda: (cr := cluster.cr(NAME)) and (cr.get("status") or {}).get("disaggregation") and cr,
                  what="the pools' status")
    status = cr["status"]
    plan = status["plan"]["disaggregation"]
    assert plan["ratio"] == "7:2" and plan["kvConnector"] == NIXL_CONNECTOR
    assert plan["derivation"][-1].endswith("Ratio prefill:decode = 7:2.")
    assert any("TTFT slack" in line for line in plan["derivation"])          # TTFT binds the prefill pool
    assert (plan["prefill"]["replicas"], plan["decode"]["replicas"]) == (7, 2)
    assert status["plan"]["maxNumSeqs"] == plan["decode"]["maxNumSeqs"]      # status.plan: the decode pool's
    assert status["endpoint"] == f"http://{NAME}-router.team-a.svc.cluster.local:80/v1"
    assert status["disaggregation"] == {"prefill": {"replicas": 0, "readyReplicas": 0, "desiredReplicas": 7},
                                        "decode": {"replicas": 0, "readyReplicas": 0, "desiredReplicas": 2}}
    cluster.wait_condition(NAME, "Degraded", "False")

    # ready only once each pool has a ready replica: a request needs both
    _ready(cluster, f"{NAME}-prefill")
    waiting = wait_for(lambda: (cond := cluster.condition(NAME, "Ready")) and cond["reason"] == "NoDecodeReplicasReady"
                       and cond, what="Ready=False for the decode pool")
    assert waiting["status"] == "False" and "prefill 7/7, decode 0/2" in waiting["message"]
    _ready(cluster, f"{NAME}-decode")
    assert cluster.wait_condition(NAME, "Ready", "True")["reason"] == "AllReplicasReady"
    status = wait_for(lambda: (s := cluster.cr(NAME)["status"])["readyReplicas"] == 9 and s, what="9 ready")
    assert status["disaggregation"]["decode"]["readyReplicas"] == 2
    table = cluster.kubectl("get", "inferenceservices", NAME).stdout.splitlines()
    column = slice(table[0].index("P:D"), table[0].index("READY-REPLICAS"))   # empty columns print nothing
    assert table[1][column].strip() == "7:2"

    # one pool doing both again: the pools, their autoscalers and budgets go, one Deployment comes
    plain = {k: v for k, v in copy.deepcopy(EXAMPLE["spec"]).items() if k not in ("disaggregation", "routing")}
    cluster.apply(NAME, plain)
    wait_for(lambda: cluster.obj("deployments", NAME), what="the plain Deployment")
    for plural, role in (("deployments", "prefill"), ("deployments", "decode"), ("scaledobjects", "prefill"),
                         ("horizontalpodautoscalers", "decode"), ("poddisruptionbudgets", "prefill"),
                         ("deployments", "router")):
        wait_for(lambda plural=plural, role=role: cluster.obj(plural, f"{NAME}-{role}") is None,
                 what=f"{plural} {NAME}-{role} deleted")
    status = wait_for(lambda: (s := cluster.cr(NAME)["status"]) and "disaggregation" not in s
                      and "disaggregation" not in s["plan"] and s, what="the pools gone from status")
    assert status["endpoint"] == f"http://{NAME}.team-a.svc.cluster.local:80/v1"
