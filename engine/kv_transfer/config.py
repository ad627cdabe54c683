"""``--kv-transfer-config``: vLLM's ``KVTransferConfig`` fields, frozen and checked (torch-free).

Parsing checks each field (names, types, ranges, vLLM's rule that a connector needs a
role); whether this engine can run the named connector is a separate question, asked at
start-up (``check_connector``), so that a configuration written for vLLM parses the same
here and the refusal names what is available.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpilot.contract.json_object import dataclass_from_object, parse_json
from kvpilot.contract.kv_transfer import (
    DEFAULT_KV_LOAD_FAILURE_POLICY,
    KV_CONSUMER,
    KV_LOAD_FAILURE_POLICIES,
    KV_PRODUCER,
    KV_ROLES,
    NIXL_CONNECTOR,
)

BUFFER_DEVICES = ("cpu", "cuda")
DEFAULT_KV_PORT = 14579            # vLLM's default kv_port
DEFAULT_KV_BUFFER_SIZE = 1e9       # vLLM's default kv_buffer_size (bytes)

# The connectors this engine runs, by vLLM's name (``kv_transfer.factory`` builds them).
# KV offloading to host memory / disk and LMCache run through the same connector API but
# are not named by --kv-transfer-config in kvpilot: they are --kv-offloading-backend
# native | lmcache.
IMPLEMENTED_CONNECTORS: tuple[str, ...] = (NIXL_CONNECTOR,)
OFFLOAD_INSTEAD = {"OffloadingConnector": "--kv-offloading-size / --kv-offloading-backend native",
                   "LMCacheConnectorV1": "--kv-offloading-backend lmcache"}


def _check_int(name: str, value: Any, least: int, most: int | None = None, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < least or (most is not None and value > most):
        bound = f"in [{least}, {most}]" if most is not None else f">= {least}"
        raise ValueError(f"{name} must be an integer {bound}{' or null' if optional else ''}, got {value!r}")


@dataclass(frozen=True, slots=True)
class KVTransferConfig:
    """How this engine exchanges KV blocks with other engines (vLLM's names, meanings and
    defaults).

    Args:
        kv_connector: the connector (``NixlConnector``, ...); None: no KV transfer.
        kv_role: ``kv_producer`` (computes prompts and hands their KV out: a prefill
            instance), ``kv_consumer`` (receives KV and decodes), ``kv_both``; required
            with a connector.
        kv_rank: this instance's rank among ``kv_parallel_size`` (connectors with a fixed
            group: 0 for prefill, 1 for decode); None where the connector needs none.
        kv_parallel_size: instances in such a group.
        kv_ip / kv_port: where such a group meets (not used by NIXL, which dials each
            peer's side channel instead).
        kv_buffer_size: bytes of a connector's transfer buffer, where it has one.
        kv_buffer_device: ``cpu`` or ``cuda`` for that buffer; None: the engine's device.
        kv_connector_extra_config: the connector's own settings (a JSON object, read-only).
        engine_id: this engine's id in transfers; None: a random one chosen at start-up
            (vLLM: a uuid4).
        kv_load_failure_policy: a consumer whose block read fails ``recompute``s those
            tokens itself or ``fail``s the request (vLLM's default).
        kv_connector_module_path: vLLM loads a connector class from this module; kvpilot
            runs built-in connectors only, so it must be null.
        enable_permute_local_kv: vLLM's experimental HND-to-NHD transfer; must be false.
    """

    kv_connector: str | None = None
    kv_role: str | None = None
    kv_rank: int | None = None
    kv_parallel_size: int = 1
    kv_ip: str = "127.0.0.1"
    kv_port: int = DEFAULT_KV_PORT
    kv_buffer_size: float = DEFAULT_KV_BUFFER_SIZE
    kv_buffer_device: str | None = None
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    engine_id: str | None = None
    kv_load_failure_policy: str = DEFAULT_KV_LOAD_FAILURE_POLICY
    kv_connector_module_path: str | None = None
    enable_permute_local_kv: bool = False

    def __post_init__(self) -> None:
        for name in ("kv_connector", "kv_role", "kv_buffer_device", "engine_id"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string or null, got {value!r}")
        if self.kv_role is not None and self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}")
        if self.kv_connector is not None and self.kv_role is None:
            raise ValueError(f"kv_connector {self.kv_connector!r} needs a kv_role: one of {', '.join(KV_ROLES)}")
        _check_int("kv_parallel_size", self.kv_parallel_size, 1)
        _check_int("kv_rank", self.kv_rank, 0, self.kv_parallel_size - 1, optional=True)
        _check_int("kv_port", self.kv_port, 0, 65535)
        if not isinstance(self.kv_ip, str) or not self.kv_ip:
            raise ValueError(f"kv_ip must be a non-empty string, got {self.kv_ip!r}")
        size = self.kv_buffer_size
        if isinstance(size, bool) or not isinstance(size, (int, float)) or not size > 0:
            raise ValueError(f"kv_buffer_size must be a number of bytes > 0, got {size!r}")
        if self.kv_buffer_device is not None and self.kv_buffer_device not in BUFFER_DEVICES:
            raise ValueError(f"kv_buffer_device must be one of {', '.join(BUFFER_DEVICES)} or null, "
                             f"got {self.kv_buffer_device!r}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("kv_connector_extra_config must be a JSON object")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy must be one of {', '.join(KV_LOAD_FAILURE_POLICIES)}, "
                             f"got {self.kv_load_failure_policy!r}")
        if self.kv_connector_module_path is not None:
            raise ValueError("kv_connector_module_path: kvpilot runs its built-in connectors only and loads "
                             "no connector module; leave it out")
        if self.enable_permute_local_kv is not False:
            raise ValueError("enable_permute_local_kv (vLLM's experimental HND-to-NHD transfer) is not "
                             "implemented; leave it out or false")

    @property
    def is_kv_transfer_instance(self) -> bool:
        return self.kv_connector is not None

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_connector is not None and self.kv_role != KV_CONSUMER

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_connector is not None and self.kv_role != KV_PRODUCER

    @classmethod
    def from_json(cls, text: str) -> KVTransferConfig:
        """Parses vLLM's JSON form; ValueError names an unknown key or a bad value."""
        return dataclass_from_object(cls, parse_json(text))


def check_connector(config: KVTransferConfig | None, implemented: tuple[str, ...] = IMPLEMENTED_CONNECTORS) -> None:
    """Refuses, before anything loads, a connector this engine does not run (ValueError
    naming the connectors it does run and, for vLLM's offloading connectors, kvpilot's
    flag for the same thing). None or no connector: nothing to check."""
    if config is None or config.kv_connector is None or config.kv_connector in implemented:
        return
    available = ", ".join(implemented) if implemented else "none yet"
    instead = OFFLOAD_INSTEAD.get(config.kv_connector)
    hint = f"; for what {config.kv_connector} does use {instead}" if instead else ""
    raise ValueError(f"--kv-transfer-config: kv_connector {config.kv_connector!r} is not implemented by this "
                     f"engine (connectors available: {available}){hint}")
