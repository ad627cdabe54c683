"""Operator settings, read once from the environment at start-up.

| variable                        | default                                   |
|---------------------------------|-------------------------------------------|
| KVPILOT_WATCH_NAMESPACES        | "" (cluster-wide); comma-separated names  |
| KVPILOT_ENGINE_IMAGE            | ghcr.io/kvpilot/kvpilot:0.1.0             |
| KVPILOT_S3_FETCH_IMAGE          | amazon/aws-cli:2.17.0                     |
| KVPILOT_LOG_LEVEL               | INFO                                      |
| KVPILOT_RESYNC_SECONDS          | 30 (observe children / repair drift)      |
| KVPILOT_LIVENESS_ENDPOINT       | http://0.0.0.0:8080/healthz ("" = off)    |
| KVPILOT_HPA_KV_USAGE_METRIC     | vllm_kv_cache_usage_perc                  |
| KVPILOT_HPA_WAITING_METRIC      | vllm_num_requests_waiting                 |
| KVPILOT_TERMINATION_GRACE_SECONDS | 120                                     |
| KVPILOT_PEERING                 | "" (off: one operator replica, standalone) |

The HPA metric names are the names a Prometheus adapter exposes in the custom metrics
API: the engine exports ``vllm:kv_cache_usage_perc`` / ``vllm:num_requests_waiting``
and a Prometheus adapter rule (README, "Operator") renames ``vllm:`` to ``vllm_``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class OperatorSettings:
    """What the operator was configured with.

    Args:
        namespaces: namespaces to watch; empty means the whole cluster.
        engine_image: image of engine pods when a spec names none.
        s3_fetch_image: image of the init container that downloads s3:// models.
        log_level: Python logging level name.
        resync_seconds: interval of the timer that observes children and repairs drift.
        liveness_endpoint: kopf's liveness URL to serve (None = off).
        hpa_kv_usage_metric / hpa_waiting_metric: custom-metrics names used by HPAs.
        termination_grace_seconds: how long a terminating engine pod may drain.
        peering: kopf peering name, or None for a standalone operator (the default).
    """

    namespaces: tuple[str, ...] = ()
    engine_image: str = "ghcr.io/kvpilot/kvpilot:0.1.0"
    s3_fetch_image: str = "amazon/aws-cli:2.17.0"
    log_level: str = "INFO"
    resync_seconds: float = 30.0
    liveness_endpoint: str | None = "http://0.0.0.0:8080/healthz"
    hpa_kv_usage_metric: str = "vllm_kv_cache_usage_perc"
    hpa_waiting_metric: str = "vllm_num_requests_waiting"
    termination_grace_seconds: int = 120
    peering: str | None = None

    def __post_init__(self) -> None:
        if not self.engine_image:
            raise ValueError("KVPILOT_ENGINE_IMAGE must not be empty")
        if self.resync_seconds <= 0:
            raise ValueError(f"KVPILOT_RESYNC_SECONDS must be > 0, got {self.resync_seconds}")
        if self.termination_grace_seconds < 0:
            raise ValueError("KVPILOT_TERMINATION_GRACE_SECONDS must be >= 0")
        if not isinstance(logging.getLevelName(self.log_level.upper()), int):
            raise ValueError(f"KVPILOT_LOG_LEVEL: unknown level {self.log_level!r}")

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

        namespaces = tuple(n.strip() for n in env.get("KVPILOT_WATCH_NAMESPACES", "").split(",") if n.strip())
        return cls(
            namespaces=namespaces,
            engine_image=env.get("KVPILOT_ENGINE_IMAGE", defaults.engine_image),
            s3_fetch_image=env.get("KVPILOT_S3_FETCH_IMAGE", defaults.s3_fetch_image),
            log_level=env.get("KVPILOT_LOG_LEVEL", defaults.log_level).upper(),
            resync_seconds=number("KVPILOT_RESYNC_SECONDS", defaults.resync_seconds),
            liveness_endpoint=env.get("KVPILOT_LIVENESS_ENDPOINT", defaults.liveness_endpoint) or None,
            hpa_kv_usage_metric=env.get("KVPILOT_HPA_KV_USAGE_METRIC", defaults.hpa_kv_usage_metric),
            hpa_waiting_metric=env.get("KVPILOT_HPA_WAITING_METRIC", defaults.hpa_waiting_metric),
            termination_grace_seconds=int(number("KVPILOT_TERMINATION_GRACE_SECONDS",
                                                 defaults.termination_grace_seconds)),
            peering=env.get("KVPILOT_PEERING") or None,
        )
