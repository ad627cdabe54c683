"""The engine pods of a disaggregated InferenceService (``spec.disaggregation``): two pools.

| child                              | name            | when                                   |
|------------------------------------|-----------------|----------------------------------------|
| Deployment (prefill, decode)       | NAME-prefill, NAME-decode | always, instead of NAME       |
| HorizontalPodAutoscaler / ScaledObject | NAME-prefill, NAME-decode | the pool's autoscaling.mode |
| PodDisruptionBudget                | NAME-prefill, NAME-decode | the pool has more than one replica |

Each pool's pods are the engine pods of the plain layout (``deployment.engine_pod_template``:
``component: engine``, so the service's Service, PodMonitor, NetworkPolicy and status see
both pools) with, in addition:

- the label ``llm-d.ai/role: prefill|decode`` (the pool's Deployment selects on it; vLLM's
  router discovers each pool by it, and llm-d's endpoint picker reads the same label);
- ``--kv-transfer-config`` with the pool's role (in the planned flags: the pool's sizing);
- NIXL's handshake side channel: ``VLLM_NIXL_SIDE_CHANNEL_HOST`` (the pod IP, which the
  decode side dials) and ``VLLM_NIXL_SIDE_CHANNEL_PORT``, and that port on the container.
  The transfer itself runs between the pods of the service, which the NetworkPolicy lets
  reach each other on any port.

Autoscalers follow each pool's own load: the prefill pool its queue (``vllm:num_requests_waiting``)
and, with a TTFT target in the SLO, its pods' p95 time to first token; the decode pool its KV
cache usage and preemptions. KEDA's queries select a pool's pods by name
(``NAME-prefill-<replicaset>-<pod>``), the HPA's Pods metrics by the Deployment it scales.
"""

from __future__ import annotations

import dataclasses

from kvpilot.contract.kv_transfer import NIXL_SIDE_CHANNEL_HOST_ENV, NIXL_SIDE_CHANNEL_PORT_ENV
from kvpilot.operator.resources.autoscaling import (
    KV_USAGE_SERIES,
    PREEMPTIONS_SERIES,
    RATE_WINDOW,
    TTFT_SERIES,
    WAITING_SERIES,
    hpa,
    pods_metric,
    prometheus_trigger,
    scaled_object,
)
from kvpilot.operator.resources.common import ROLE_LABEL, Owner
from kvpilot.operator.resources.deployment import ReplicaPolicy, build_deployment
from kvpilot.operator.resources.sizing import EngineSizing
from kvpilot.operator.settings import OperatorSettings
from kvpilot.operator.spec import InferenceServiceSpec, PoolSpec

PREFILL, DECODE = "prefill", "decode"
SIDE_CHANNEL_PORT_NAME = "nixl"


def pool_name(owner: Owner, role: str) -> str:
    return f"{owner.name}-{role}"


def pool_sizings(sizing: EngineSizing) -> dict[str, EngineSizing]:
    """Each pool's sizing: the plan's decode sizing carries the prefill pool's."""
    return {PREFILL: sizing.prefill, DECODE: dataclasses.replace(sizing, prefill=None)}


def pool_policy(pool: PoolSpec, sizing: EngineSizing, pods_at_most: int) -> ReplicaPolicy:
    """A pool's replicas (``sizing.replicas``: pinned, planned or the autoscaler's start) and
    who decides; ``pods_at_most``: the most engine pods of both pools (the model cache's layout)."""
    return ReplicaPolicy(sizing.replicas, pool.autoscaling.enabled, pods_at_most)


def most_pods(spec: InferenceServiceSpec, sizing: EngineSizing) -> int:
    """The most engine pods the two pools may run (their autoscalers' ceilings, else their counts)."""
    sizings = pool_sizings(sizing)
    return sum(pool.autoscaling.ceiling if pool.autoscaling.enabled else sizings[pool.role].replicas
               for pool in spec.disaggregation.pools)


def _pool_view(spec: InferenceServiceSpec, pool: PoolSpec) -> InferenceServiceSpec:
    """``spec`` as one pool's pods see it: the pool's engine settings and resources."""
    resources = {kind: {**(spec.resources.get(kind) or {}), **(pool.resources.get(kind) or {})}
                 for kind in ("limits", "requests") if spec.resources.get(kind) or pool.resources.get(kind)}
    return dataclasses.replace(spec, engine=pool.engine, resources=resources)


def build_pool_deployment(owner: Owner, spec: InferenceServiceSpec, pool: PoolSpec, sizing: EngineSizing,
                          settings: OperatorSettings, policy: ReplicaPolicy) -> dict:
    """The Deployment of one pool (see the module docstring for what it adds to an engine pod)."""
    deployment = build_deployment(owner, _pool_view(spec, pool), sizing, settings, policy)
    name, selector = pool_name(owner, pool.role), owner.pool_selector(pool.role)
    deployment["metadata"]["name"] = name
    deployment["spec"]["selector"] = {"matchLabels": selector}
    template = deployment["spec"]["template"]
    template["metadata"]["labels"][ROLE_LABEL] = pool.role
    container = template["spec"]["containers"][0]
    port = spec.disaggregation.side_channel_port
    container["env"] = [*container["env"],
                        {"name": NIXL_SIDE_CHANNEL_HOST_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                        {"name": NIXL_SIDE_CHANNEL_PORT_ENV, "value": str(port)}]
    container["ports"] = [*container["ports"],
                          {"name": SIDE_CHANNEL_PORT_NAME, "containerPort": port, "protocol": "TCP"}]
    return deployment


def _pool_pods(owner: Owner, role: str) -> str:
    """PromQL matchers of one pool's pods: the namespace and the Deployment's pod names."""
    return f'namespace="{owner.namespace}",pod=~"{pool_name(owner, role)}-[a-z0-9]+-[a-z0-9]+"'


def pool_queries(owner: Owner, spec: InferenceServiceSpec, role: str) -> list[tuple[str, float, str]]:
    """(PromQL, threshold, KEDA metric type) of one pool's triggers: per-pod sums of the
    pool's signals, and the prefill pool's p95 TTFT against the SLO's target (as a value)."""
    pods = _pool_pods(owner, role)
    auto = getattr(spec.disaggregation, role).autoscaling
    if role == DECODE:
        return [(f"sum({KV_USAGE_SERIES}{{{pods}}})", auto.kv_cache_usage_target, "AverageValue"),
                (f"sum(rate({PREEMPTIONS_SERIES}{{{pods}}}[{RATE_WINDOW}]))", auto.preemption_rate_target,
                 "AverageValue")]
    queries = [(f"sum({WAITING_SERIES}{{{pods}}})", auto.waiting_requests_target, "AverageValue")]
    if spec.slo.ttft_p95_ms is not None:
        queries.append((f"histogram_quantile(0.95, sum by (le) (rate({TTFT_SERIES}_bucket{{{pods}}}"
                        f"[{RATE_WINDOW}])))", spec.slo.ttft_p95_ms / 1000, "Value"))
    return queries


def _target(owner: Owner, role: str) -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "name": pool_name(owner, role)}


def build_pool_hpa(owner: Owner, spec: InferenceServiceSpec, role: str, settings: OperatorSettings) -> dict:
    """An HPA of one pool on its own per-pod signals (the Deployment's pods: that pool's)."""
    auto = getattr(spec.disaggregation, role).autoscaling
    if role == DECODE:
        metrics = [pods_metric(settings.hpa_kv_usage_metric, auto.kv_cache_usage_target),
                   pods_metric(settings.hpa_preemption_metric, auto.preemption_rate_target)]
    else:
        metrics = [pods_metric(settings.hpa_waiting_metric, auto.waiting_requests_target)]
        if spec.slo.ttft_p95_ms is not None:
            metrics.append(pods_metric(settings.hpa_ttft_metric, spec.slo.ttft_p95_ms / 1000))
    return hpa(owner.metadata("autoscaler", pool_name(owner, role)), _target(owner, role), auto, metrics)


def build_pool_scaledobject(owner: Owner, spec: InferenceServiceSpec, role: str) -> dict:
    """A KEDA ScaledObject of one pool on PromQL over that pool's pods."""
    auto = getattr(spec.disaggregation, role).autoscaling
    triggers = [prometheus_trigger(auto, query, threshold, kind)
                for query, threshold, kind in pool_queries(owner, spec, role)]
    return scaled_object(owner.metadata("autoscaler", pool_name(owner, role)), _target(owner, role), auto, triggers)


def build_pool_pdb(owner: Owner, role: str) -> dict:
    """One pod of the pool at a time through voluntary evictions."""
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": owner.metadata("disruption-budget", pool_name(owner, role)),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": owner.pool_selector(role)}}}


def pool_bodies(owner: Owner, spec: InferenceServiceSpec, sizing: EngineSizing, settings: OperatorSettings, *,
                keda_api: bool) -> list[tuple[dict, tuple[str, ...]]]:
    """(body, create-only paths) of each pool's Deployment, autoscaler and PodDisruptionBudget."""
    sizings, pods = pool_sizings(sizing), most_pods(spec, sizing)
    out: list[tuple[dict, tuple[str, ...]]] = []
    for pool in spec.disaggregation.pools:
        policy = pool_policy(pool, sizings[pool.role], pods)
        out.append((build_pool_deployment(owner, spec, pool, sizings[pool.role], settings, policy),
                    ("spec.replicas",) if policy.autoscaled else ()))
        if pool.autoscaling.mode == "hpa":
            out.append((build_pool_hpa(owner, spec, pool.role, settings), ()))
        elif pool.autoscaling.mode == "keda" and keda_api:
            out.append((build_pool_scaledobject(owner, spec, pool.role), ()))
        least = pool.autoscaling.min_replicas if policy.autoscaled else policy.replicas
        if least > 1:
            out.append((build_pool_pdb(owner, pool.role), ()))
    return out


def pool_names(owner: Owner) -> list[tuple[str, str]]:
    """(kind, name) of every child the pools may have (removed when not desired)."""
    return [(kind, pool_name(owner, role)) for role in (PREFILL, DECODE)
            for kind in ("Deployment", "HorizontalPodAutoscaler", "ScaledObject", "PodDisruptionBudget")]
