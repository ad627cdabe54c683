"""The engine Deployment: ``kvpilot serve`` with the planned flags.

Pod layout: an optional model-download init container; the engine container with the GPU
limit (``gpu.count`` GPUs: one replica is one pod, its tensor-parallel worker processes
inside), startup and readiness probes on ``/health`` and liveness on ``/livez`` (which never
waits on the engine: a pod busy with a huge prompt or a hung step is taken out of the
Service by readiness, not restarted; a dead engine fails both), a memory-backed
``/dev/shm`` sized for the CPU KV tier and
the workers' NCCL buffers, the
disk KV tier (the PVC child when the service has one replica, else a per-pod ephemeral
claim, since a ReadWriteOnce claim cannot follow several pods), a writable ``/tmp`` and a
read-only root filesystem; Prometheus scrape annotations; non-root, under the service's
own account (or an allowed one, ``security``) with no API token mounted; and a graceful stop
(``preStop`` sleep so endpoints drop the pod first, then SIGTERM lets the server drain for
``--shutdown-timeout`` seconds; the grace period covers both and the exit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpilot.contract.constants import LIVENESS_PATH, READINESS_PATH
from kvpilot.operator import constants as c
from kvpilot.operator.resources import placement
from kvpilot.operator.resources.adapters import adapter_delivery, lora_args
from kvpilot.operator.resources.common import Owner, format_gib, gib_quantity
from kvpilot.operator.resources.inference_pool import ENGINE_TYPE, ENGINE_TYPE_LABEL
from kvpilot.operator.resources.model import model_delivery
from kvpilot.operator.resources.router import engine_routing
from kvpilot.operator.resources.sizing import EngineSizing
from kvpilot.operator.resources.storage import (
    RWO,
    disk_claim_spec,
    model_cache_access_mode,
    model_cache_claim_child,
    model_cache_volume,
)
from kvpilot.operator.security import engine_service_account
from kvpilot.operator.settings import OperatorSettings
from kvpilot.operator.spec import SHUTDOWN_TIMEOUT_FLAG, InferenceServiceSpec

GPU_RESOURCE = placement.GPU_RESOURCE
PRESTOP_SLEEP_SECONDS = 10
# Beyond the drain: uvicorn's last seconds for open connections, stopping the engine
# thread (up to 10 s) and the process exit.
SHUTDOWN_MARGIN_SECONDS = 15
# OnRootMismatch: the kubelet re-owns a volume only when its root is not the pod's group
# already, instead of walking the whole model cache at every pod start.
POD_SECURITY_CONTEXT = {
    "runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000,
    "fsGroupChangePolicy": "OnRootMismatch", "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY_CONTEXT = {
    "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}
TMP_MOUNT = {"name": "tmp", "mountPath": "/tmp"}


@dataclass(frozen=True, slots=True)
class ReplicaPolicy:
    """How many replicas, and who decides.

    Args:
        replicas: the Deployment's count at creation (and always, when not autoscaled).
        autoscaled: an HPA/ScaledObject owns the count after creation.
        max_replicas: the most replicas there can be (decides PDB and disk-claim layout).
            Times ``EngineSizing.nodes``: the pods there can be (a LeaderWorkerSet group has several).
        inherited: the count the operator took over from an autoscaler (``replica_handover``),
            kept as a floor while ``spec.replicas`` is unset; None when there is none.
    """

    replicas: int
    autoscaled: bool
    max_replicas: int
    inherited: int | None = None

    @classmethod
    def of(cls, spec: InferenceServiceSpec, sizing: EngineSizing,
           inherited: int | None = None) -> ReplicaPolicy:
        """The policy of ``spec`` planned as ``sizing``; ``inherited`` is the count an
        autoscaler left when autoscaling was switched off (``replica_handover.inherited_replicas``)."""
        auto = spec.autoscaling
        if auto.enabled:
            return cls(min(max(sizing.replicas, auto.min_replicas), auto.ceiling), True, auto.ceiling)
        if spec.replicas is not None:  # explicit (kubectl scale kvis): wins over what was inherited
            return cls(spec.replicas, False, spec.replicas)
        if inherited is not None:
            n = max(sizing.replicas, inherited)
            return cls(n, False, n, inherited)
        return cls(sizing.replicas, False, sizing.replicas)


def disk_claim_child(policy: ReplicaPolicy, sizing: EngineSizing) -> bool:
    """True when the disk KV tier is the PVC child: a disk tier and one replica at most (a
    ReadWriteOnce claim cannot follow several pods; those get per-pod claims instead)."""
    return sizing.disk_offload_gib > 0 and policy.max_replicas * sizing.nodes <= 1


def engine_args(spec: InferenceServiceSpec, sizing: EngineSizing, model_path: str,
                shutdown_timeout: int, routing_args: tuple[str, ...] = (),
                tokenizer_path: str | None = None, lora: tuple[str, ...] = ()) -> list[str]:
    """The ``kvpilot serve`` flags of the engine container (the API key is never here);
    ``lora``: the LoRA flags (``adapters.lora_args``); ``engine.extraArgs`` come last, so
    that they win (a ``--shutdown-timeout`` included)."""
    tokenizer = ["--tokenizer", tokenizer_path] if tokenizer_path else []
    return ["--model", model_path, *tokenizer, "--served-model-name", spec.model.served_name,
            "--host", "0.0.0.0", "--port", str(spec.port), SHUTDOWN_TIMEOUT_FLAG,
            str(shutdown_timeout), *sizing.serve_args, *lora, *routing_args, *spec.engine.extra_args]


def termination_grace_seconds(spec: InferenceServiceSpec, settings: OperatorSettings) -> int:
    """The pod's grace period: the preStop sleep, the engine's drain (``extraArgs``'
    ``--shutdown-timeout``, else the operator's) and a margin for the exit."""
    drain = spec.engine.shutdown_timeout
    if drain is None:
        drain = settings.termination_grace_seconds
    return PRESTOP_SLEEP_SECONDS + math.ceil(drain) + SHUTDOWN_MARGIN_SECONDS


def _lmcache_env(spec: InferenceServiceSpec, sizing: EngineSizing) -> list[dict]:
    """LMCache reads its configuration from LMCACHE_* variables (usage tracking off)."""
    env = {"LMCACHE_TRACK_USAGE": "false",
           "LMCACHE_LOCAL_CPU": "True" if sizing.cpu_offload_gib > 0 else "False",
           "LMCACHE_MAX_LOCAL_CPU_SIZE": format_gib(sizing.cpu_offload_gib)}
    if sizing.disk_offload_gib > 0:
        env["LMCACHE_LOCAL_DISK"] = f"file://{sizing.disk_path or c.KV_DISK_MOUNT}/"
        env["LMCACHE_MAX_LOCAL_DISK_SIZE"] = format_gib(sizing.disk_offload_gib)
    if spec.offload.lmcache_remote_url:
        env["LMCACHE_REMOTE_URL"] = spec.offload.lmcache_remote_url
    if spec.offload.lmcache_chunk_size:
        env["LMCACHE_CHUNK_SIZE"] = str(spec.offload.lmcache_chunk_size)
    return [{"name": k, "value": v} for k, v in env.items()]


def _env(spec: InferenceServiceSpec, sizing: EngineSizing) -> list[dict]:
    env = [{"name": "HOME", "value": "/tmp"}]
    if spec.api_key_secret is not None:
        name, key = spec.api_key_secret
        env.append({"name": c.API_KEY_ENV,
                    "valueFrom": {"secretKeyRef": {"name": name, "key": key}}})
    if sizing.offload_backend == "lmcache":
        env += _lmcache_env(spec, sizing)
    own = {e["name"] for e in env}
    return env + [dict(e) for e in spec.env if e["name"] not in own]


def _resources(spec: InferenceServiceSpec, sizing: EngineSizing) -> dict:
    limits: dict = {}
    requests: dict = {}
    if sizing.memory_gib is not None:
        limits["memory"] = requests["memory"] = gib_quantity(sizing.memory_gib)
    limits.update(spec.resources.get("limits") or {})
    requests.update(spec.resources.get("requests") or {})
    # quantities as strings: the server stores them so, and desired must equal stored
    limits[GPU_RESOURCE] = requests[GPU_RESOURCE] = str(spec.gpu.count)
    return {"limits": limits, "requests": requests}


def _probe(path: str, period: int, failures: int, timeout: int) -> dict:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period,
            "failureThreshold": failures, "timeoutSeconds": timeout}


def _disk_volume(owner: Owner, spec: InferenceServiceSpec, sizing: EngineSizing,
                 policy: ReplicaPolicy) -> dict:
    if disk_claim_child(policy, sizing):
        return {"name": "kv-disk", "persistentVolumeClaim": {"claimName": owner.kv_disk_claim}}
    return {"name": "kv-disk", "ephemeral": {"volumeClaimTemplate": {
        "metadata": {"labels": owner.labels("kv-disk")}, "spec": disk_claim_spec(spec, sizing)}}}


@dataclass(frozen=True, slots=True)
class PodRole:
    """Which pod of a replica a template is for.

    Args:
        component: the pods' ``app.kubernetes.io/component`` label: ``engine`` for the pods
            clients reach (the Service, InferencePool, PDB and PodMonitor select it), else
            ``engine-worker`` (a LeaderWorkerSet's workers: pipeline stages past the first).
        serves: runs the API server: its port, the routing labels and env, the probes and
            the preStop drain.
        extra_ports: further container ports (the group's rendezvous port on a leader).
    """

    component: str = "engine"
    serves: bool = True
    extra_ports: tuple[dict, ...] = ()


LEADER = PodRole()


def engine_pod_template(owner: Owner, spec: InferenceServiceSpec, sizing: EngineSizing,
                        settings: OperatorSettings, policy: ReplicaPolicy, role: PodRole = LEADER,
                        verified_adapters: frozenset[str] = frozenset()) -> dict:
    """The engine pod template (``metadata`` and ``spec``) of ``role``; ``verified_adapters``:
    the adapters that load (``resources.adapters``), passed as ``--lora-modules``."""
    image = spec.image or settings.engine_image
    delivery = model_delivery(spec.model, image, settings.s3_fetch_image, CONTAINER_SECURITY_CONTEXT,
                              TMP_MOUNT, model_cache_volume(owner, spec, sizing, settings,
                                                            policy.max_replicas * sizing.nodes))
    adapters = adapter_delivery(spec, image, settings.s3_fetch_image, CONTAINER_SECURITY_CONTEXT, TMP_MOUNT)
    volumes = [*delivery.volumes, *adapters.volumes,
               {"name": "dshm", "emptyDir": {"medium": "Memory",
                                             "sizeLimit": gib_quantity(sizing.shm_gib)}},
               {"name": "tmp", "emptyDir": {}}]
    mounts = [*delivery.engine_mounts, *adapters.engine_mounts, {"name": "dshm", "mountPath": "/dev/shm"}, TMP_MOUNT]
    if sizing.disk_offload_gib > 0:
        volumes.append(_disk_volume(owner, spec, sizing, policy))
        mounts.append({"name": "kv-disk", "mountPath": sizing.disk_path or c.KV_DISK_MOUNT})

    routing = engine_routing(owner, spec.router.kind, spec.model.served_name)
    ports = [{"name": "http", "containerPort": spec.port, "protocol": "TCP"}, *routing.ports] if role.serves else []
    container = {
        "name": c.ENGINE_CONTAINER,
        "image": image,
        "command": ["kvpilot", "serve"],
        "args": engine_args(spec, sizing, delivery.model_path, settings.termination_grace_seconds,
                            routing.args if role.serves else (), delivery.tokenizer_path,
                            tuple(lora_args(spec, adapters.paths, verified_adapters))),
        "ports": [*ports, *role.extra_ports],
        "env": [*_env(spec, sizing), *(routing.env if role.serves else ())],
        "resources": _resources(spec, sizing),
        "volumeMounts": mounts,
        "securityContext": CONTAINER_SECURITY_CONTEXT,
    }
    if not container["ports"]:
        del container["ports"]
    if role.serves:
        # Loading weights can take minutes: the startup probe (readiness' path, 200 once
        # loaded) allows 30 of them before liveness takes over; readiness gates traffic.
        container.update({
            "startupProbe": _probe(READINESS_PATH, period=10, failures=180, timeout=5),
            "readinessProbe": _probe(READINESS_PATH, period=5, failures=3, timeout=3),
            "livenessProbe": _probe(LIVENESS_PATH, period=10, failures=6, timeout=5),
            "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_SECONDS}}},
        })
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy

    pod_spec: dict = {
        # the engine never calls the Kubernetes API: no token in its pods, whatever the account
        "serviceAccountName": spec.service_account_name or engine_service_account(owner.name),
        "automountServiceAccountToken": False,
        "securityContext": POD_SECURITY_CONTEXT,
        "terminationGracePeriodSeconds": termination_grace_seconds(spec, settings),
        "enableServiceLinks": False,
        "containers": [container],
        "volumes": volumes,
        "tolerations": placement.tolerations(spec),
    }
    if delivery.init_containers or adapters.init_containers:
        pod_spec["initContainers"] = [*delivery.init_containers, *adapters.init_containers]
    if selector := placement.node_selector(spec):
        pod_spec["nodeSelector"] = selector
    if affinity := placement.affinity(spec, sizing.gpu, settings):
        pod_spec["affinity"] = affinity
    labels = owner.labels(role.component)
    metadata: dict = {"labels": labels}
    if role.serves:
        # the engine type tells Gateway API inference routing which metrics to read
        labels.update({ENGINE_TYPE_LABEL: ENGINE_TYPE, **routing.labels})
        metadata["annotations"] = {"prometheus.io/scrape": "true", "prometheus.io/port": str(spec.port),
                                   "prometheus.io/path": "/metrics"}
    return {"metadata": metadata, "spec": pod_spec}


def build_deployment(owner: Owner, spec: InferenceServiceSpec, sizing: EngineSizing,
                     settings: OperatorSettings, policy: ReplicaPolicy | None = None,
                     verified_adapters: frozenset[str] = frozenset()) -> dict:
    """The engine Deployment for one InferenceService.

    Args:
        owner: the InferenceService's name/namespace.
        spec: its parsed spec.
        sizing: the plan's flags and sizes (with spec overrides already applied).
        settings: operator settings (default image, metric names, grace period).
        policy: the replica policy (default: ``ReplicaPolicy.of(spec, sizing)``).
        verified_adapters: the adapters seen to load, passed as ``--lora-modules``.
    """
    policy = policy or ReplicaPolicy.of(spec, sizing)
    template = engine_pod_template(owner, spec, sizing, settings, policy, verified_adapters=verified_adapters)

    # A single replica on a ReadWriteOnce claim (disk tier, model cache) cannot surge (the new
    # pod could land on another node and wait forever for the volume): replace it instead.
    rwo_cache = (model_cache_claim_child(spec, settings, policy.max_replicas)
                 and model_cache_access_mode(spec, settings) == RWO)
    strategy = ({"type": "Recreate"} if disk_claim_child(policy, sizing) or rwo_cache else
                {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}})
    metadata = owner.metadata("engine")
    if policy.inherited is not None:  # remembered until spec.replicas is set or autoscaling is back
        metadata["annotations"] = {c.ANNOTATION_INHERITED_REPLICAS: str(policy.inherited)}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata,
        "spec": {
            "replicas": policy.replicas,
            "selector": {"matchLabels": owner.selector_labels},
            "strategy": strategy,
            "revisionHistoryLimit": 3,
            "progressDeadlineSeconds": 3600,
            "template": template,
        },
    }
