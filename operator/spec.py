"""Typed view of an InferenceService ``spec``: checked against the contract, then read.

The API server validates the CRD's schema and CEL rules before the operator sees an
object, but the operator checks again, with the same table the CRD is generated from
(``contract.inference_service.SPEC``: types, bounds, enums, defaults and the CEL rules,
evaluated in Python), so that it behaves the same against servers that skip them and
applies the same defaults. Then it reads the typed values; the few checks here are those
a CRD cannot express (an ``--shutdown-timeout`` that parses, the shape of an affinity's
node terms, a model the planner can size).

``spec.slo`` becomes the planner's own ``ServiceLevel`` and ``spec.engine``'s settings the
planner's ``Overrides`` fields: each field's Python name is its snake_case
(``p95PromptTokens`` -> ``p95_prompt_tokens``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpilot.operator.constants import HTTP_PORT
from kvpilot.operator.contract.inference_service import (
    ADAPTER_URI_FORMS,
    DEFAULT_DECODE_POLICY,
    DEFAULT_KV_USAGE_TARGET,
    DEFAULT_PREEMPTION_RATE_TARGET,
    DEFAULT_PREFILL_POLICY,
    DEFAULT_PROMETHEUS,
    DEFAULT_WAITING_REQUESTS_TARGET,
    ENGINE,
    SLO,
    SPEC,
    URI_FORMS,
)
from kvpilot.operator.contract.schema import SpecError
from kvpilot.operator.planner.plan_request import snake_case
from kvpilot.operator.planner.slo import ServiceLevel

__all__ = ["InferenceServiceSpec", "SpecError", "parse_spec", "planner_name"]

SHUTDOWN_TIMEOUT_FLAG = "--shutdown-timeout"   # kvpilot serve's drain time after SIGTERM
# The one CRD field whose planner name is not its snake_case.
PLANNER_NAMES = {"allowFp8KvCache": "allow_fp8_kv"}
# spec.engine fields that are planner Overrides (extraArgs goes to the command line).
ENGINE_SETTINGS = tuple(name for name in ENGINE.properties if name != "extraArgs")
_URIS = {scheme: re.compile(f"^{pattern}$") for scheme, pattern in URI_FORMS.items()}
_ADAPTER_URIS = {scheme: re.compile(f"^{pattern}$") for scheme, pattern in ADAPTER_URI_FORMS.items()}


def planner_name(crd_field: str) -> str:
    """The planner's name of a ``spec.slo`` / ``spec.engine`` field (``maxNumSeqs`` -> ``max_num_seqs``)."""
    return PLANNER_NAMES.get(crd_field, snake_case(crd_field))


@dataclass(frozen=True, slots=True)
class ModelCacheSpec:
    """``spec.model.cache``: the claim that keeps downloaded hf:// weights across pod starts.

    Args:
        enabled: use a cache claim (else an emptyDir, refilled at every pod start).
        access_mode: ``ReadWriteMany`` / ``ReadWriteOnce``; None = by storage class (settings).
        storage_class: the claim's storage class (None = the operator's setting).
        size_gib: the claim's size (None = the planner's checkpoint size plus headroom).
    """

    enabled: bool = True
    access_mode: str | None = None
    storage_class: str | None = None
    size_gib: float | None = None


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where the weights are: ``scheme`` is hf, pvc, s3 or path (inside the image)."""

    uri: str
    scheme: str
    served_name: str
    architecture: str | None = None
    credentials_secret: str | None = None
    repo_id: str | None = None       # hf
    file: str | None = None          # hf: the one GGUF file of the repository to serve
    tokenizer_uri: str | None = None  # hf://org/name[@rev] whose tokenizer files replace the model's
    claim: str | None = None         # pvc
    bucket: str | None = None        # s3
    sub_path: str = ""               # pvc path inside the claim / s3 prefix
    image_path: str | None = None    # path
    cache: ModelCacheSpec = ModelCacheSpec()


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """One ``spec.adapters[]`` entry: a LoRA adapter and where it comes from (``scheme`` hf,
    s3 or pvc, its parts read as ``spec.model.uri``'s)."""

    name: str
    source: str
    scheme: str
    rank: int | None = None
    repo_id: str | None = None       # hf
    revision: str | None = None      # hf
    claim: str | None = None         # pvc
    bucket: str | None = None        # s3
    sub_path: str = ""               # pvc path inside the claim / s3 prefix


@dataclass(frozen=True, slots=True)
class LoRASpec:
    """``spec.lora`` with the defaults derived from the adapters (None: no adapters, LoRA off)."""

    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int


DEFAULT_MAX_LORAS = 4          # unset maxLoras: the number of adapters, at most this
DEFAULT_MAX_LORA_RANK = 16     # unset maxLoraRank and no declared rank: the engine's default


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """``spec.gpu``; ``node_selector`` (when given) replaces the GPU-type node match."""

    type: str
    count: int = 1
    node_selector: Mapping[str, str] | None = None
    per_node: int | None = None     # GPUs in one node (None: the planner's catalogue)
    nodes: int | None = None        # nodes (pipeline stages) per replica (None: the planner's choice)


@dataclass(frozen=True, slots=True)
class InferencePoolSpec:
    """``spec.routing.inferencePool``: Gateway API inference routing (when the API exists).

    Args:
        enabled: create an InferencePool for the service.
        endpoint_picker / endpoint_picker_port / failure_mode: the endpoint picker
            reference; None = the operator's settings.
    """

    enabled: bool = True
    endpoint_picker: str | None = None
    endpoint_picker_port: int | None = None
    failure_mode: str | None = None


@dataclass(frozen=True, slots=True)
class RouterSpec:
    """``spec.routing.router`` (``gateway`` | ``vllm-router``; None: as before, no events) and
    ``spec.routing.vllmRouter`` (``resources/router.py``)."""

    kind: str | None = None
    policy: str = "kv_aware"
    replicas: int = 2
    session_affinity_ttl_s: int | None = None   # kv_aware's session affinity (None: off)
    prefill_policy: str = DEFAULT_PREFILL_POLICY  # P/D mode (spec.disaggregation) only
    decode_policy: str = DEFAULT_DECODE_POLICY


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """``spec.engine``.

    Args:
        pinned: the engine settings the user pins, as planner ``Overrides`` fields
            (``{"max_num_seqs": 8}``); absent settings are left out.
        extra_args: flags appended to the ``kvpilot serve`` command line.
    """

    pinned: Mapping[str, Any] = field(default_factory=dict)
    extra_args: tuple[str, ...] = ()

    @property
    def shutdown_timeout(self) -> float | None:
        """The drain time ``extra_args`` set (the last ``--shutdown-timeout``, as argparse
        reads it), or None."""
        value = None
        for i, arg in enumerate(self.extra_args):
            if arg == SHUTDOWN_TIMEOUT_FLAG and i + 1 < len(self.extra_args):
                value = self.extra_args[i + 1]
            elif arg.startswith(SHUTDOWN_TIMEOUT_FLAG + "="):
                value = arg.partition("=")[2]
        return None if value is None else float(value)


@dataclass(frozen=True, slots=True)
class OffloadSpec:
    enabled: bool = False
    backend: str = "native"
    cpu_gib: float | None = None
    disk: bool = False               # a disk tier was asked for (spec.offload.disk present)
    disk_gib: float | None = None
    storage_class: str | None = None
    lmcache_remote_url: str | None = None
    lmcache_chunk_size: int | None = None


@dataclass(frozen=True, slots=True)
class AutoscalingSpec:
    """``spec.autoscaling``: the composite scale signal's per-pod targets and the bounds.

    Args:
        mode: ``none``, ``hpa`` (through a Prometheus adapter) or ``keda``.
        min_replicas / max_replicas: the bounds; 0 (scale to zero) only with KEDA.
        kv_cache_usage_target: average KV cache usage (0..1) per pod.
        waiting_requests_target: average queued requests per pod (catches prefill-heavy
            saturation that KV usage misses: the queue grows while usage stays flat).
        preemption_rate_target: average preemptions per second per pod (KV thrash).
        prometheus_server_address: the Prometheus KEDA's triggers query.
    """

    mode: str = "none"
    min_replicas: int = 1
    max_replicas: int | None = None
    kv_cache_usage_target: float = DEFAULT_KV_USAGE_TARGET
    waiting_requests_target: int = DEFAULT_WAITING_REQUESTS_TARGET
    preemption_rate_target: float = DEFAULT_PREEMPTION_RATE_TARGET
    prometheus_server_address: str = DEFAULT_PROMETHEUS

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    @property
    def ceiling(self) -> int:
        """The most replicas an autoscaler may run (``maxReplicas``, else ``minReplicas``)."""
        return self.max_replicas or self.min_replicas


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """One pool of ``spec.disaggregation``.

    Args:
        role: ``prefill`` or ``decode``.
        replicas: pinned replicas (None: the planner's ratio, or the autoscaler's).
        resources: extra requests/limits over ``spec.resources``.
        engine: the pool's engine settings (pinned over ``spec.engine``'s; its extraArgs
            come after the service's).
        autoscaling: the pool's own autoscaler (``mode: none``: off).
    """

    role: str
    replicas: int | None = None
    resources: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    engine: EngineSpec = field(default_factory=EngineSpec)
    autoscaling: AutoscalingSpec = AutoscalingSpec()


@dataclass(frozen=True, slots=True)
class DisaggregationSpec:
    """``spec.disaggregation``: the two pools, the KV connector and NIXL's side-channel port."""

    prefill: PoolSpec
    decode: PoolSpec
    kv_connector: str
    side_channel_port: int

    @property
    def pools(self) -> tuple[PoolSpec, PoolSpec]:
        return self.prefill, self.decode


@dataclass(frozen=True, slots=True)
class InferenceServiceSpec:
    """Everything the builders need from one InferenceService, defaults applied."""

    model: ModelSource
    gpu: GpuSpec
    slo: ServiceLevel
    engine: EngineSpec = field(default_factory=EngineSpec)
    offload: OffloadSpec = OffloadSpec()
    autoscaling: AutoscalingSpec = AutoscalingSpec()
    replicas: int | None = None
    image: str | None = None
    image_pull_policy: str | None = None
    resources: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    env: tuple[Mapping[str, Any], ...] = ()
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] = field(default_factory=dict)
    port: int = HTTP_PORT
    inference_pool: InferencePoolSpec = InferencePoolSpec()
    router: RouterSpec = RouterSpec()
    service_account_name: str | None = None
    api_key_secret: tuple[str, str] | None = None   # (secret name, key)
    env_secrets: tuple[str, ...] = ()   # security: the Secrets spec.env may read (secretKeyRef)
    adapters: tuple[AdapterSpec, ...] = ()
    lora: LoRASpec | None = None        # None: no adapters (LoRA off)
    disaggregation: DisaggregationSpec | None = None   # None: one pool doing both


def _planner_kwargs(values: Mapping[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """``values``' fields of ``names`` by planner name, absent ones left out."""
    return {planner_name(name): values[name] for name in names if values.get(name) is not None}


def _parse_model(m: Mapping[str, Any], resource_name: str) -> ModelSource:
    uri = m["uri"]
    cache = m.get("cache") or {}
    common = dict(uri=uri, served_name=m.get("servedName", resource_name), architecture=m.get("architecture"),
                  credentials_secret=(m.get("credentialsSecretRef") or {}).get("name"),
                  tokenizer_uri=m.get("tokenizer"),
                  cache=ModelCacheSpec(enabled=cache.get("enabled", True), access_mode=cache.get("accessMode"),
                                       storage_class=cache.get("storageClassName"), size_gib=cache.get("sizeGiB")))
    if match := _URIS["hf"].match(uri):
        return ModelSource(scheme="hf", repo_id=match["repo"], file=match["file"], **common)
    if match := _URIS["pvc"].match(uri):
        return ModelSource(scheme="pvc", claim=match["claim"], sub_path=match["path"] or "", **common)
    if match := _URIS["s3"].match(uri):
        return ModelSource(scheme="s3", bucket=match["bucket"], sub_path=match["prefix"] or "", **common)
    return ModelSource(scheme="path", image_path=uri, **common)   # the contract's pattern: nothing else


def _parse_adapters(adapters: list[Mapping[str, Any]], served_name: str) -> tuple[AdapterSpec, ...]:
    out = []
    for i, a in enumerate(adapters):
        if a["name"] == served_name:
            raise SpecError(f"spec.adapters[{i}].name {a['name']!r} is the base model's served name")
        source, common = a["source"], dict(name=a["name"], source=a["source"], rank=a.get("rank"))
        if match := _ADAPTER_URIS["hf"].match(source):
            if match["file"]:
                raise SpecError(f"spec.adapters[{i}].source: an adapter is a repository, not a file: {source!r}")
            out.append(AdapterSpec(scheme="hf", repo_id=match["repo"], revision=match["rev"], **common))
        elif match := _ADAPTER_URIS["pvc"].match(source):
            if ".." in (match["path"] or "").split("/"):
                raise SpecError(f"spec.adapters[{i}].source: no '..' in a claim path: {source!r}")
            out.append(AdapterSpec(scheme="pvc", claim=match["claim"], sub_path=match["path"] or "", **common))
        else:   # the contract's pattern: s3 is all that is left
            match = _ADAPTER_URIS["s3"].match(source)
            out.append(AdapterSpec(scheme="s3", bucket=match["bucket"], sub_path=match["prefix"] or "", **common))
    return tuple(out)


def _parse_lora(lora: Mapping[str, Any], adapters: tuple[AdapterSpec, ...]) -> LoRASpec | None:
    """``spec.lora`` with its defaults; a declared rank above ``maxLoraRank`` is refused."""
    if not adapters:
        return None
    ranks = [a.rank for a in adapters if a.rank is not None]
    max_rank = lora.get("maxLoraRank") or max(ranks, default=DEFAULT_MAX_LORA_RANK)
    for i, a in enumerate(adapters):
        if a.rank is not None and a.rank > max_rank:
            raise SpecError(f"spec.adapters[{i}].rank {a.rank} is above lora.maxLoraRank {max_rank}")
    max_loras = lora.get("maxLoras") or min(len(adapters), DEFAULT_MAX_LORAS)
    return LoRASpec(max_loras, max_rank, lora.get("maxCpuLoras") or max(len(adapters), max_loras))


def _check_affinity(affinity: Mapping[str, Any]) -> None:
    """The node terms must be a list of objects: the GPU match is joined into each."""
    required = ((affinity.get("nodeAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution")
                or {})
    terms = required.get("nodeSelectorTerms") if isinstance(required, Mapping) else None
    if terms is not None and not (isinstance(terms, list) and all(isinstance(t, Mapping) for t in terms)):
        raise SpecError("spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
                        ".nodeSelectorTerms must be a list of objects")


def _parse_routing(routing: Mapping[str, Any]) -> InferencePoolSpec:
    pool = routing.get("inferencePool")
    if pool is None:
        return InferencePoolSpec()
    picker = pool.get("endpointPickerRef") or {}
    return InferencePoolSpec(enabled=pool["enabled"], endpoint_picker=picker.get("name"),
                             endpoint_picker_port=picker.get("port"), failure_mode=picker.get("failureMode"))


def _parse_router(routing: Mapping[str, Any]) -> RouterSpec:
    vllm = routing.get("vllmRouter", {})
    return RouterSpec(kind=routing.get("router"), policy=vllm.get("policy", "kv_aware"),
                      replicas=vllm.get("replicas", 2),
                      session_affinity_ttl_s=vllm.get("sessionAffinityTTLSeconds"),
                      prefill_policy=vllm.get("prefillPolicy", DEFAULT_PREFILL_POLICY),
                      decode_policy=vllm.get("decodePolicy", DEFAULT_DECODE_POLICY))


def _parse_slo(slo: Mapping[str, Any]) -> ServiceLevel:
    try:
        return ServiceLevel(**_planner_kwargs(slo, tuple(SLO.properties)))
    except ValueError as exc:  # the planner's own checks; the contract's should leave none
        raise SpecError(f"spec.slo: {exc}") from None


def _parse_engine(engine: Mapping[str, Any]) -> EngineSpec:
    pinned = _planner_kwargs(engine, ENGINE_SETTINGS)
    if "speculative" in pinned:   # vLLM's --speculative-config field names (snake_case)
        pinned["speculative"] = {snake_case(k): v for k, v in pinned["speculative"].items()}
    parsed = EngineSpec(pinned=pinned, extra_args=tuple(engine.get("extraArgs", ())))
    try:
        timeout = parsed.shutdown_timeout
    except ValueError:
        timeout = -1.0
    if timeout is not None and not 0 <= timeout < math.inf:
        raise SpecError(f"engine.extraArgs: {SHUTDOWN_TIMEOUT_FLAG} needs a number of seconds >= 0")
    return parsed


def _parse_offload(offload: Mapping[str, Any]) -> OffloadSpec:
    if not offload:
        return OffloadSpec()
    disk, lmcache = offload.get("disk"), offload.get("lmcache") or {}
    return OffloadSpec(enabled=offload["enabled"], backend=offload["backend"], cpu_gib=offload.get("cpuGiB"),
                       disk=disk is not None, disk_gib=(disk or {}).get("sizeGiB"),
                       storage_class=(disk or {}).get("storageClassName"),
                       lmcache_remote_url=lmcache.get("remoteUrl"), lmcache_chunk_size=lmcache.get("chunkSize"))


def _parse_autoscaling(auto: Mapping[str, Any]) -> AutoscalingSpec:
    """``spec.autoscaling`` or a pool's (which names only its own signals' targets: the
    others keep their defaults and are not used)."""
    if not auto:
        return AutoscalingSpec()
    defaults = AutoscalingSpec()
    return AutoscalingSpec(
        mode=auto["mode"], min_replicas=auto["minReplicas"], max_replicas=auto.get("maxReplicas"),
        kv_cache_usage_target=auto.get("kvCacheUsageTarget", defaults.kv_cache_usage_target),
        waiting_requests_target=auto.get("waitingRequestsTarget", defaults.waiting_requests_target),
        preemption_rate_target=auto.get("preemptionRateTarget", defaults.preemption_rate_target),
        prometheus_server_address=auto["prometheusServerAddress"])


def _parse_disaggregation(d: Mapping[str, Any] | None, service_engine: EngineSpec) -> DisaggregationSpec | None:
    """``spec.disaggregation``; each pool's engine settings merged over the service's."""
    if d is None:
        return None

    def pool(role: str) -> PoolSpec:
        p = d[role]
        own = _parse_engine(p.get("engine", {}))
        engine = EngineSpec(pinned={**service_engine.pinned, **own.pinned},
                            extra_args=(*service_engine.extra_args, *own.extra_args))
        return PoolSpec(role=role, replicas=p.get("replicas"), resources=p.get("resources", {}), engine=engine,
                        autoscaling=_parse_autoscaling(p.get("autoscaling", {})))

    return DisaggregationSpec(prefill=pool("prefill"), decode=pool("decode"), kv_connector=d["kvConnector"],
                              side_channel_port=d["sideChannelPort"])


def parse_spec(spec: Mapping[str, Any], resource_name: str) -> InferenceServiceSpec:
    """Check an InferenceService ``spec`` against the contract and read it, defaults applied.

    Args:
        spec: the object's ``spec`` as returned by the API server.
        resource_name: ``metadata.name``; the default served model name.
    Raises:
        SpecError: with the offending field's path, on anything the CRD would reject (or,
            for the few checks a CRD cannot express, the operator does).
    """
    s = SPEC.check(spec, "spec")
    _check_affinity(s.get("affinity", {}))
    api_key = s.get("apiKeySecretRef")
    model = _parse_model(s["model"], resource_name)
    adapters = _parse_adapters(s.get("adapters", []), model.served_name)
    engine = _parse_engine(s.get("engine", {}))
    return InferenceServiceSpec(
        model=model,
        adapters=adapters,
        lora=_parse_lora(s.get("lora", {}), adapters),
        gpu=GpuSpec(type=s["gpu"]["type"], count=s["gpu"]["count"], node_selector=s["gpu"].get("nodeSelector"),
                    per_node=s["gpu"].get("perNode"), nodes=s["gpu"].get("nodes")),
        slo=_parse_slo(s["slo"]),
        engine=engine,
        offload=_parse_offload(s.get("offload", {})),
        autoscaling=_parse_autoscaling(s.get("autoscaling", {})),
        replicas=s.get("replicas"),
        image=s.get("image"),
        image_pull_policy=s.get("imagePullPolicy"),
        resources=s.get("resources", {}),
        env=tuple(s.get("env", ())),
        node_selector=s.get("nodeSelector", {}),
        tolerations=tuple(s.get("tolerations", ())),
        service_account_name=s.get("serviceAccountName"),
        affinity=s.get("affinity", {}),
        port=s["port"],
        inference_pool=_parse_routing(s.get("routing", {})),
        router=_parse_router(s.get("routing", {})),
        disaggregation=_parse_disaggregation(s.get("disaggregation"), engine),
        api_key_secret=(api_key["name"], api_key["key"]) if api_key else None,
        # security (kvpilot.operator.security): checked against the platform's policy
        env_secrets=tuple(s.get("envSecrets", ())),
    )
