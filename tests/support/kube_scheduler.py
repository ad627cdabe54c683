"""kube-scheduler for the emulator: binds Pending pods to Nodes, or says why not in its words.

The test calls ``schedule(emulator)`` (under the store lock, ``EmulatorThread.run``) where
kube-scheduler would act: after pods or nodes change. Each Pending pod without a node is
checked against every Node with the real default filters, in their real order, a node
leaving at the first filter it fails:

1. NodeUnschedulable: ``node(s) were unschedulable`` (a cordoned node);
2. TaintToleration: ``node(s) had untolerated taint {key: value}`` (NoSchedule / NoExecute);
3. NodeAffinity: ``node(s) didn't match Pod's node affinity/selector`` (``nodeSelector`` and
   the required node affinity terms: In, NotIn, Exists, DoesNotExist, Gt, Lt);
4. NodeResourcesFit: ``Too many pods`` and ``Insufficient <resource>`` for each requested
   resource the node lacks (all of them at once: cpu, memory, nvidia.com/gpu, ...), against
   ``status.allocatable`` less the requests of the pods bound there.

A pod that fits is bound to the first fitting node by name (``spec.nodeName``,
``PodScheduled=True``; it stays Pending: no kubelet runs it). One that does not gets
``PodScheduled=False, reason=Unschedulable`` with kube-scheduler's FitError text: the node
count, the histogram of reasons as "<count> <reason>" strings sorted as strings, and the
preemption suffix (nodes failing the first three filters: "Preemption is not helpful for
scheduling"; nodes short of resources: "No preemption victims found for incoming pod", as no
pod here has a lower priority to evict)::

    0/2 nodes are available: 1 Insufficient nvidia.com/gpu, 1 node(s) didn't match Pod's
    node affinity/selector. preemption: 0/2 nodes are available: 1 No preemption victims
    found for incoming pod, 1 Preemption is not helpful for scheduling.

Not modelled: scoring (the first fitting node wins), priorities and preemption itself, pod
(anti-)affinity, topology spread, volumes, ports, preferred affinity, PreFilter messages.
"""

from __future__ import annotations

import copy
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from decimal import Decimal
from typing import Any

NOT_HELPFUL = "Preemption is not helpful for scheduling"
NO_VICTIMS = "No preemption victims found for incoming pod"
_UNRESOLVABLE = ("node(s) were unschedulable", "node(s) had untolerated taint", "node(s) didn't match")
_SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50,
           "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "m": Decimal("0.001")}
_QUANTITY = re.compile(r"^([0-9.]+)([A-Za-z]*)$")


def quantity(value: Any) -> Decimal:
    """A Kubernetes quantity ("500m", "16Gi", 8) as a number."""
    match = _QUANTITY.match(str(value).strip())
    if match is None or (match[2] and match[2] not in _SUFFIX):
        raise ValueError(f"not a quantity: {value!r}")
    return Decimal(match[1]) * Decimal(_SUFFIX.get(match[2], 1))


def gpu_node(name: str, product: str, gpus: int = 8, taint: bool = True) -> dict:
    """A GPU node as GPU feature discovery and the NVIDIA device plugin leave it."""
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name,
                                                  "nvidia.com/gpu.product": product,
                                                  "nvidia.com/gpu.count": str(gpus)}},
            "spec": {"taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]
                     if taint else []},
            "status": {"allocatable": {"cpu": "64", "memory": "512Gi", "pods": "110",
                                       "nvidia.com/gpu": str(gpus)}}}


def add_node(emulator: Any, node: Mapping[str, Any]) -> dict:
    """Store ``node`` as it joins: the object, then its status (the kubelet reports allocatable)."""
    nodes = emulator.types[("", "v1", "nodes")]
    emulator._store_create(nodes, None, dict(node))
    return emulator._write(nodes, None, node["metadata"]["name"], "status", "PATCH",
                           "application/merge-patch+json", {"status": node.get("status") or {}})


def pod_requests(pod: Mapping[str, Any]) -> dict[str, Decimal]:
    """What a pod asks of a node: its containers' requests (a limit alone counts as the
    request, as the API server defaults it), init containers' largest, plus one pod."""
    spec = pod.get("spec") or {}

    def of(container: Mapping[str, Any]) -> Counter:
        resources = container.get("resources") or {}
        asked = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
        return Counter({k: quantity(v) for k, v in asked.items()})

    total: Counter = Counter()
    for container in spec.get("containers") or ():
        total.update(of(container))
    for init in spec.get("initContainers") or ():
        for key, value in of(init).items():
            total[key] = max(total[key], value)
    total["pods"] += 1
    return dict(total)


def tolerates(tolerations: Iterable[Mapping[str, Any]], taint: Mapping[str, Any]) -> bool:
    for tol in tolerations:
        if tol.get("effect") and tol["effect"] != taint.get("effect"):
            continue
        if not tol.get("key") and tol.get("operator") == "Exists":
            return True
        if tol.get("key") != taint.get("key"):
            continue
        if tol.get("operator") == "Exists" or tol.get("value", "") == taint.get("value", ""):
            return True
    return False


def _expression_holds(expr: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    key, op, values = expr["key"], expr["operator"], expr.get("values") or []
    if op == "In":
        return key in labels and labels[key] in values
    if op == "NotIn":
        return key not in labels or labels[key] not in values
    if op == "Exists":
        return key in labels
    if op == "DoesNotExist":
        return key not in labels
    if op in ("Gt", "Lt") and key in labels:
        have, bound = int(labels[key]), int(values[0])
        return have > bound if op == "Gt" else have < bound
    return False


def matches_affinity(pod_spec: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """``nodeSelector`` and the required node affinity (terms ORed, expressions ANDed)."""
    if any(labels.get(k) != v for k, v in (pod_spec.get("nodeSelector") or {}).items()):
        return False
    required = (((pod_spec.get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution") or {})
    terms = required.get("nodeSelectorTerms")
    if not terms:
        return True
    return any(all(_expression_holds(e, labels) for e in term.get("matchExpressions") or ()) for term in terms)


def node_reasons(pod: Mapping[str, Any], node: Mapping[str, Any], used: Mapping[str, Decimal]) -> list[str]:
    """Why ``node`` cannot take ``pod`` (empty: it can), from the first filter that fails."""
    spec, node_spec = pod.get("spec") or {}, node.get("spec") or {}
    tolerations = spec.get("tolerations") or ()
    if node_spec.get("unschedulable") and not tolerates(
            tolerations, {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}):
        return ["node(s) were unschedulable"]
    for taint in node_spec.get("taints") or ():
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not tolerates(tolerations, taint):
            return [f"node(s) had untolerated taint {{{taint['key']}: {taint.get('value', '')}}}"]
    if not matches_affinity(spec, (node.get("metadata") or {}).get("labels") or {}):
        return ["node(s) didn't match Pod's node affinity/selector"]
    allocatable = {k: quantity(v) for k, v in ((node.get("status") or {}).get("allocatable") or {}).items()}
    reasons = []
    for resource, asked in sorted(pod_requests(pod).items()):
        if asked and used.get(resource, 0) + asked > allocatable.get(resource, 0):
            reasons.append("Too many pods" if resource == "pods" else f"Insufficient {resource}")
    return reasons


def fit_error(num_nodes: int, per_node: Mapping[str, list[str]]) -> str:
    """kube-scheduler's FitError message for the reasons each node gave."""
    def histogram(reasons: Iterable[str]) -> str:
        return ", ".join(sorted(f"{n} {r}" for r, n in Counter(reasons).items()))

    filters = histogram(r for reasons in per_node.values() for r in reasons)
    preemption = histogram(NOT_HELPFUL if any(r.startswith(_UNRESOLVABLE) for r in reasons) else NO_VICTIMS
                           for reasons in per_node.values())
    return (f"0/{num_nodes} nodes are available: {filters}. "
            f"preemption: 0/{num_nodes} nodes are available: {preemption}.")


def _usage(pods: Iterable[Mapping[str, Any]]) -> dict[str, Counter]:
    used: dict[str, Counter] = {}
    for pod in pods:
        node = (pod.get("spec") or {}).get("nodeName")
        if node and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
            used.setdefault(node, Counter()).update(pod_requests(pod))
    return used


def place(pod: Mapping[str, Any], nodes: list[Mapping[str, Any]],
          used: Mapping[str, Mapping[str, Decimal]]) -> tuple[str | None, str | None]:
    """(the node ``pod`` goes to, None) or (None, the FitError message)."""
    per_node = {}
    for node in sorted(nodes, key=lambda n: n["metadata"]["name"]):
        name = node["metadata"]["name"]
        reasons = node_reasons(pod, node, used.get(name, {}))
        if not reasons:
            return name, None
        per_node[name] = reasons
    if not nodes:
        return None, "no nodes available to schedule pods"
    return None, fit_error(len(nodes), per_node)


def schedule(emulator: Any) -> dict[tuple[str, str], str]:
    """One scheduling round over the emulator's store: every Pending pod without a node is
    bound or marked Unschedulable (written only when its condition changes, as the
    scheduler does). Returns (namespace, pod) -> the node, or the message."""
    pods_type = emulator.types[("", "v1", "pods")]
    pods = [o for (g, p, _, _), o in emulator.objects.items() if (g, p) == ("", "pods")]
    nodes = [o for (g, p, _, _), o in emulator.objects.items() if (g, p) == ("", "nodes")]
    used = _usage(pods)
    outcome = {}
    for pod in sorted(pods, key=lambda o: (o["metadata"]["creationTimestamp"], o["metadata"]["name"])):
        meta, spec = pod["metadata"], pod.get("spec") or {}
        if spec.get("nodeName") or meta.get("deletionTimestamp") or \
                (pod.get("status") or {}).get("phase", "Pending") != "Pending":
            continue
        ns, name = meta["namespace"], meta["name"]
        node, message = place(pod, nodes, used)
        if node is not None:
            bound = copy.deepcopy(pod)
            bound["spec"]["nodeName"] = node
            emulator._write(pods_type, ns, name, None, "PUT", "application/json", bound)
            condition = {"type": "PodScheduled", "status": "True"}
            used.setdefault(node, Counter()).update(pod_requests(pod))
        else:
            condition = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}
        old = next((cd for cd in (pod.get("status") or {}).get("conditions") or ()
                    if cd.get("type") == "PodScheduled"), None)
        if old is None or any(old.get(k) != v for k, v in condition.items()):
            others = [cd for cd in (pod.get("status") or {}).get("conditions") or ()
                      if cd.get("type") != "PodScheduled"]
            emulator._write(pods_type, ns, name, "status", "PATCH", "application/merge-patch+json",
                            {"status": {"phase": "Pending", "conditions": [*others, condition]}})
        outcome[(ns, name)] = node or message
    return outcome
