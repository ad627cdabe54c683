"""Typed view of an InferenceService ``spec``: parsing, defaults and validation.

The API server validates the CRD's schema and CEL rules before the operator sees an
object, but the operator repeats the checks (and applies the CRD's defaults) so that it
behaves the same against servers that skip them and says precisely what is wrong.
tests/operator/test_crd.py checks that these rules and defaults agree with the CRD's.

``spec.slo`` becomes the planner's own ``ServiceLevel`` and ``spec.engine``'s settings the
planner's ``Overrides`` fields: each CRD field's Python name is its snake_case
(``p95PromptTokens`` -> ``p95_prompt_tokens``), so the field lists below hold only what the
CRD schema adds (types and bounds).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpilot.engine.core.constants import KV_CACHE_DTYPES, OFFLOAD_BACKENDS
from kvpilot.operator.constants import HTTP_PORT
from kvpilot.operator.planner.plan_request import snake_case
from kvpilot.operator.planner.slo import ServiceLevel
from kvpilot.operator.spec_reader import Reader, SpecError

BLOCK_SIZES = (8, 16, 32, 64, 128)
AUTOSCALING_MODES = ("none", "hpa", "keda")
ACCESS_MODES = ("ReadWriteMany", "ReadWriteOnce")
FAILURE_MODES = ("FailOpen", "FailClose")
DEFAULT_PROMETHEUS = "http://prometheus-operated.monitoring.svc:9090"
# The composite scale signal's defaults: ~5 queued requests per replica is the usual
# vLLM queue-depth target; one preemption per 10 s per pod means the KV cache thrashes.
DEFAULT_WAITING_REQUESTS_TARGET = 5
DEFAULT_PREEMPTION_RATE_TARGET = 0.1
SHUTDOWN_TIMEOUT_FLAG = "--shutdown-timeout"   # kvpilot serve's drain time after SIGTERM

# field -> (type, bounds as in the CRD schema: Reader.get's keyword arguments)
Fields = dict[str, tuple[type, dict[str, Any]]]
SLO_FIELDS: Fields = {
    "maxContext": (int, {"required": True, "minimum": 16, "maximum": 2097152}),
    "p95PromptTokens": (int, {"required": True, "minimum": 1}),
    "p95OutputTokens": (int, {"required": True, "minimum": 1}),
    "p50PromptTokens": (int, {"minimum": 1}),
    "p50OutputTokens": (int, {"minimum": 1}),
    "concurrency": (int, {"minimum": 1, "maximum": 100000}),
    "requestsPerSecond": (float, {"minimum": 0, "exclusive_min": True, "maximum": 100000}),
    "ttftP95Ms": (float, {"minimum": 0, "exclusive_min": True}),
    "itlP95Ms": (float, {"minimum": 0, "exclusive_min": True}),
    "sharedPrefixTokens": (int, {"minimum": 0}),
    "distinctPrefixes": (int, {"minimum": 1, "maximum": 1000000}),
    "allowFp8KvCache": (bool, {}),
}
ENGINE_FIELDS: Fields = {
    "gpuMemoryUtilization": (float, {"minimum": 0.05, "maximum": 0.99}),
    "maxNumSeqs": (int, {"minimum": 1, "maximum": 65536}),
    "maxNumBatchedTokens": (int, {"minimum": 1, "maximum": 4194304}),
    "kvCacheDtype": (str, {"choices": KV_CACHE_DTYPES}),
    "blockSize": (int, {"choices": BLOCK_SIZES}),
    "enablePrefixCaching": (bool, {}),
    # planner: plan the KV cache this fraction below the calibrated estimate (default 3%)
    "kvSafetyMargin": (float, {"minimum": 0, "maximum": 0.49}),
    # planner: pin the KV cache size per GPU (--kv-cache-memory-bytes) instead of the estimate
    "kvCacheMemoryBytes": (int, {"minimum": 1}),
}
# The one CRD field whose planner name is not its snake_case.
PLANNER_NAMES = {"allowFp8KvCache": "allow_fp8_kv"}

_HF = re.compile(r"^hf://(?P<repo>[A-Za-z0-9][-A-Za-z0-9_.]*/[A-Za-z0-9][-A-Za-z0-9_.]*)(@(?P<rev>[-A-Za-z0-9_./]+))?$")
_PVC = re.compile(r"^pvc://(?P<claim>[a-z0-9]([-a-z0-9]*[a-z0-9])?)(/(?P<path>\S*))?$")
_S3 = re.compile(r"^s3://(?P<bucket>[a-z0-9][-a-z0-9.]*[a-z0-9])(/(?P<prefix>\S*))?$")
_SERVED = re.compile(r"^[A-Za-z0-9][-A-Za-z0-9_./:]*$")
_LM_URL = re.compile(r"^lm://[^\s/:]+:[0-9]+$")


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
    claim: str | None = None         # pvc
    bucket: str | None = None        # s3
    sub_path: str = ""               # pvc path inside the claim / s3 prefix
    image_path: str | None = None    # path
    cache: ModelCacheSpec = ModelCacheSpec()


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """``spec.gpu``; ``node_selector`` (when given) replaces the GPU-type node match."""

    type: str
    count: int = 1
    node_selector: Mapping[str, str] | None = None


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
    kv_cache_usage_target: float = 0.7
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
    service_account_name: str | None = None
    api_key_secret: tuple[str, str] | None = None   # (secret name, key)
    env_secrets: tuple[str, ...] = ()   # security: the Secrets spec.env may read (secretKeyRef)


def _read(r: Reader, table: Fields) -> dict[str, Any]:
    """Every field of ``table`` in ``r``, checked, by its CRD name (None when absent)."""
    return {name: r.get(name, kind, **bounds) for name, (kind, bounds) in table.items()}


def _planner_kwargs(values: Mapping[str, Any]) -> dict[str, Any]:
    """``_read``'s result by planner names, absent fields left out."""
    return {planner_name(name): value for name, value in values.items() if value is not None}


def _parse_model(r: Reader, resource_name: str) -> ModelSource:
    uri = r.get("uri", str, required=True)
    served = r.get("servedName", str, resource_name)
    if not _SERVED.match(served) or len(served) > 128:
        raise SpecError(f"spec.model.servedName {served!r} is not a valid model name")
    common = dict(uri=uri, served_name=served, architecture=r.get("architecture", str),
                  credentials_secret=None, cache=_parse_model_cache(r.sub("cache")))
    if r.sub("cache") is not None and not uri.startswith("hf://"):
        raise SpecError("spec.model.cache is only used with hf:// URIs")
    creds = r.sub("credentialsSecretRef")
    if creds is not None:
        common["credentials_secret"] = creds.get("name", str, required=True)
    if m := _HF.match(uri):
        return ModelSource(scheme="hf", repo_id=m["repo"], **common)
    if m := _PVC.match(uri):
        return ModelSource(scheme="pvc", claim=m["claim"], sub_path=m["path"] or "", **common)
    if m := _S3.match(uri):
        return ModelSource(scheme="s3", bucket=m["bucket"], sub_path=m["prefix"] or "", **common)
    if uri.startswith("/") and not any(c.isspace() for c in uri):
        if common["credentials_secret"]:
            raise SpecError("spec.model.credentialsSecretRef is only used with hf:// and s3:// URIs")
        return ModelSource(scheme="path", image_path=uri, **common)
    raise SpecError(f"spec.model.uri {uri!r} is not hf://org/name[@revision], pvc://claim/path, "
                    "s3://bucket/prefix or an absolute path in the image")


def _parse_model_cache(r: Reader | None) -> ModelCacheSpec:
    if r is None:
        return ModelCacheSpec()
    return ModelCacheSpec(
        enabled=r.get("enabled", bool, True),
        access_mode=r.get("accessMode", str, choices=ACCESS_MODES),
        storage_class=r.get("storageClassName", str),
        size_gib=r.get("sizeGiB", float, minimum=1, maximum=65536),
    )


def _parse_gpu(r: Reader) -> GpuSpec:
    selector = r.get("nodeSelector", Mapping)
    if selector is not None and not all(isinstance(v, str) for v in selector.values()):
        raise SpecError("spec.gpu.nodeSelector values must be strings")
    return GpuSpec(type=r.get("type", str, required=True),
                   count=r.get("count", int, 1, minimum=1, maximum=8),
                   node_selector=dict(selector) if selector is not None else None)


def _parse_affinity(r: Reader) -> dict[str, Any]:
    """``spec.affinity`` (a pod Affinity); the node terms must be a list, as the GPU match joins them."""
    affinity = dict(r.get("affinity", Mapping, {}))
    required = ((affinity.get("nodeAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution")
                or {})
    terms = required.get("nodeSelectorTerms") if isinstance(required, Mapping) else None
    if terms is not None and not (isinstance(terms, list) and all(isinstance(t, Mapping) for t in terms)):
        raise SpecError("spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
                        ".nodeSelectorTerms must be a list of objects")
    return affinity


def _parse_routing(r: Reader | None) -> InferencePoolSpec:
    pool = r.sub("inferencePool") if r is not None else None
    if pool is None:
        return InferencePoolSpec()
    picker = pool.sub("endpointPickerRef")
    return InferencePoolSpec(
        enabled=pool.get("enabled", bool, True),
        endpoint_picker=picker.get("name", str, required=True) if picker else None,
        endpoint_picker_port=picker.get("port", int, minimum=1, maximum=65535) if picker else None,
        failure_mode=picker.get("failureMode", str, choices=FAILURE_MODES) if picker else None,
    )


def _parse_slo(r: Reader) -> ServiceLevel:
    slo = _read(r, SLO_FIELDS)
    # The CRD's CEL rules on spec.slo, in the same order.
    if slo["concurrency"] is None and slo["requestsPerSecond"] is None:
        raise SpecError("spec.slo needs a target concurrency, a request rate, or both")
    if slo["p50PromptTokens"] is not None and slo["p50PromptTokens"] > slo["p95PromptTokens"]:
        raise SpecError("spec.slo.p50PromptTokens must be <= slo.p95PromptTokens")
    if slo["p50OutputTokens"] is not None and slo["p50OutputTokens"] > slo["p95OutputTokens"]:
        raise SpecError("spec.slo.p50OutputTokens must be <= slo.p95OutputTokens")
    if slo["p95PromptTokens"] + slo["p95OutputTokens"] > slo["maxContext"]:
        raise SpecError("spec.slo.p95PromptTokens + slo.p95OutputTokens must fit in slo.maxContext")
    if slo["sharedPrefixTokens"] is not None and slo["sharedPrefixTokens"] > slo["p95PromptTokens"]:
        raise SpecError("spec.slo.sharedPrefixTokens is part of the prompt and must be <= slo.p95PromptTokens")
    try:
        return ServiceLevel(**_planner_kwargs(slo))
    except ValueError as exc:  # the planner's own checks; the CRD's above should leave none
        raise SpecError(f"spec.slo: {exc}") from None


def _parse_engine(r: Reader | None) -> EngineSpec:
    if r is None:
        return EngineSpec()
    extra = r.items("extraArgs", lambda a: isinstance(a, str), "strings")
    if any(a.startswith("--api-key") for a in extra):
        raise SpecError("pass the API key through spec.apiKeySecretRef, never on the command line")
    try:
        timeout = EngineSpec(extra_args=extra).shutdown_timeout
    except ValueError:
        timeout = -1.0
    if timeout is not None and not 0 <= timeout < math.inf:
        raise SpecError(f"engine.extraArgs: {SHUTDOWN_TIMEOUT_FLAG} needs a number of seconds >= 0")
    engine = _read(r, ENGINE_FIELDS)
    if (engine["maxNumBatchedTokens"] is not None and engine["maxNumSeqs"] is not None
            and engine["maxNumBatchedTokens"] < engine["maxNumSeqs"]):
        raise SpecError("engine.maxNumBatchedTokens must be >= engine.maxNumSeqs "
                        "(every running sequence needs a token per step)")
    return EngineSpec(pinned=_planner_kwargs(engine), extra_args=extra)


def _parse_offload(r: Reader | None) -> OffloadSpec:
    if r is None:
        return OffloadSpec()
    disk = r.sub("disk")
    lmcache = r.sub("lmcache")
    offload = OffloadSpec(
        enabled=r.get("enabled", bool, False),
        backend=r.get("backend", str, "native", choices=OFFLOAD_BACKENDS),
        cpu_gib=r.get("cpuGiB", float, minimum=0, exclusive_min=True, maximum=4096),
        disk=disk is not None,
        disk_gib=disk.get("sizeGiB", float, minimum=1, maximum=65536) if disk else None,
        storage_class=disk.get("storageClassName", str) if disk else None,
        lmcache_remote_url=lmcache.get("remoteUrl", str) if lmcache else None,
        lmcache_chunk_size=lmcache.get("chunkSize", int, minimum=16, maximum=8192) if lmcache else None,
    )
    if not offload.enabled and (offload.cpu_gib is not None or disk is not None or lmcache is not None):
        raise SpecError("offload.cpuGiB, offload.disk and offload.lmcache need offload.enabled=true")
    if lmcache is not None and offload.backend != "lmcache":
        raise SpecError("offload.lmcache needs offload.backend=lmcache")
    if offload.lmcache_remote_url is not None and not _LM_URL.match(offload.lmcache_remote_url):
        raise SpecError(f"spec.offload.lmcache.remoteUrl {offload.lmcache_remote_url!r} is not lm://host:port")
    return offload


def _parse_autoscaling(r: Reader | None) -> AutoscalingSpec:
    if r is None:
        return AutoscalingSpec()
    auto = AutoscalingSpec(
        mode=r.get("mode", str, "none", choices=AUTOSCALING_MODES),
        min_replicas=r.get("minReplicas", int, 1, minimum=0, maximum=1000),
        max_replicas=r.get("maxReplicas", int, minimum=1, maximum=1000),
        kv_cache_usage_target=r.get("kvCacheUsageTarget", float, 0.7, minimum=0.05, maximum=1),
        waiting_requests_target=r.get("waitingRequestsTarget", int, DEFAULT_WAITING_REQUESTS_TARGET,
                                      minimum=1),
        preemption_rate_target=r.get("preemptionRateTarget", float, DEFAULT_PREEMPTION_RATE_TARGET,
                                     minimum=0, exclusive_min=True),
        prometheus_server_address=r.get("prometheusServerAddress", str, DEFAULT_PROMETHEUS),
    )
    if auto.enabled and auto.max_replicas is None:
        raise SpecError("autoscaling.maxReplicas is required when autoscaling.mode is hpa or keda")
    if auto.min_replicas == 0 and auto.mode != "keda":
        raise SpecError("autoscaling.minReplicas 0 (scale to zero) needs autoscaling.mode keda")
    if auto.max_replicas is not None and auto.min_replicas > auto.max_replicas:
        raise SpecError("autoscaling.minReplicas must be <= autoscaling.maxReplicas")
    return auto


def parse_spec(spec: Mapping[str, Any], resource_name: str) -> InferenceServiceSpec:
    """Parse an InferenceService ``spec`` mapping into typed, defaulted values.

    Args:
        spec: the object's ``spec`` as returned by the API server.
        resource_name: ``metadata.name``; the default served model name.
    Raises:
        SpecError: with the offending field's path, on anything the CRD would reject.
    """
    r = Reader(spec, "spec")
    gpu = r.sub("gpu", required=True)
    api_key = r.sub("apiKeySecretRef")
    env = r.items("env", lambda e: isinstance(e, Mapping) and e.get("name"), "{name, value|valueFrom}")
    tolerations = r.items("tolerations", lambda t: isinstance(t, Mapping), "objects")
    return InferenceServiceSpec(
        model=_parse_model(r.sub("model", required=True), resource_name),
        gpu=_parse_gpu(gpu),
        slo=_parse_slo(r.sub("slo", required=True)),
        engine=_parse_engine(r.sub("engine")),
        offload=_parse_offload(r.sub("offload")),
        autoscaling=_parse_autoscaling(r.sub("autoscaling")),
        replicas=r.get("replicas", int, minimum=0, maximum=1000),
        image=r.get("image", str),
        image_pull_policy=r.get("imagePullPolicy", str, choices=("Always", "IfNotPresent", "Never")),
        resources=dict(r.get("resources", Mapping, {})),
        env=tuple(dict(e) for e in env),
        node_selector=dict(r.get("nodeSelector", Mapping, {})),
        tolerations=tuple(dict(t) for t in tolerations),
        service_account_name=r.get("serviceAccountName", str),
        affinity=_parse_affinity(r),
        port=r.get("port", int, HTTP_PORT, minimum=1024, maximum=65535),
        inference_pool=_parse_routing(r.sub("routing")),
        api_key_secret=(api_key.get("name", str, required=True), api_key.get("key", str, "api-key"))
        if api_key else None,
        # security (kvpilot.operator.security): checked against the platform's policy
        env_secrets=r.items("envSecrets", lambda n: isinstance(n, str) and 0 < len(n) <= 253, "Secret names"),
    )
