"""Placement: engine pods land only on nodes with the GPU type their plan was made for.

Oracles: a fleet of nodes labelled as NVIDIA GPU feature discovery labels them (one node per
product name of every catalogue GPU, plus MIG slices, shared GPUs, a GPU outside the
catalogue and an unlabelled node), matched against the pod's nodeSelector and required node
affinity with Kubernetes' rules (``node_matches`` below, after the scheduler's NodeAffinity
plugin: nodeSelector AND any one required term, each term AND of its expressions);
kubernetes-validate (strict) for the Deployment; the scheduler's own message for Pending pods.
"""

from __future__ import annotations

import copy

import pytest
import yaml

from kvpilot.operator import constants as c
from kvpilot.operator.planner.gpu import GPU_NODE_PRODUCTS, gpu_names
from kvpilot.operator.scheduling import scheduling_problem
from kvpilot.operator.settings import OperatorSettings
from kvpilot.operator.spec import SpecError, parse_spec
from kvpilot.operator.spec_to_plan import plan_service
from kvpilot.operator.status import workload_conditions

from support import crd_schema
from support.built import SETTINGS, build
from support.engine_workload import assert_valid_workload, templates, workload

PRODUCT = "nvidia.com/gpu.product"
BASE = {"model": {"uri": "hf://Qwen/Qwen3-0.6B"}, "gpu": {"type": "l4"},
        "slo": {"maxContext": 8192, "p95PromptTokens": 2048, "p95OutputTokens": 512, "concurrency": 8}}


def _fleet() -> dict[str, dict[str, str]]:
    """node name -> labels: every product of every catalogue GPU, and near misses."""
    nodes = {f"{gpu}-{i}": {PRODUCT: product, "gpu-type": gpu}
             for gpu, products in GPU_NODE_PRODUCTS.items() for i, product in enumerate(products)}
    nodes.update({
        "l4-shared": {PRODUCT: "NVIDIA-L4-SHARED"},                       # time-sliced L4
        "a100-mig": {PRODUCT: "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb"},       # a MIG slice
        "h100-pcie": {PRODUCT: "NVIDIA-H100-PCIe"},                       # other bandwidth
        "t4": {PRODUCT: "Tesla-T4"},                                      # not in the catalogue
        "cpu": {"kubernetes.io/os": "linux"},
    })
    return nodes


def _requirement_matches(req: dict, labels: dict[str, str]) -> bool:
    key, op, values = req["key"], req["operator"], req.get("values") or []
    if op == "In":
        return labels.get(key) in values
    if op == "NotIn":
        return key not in labels or labels[key] not in values
    if op == "Exists":
        return key in labels
    if op == "DoesNotExist":
        return key not in labels
    if op in ("Gt", "Lt"):
        return key in labels and (int(labels[key]) > int(values[0]) if op == "Gt"
                                  else int(labels[key]) < int(values[0]))
    raise AssertionError(f"unknown operator {op}")


def node_matches(pod: dict, labels: dict[str, str]) -> bool:
    """Whether kube-scheduler's node selector / required node affinity admit a node."""
    if any(labels.get(k) != v for k, v in (pod.get("nodeSelector") or {}).items()):
        return False
    required = (((pod.get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution"))
    if not required:
        return True
    return any(all(_requirement_matches(r, labels) for r in term.get("matchExpressions") or ())
               for term in required["nodeSelectorTerms"])


def _pod(cr: dict, settings: OperatorSettings = SETTINGS) -> tuple[dict, dict]:
    """(the Deployment, its pod spec) as the operator builds them."""
    children = build(cr["spec"], settings, cr["metadata"]["name"])
    owner = workload({ch.kind.kind: ch.body for ch in children})   # a Deployment or a LeaderWorkerSet
    assert_valid_workload(owner)
    pods = [t["spec"] for t in templates(owner)]
    assert all(p.get("affinity") == pods[0].get("affinity") for p in pods)   # a group's pods all land on its GPU
    return owner, pods[0]


def _cr(spec: dict, name: str = "svc") -> dict:
    return {"apiVersion": c.API_VERSION, "kind": c.KIND,
            "metadata": {"name": name, "namespace": "serving", "uid": "uid-1"}, "spec": spec}


def _matching(pod: dict, fleet: dict[str, dict[str, str]] | None = None) -> set[str]:
    return {name for name, labels in (fleet or _fleet()).items() if node_matches(pod, labels)}


@pytest.mark.parametrize("path", crd_schema.ONE_POOL_EXAMPLES, ids=lambda p: p.stem)
def test_every_example_lands_only_on_its_planned_gpu(path):
    cr = yaml.safe_load(path.read_text())
    cr["metadata"].update(namespace="serving", uid="uid-1")
    _, pod = _pod(cr)
    planned = plan_service(parse_spec(cr["spec"], cr["metadata"]["name"])).sizing.gpu
    assert planned == cr["spec"]["gpu"]["type"]
    expected = {f"{planned}-{i}" for i in range(len(GPU_NODE_PRODUCTS[planned]))}
    assert _matching(pod) == expected
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]


def test_the_catalogue_names_products_for_every_gpu_and_no_product_twice():
    assert set(GPU_NODE_PRODUCTS) == set(gpu_names())
    products = [p for values in GPU_NODE_PRODUCTS.values() for p in values]
    assert len(products) == len(set(products))
    for gpu in gpu_names():  # each type, planned, matches its own nodes only
        spec = copy.deepcopy(BASE)
        spec["gpu"]["type"] = gpu
        _, pod = _pod(_cr(spec))
        assert {n.rsplit("-", 1)[0] for n in _matching(pod)} == {gpu}


def test_a_gpu_node_selector_in_the_spec_replaces_the_product_match():
    spec = copy.deepcopy(BASE)
    spec["gpu"]["nodeSelector"] = {"cloud.google.com/gke-accelerator": "nvidia-l4"}
    spec["nodeSelector"] = {"pool": "serving"}
    _, pod = _pod(_cr(spec))
    fleet = {"gke-l4": {"cloud.google.com/gke-accelerator": "nvidia-l4", "pool": "serving"},
             "gke-l4-other-pool": {"cloud.google.com/gke-accelerator": "nvidia-l4", "pool": "batch"},
             "gfd-l4": {PRODUCT: "NVIDIA-L4", "pool": "serving"}}
    assert _matching(pod, fleet) == {"gke-l4"}
    assert "affinity" not in pod  # the product match is gone, not ANDed


def test_spec_affinity_terms_each_keep_the_gpu_match_and_pod_affinity_passes_through():
    spec = copy.deepcopy(BASE)
    anti = {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": {"matchLabels": {"app": "other"}}, "topologyKey": "kubernetes.io/hostname"}]}
    spec["affinity"] = {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
            {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]}]},
            "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 10, "preference": {
                "matchExpressions": [{"key": "spot", "operator": "DoesNotExist"}]}}]},
        "podAntiAffinity": anti}
    _, pod = _pod(_cr(spec))
    fleet = {"l4-a": {PRODUCT: "NVIDIA-L4", "zone": "a"}, "l4-b": {PRODUCT: "NVIDIA-L4", "zone": "b"},
             "l4-c": {PRODUCT: "NVIDIA-L4", "zone": "c"}, "h100-a": {PRODUCT: "NVIDIA-H100-80GB-HBM3", "zone": "a"}}
    assert _matching(pod, fleet) == {"l4-a", "l4-b"}
    assert pod["affinity"]["podAntiAffinity"] == anti
    assert pod["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["weight"] == 10
    assert spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"][0]["matchExpressions"] == [{"key": "zone", "operator": "In", "values": ["a"]}]


def test_operator_settings_choose_the_label_and_its_values():
    custom = OperatorSettings.from_env({"KVPILOT_GPU_NODE_LABEL": "example.com/gpu",
                                        "KVPILOT_GPU_NODE_VALUES": '{"l4": ["l4", "l4-24gb"]}'})
    _, pod = _pod(_cr(copy.deepcopy(BASE)), custom)
    fleet = {"a": {"example.com/gpu": "l4"}, "b": {"example.com/gpu": "l4-24gb"},
             "c": {PRODUCT: "NVIDIA-L4"}, "d": {"example.com/gpu": "h100"}}
    assert _matching(pod, fleet) == {"a", "b"}
    off = OperatorSettings.from_env({"KVPILOT_GPU_NODE_LABEL": ""})
    assert "affinity" not in _pod(_cr(copy.deepcopy(BASE)), off)[1]
    with pytest.raises(ValueError, match="unknown GPU type 'tpu'"):
        OperatorSettings.from_env({"KVPILOT_GPU_NODE_VALUES": '{"tpu": ["v5e"]}'})
    with pytest.raises(ValueError, match="must map GPU types to lists"):
        OperatorSettings.from_env({"KVPILOT_GPU_NODE_VALUES": '{"l4": "NVIDIA-L4"}'})


def test_bad_placement_overrides_are_rejected():
    spec = copy.deepcopy(BASE)
    spec["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": {"matchExpressions": []}}}}
    with pytest.raises(SpecError, match="nodeSelectorTerms must be a list"):
        parse_spec(spec, "x")
    spec = copy.deepcopy(BASE)
    spec["gpu"]["nodeSelector"] = {"gpu": 4}
    with pytest.raises(SpecError, match="nodeSelector values must be strings"):
        parse_spec(spec, "x")
    schema = crd_schema.version_schema(crd_schema.load_crd())
    stored, errors = crd_schema.admit(schema, _cr({**BASE, "gpu": {"type": "l4", "nodeSelector": {"gpu": 4}}}))
    assert errors and "nodeSelector" in errors[0]


# kube-scheduler's PodScheduled message for a pod no node can take, and for a full cluster
NO_MATCH = ("0/4 nodes are available: 1 node(s) had untolerated taint {node-role: control-plane}, "
            "3 node(s) didn't match Pod's node affinity/selector. preemption: 0/4 nodes are available: "
            "4 Preemption is not helpful for scheduling.")
NO_GPU = "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."


def _pending(message: str | None) -> dict:
    conditions = [] if message is None else [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}]
    return {"status": {"phase": "Pending", "conditions": conditions}}


def test_pending_pods_name_the_missing_gpu_nodes():
    problem = scheduling_problem([_pending(NO_MATCH), _pending(None)], "nvidia.com/gpu.product in (NVIDIA-L4)")
    assert problem.reason == "NoMatchingNodes"
    assert "nvidia.com/gpu.product in (NVIDIA-L4)" in problem.message and NO_MATCH in problem.message
    assert scheduling_problem([_pending(NO_GPU)]).reason == "Unschedulable"
    running = {"status": {"phase": "Running", "conditions": [{"type": "PodScheduled", "status": "True"}]}}
    assert scheduling_problem([running, _pending(None)]) is None  # scheduled, or not yet tried
    from kvpilot.operator.status import DeploymentState

    state = DeploymentState.read({"metadata": {"generation": 1}, "spec": {"replicas": 1},
                                  "status": {"observedGeneration": 1}})
    degraded = {cd.type: cd for cd in workload_conditions(state, None, problem)}["Degraded"]
    assert (degraded.status, degraded.reason) == ("True", "NoMatchingNodes")
