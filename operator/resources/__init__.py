"""Pure builders of an InferenceService's children, and the kinds the operator manages.

``desired_children`` is the single place that decides which children exist:

| child                   | when                                                        |
|-------------------------|-------------------------------------------------------------|
| Deployment, Service     | always (once the spec is planned); a replica of several nodes: |
| LeaderWorkerSet + its headless Service instead of the Deployment (``leader_worker_set.py``) |
| PersistentVolumeClaim   | a disk KV tier and at most one replica (else per-pod claims) |
| PersistentVolumeClaim   | the hf:// model cache: ReadWriteMany, or at most one replica |
| HorizontalPodAutoscaler | autoscaling.mode = hpa                                       |
| ScaledObject (KEDA)     | autoscaling.mode = keda and the keda.sh/v1alpha1 API exists  |
| PodMonitor              | the monitoring.coreos.com/v1 API exists                      |
| PodDisruptionBudget     | more than one replica (autoscaled: minReplicas > 1)          |
| InferencePool           | the inference.networking.k8s.io/v1 API exists and spec.routing.inferencePool.enabled |
| router Deployment, Service, ServiceAccount, Role, RoleBinding, PodDisruptionBudget (PodMonitor with the API) | spec.routing.router = vllm-router (``router.py``) |
| ServiceAccount          | always: the engine pods' own identity, no API token          |
| NetworkPolicy           | KVPILOT_NETWORK_POLICY on (the default): the engine pods' fence |
| prefill and decode Deployments (HPA / ScaledObject, PDB each) instead of the Deployment | spec.disaggregation (``pools.py``; the router runs in P/D mode, no InferencePool) |

Builders are pure (dicts in, dicts out, no API calls). May import: the operator's typed
spec, settings, constants and security rules, the contract (``kvpilot.operator.contract``,
``kvpilot.contract``) and the init container's fetcher (``model_fetch``, for its command);
never ``reconcile``, the API client or kopf.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.operator.resources.autoscaling import KEDA_API, build_hpa, build_scaledobject
from kvpilot.operator.resources.common import LWS_API_VERSION, Owner
from kvpilot.operator.resources.deployment import ReplicaPolicy, build_deployment, disk_claim_child
from kvpilot.operator.resources.disruption import build_pdb
from kvpilot.operator.resources.inference_pool import INFERENCE_POOL_API, build_inference_pool
from kvpilot.operator.resources.leader_worker_set import (
    WORKER_COMPONENT,
    build_group_service,
    build_leader_worker_set,
)
from kvpilot.operator.resources.monitoring import (
    PODMONITOR_API,
    build_podmonitor,
    build_slo_prometheusrule,
)
from kvpilot.operator.resources.network_policy import build_network_policy
from kvpilot.operator.resources.pools import most_pods, pool_bodies, pool_names
from kvpilot.operator.resources.router import router_children, router_names
from kvpilot.operator.resources.service import build_service
from kvpilot.operator.resources.service_account import build_service_account
from kvpilot.operator.resources.sizing import EngineSizing
from kvpilot.operator.resources.storage import (
    build_kv_disk_claim,
    build_model_cache_claim,
    model_cache_claim_child,
)
from kvpilot.operator.security import engine_service_account
from kvpilot.operator.settings import OperatorSettings
from kvpilot.operator.spec import InferenceServiceSpec


@dataclass(frozen=True, slots=True)
class ChildKind:
    """A namespaced resource kind the operator creates: ``apps/v1`` ``Deployment`` ``deployments``."""

    api_version: str
    kind: str
    plural: str

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]

    def path(self, namespace: str, name: str | None = None) -> str:
        """REST path of the collection in ``namespace``, or of one object."""
        base = "/api/v1" if not self.group else f"/apis/{self.api_version}"
        tail = f"/{name}" if name else ""
        return f"{base}/namespaces/{namespace}/{self.plural}{tail}"


DEPLOYMENT = ChildKind("apps/v1", "Deployment", "deployments")
SERVICE = ChildKind("v1", "Service", "services")
PVC = ChildKind("v1", "PersistentVolumeClaim", "persistentvolumeclaims")
HPA = ChildKind("autoscaling/v2", "HorizontalPodAutoscaler", "horizontalpodautoscalers")
SCALED_OBJECT = ChildKind("/".join(KEDA_API), "ScaledObject", "scaledobjects")
POD_MONITOR = ChildKind("/".join(PODMONITOR_API), "PodMonitor", "podmonitors")
PROMETHEUS_RULE = ChildKind("/".join(PODMONITOR_API), "PrometheusRule", "prometheusrules")
PDB = ChildKind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets")
INFERENCE_POOL = ChildKind("/".join(INFERENCE_POOL_API), "InferencePool", "inferencepools")
SERVICE_ACCOUNT = ChildKind("v1", "ServiceAccount", "serviceaccounts")
ROLE = ChildKind("rbac.authorization.k8s.io/v1", "Role", "roles")
ROLE_BINDING = ChildKind("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings")
NETWORK_POLICY = ChildKind("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies")
LEADER_WORKER_SET = ChildKind(LWS_API_VERSION, "LeaderWorkerSet", "leaderworkersets")
KINDS: dict[str, ChildKind] = {k.kind: k for k in (DEPLOYMENT, SERVICE, PVC, HPA, SCALED_OBJECT,
                                                   POD_MONITOR, PROMETHEUS_RULE, PDB, INFERENCE_POOL,
                                                   SERVICE_ACCOUNT, ROLE, ROLE_BINDING, NETWORK_POLICY,
                                                   LEADER_WORKER_SET)}
WORKLOADS = (DEPLOYMENT, LEADER_WORKER_SET)   # the engine pods' owner: one or the other


def workload_name(owner: Owner, kind: ChildKind) -> str:
    return owner.group_name if kind is LEADER_WORKER_SET else owner.name


def workload_kind(nodes: int) -> ChildKind:
    """The engine pods' owner for replicas of ``nodes`` pods."""
    return LEADER_WORKER_SET if nodes > 1 else DEPLOYMENT


@dataclass(frozen=True, slots=True)
class Child:
    """One desired child object.

    Args:
        kind: its resource kind.
        body: the full object to create.
        create_only: dotted paths set at creation and then owned by someone else
            (``spec.replicas`` of an autoscaled Deployment): never compared or patched.
    """

    kind: ChildKind
    body: dict
    create_only: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.body["metadata"]["name"]


def possible_children(owner: Owner) -> list[tuple[ChildKind, str]]:
    """Every (kind, name) this owner may have: those not desired are removed if present."""
    return [(DEPLOYMENT, owner.name), (SERVICE, owner.name), (LEADER_WORKER_SET, owner.group_name),
            (SERVICE, owner.group_name), (PVC, owner.kv_disk_claim),
            (PVC, owner.model_cache_claim),
            (HPA, owner.name), (SCALED_OBJECT, owner.name), (POD_MONITOR, owner.name),
            (PROMETHEUS_RULE, owner.name), (PDB, owner.name), (INFERENCE_POOL, owner.name),
            (SERVICE_ACCOUNT, engine_service_account(owner.name)), (NETWORK_POLICY, owner.name),
            *((KINDS[kind], name) for kind, name in (*router_names(owner), *pool_names(owner)))]


def _service_children(owner: Owner, spec: InferenceServiceSpec, settings: OperatorSettings, *,
                      podmonitor_api: bool, workers: tuple[str, ...] = ()) -> list[Child]:
    """What every service has around its engine pods: their Service, their network fence
    (``workers``: more components fenced with them), the PodMonitor and the SLO alerts."""
    children = [Child(SERVICE, build_service(owner))]
    if settings.fence.enabled:
        children.append(Child(NETWORK_POLICY, build_network_policy(owner, spec, settings.fence, workers)))
    if podmonitor_api:
        children.append(Child(POD_MONITOR, build_podmonitor(owner)))
        slo_rule = build_slo_prometheusrule(owner, spec.model.served_name,
                                            {"ttftP95Ms": spec.slo.ttft_p95_ms,
                                             "itlP95Ms": spec.slo.itl_p95_ms})
        if slo_rule is not None:
            children.append(Child(PROMETHEUS_RULE, slo_rule))
    return children


def _disaggregated_children(owner: Owner, spec: InferenceServiceSpec, sizing: EngineSizing,
                            settings: OperatorSettings, *, podmonitor_api: bool, keda_api: bool) -> list[Child]:
    """A disaggregated service's children: the two pools (``pools.py``), what every service
    has, the model cache shared by both pools, and the router in P/D mode."""
    children = [Child(SERVICE_ACCOUNT, build_service_account(owner))]
    children += [Child(KINDS[body["kind"]], body, create_only=owned)
                 for body, owned in pool_bodies(owner, spec, sizing, settings, keda_api=keda_api)]
    children += _service_children(owner, spec, settings, podmonitor_api=podmonitor_api)
    if model_cache_claim_child(spec, settings, most_pods(spec, sizing)):
        children.append(Child(PVC, build_model_cache_claim(owner, spec, sizing, settings), create_only=("spec",)))
    children += [Child(KINDS[body["kind"]], body)
                 for body in router_children(owner, spec, sizing, settings, podmonitor_api)]
    return children


def desired_children(owner: Owner, spec: InferenceServiceSpec, sizing: EngineSizing,
                     settings: OperatorSettings, *, podmonitor_api: bool,
                     inherited_replicas: int | None = None,
                     inference_pool_api: bool = False, keda_api: bool = True,
                     verified_adapters: frozenset[str] = frozenset()) -> list[Child]:
    """The children that should exist for ``spec`` planned as ``sizing``.

    Args:
        owner: the InferenceService's identity.
        spec: its parsed spec.
        sizing: the plan's flags and sizes.
        settings: operator settings.
        podmonitor_api: whether the cluster serves monitoring.coreos.com/v1 (PodMonitors,
            and PrometheusRules for the SLO alerts when the spec declares latency targets).
        inherited_replicas: the count an autoscaler left when autoscaling was switched off
            (``kvpilot.operator.replica_handover``), a floor while ``spec.replicas`` is unset.
        inference_pool_api: whether it serves inference.networking.k8s.io/v1 InferencePools.
        keda_api: whether it serves keda.sh/v1alpha1 ScaledObjects (without: none is built for
            ``autoscaling.mode: keda``; ``optional_apis`` reports it).
        verified_adapters: the LoRA adapters seen to load (``status.adapters`` verified), which
            the engine loads at start-up (``resources.adapters``).
    """
    if spec.disaggregation is not None:
        return _disaggregated_children(owner, spec, sizing, settings, podmonitor_api=podmonitor_api,
                                       keda_api=keda_api)
    policy = ReplicaPolicy.of(spec, sizing, inherited_replicas)
    replicas_owned = ("spec.replicas",) if policy.autoscaled else ()
    children = [Child(SERVICE_ACCOUNT, build_service_account(owner))]
    if sizing.nodes > 1:
        children += [Child(LEADER_WORKER_SET, build_leader_worker_set(owner, spec, sizing, settings, policy),
                           create_only=replicas_owned),
                     Child(SERVICE, build_group_service(owner))]
    else:
        children.append(Child(DEPLOYMENT, build_deployment(owner, spec, sizing, settings, policy,
                                                           verified_adapters),
                              create_only=replicas_owned))
    children += _service_children(owner, spec, settings, podmonitor_api=podmonitor_api,
                                  workers=(WORKER_COMPONENT,) if sizing.nodes > 1 else ())
    if disk_claim_child(policy, sizing):
        children.append(Child(PVC, build_kv_disk_claim(owner, spec, sizing)))
    # every pod of a group loads its stage's weights: a ReadWriteOnce cache cannot follow them
    if model_cache_claim_child(spec, settings, policy.max_replicas * sizing.nodes):
        # A claim's size and access mode are fixed once bound (it cannot shrink): set at creation.
        children.append(Child(PVC, build_model_cache_claim(owner, spec, sizing, settings),
                              create_only=("spec",)))
    if spec.autoscaling.mode == "hpa":
        children.append(Child(HPA, build_hpa(owner, spec, settings, sizing.nodes)))
    elif spec.autoscaling.mode == "keda" and keda_api:
        children.append(Child(SCALED_OBJECT, build_scaledobject(owner, spec, sizing.nodes)))
    least = spec.autoscaling.min_replicas if policy.autoscaled else policy.replicas
    if least > 1:
        children.append(Child(PDB, build_pdb(owner)))
    if inference_pool_api and spec.inference_pool.enabled:
        children.append(Child(INFERENCE_POOL, build_inference_pool(owner, spec, settings)))
    if spec.router.kind == "vllm-router":
        children += [Child(KINDS[body["kind"]], body)
                     for body in router_children(owner, spec, sizing, settings, podmonitor_api)]
    return children
