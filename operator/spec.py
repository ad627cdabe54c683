"""Typed view of an InferenceService ``spec``: parsing, defaults and validation.

The API server validates the CRD's schema and CEL rules before the operator sees an
object, but the operator repeats the checks (and applies the CRD's defaults) so that it
behaves the same against servers that skip them and says precisely what is wrong.
tests/operator/test_crd.py checks that these rules and defaults agree with the CRD's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
BLOCK_SIZES = (8, 16, 32, 64, 128)
AUTOSCALING_MODES = ("none", "hpa", "keda")
OFFLOAD_BACKENDS = ("native", "lmcache")
DEFAULT_PROMETHEUS = "http://prometheus-operated.monitoring.svc:9090"

_HF = re.compile(r"^hf://(?P<repo>[A-Za-z0-9][-A-Za-z0-9_.]*/[A-Za-z0-9][-A-Za-z0-9_.]*)(@(?P<rev>[-A-Za-z0-9_./]+))?$")
_PVC = re.compile(r"^pvc://(?P<claim>[a-z0-9]([-a-z0-9]*[a-z0-9])?)(/(?P<path>\S*))?$")
_S3 = re.compile(r"^s3://(?P<bucket>[a-z0-9][-a-z0-9.]*[a-z0-9])(/(?P<prefix>\S*))?$")
_SERVED = re.compile(r"^[A-Za-z0-9][-A-Za-z0-9_./:]*$")
_LM_URL = re.compile(r"^lm://[^\s/:]+:[0-9]+$")


class SpecError(ValueError):
    """A spec the operator cannot act on; the message names the field."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where the weights are: ``scheme`` is hf, pvc, s3 or path (inside the image)."""

    uri: str
    scheme: str
    served_name: str
    architecture: str | None = None
    credentials_secret: str | None = None
    repo_id: str | None = None       # hf
    revision: str | None = None      # hf
    claim: str | None = None         # pvc
    bucket: str | None = None        # s3
    sub_path: str = ""               # pvc path inside the claim / s3 prefix
    image_path: str | None = None    # path

    @property
    def name_hint(self) -> str:
        """The part of the URI that may name a catalogue model (repo or last path part)."""
        if self.repo_id:
            return self.repo_id
        tail = (self.sub_path or self.image_path or "").rstrip("/").rsplit("/", 1)[-1]
        return tail


@dataclass(frozen=True, slots=True)
class GpuSpec:
    type: str
    count: int = 1


@dataclass(frozen=True, slots=True)
class SloSpec:
    max_context: int
    p95_prompt_tokens: int
    p95_output_tokens: int
    p50_prompt_tokens: int | None = None
    p50_output_tokens: int | None = None
    concurrency: int | None = None
    requests_per_second: float | None = None
    ttft_p95_ms: float | None = None
    itl_p95_ms: float | None = None
    shared_prefix_tokens: int | None = None
    distinct_prefixes: int | None = None
    allow_fp8_kv_cache: bool = False


@dataclass(frozen=True, slots=True)
class EngineOverrides:
    gpu_memory_utilization: float | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_cache_dtype: str | None = None
    block_size: int | None = None
    enable_prefix_caching: bool | None = None
    extra_args: tuple[str, ...] = ()


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
    mode: str = "none"
    min_replicas: int = 1
    max_replicas: int | None = None
    kv_cache_usage_target: float = 0.7
    waiting_requests_target: int | None = None
    prometheus_server_address: str = DEFAULT_PROMETHEUS

    @property
    def enabled(self) -> bool:
        return self.mode != "none"


@dataclass(frozen=True, slots=True)
class InferenceServiceSpec:
    """Everything the builders need from one InferenceService, defaults applied."""

    model: ModelSource
    gpu: GpuSpec
    slo: SloSpec
    engine: EngineOverrides = EngineOverrides()
    offload: OffloadSpec = OffloadSpec()
    autoscaling: AutoscalingSpec = AutoscalingSpec()
    replicas: int | None = None
    image: str | None = None
    image_pull_policy: str | None = None
    resources: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    env: tuple[Mapping[str, Any], ...] = ()
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    service_account_name: str | None = None
    api_key_secret: tuple[str, str] | None = None   # (secret name, key)


class _Reader:
    """Typed, path-aware access to one object of the spec."""

    def __init__(self, data: Any, path: str) -> None:
        if not isinstance(data, Mapping):
            raise SpecError(f"{path} must be an object, got {type(data).__name__}")
        self.data, self.path = data, path

    def sub(self, key: str, required: bool = False) -> _Reader | None:
        if key not in self.data or self.data[key] is None:
            if required:
                raise SpecError(f"{self.path}.{key} is required")
            return None
        return _Reader(self.data[key], f"{self.path}.{key}")

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = None, *, required: bool = False,
            minimum: float | None = None, maximum: float | None = None, exclusive_min: bool = False,
            choices: tuple[Any, ...] | None = None) -> Any:
        where = f"{self.path}.{key}"
        if key not in self.data or self.data[key] is None:
            if required:
                raise SpecError(f"{where} is required")
            return default
        value = self.data[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, bool) and bool not in kinds:
            raise SpecError(f"{where} must be {kinds[0].__name__}, got a boolean")
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kinds):
            raise SpecError(f"{where} must be {kinds[0].__name__}, got {value!r}")
        if minimum is not None and (value <= minimum if exclusive_min else value < minimum):
            raise SpecError(f"{where} must be {'>' if exclusive_min else '>='} {minimum:g}, got {value!r}")
        if maximum is not None and value > maximum:
            raise SpecError(f"{where} must be <= {maximum:g}, got {value!r}")
        if choices is not None and value not in choices:
            raise SpecError(f"{where} must be one of {', '.join(map(str, choices))}; got {value!r}")
        return value


def _parse_model(r: _Reader, resource_name: str) -> ModelSource:
    uri = r.get("uri", str, required=True)
    served = r.get("servedName", str, resource_name)
    if not _SERVED.match(served) or len(served) > 128:
        raise SpecError(f"spec.model.servedName {served!r} is not a valid model name")
    common = dict(uri=uri, served_name=served, architecture=r.get("architecture", str),
                  credentials_secret=None)
    creds = r.sub("credentialsSecretRef")
    if creds is not None:
        common["credentials_secret"] = creds.get("name", str, required=True)
    if m := _HF.match(uri):
        return ModelSource(scheme="hf", repo_id=m["repo"], revision=m["rev"], **common)
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


def _parse_slo(r: _Reader) -> SloSpec:
    slo = SloSpec(
        max_context=r.get("maxContext", int, required=True, minimum=16, maximum=2097152),
        p95_prompt_tokens=r.get("p95PromptTokens", int, required=True, minimum=1),
        p95_output_tokens=r.get("p95OutputTokens", int, required=True, minimum=1),
        p50_prompt_tokens=r.get("p50PromptTokens", int, minimum=1),
        p50_output_tokens=r.get("p50OutputTokens", int, minimum=1),
        concurrency=r.get("concurrency", int, minimum=1, maximum=100000),
        requests_per_second=r.get("requestsPerSecond", float, minimum=0, exclusive_min=True, maximum=100000),
        ttft_p95_ms=r.get("ttftP95Ms", float, minimum=0, exclusive_min=True),
        itl_p95_ms=r.get("itlP95Ms", float, minimum=0, exclusive_min=True),
        shared_prefix_tokens=r.get("sharedPrefixTokens", int, minimum=0),
        distinct_prefixes=r.get("distinctPrefixes", int, minimum=1, maximum=1000000),
        allow_fp8_kv_cache=r.get("allowFp8KvCache", bool, False),
    )
    # The CRD's CEL rules on spec.slo, in the same order.
    if slo.concurrency is None and slo.requests_per_second is None:
        raise SpecError("spec.slo needs a target concurrency, a request rate, or both")
    if slo.p50_prompt_tokens is not None and slo.p50_prompt_tokens > slo.p95_prompt_tokens:
        raise SpecError("spec.slo.p50PromptTokens must be <= slo.p95PromptTokens")
    if slo.p50_output_tokens is not None and slo.p50_output_tokens > slo.p95_output_tokens:
        raise SpecError("spec.slo.p50OutputTokens must be <= slo.p95OutputTokens")
    if slo.p95_prompt_tokens + slo.p95_output_tokens > slo.max_context:
        raise SpecError("spec.slo.p95PromptTokens + slo.p95OutputTokens must fit in slo.maxContext")
    if slo.shared_prefix_tokens is not None and slo.shared_prefix_tokens > slo.p95_prompt_tokens:
        raise SpecError("spec.slo.sharedPrefixTokens is part of the prompt and must be <= slo.p95PromptTokens")
    return slo


def _parse_engine(r: _Reader | None) -> EngineOverrides:
    if r is None:
        return EngineOverrides()
    extra = r.data.get("extraArgs") or []
    if not isinstance(extra, list) or not all(isinstance(a, str) for a in extra):
        raise SpecError("spec.engine.extraArgs must be a list of strings")
    if any(a.startswith("--api-key") for a in extra):
        raise SpecError("pass the API key through spec.apiKeySecretRef, never on the command line")
    engine = EngineOverrides(
        gpu_memory_utilization=r.get("gpuMemoryUtilization", float, minimum=0.05, maximum=0.99),
        max_num_seqs=r.get("maxNumSeqs", int, minimum=1, maximum=65536),
        max_num_batched_tokens=r.get("maxNumBatchedTokens", int, minimum=1, maximum=4194304),
        kv_cache_dtype=r.get("kvCacheDtype", str, choices=KV_CACHE_DTYPES),
        block_size=r.get("blockSize", int, choices=BLOCK_SIZES),
        enable_prefix_caching=r.get("enablePrefixCaching", bool),
        extra_args=tuple(extra),
    )
    if (engine.max_num_batched_tokens is not None and engine.max_num_seqs is not None
            and engine.max_num_batched_tokens < engine.max_num_seqs):
        raise SpecError("engine.maxNumBatchedTokens must be >= engine.maxNumSeqs "
                        "(every running sequence needs a token per step)")
    return engine


def _parse_offload(r: _Reader | None) -> OffloadSpec:
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


def _parse_autoscaling(r: _Reader | None) -> AutoscalingSpec:
    if r is None:
        return AutoscalingSpec()
    auto = AutoscalingSpec(
        mode=r.get("mode", str, "none", choices=AUTOSCALING_MODES),
        min_replicas=r.get("minReplicas", int, 1, minimum=1, maximum=1000),
        max_replicas=r.get("maxReplicas", int, minimum=1, maximum=1000),
        kv_cache_usage_target=r.get("kvCacheUsageTarget", float, 0.7, minimum=0.05, maximum=1),
        waiting_requests_target=r.get("waitingRequestsTarget", int, minimum=1),
        prometheus_server_address=r.get("prometheusServerAddress", str, DEFAULT_PROMETHEUS),
    )
    if auto.enabled and auto.max_replicas is None:
        raise SpecError("autoscaling.maxReplicas is required when autoscaling.mode is hpa or keda")
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
    r = _Reader(spec, "spec")
    gpu = r.sub("gpu", required=True)
    api_key = r.sub("apiKeySecretRef")
    env = spec.get("env") or []
    tolerations = spec.get("tolerations") or []
    if not isinstance(env, list) or not all(isinstance(e, Mapping) and e.get("name") for e in env):
        raise SpecError("spec.env must be a list of {name, value|valueFrom}")
    if not isinstance(tolerations, list) or not all(isinstance(t, Mapping) for t in tolerations):
        raise SpecError("spec.tolerations must be a list of objects")
    return InferenceServiceSpec(
        model=_parse_model(r.sub("model", required=True), resource_name),
        gpu=GpuSpec(type=gpu.get("type", str, required=True),
                    count=gpu.get("count", int, 1, minimum=1, maximum=8)),
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
        api_key_secret=(api_key.get("name", str, required=True), api_key.get("key", str, "api-key"))
        if api_key else None,
    )
