"""KV transfer between engines (disaggregated prefill and decode): ``--kv-transfer-config``.

- ``config``: vLLM's ``KVTransferConfig`` fields, frozen and checked, and the start-up
  check that the named connector is one this engine runs (``check_connector``).
- ``base``: the KV-connector API's worker half and ``KVConnector`` (both halves); the
  scheduler half is ``kvpilot.engine.core.kv_connector``. KV offload is a connector too
  (``kvpilot.engine.offload.connector``).
- ``params``: ``kv_transfer_params``, what the router and the two engines pass each other.
- ``nixl``: ``NixlConnector`` over NVIDIA's NIXL (disaggregated prefill and decode).
- ``stats``: transfer figures (vLLM's ``kvpilot:nixl_*`` metrics).
- ``factory``: the connector ``--kv-transfer-config`` names, over the allocated KV cache.

May import: the standard library, ``kvpilot.contract``, ``kvpilot.engine.core`` and, in
``nixl`` and ``factory`` only, torch, numpy, pyzmq and NIXL. This package's ``__init__``,
``config``, ``params`` and ``stats`` stay torch-free (the flag parser reads them).
"""

from kvpilot.engine.kv_transfer.config import (
    IMPLEMENTED_CONNECTORS,
    KVTransferConfig,
    check_connector,
)

__all__ = ["IMPLEMENTED_CONNECTORS", "KVTransferConfig", "check_connector"]
