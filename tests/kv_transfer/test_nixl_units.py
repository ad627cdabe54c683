"""NixlConnector's pure pieces: ``kv_transfer_params`` (vLLM's field names, as vllm-router
sends and reads them: vllm-project/router ``src/routers/http/vllm_pd_router.rs``), its
settings, the handshake's compatibility check and the READ descriptors (checked against the
KV cache tensor's own byte offsets)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvpilot.engine.kv_transfer.config import KVTransferConfig
from kvpilot.engine.kv_transfer.nixl.layout import (
    AgentInfo,
    HandshakeError,
    check_compatible,
    kv_regions,
    transfer_descs,
)
from kvpilot.engine.kv_transfer.nixl.settings import NixlSettings
from kvpilot.engine.kv_transfer.params import (
    check_kv_transfer_params,
    parse_remote_prefill,
    producer_params,
)

PRODUCER = KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_producer")
CONSUMER = KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_consumer")
ROUTER_PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


def test_params_round_trip_and_refusals():
    params = producer_params(engine_id="p", request_id="cmpl-1", block_ids=[3, 4, 9], host="10.0.0.5", port=5600,
                             tp_size=1, num_tokens=40, prefix_hash="ab")
    check_kv_transfer_params(ROUTER_PREFILL, PRODUCER)          # what the router sends a prefill engine
    check_kv_transfer_params(params, CONSUMER)                  # and, with the answer, a decode engine
    remote = parse_remote_prefill(params)
    assert (remote.block_ids, remote.address, remote.num_tokens) == ((3, 4, 9), ("10.0.0.5", 5600), 40)
    assert parse_remote_prefill({**params, "remote_block_ids": [[3, 4]]}).block_ids == (3, 4)   # vLLM's per-group form
    for params_, config, words in [
        (ROUTER_PREFILL, CONSUMER, "kv_consumer"),
        (params, PRODUCER, "kv_producer"),
        (params, None, "--kv-transfer-config"),
        ({**params, "remote_block_ids": []}, CONSUMER, "remote_block_ids"),
        ({**params, "remote_port": "x"}, CONSUMER, "remote_port"),
        ({"do_remote_prefill": True}, CONSUMER, "remote_engine_id"),
        ({**ROUTER_PREFILL, "do_remote_prefill": True}, KVTransferConfig(kv_connector="NixlConnector",
                                                                        kv_role="kv_both"), "both"),
        ([], CONSUMER, "JSON object"),
    ]:
        with pytest.raises(ValueError, match=words):
            check_kv_transfer_params(params_, config)


def test_settings_from_config_and_environment():
    config = KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_producer", engine_id="e1",
                              kv_connector_extra_config={"kv_lease_duration": 2})
    s = NixlSettings.from_config(config, env={"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.1.2.3",
                                               "VLLM_NIXL_SIDE_CHANNEL_PORT": "6000"})
    assert (s.engine_id, s.producer, s.consumer, s.side_channel_host, s.side_channel_port, s.lease_seconds) == \
        ("e1", True, False, "10.1.2.3", 6000, 2.0)
    assert NixlSettings.from_config(CONSUMER, env={"VLLM_NIXL_ABORT_REQUEST_TIMEOUT": "30"}).lease_seconds == 30.0
    assert s.read_pause is None   # one transfer per read, unless a test asks otherwise
    assert NixlSettings.from_config(CONSUMER, env={"KVPILOT_NIXL_TEST_READ_PAUSE": "64:2.5"}).read_pause == (64, 2.5)
    for extra, env, words in [({"kv_lease": 1}, {}, "unknown key"), ({"kv_read_timeout": 0}, {}, "kv_read_timeout"),
                              ({}, {"VLLM_NIXL_SIDE_CHANNEL_PORT": "99999"}, "port number"),
                              ({"backends": "UCX"}, {}, "backends"),
                              ({}, {"KVPILOT_NIXL_TEST_READ_PAUSE": "0:1"}, "BLOCKS:SECONDS"),
                              ({}, {"KVPILOT_NIXL_TEST_READ_PAUSE": "64"}, "BLOCKS:SECONDS")]:
        with pytest.raises(ValueError, match=words):
            NixlSettings.from_config(dataclasses.replace(CONSUMER, kv_connector_extra_config=extra), env=env)


def _info(**changes) -> AgentInfo:
    base = AgentInfo(1, "p", b"", (0, 100), (64, 64), 10, "DRAM", 0, 16, "float32", "NHD", 1, "aa")
    return dataclasses.replace(base, **changes)


@pytest.mark.parametrize(("change", "words"), [
    ({"block_size": 32}, "block size .* 16 here, 32 on prefill engine 'p'"),
    ({"kv_dtype": "bfloat16"}, "KV cache dtype .* float32 here, bfloat16"),
    ({"layout": "HND"}, "layout"),
    ({"tp_size": 2}, "tensor-parallel size"),
    ({"block_len": (32, 32)}, "block shapes differ"),
    ({"hash_root": "bb"}, "prefix-hash roots differ"),
    ({"version": 2}, "versions differ"),
])
def test_handshake_names_the_first_difference(change, words):
    check_compatible(_info(), _info(engine_id="other", base_addrs=(5, 6)))   # addresses may differ
    with pytest.raises(HandshakeError, match=words):
        check_compatible(_info(), _info(**change))


def test_descriptors_address_the_blocks_of_every_layer_and_merge_runs():
    local = torch.zeros(3, 2, 8, 4, 2, 4)        # [layers, K/V, blocks, block_size, kv_heads, head_dim]
    remote = torch.zeros(3, 2, 8, 4, 2, 4)
    regions, _ = kv_regions(local)
    remote_regions, _ = kv_regions(remote)
    info = _info(base_addrs=remote_regions.base_addrs, block_len=remote_regions.block_len)
    local_rows, remote_rows = transfer_descs(regions, [2, 3, 7], info, [5, 6, 0])
    assert len(local_rows) == 3 * 2 * 2                  # two runs ([2, 3] <- [5, 6], [7] <- [0]) per region
    size = local[0, 0, 0].numel() * 4
    expected_local = sorted((local[layer, kv, b].data_ptr(), n * size) for layer in range(3) for kv in range(2)
                            for b, n in ((2, 2), (7, 1)))
    expected_remote = sorted((remote[layer, kv, b].data_ptr(), n * size) for layer in range(3) for kv in range(2)
                             for b, n in ((5, 2), (0, 1)))
    assert sorted(map(tuple, local_rows[:, :2].tolist())) == expected_local
    assert sorted(map(tuple, remote_rows[:, :2].tolist())) == expected_remote


def test_start_up_refusals_name_what_is_not_implemented():
    from kvpilot.engine.engine_args import EngineArgs

    for kwargs, words in [({"kv_offloading_size": 1.0}, "one KV connector"),
                          ({"tensor_parallel_size": 2}, "one rank per engine"),
                          ({"token_granular_reuse": True}, "--token-granular-reuse is not implemented"),
                          ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
                           "--speculative-config is not implemented"),
                          ({"kv_transfer_config": dataclasses.replace(CONSUMER, kv_connector_extra_config={"x": 1})},
                           "unknown key")]:
        with pytest.raises(ValueError, match=words):
            EngineArgs(**{"kv_transfer_config": CONSUMER, **kwargs}).create_kv_transfer_config()
    assert EngineArgs(kv_transfer_config=PRODUCER).create_kv_transfer_config() == PRODUCER
