"""``--kv-transfer-config``: vLLM's JSON fields parse into a frozen config with clear errors,
and a connector this engine does not run stops ``kvpilot serve`` at start-up, naming what it
does run.

Oracles: vLLM's own field names and defaults (``vllm/config/kv_transfer.py``: kv_port 14579,
kv_buffer_size 1e9, kv_parallel_size 1, kv_load_failure_policy "fail", a connector needs a
role), the real ``kvpilot serve`` process for the start-up refusal, and the names the
operator renders (``kvpilot.contract.kv_transfer``).
"""

from __future__ import annotations

import json
import pickle
import re
import subprocess
import sys

import pytest

from kvpilot.contract.kv_transfer import KV_CONSUMER, KV_PRODUCER, NIXL_CONNECTOR, VLLM_CONNECTORS
from kvpilot.engine.engine_args import EngineArgs
from kvpilot.engine.kv_transfer import IMPLEMENTED_CONNECTORS, KVTransferConfig, check_connector
from kvpilot.engine.server.args import engine_args_from_namespace, make_serve_parser


def test_vllms_nixl_configs_parse_with_vllms_defaults():
    producer = KVTransferConfig.from_json(json.dumps({"kv_connector": NIXL_CONNECTOR, "kv_role": KV_PRODUCER}))
    assert producer.is_kv_transfer_instance and producer.is_kv_producer and not producer.is_kv_consumer
    assert (producer.kv_port, producer.kv_buffer_size, producer.kv_parallel_size, producer.kv_ip) == \
        (14579, 1e9, 1, "127.0.0.1")
    assert producer.kv_load_failure_policy == "fail" and producer.engine_id is None
    consumer = KVTransferConfig.from_json(json.dumps({
        "kv_connector": NIXL_CONNECTOR, "kv_role": KV_CONSUMER, "kv_rank": 1, "kv_parallel_size": 2,
        "kv_ip": "10.0.0.7", "kv_port": 15000, "kv_buffer_size": 5e8, "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"kv_lease_duration": 30}, "engine_id": "decode-0",
        "kv_load_failure_policy": "recompute"}))
    assert consumer.is_kv_consumer and not consumer.is_kv_producer
    assert consumer.kv_connector_extra_config == {"kv_lease_duration": 30} and consumer.kv_rank == 1
    both = KVTransferConfig(kv_connector=NIXL_CONNECTOR, kv_role="kv_both")
    assert both.is_kv_producer and both.is_kv_consumer
    # a role without a connector is no transfer at all (vLLM's rule, too)
    assert not KVTransferConfig(kv_role=KV_PRODUCER).is_kv_transfer_instance
    # the engine process receives its arguments pickled
    assert pickle.loads(pickle.dumps(EngineArgs(kv_transfer_config=consumer))).kv_transfer_config == consumer


@pytest.mark.parametrize("data, message", [
    ({"kv_connector": NIXL_CONNECTOR}, "needs a kv_role"),
    ({"kv_connector": NIXL_CONNECTOR, "kv_role": "prefill"}, "kv_role must be one of kv_producer, kv_consumer"),
    ({"kv_role": KV_PRODUCER, "kv_rank": 2, "kv_parallel_size": 2}, r"kv_rank must be an integer in \[0, 1\]"),
    ({"kv_parallel_size": 0}, "kv_parallel_size must be an integer >= 1"),
    ({"kv_port": 70000}, r"kv_port must be an integer in \[0, 65535\]"),
    ({"kv_buffer_size": 0}, "kv_buffer_size must be a number of bytes > 0"),
    ({"kv_buffer_device": "xpu"}, "kv_buffer_device must be one of cpu, cuda"),
    ({"kv_connector_extra_config": [1]}, "kv_connector_extra_config must be a JSON object"),
    ({"kv_load_failure_policy": "retry"}, "kv_load_failure_policy must be one of recompute, fail"),
    ({"kv_connector_module_path": "my.connector"}, "loads no connector module"),
    ({"enable_permute_local_kv": True}, "enable_permute_local_kv"),
    ({"kv_conector": NIXL_CONNECTOR}, r"unknown key\(s\) \['kv_conector'\]"),
    ({"engine_id": ""}, "engine_id must be a non-empty string"),
])
def test_bad_fields_are_refused_by_name(data, message):
    with pytest.raises(ValueError, match=message):
        KVTransferConfig.from_json(json.dumps(data))


@pytest.mark.parametrize("text", ["{not json", "[1, 2]"])
def test_the_flag_refuses_what_is_not_a_json_object(text, capsys):
    with pytest.raises(SystemExit):
        make_serve_parser().parse_args(["--kv-transfer-config", text])
    assert "--kv-transfer-config" in capsys.readouterr().err


@pytest.mark.parametrize("connector", [c for c in VLLM_CONNECTORS if c not in IMPLEMENTED_CONNECTORS])
def test_every_connector_is_refused_until_the_engine_runs_it(connector):
    ns = make_serve_parser().parse_args(["--kv-transfer-config",
                                         json.dumps({"kv_connector": connector, "kv_role": "kv_both"})])
    args = engine_args_from_namespace(ns)      # the flag parses as vLLM's does
    available = re.escape(", ".join(IMPLEMENTED_CONNECTORS) or "none yet")   # the KV-connector API adds them
    with pytest.raises(ValueError, match=rf"kv_connector '{connector}' is not implemented by this engine "
                                         rf"\(connectors available: {available}\)"):
        args.create_kv_transfer_config()
    # a connector the engine registers passes the same check
    check_connector(args.kv_transfer_config, implemented=(connector,))


def test_the_offloading_connectors_point_at_kvpilots_offload_flags():
    with pytest.raises(ValueError, match="use --kv-offloading-backend lmcache"):
        check_connector(KVTransferConfig(kv_connector="LMCacheConnectorV1", kv_role="kv_both"))
    with pytest.raises(ValueError, match="--kv-offloading-backend native"):
        check_connector(KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both"))
    assert EngineArgs().create_kv_transfer_config() is None                 # off: nothing to check
    assert EngineArgs(kv_transfer_config=KVTransferConfig(kv_role=KV_CONSUMER)).create_kv_transfer_config() \
        == KVTransferConfig(kv_role=KV_CONSUMER)


def test_serve_stops_at_start_up_with_one_line_before_loading_anything(tmp_path):
    # a connector vLLM has and kvpilot never will (NCCL point to point, removed from vLLM since)
    config = json.dumps({"kv_connector": "P2pNcclConnector", "kv_role": KV_PRODUCER})
    run = subprocess.run([sys.executable, "-m", "kvpilot.engine.cli.main", "serve",
                          "--model", str(tmp_path / "no-such-model"), "--kv-transfer-config", config],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1] == (
        "kvpilot serve: error: --kv-transfer-config: kv_connector 'P2pNcclConnector' is not implemented by "
        f"this engine (connectors available: {', '.join(IMPLEMENTED_CONNECTORS) or 'none yet'})")
    assert "no-such-model" not in run.stderr     # refused before the model was looked for
