"""The KV connector ``--kv-transfer-config`` names, built over the allocated KV cache."""

from __future__ import annotations

from kvpilot.contract.kv_layout import HybridKVLayout
from kvpilot.contract.kv_transfer import NIXL_CONNECTOR
from kvpilot.engine.kv_transfer.base import KVConnector
from kvpilot.engine.kv_transfer.config import KVTransferConfig


def create_kv_connector(config: KVTransferConfig, kv_caches, kv_cache_manager, layout, hash_root: bytes,
                        parallel_config, cache_info) -> KVConnector:
    """Both halves of the connector; ValueError for an engine it cannot serve.

    Args:
        config: ``--kv-transfer-config`` (its connector already checked at start-up).
        kv_caches: the runner's allocated KV cache.
        kv_cache_manager: block tables and the prefix cache.
        layout: the KV layout (a hybrid sliding-window layout is refused).
        hash_root: the prefix-hash chain's root (both engines must share it).
        parallel_config: this engine's ranks (one is required).
        cache_info: the allocated cache's figures (its KV dtype).
    """
    if config.kv_connector != NIXL_CONNECTOR:
        raise ValueError(f"no KV connector named {config.kv_connector!r}")
    if isinstance(layout, HybridKVLayout):
        raise ValueError("NixlConnector is not implemented for hybrid sliding-window models (their sliding "
                         "layers keep a second block table)")
    if parallel_config.world_size != 1:
        raise ValueError("NixlConnector is implemented for one rank per engine")
    from kvpilot.engine.kv_transfer.nixl.layout import (
        CONNECTOR_VERSION,
        LAYOUT,
        AgentInfo,
        kv_regions,
    )
    from kvpilot.engine.kv_transfer.nixl.scheduler import NixlConnectorScheduler
    from kvpilot.engine.kv_transfer.nixl.settings import NixlSettings
    from kvpilot.engine.kv_transfer.nixl.worker import NixlConnectorWorker

    settings = NixlSettings.from_config(config)
    regions, tensors = kv_regions(kv_caches)
    tp_size = parallel_config.tensor_parallel_size
    info = AgentInfo(CONNECTOR_VERSION, settings.engine_id, b"", regions.base_addrs, regions.block_len,
                     regions.num_blocks, regions.mem_type, regions.device_id, layout.block_size,
                     str(cache_info.kv_cache_dtype), LAYOUT, tp_size, hash_root.hex())
    worker = NixlConnectorWorker(settings, regions, tensors, info)
    return KVConnector(NIXL_CONNECTOR, NixlConnectorScheduler(settings, layout.block_size, tp_size), worker,
                       settings.load_failure_policy)
