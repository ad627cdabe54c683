"""Server-side settings (everything ``kvpilot serve`` needs beyond ``EngineArgs``)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """What the HTTP layer needs to know.

    Args:
        served_model_names: names accepted in requests' ``model`` field; empty means
            only the engine's own served model name. The first one is reported.
        api_key: when set, ``/v1/*`` requires ``Authorization: Bearer <api_key>``.
        max_waiting_requests: requests allowed to wait for a batch slot before new
            ones get 429; None = unbounded.
        log_stats_interval: seconds between periodic INFO stats lines; 0 = off.
        retry_after_seconds: value of the ``Retry-After`` header on a 429.
    """

    served_model_names: tuple[str, ...] = ()
    api_key: str | None = field(default=None, repr=False)
    max_waiting_requests: int | None = 1024
    log_stats_interval: float = 10.0
    retry_after_seconds: int = 1

    def __post_init__(self) -> None:
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {self.max_waiting_requests}")
        if not self.log_stats_interval >= 0:
            raise ValueError(f"log_stats_interval must be >= 0, got {self.log_stats_interval}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (omit it to disable authentication)")
        if self.retry_after_seconds < 0:
            raise ValueError(f"retry_after_seconds must be >= 0, got {self.retry_after_seconds}")

    def reported_model_name(self, engine_model_name: str) -> str:
        """The name reported in responses and in the metrics' ``model_name`` label: the first
        served name, else ``engine_model_name`` (the engine's own served model name)."""
        return self.served_model_names[0] if self.served_model_names else engine_model_name


def server_config_from_namespace(ns: argparse.Namespace) -> ServerConfig:
    """Builds a ServerConfig from parsed ``kvpilot serve`` flags.

    Without ``--api-key`` the key comes from ``$KVPILOT_API_KEY`` (how a Kubernetes
    Secret reaches the server without showing on the command line).
    """
    from kvpilot.engine.server.args import API_KEY_ENV

    return ServerConfig(
        served_model_names=tuple(ns.served_model_name or ()),
        api_key=ns.api_key or os.environ.get(API_KEY_ENV) or None,
        max_waiting_requests=ns.max_waiting_requests,
        log_stats_interval=ns.log_stats_interval,
    )
