"""KV transfer between engines (disaggregated prefill and decode): ``--kv-transfer-config``.

- ``config``: vLLM's ``KVTransferConfig`` fields, frozen and checked, and the start-up
  check that the named connector is one this engine runs (``check_connector``; none yet:
  the KV-connector API registers NixlConnector there).

May import: the standard library and ``kvpilot.contract`` (the role and connector names
the operator shares); never torch (the flag parser reads it).
"""

from kvpilot.engine.kv_transfer.config import (
    IMPLEMENTED_CONNECTORS,
    KVTransferConfig,
    check_connector,
)

__all__ = ["IMPLEMENTED_CONNECTORS", "KVTransferConfig", "check_connector"]
