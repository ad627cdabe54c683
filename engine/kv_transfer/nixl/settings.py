"""The NixlConnector's settings: from ``--kv-transfer-config`` and vLLM's environment (torch-free).

- ``VLLM_NIXL_SIDE_CHANNEL_HOST`` / ``VLLM_NIXL_SIDE_CHANNEL_PORT``: where this engine's
  handshake side channel listens, and what a producer tells consumers to dial (the
  operator sets the pod IP and port; vLLM's defaults ``localhost`` and 5600).
- how long a producer holds a finished request's blocks for a reader that never comes:
  ``kv_connector_extra_config.kv_lease_duration`` (seconds), else vLLM's
  ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, else vLLM's default of 480 s;
- ``kv_read_timeout`` (default 120 s): how long a producer keeps blocks a consumer has
  pinned for reading (a consumer that dies mid-read frees them then);
- ``kv_handshake_timeout`` (default 5 s): how long a consumer waits for a producer's side
  channel before the request's load counts as failed;
- ``backends`` (default ``["UCX"]``): NIXL backends, as vLLM reads them;
- ``KVPILOT_NIXL_TEST_READ_PAUSE=BLOCKS:SECONDS`` (a test hook, unset in production): a
  consumer posts a read of more than BLOCKS blocks as several NIXL transfers of at most
  BLOCKS blocks and sleeps SECONDS on its transfer thread after each but the last, logging
  "paused mid-read", so that a test can kill the producer while a read is half done.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from kvpilot.contract.kv_transfer import (
    DEFAULT_NIXL_SIDE_CHANNEL_PORT,
    NIXL_SIDE_CHANNEL_HOST_ENV,
    NIXL_SIDE_CHANNEL_PORT_ENV,
)
from kvpilot.engine.kv_transfer.config import KVTransferConfig

ABORT_REQUEST_TIMEOUT_ENV = "VLLM_NIXL_ABORT_REQUEST_TIMEOUT"
DEFAULT_LEASE_SECONDS = 480.0        # vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT
DEFAULT_READ_TIMEOUT_SECONDS = 120.0
DEFAULT_HANDSHAKE_TIMEOUT_SECONDS = 5.0
READ_PAUSE_ENV = "KVPILOT_NIXL_TEST_READ_PAUSE"
EXTRA_KEYS = ("kv_lease_duration", "kv_read_timeout", "kv_handshake_timeout", "backends")


def _seconds(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
    return float(value)


def _read_pause(text: str | None) -> tuple[int, float] | None:
    """``KVPILOT_NIXL_TEST_READ_PAUSE``: ``(blocks per transfer, seconds between)``."""
    if not text:
        return None
    blocks, _, seconds = text.partition(":")
    try:
        pause = int(blocks), float(seconds)
    except ValueError:
        pause = (0, 0.0)
    if pause[0] < 1 or not pause[1] >= 0:
        raise ValueError(f"{READ_PAUSE_ENV} must be BLOCKS:SECONDS (a test hook: blocks per NIXL transfer, "
                         f"pause between transfers), got {text!r}")
    return pause


@dataclass(frozen=True, slots=True)
class NixlSettings:
    engine_id: str
    producer: bool
    consumer: bool
    side_channel_host: str
    side_channel_port: int
    lease_seconds: float
    read_timeout_seconds: float
    handshake_timeout_seconds: float
    backends: tuple[str, ...]
    load_failure_policy: str
    # A test hook (``READ_PAUSE_ENV``): reads split into transfers of this many blocks,
    # this many seconds apart; None: one transfer per read.
    read_pause: tuple[int, float] | None = None

    @classmethod
    def from_config(cls, config: KVTransferConfig, env: Mapping[str, str] | None = None) -> NixlSettings:
        """ValueError names a bad extra key or value."""
        env = os.environ if env is None else env
        extra = config.kv_connector_extra_config
        unknown = sorted(set(extra) - set(EXTRA_KEYS))
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown key(s) {unknown} for NixlConnector; "
                             f"it reads {list(EXTRA_KEYS)}")
        port_text = env.get(NIXL_SIDE_CHANNEL_PORT_ENV, str(DEFAULT_NIXL_SIDE_CHANNEL_PORT))
        try:
            port = int(port_text)
        except ValueError:
            port = -1
        if not 0 < port < 65536:
            raise ValueError(f"{NIXL_SIDE_CHANNEL_PORT_ENV} must be a port number, got {port_text!r}")
        lease = extra.get("kv_lease_duration", env.get(ABORT_REQUEST_TIMEOUT_ENV, DEFAULT_LEASE_SECONDS))
        try:
            lease = float(lease) if isinstance(lease, str) else lease
        except ValueError:
            raise ValueError(f"{ABORT_REQUEST_TIMEOUT_ENV} must be a number of seconds, got {lease!r}") from None
        backends = extra.get("backends", ["UCX"])
        if not isinstance(backends, list) or not backends or not all(isinstance(b, str) for b in backends):
            raise ValueError(f"kv_connector_extra_config.backends must be a list of NIXL backend names, "
                             f"got {backends!r}")
        return cls(
            engine_id=config.engine_id or f"kvpilot-{uuid.uuid4().hex[:16]}",
            producer=config.is_kv_producer, consumer=config.is_kv_consumer,
            side_channel_host=env.get(NIXL_SIDE_CHANNEL_HOST_ENV, "localhost"), side_channel_port=port,
            lease_seconds=_seconds(lease, "kv_lease_duration"),
            read_timeout_seconds=_seconds(extra.get("kv_read_timeout", DEFAULT_READ_TIMEOUT_SECONDS),
                                          "kv_read_timeout"),
            handshake_timeout_seconds=_seconds(extra.get("kv_handshake_timeout",
                                                         DEFAULT_HANDSHAKE_TIMEOUT_SECONDS),
                                               "kv_handshake_timeout"),
            backends=tuple(backends), load_failure_policy=config.kv_load_failure_policy,
            read_pause=_read_pause(env.get(READ_PAUSE_ENV)))
