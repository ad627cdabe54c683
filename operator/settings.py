"""Operator settings, read once from the environment at start-up.

| variable                        | default                                   |
|---------------------------------|-------------------------------------------|
| KVPILOT_WATCH_NAMESPACES        | "" (cluster-wide); comma-separated names  |
| KVPILOT_ENGINE_IMAGE            | ghcr.io/kvpilot/kvpilot:0.1.0             |
| KVPILOT_S3_FETCH_IMAGE          | amazon/aws-cli:2.17.0                     |
| KVPILOT_LOG_LEVEL               | INFO                                      |
| KVPILOT_RESYNC_SECONDS          | 600 (safety-net resync, jittered ±25%)    |
| KVPILOT_MAX_CONCURRENT_RECONCILES | 10 (reconcile passes at once)           |
| KVPILOT_API_TIMEOUT_SECONDS     | 30 (one API request, then retry later)    |
| KVPILOT_LIVENESS_ENDPOINT       | http://0.0.0.0:8080/healthz ("" = off)    |
| KVPILOT_HPA_KV_USAGE_METRIC     | vllm_kv_cache_usage_perc                  |
| KVPILOT_HPA_WAITING_METRIC      | vllm_num_requests_waiting                 |
| KVPILOT_HPA_PREEMPTION_METRIC   | vllm_num_preemptions_per_second           |
| KVPILOT_HPA_TTFT_METRIC         | vllm_time_to_first_token_seconds_p95      |
| KVPILOT_TERMINATION_GRACE_SECONDS | 120                                     |
| KVPILOT_PEERING                 | "" (off: one operator replica, standalone) |
| KVPILOT_GPU_NODE_LABEL          | nvidia.com/gpu.product ("" = no GPU placement) |
| KVPILOT_GPU_NODE_VALUES         | {} (JSON: GPU type -> label values, over the catalogue's) |
| KVPILOT_MODEL_CACHE             | on (off: hf:// weights go to an emptyDir)  |
| KVPILOT_MODEL_CACHE_STORAGE_CLASS | "" (the cluster's default class)        |
| KVPILOT_RWX_STORAGE_CLASSES     | "" (comma-separated classes that offer ReadWriteMany) |
| KVPILOT_EPP_NAME                | {name}-epp (endpoint picker Service; {name} = the service) |
| KVPILOT_EPP_PORT                | 9002                                      |
| KVPILOT_EPP_FAILURE_MODE        | FailClose                                 |
| KVPILOT_PEERING_LIFETIME        | 60 (seconds a keep-alive stays valid)     |
| KVPILOT_METRICS_PORT            | 0 (off); the Helm chart serves 8081       |
| KVPILOT_METRICS_BIND_ADDRESS    | 127.0.0.1 (the host / pod only); the chart: 0.0.0.0, for Prometheus |
| KVPILOT_ENGINE_METRICS          | pod (read engine pods' /metrics directly; apiserver: through the API server's pod proxy; off) |
| KVPILOT_ENGINE_SCRAPE_TIMEOUT   | 2 (seconds one read of a pod's /metrics may take) |
| KVPILOT_ENGINE_SCRAPES_PER_PASS | 4 (engine pods read at most per pass of a service) |
| KVPILOT_SIZING_DRIFT_THRESHOLD  | 0.02 (relative error of observed vs planned KV capacity that sets SizingDrift) |
| KVPILOT_ADAPTER_LOAD_ATTEMPTS   | 5 (loads of a LoRA adapter before it is Failed) |
| KVPILOT_ADAPTER_LOAD_BACKOFF_SECONDS | 2 (the first wait between loads; doubling, at most 60) |
| KVPILOT_ALLOWED_IMAGES          | "" (only KVPILOT_ENGINE_IMAGE); comma-separated globs of spec.image |
| KVPILOT_ALLOWED_SERVICE_ACCOUNTS | "" (only the per-service account); comma-separated names |
| KVPILOT_ALLOWED_SECRETS         | * (any declared Secret); comma-separated globs; "" = none |
| KVPILOT_NETWORK_POLICY          | on (a NetworkPolicy per service; off: none) |
| KVPILOT_NETWORK_CLIENT_LABELS   | serving.kvpilot.dev/client=true (pods that may call the engine port) |
| KVPILOT_NETWORK_CLIENT_NAMESPACE_LABELS | unset (clients in the service's namespace); k=v,... (namespaces) |
| KVPILOT_NETWORK_MONITORING_NAMESPACE | monitoring (may scrape the engine port; "" = none) |
| KVPILOT_OPERATOR_NAMESPACE      | "" (the operator's pods may read engine /metrics from there) |
| KVPILOT_NETWORK_DNS_LABELS      | k8s-app=kube-dns (the DNS pods the engines may query) |
| KVPILOT_NETWORK_MODEL_EGRESS_CIDRS | 0.0.0.0/0,::/0 (where hf:// / s3:// / LMCache remote are) |
| KVPILOT_NETWORK_MODEL_EGRESS_PORTS | 443 (their ports; an LMCache remote URL's port is added) |

The HPA metric names are the names a Prometheus adapter exposes in the custom metrics
API: the engine exports ``vllm:kv_cache_usage_perc`` / ``vllm:num_requests_waiting`` /
``vllm:num_preemptions_total`` and the adapter rules the chart ships
(``charts/kvpilot/files/prometheus-adapter/``) rename ``vllm:`` to ``vllm_`` (and the
counter to its per-second rate, ``vllm_num_preemptions_per_second``).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvpilot.operator.planner.gpu import gpu_names, gpu_node_products
from kvpilot.operator.security import NetworkFence, SpecPolicy

EPP_FAILURE_MODES = ("FailOpen", "FailClose")
ENGINE_METRICS_MODES = ("pod", "apiserver", "off")
_ON, _OFF = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


@dataclass(frozen=True, slots=True)
class OperatorSettings:
    """What the operator was configured with.

    Args:
        namespaces: namespaces to watch; empty means the whole cluster.
        engine_image: image of engine pods when a spec names none.
        s3_fetch_image: image of the init container that downloads s3:// models.
        log_level: Python logging level name.
        resync_seconds: the safety-net resync of each service (changes to a service and
            its children are acted on as their watch events arrive, not at the resync).
        max_concurrent_reconciles: reconcile passes that may run at once, operator-wide.
        api_timeout_seconds: how long one API request may take before it counts as failed.
        liveness_endpoint: kopf's liveness URL to serve (None = off).
        hpa_kv_usage_metric / hpa_waiting_metric / hpa_preemption_metric: custom-metrics
            names used by HPAs; hpa_ttft_metric: a pod's p95 time to first token (seconds),
            the prefill pool's HPA of a disaggregated service with a TTFT target.
        termination_grace_seconds: how long a terminating engine pod may drain: its
            ``--shutdown-timeout`` (the pod's grace period adds the preStop sleep and a
            margin for the exit).
        peering: kopf peering name, or None for a standalone operator (the default). With a
            name, the replicas elect one to reconcile (``kvpilot.operator.peering``).
        peering_lifetime: seconds a replica's peering keep-alive stays valid: after a crash
            the next replica takes over within this time (after a clean stop at once).
        metrics_port: port of the operator's Prometheus ``/metrics`` (0 = off).
        metrics_bind_address: the address ``/metrics`` listens on: 127.0.0.1 by default (nothing
            outside the host, or the pod, reaches it), 0.0.0.0 / :: for every interface (what the
            chart sets, so that Prometheus scrapes the pod IP).
        engine_metrics: how the operator reads engine pods' ``/metrics`` to observe their KV
            cache (``engine_observer``): ``pod`` (directly), ``apiserver`` (pod proxy) or ``off``.
        engine_scrape_timeout / engine_scrapes_per_pass: seconds per read; reads per pass.
        sizing_drift_threshold: observed vs planned KV capacity error that sets ``SizingDrift``.
        adapter_load_attempts / adapter_load_backoff_seconds: how often the operator loads a
            LoRA adapter into the ready pods before the adapter is ``Failed``, and the first
            wait between tries (doubling up to ``adapter_loader.LoaderPolicy.max_backoff_s``).
        policy: what a spec may ask for: images, service accounts, Secrets (``security``).
        fence: the engine pods' NetworkPolicy (``security.NetworkFence``).
        gpu_node_label: node label whose value names the GPU product (GPU feature
            discovery's); None = pods are not pinned to a GPU type.
        gpu_node_values: GPU type -> label values, replacing the catalogue's products.
        model_cache: hf:// weights go to a cache claim that outlives pods (else an emptyDir).
        model_cache_storage_class: storage class of cache claims (None = cluster default).
        rwx_storage_classes: storage classes that can be mounted ReadWriteMany.
        endpoint_picker_name: the endpoint picker Service of an InferencePool; ``{name}``
            is replaced by the InferenceService's name.
        endpoint_picker_port / endpoint_picker_failure_mode: its port and failure mode.
        router_image: vLLM's router (``Dockerfile.router``) for ``spec.routing.router: vllm-router``.
    """

    namespaces: tuple[str, ...] = ()
    engine_image: str = "ghcr.io/kvpilot/kvpilot:0.1.0"
    s3_fetch_image: str = "amazon/aws-cli:2.17.0"
    log_level: str = "INFO"
    resync_seconds: float = 600.0
    max_concurrent_reconciles: int = 10
    api_timeout_seconds: float = 30.0
    liveness_endpoint: str | None = "http://0.0.0.0:8080/healthz"
    hpa_kv_usage_metric: str = "vllm_kv_cache_usage_perc"
    hpa_waiting_metric: str = "vllm_num_requests_waiting"
    hpa_preemption_metric: str = "vllm_num_preemptions_per_second"
    hpa_ttft_metric: str = "vllm_time_to_first_token_seconds_p95"
    termination_grace_seconds: int = 120
    peering: str | None = None
    gpu_node_label: str | None = "nvidia.com/gpu.product"
    gpu_node_values: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    model_cache: bool = True
    model_cache_storage_class: str | None = None
    rwx_storage_classes: tuple[str, ...] = ()
    endpoint_picker_name: str = "{name}-epp"
    endpoint_picker_port: int = 9002
    endpoint_picker_failure_mode: str = "FailClose"
    peering_lifetime: int = 60
    metrics_port: int = 0
    metrics_bind_address: str = "127.0.0.1"
    engine_metrics: str = "pod"
    engine_scrape_timeout: float = 2.0
    engine_scrapes_per_pass: int = 4
    sizing_drift_threshold: float = 0.02
    adapter_load_attempts: int = 5
    adapter_load_backoff_seconds: float = 2.0
    router_image: str = "ghcr.io/kvpilot/router:0.1.17"
    policy: SpecPolicy = SpecPolicy()
    fence: NetworkFence = field(default_factory=NetworkFence)

    def __post_init__(self) -> None:
        if not self.engine_image:
            raise ValueError("KVPILOT_ENGINE_IMAGE must not be empty")
        if self.resync_seconds <= 0:
            raise ValueError(f"KVPILOT_RESYNC_SECONDS must be > 0, got {self.resync_seconds}")
        if self.max_concurrent_reconciles < 1:
            raise ValueError("KVPILOT_MAX_CONCURRENT_RECONCILES must be >= 1, "
                             f"got {self.max_concurrent_reconciles}")
        if self.api_timeout_seconds <= 0:
            raise ValueError(f"KVPILOT_API_TIMEOUT_SECONDS must be > 0, got {self.api_timeout_seconds}")
        if self.termination_grace_seconds < 0:
            raise ValueError("KVPILOT_TERMINATION_GRACE_SECONDS must be >= 0")
        if self.peering_lifetime < 1:
            raise ValueError(f"KVPILOT_PEERING_LIFETIME must be >= 1, got {self.peering_lifetime}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"KVPILOT_METRICS_PORT must be a port (0 = off), got {self.metrics_port}")
        try:
            ipaddress.ip_address(self.metrics_bind_address)
        except ValueError:
            raise ValueError("KVPILOT_METRICS_BIND_ADDRESS must be an IP address (0.0.0.0 or :: for every "
                             f"interface), got {self.metrics_bind_address!r}") from None
        if self.engine_metrics not in ENGINE_METRICS_MODES:
            raise ValueError(f"KVPILOT_ENGINE_METRICS must be one of {', '.join(ENGINE_METRICS_MODES)}, "
                             f"got {self.engine_metrics!r}")
        if self.engine_scrape_timeout <= 0 or self.engine_scrapes_per_pass < 1:
            raise ValueError("KVPILOT_ENGINE_SCRAPE_TIMEOUT must be > 0 and KVPILOT_ENGINE_SCRAPES_PER_PASS >= 1")
        if not 0 < self.sizing_drift_threshold < 1:
            raise ValueError(f"KVPILOT_SIZING_DRIFT_THRESHOLD must be in (0, 1), got {self.sizing_drift_threshold}")
        if self.adapter_load_attempts < 1 or self.adapter_load_backoff_seconds <= 0:
            raise ValueError("KVPILOT_ADAPTER_LOAD_ATTEMPTS must be >= 1 and KVPILOT_ADAPTER_LOAD_BACKOFF_SECONDS "
                             f"> 0, got {self.adapter_load_attempts} and {self.adapter_load_backoff_seconds}")
        if not isinstance(logging.getLevelName(self.log_level.upper()), int):
            raise ValueError(f"KVPILOT_LOG_LEVEL: unknown level {self.log_level!r}")
        for gpu, values in self.gpu_node_values.items():
            if gpu not in gpu_names():
                raise ValueError(f"KVPILOT_GPU_NODE_VALUES: unknown GPU type {gpu!r}; known: "
                                 f"{', '.join(gpu_names())}")
            if not values or not all(isinstance(v, str) and v for v in values):
                raise ValueError(f"KVPILOT_GPU_NODE_VALUES[{gpu!r}] must be a non-empty list of strings")
        if not 1 <= self.endpoint_picker_port <= 65535:
            raise ValueError(f"KVPILOT_EPP_PORT must be 1..65535, got {self.endpoint_picker_port}")
        if self.endpoint_picker_failure_mode not in EPP_FAILURE_MODES:
            raise ValueError(f"KVPILOT_EPP_FAILURE_MODE must be one of {', '.join(EPP_FAILURE_MODES)}")
        try:
            self.endpoint_picker_name.format(name="x")
        except (KeyError, IndexError, ValueError):
            raise ValueError("KVPILOT_EPP_NAME may use only {name}, got "
                             f"{self.endpoint_picker_name!r}") from None

    def gpu_node_values_for(self, gpu: str) -> tuple[str, ...]:
        """The node-label values that mean GPU type ``gpu`` (the settings', else the catalogue's)."""
        return tuple(self.gpu_node_values.get(gpu) or gpu_node_products(gpu))

    def endpoint_picker_for(self, service: str) -> str:
        """The endpoint picker Service name of the InferenceService ``service``."""
        return self.endpoint_picker_name.format(name=service)

    @property
    def clusterwide(self) -> bool:
        return not self.namespaces

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> OperatorSettings:
        """Read the KVPILOT_* variables from ``environ`` (default: ``os.environ``)."""
        env = os.environ if environ is None else environ
        defaults = cls()

        def number(name: str, default: float) -> float:
            raw = env.get(name, "")
            try:
                return float(raw) if raw else default
            except ValueError:
                raise ValueError(f"{name} must be a number, got {raw!r}") from None

        def switch(name: str, default: bool) -> bool:
            raw = env.get(name, "").strip().lower()
            if not raw:
                return default
            if raw not in _ON + _OFF:
                raise ValueError(f"{name} must be on or off, got {raw!r}")
            return raw in _ON

        def names(name: str) -> tuple[str, ...]:
            return tuple(n.strip() for n in env.get(name, "").split(",") if n.strip())

        raw_values = env.get("KVPILOT_GPU_NODE_VALUES", "").strip()
        try:
            values = json.loads(raw_values) if raw_values else {}
        except ValueError as exc:
            raise ValueError(f"KVPILOT_GPU_NODE_VALUES is not JSON: {exc}") from None
        if not isinstance(values, dict) or not all(isinstance(v, list) for v in values.values()):
            raise ValueError('KVPILOT_GPU_NODE_VALUES must map GPU types to lists: {"l4": ["NVIDIA-L4"]}')

        namespaces = names("KVPILOT_WATCH_NAMESPACES")
        return cls(
            namespaces=namespaces,
            engine_image=env.get("KVPILOT_ENGINE_IMAGE", defaults.engine_image),
            s3_fetch_image=env.get("KVPILOT_S3_FETCH_IMAGE", defaults.s3_fetch_image),
            router_image=env.get("KVPILOT_ROUTER_IMAGE", defaults.router_image),
            log_level=env.get("KVPILOT_LOG_LEVEL", defaults.log_level).upper(),
            resync_seconds=number("KVPILOT_RESYNC_SECONDS", defaults.resync_seconds),
            max_concurrent_reconciles=int(number("KVPILOT_MAX_CONCURRENT_RECONCILES",
                                                 defaults.max_concurrent_reconciles)),
            api_timeout_seconds=number("KVPILOT_API_TIMEOUT_SECONDS", defaults.api_timeout_seconds),
            liveness_endpoint=env.get("KVPILOT_LIVENESS_ENDPOINT", defaults.liveness_endpoint) or None,
            hpa_kv_usage_metric=env.get("KVPILOT_HPA_KV_USAGE_METRIC", defaults.hpa_kv_usage_metric),
            hpa_waiting_metric=env.get("KVPILOT_HPA_WAITING_METRIC", defaults.hpa_waiting_metric),
            hpa_preemption_metric=env.get("KVPILOT_HPA_PREEMPTION_METRIC", defaults.hpa_preemption_metric),
            hpa_ttft_metric=env.get("KVPILOT_HPA_TTFT_METRIC", defaults.hpa_ttft_metric),
            termination_grace_seconds=int(number("KVPILOT_TERMINATION_GRACE_SECONDS",
                                                 defaults.termination_grace_seconds)),
            peering=env.get("KVPILOT_PEERING") or None,
            gpu_node_label=env.get("KVPILOT_GPU_NODE_LABEL", defaults.gpu_node_label) or None,
            gpu_node_values={k: tuple(v) for k, v in values.items()},
            model_cache=switch("KVPILOT_MODEL_CACHE", defaults.model_cache),
            model_cache_storage_class=env.get("KVPILOT_MODEL_CACHE_STORAGE_CLASS") or None,
            rwx_storage_classes=names("KVPILOT_RWX_STORAGE_CLASSES"),
            endpoint_picker_name=env.get("KVPILOT_EPP_NAME") or defaults.endpoint_picker_name,
            endpoint_picker_port=int(number("KVPILOT_EPP_PORT", defaults.endpoint_picker_port)),
            endpoint_picker_failure_mode=env.get("KVPILOT_EPP_FAILURE_MODE")
            or defaults.endpoint_picker_failure_mode,
            peering_lifetime=int(number("KVPILOT_PEERING_LIFETIME", defaults.peering_lifetime)),
            metrics_port=int(number("KVPILOT_METRICS_PORT", defaults.metrics_port)),
            metrics_bind_address=env.get("KVPILOT_METRICS_BIND_ADDRESS") or defaults.metrics_bind_address,
            engine_metrics=env.get("KVPILOT_ENGINE_METRICS") or defaults.engine_metrics,
            engine_scrape_timeout=number("KVPILOT_ENGINE_SCRAPE_TIMEOUT", defaults.engine_scrape_timeout),
            engine_scrapes_per_pass=int(number("KVPILOT_ENGINE_SCRAPES_PER_PASS",
                                               defaults.engine_scrapes_per_pass)),
            sizing_drift_threshold=number("KVPILOT_SIZING_DRIFT_THRESHOLD", defaults.sizing_drift_threshold),
            adapter_load_attempts=int(number("KVPILOT_ADAPTER_LOAD_ATTEMPTS", defaults.adapter_load_attempts)),
            adapter_load_backoff_seconds=number("KVPILOT_ADAPTER_LOAD_BACKOFF_SECONDS",
                                                defaults.adapter_load_backoff_seconds),
            policy=SpecPolicy.from_env(env),
            fence=NetworkFence.from_env(env),
        )
