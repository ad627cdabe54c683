"""Fast tests without a server: flags, the stats line, metric buckets (docs/metrics.md's
coverage of the metrics: ``test_metric_names.py``)."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvpilot.engine.cli.main import main
from kvpilot.engine.engine_args import EngineArgs
from kvpilot.engine.server.args import (
    engine_args_from_namespace,
    make_serve_parser,
    parse_size,
    server_config_from_namespace,
)
from kvpilot.engine.server.config import ServerConfig
from kvpilot.engine.server.metrics import token_buckets
from kvpilot.engine.server.stats_logger import StatsLogger
from kvpilot.engine.stats import EngineStats

SERVING_PAGE = Path(__file__).resolve().parents[2] / "docs" / "serving.md"

ISSUE_FLAGS = [  # the flags the serve issue asks for, by their vLLM names
    "--model", "--host", "--port", "--served-model-name", "--block-size",
    "--gpu-memory-utilization", "--kv-cache-memory-bytes", "--max-num-seqs",
    "--max-num-batched-tokens", "--max-model-len", "--kv-cache-dtype", "--enable-prefix-caching",
    "--no-enable-prefix-caching", "--dtype", "--seed", "--api-key", "--prefix-caching-hash-seed",
    "--max-waiting-requests",
]


def test_every_issue_flag_is_documented_in_help(capsys):
    with pytest.raises(SystemExit) as info:
        main(["serve", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    actions = make_serve_parser()._option_string_actions
    for flag in ISSUE_FLAGS:
        assert re.search(rf"^\s+(\S+ )*{re.escape(flag)}\b", text, re.MULTILINE), flag
        assert flag in actions and len(actions[flag].help) >= 8, f"{flag} has no real help text"


def test_parser_defaults_are_the_engine_defaults():
    ns = make_serve_parser().parse_args([])
    assert engine_args_from_namespace(ns) == EngineArgs()
    assert (ns.host, ns.port) == ("0.0.0.0", 8000)


def test_flags_map_onto_engine_args():
    ns = make_serve_parser().parse_args([
        "--model", "/models/x", "--served-model-name", "a", "b", "--dtype", "bfloat16",
        "--seed", "7", "--block-size", "32", "--gpu-memory-utilization", "0.5",
        "--kv-cache-memory-bytes", "2Gi", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
        "--max-model-len", "4096", "--kv-cache-dtype", "fp8", "--no-enable-prefix-caching",
        "--prefix-caching-hash-seed", "s", "--attention-backend", "torch", "--device", "cpu",
        "--api-key", "k", "--max-waiting-requests", "5",
    ])
    expected = EngineArgs(
        model="/models/x", served_model_name="a", dtype="bfloat16", seed=7, block_size=32,
        gpu_memory_utilization=0.5, kv_cache_memory_bytes=2 << 30, max_num_seqs=8,
        max_num_batched_tokens=512, max_model_len=4096, kv_cache_dtype="fp8",
        enable_prefix_caching=False, prefix_caching_hash_seed="s", attention_backend="torch",
        device="cpu")
    assert engine_args_from_namespace(ns) == expected
    config = server_config_from_namespace(ns)
    assert config.served_model_names == ("a", "b")
    assert config.api_key == "k" and config.max_waiting_requests == 5


def test_api_key_from_environment(monkeypatch):
    monkeypatch.setenv("KVPILOT_API_KEY", "from-env")
    ns = make_serve_parser().parse_args([])
    assert server_config_from_namespace(ns).api_key == "from-env"
    assert "from-env" not in repr(server_config_from_namespace(ns))


def test_reliability_flags_reach_the_server_config_and_the_serving_page():
    ns = make_serve_parser().parse_args(["--max-request-body-bytes", "1Mi", "--tokenizer-threads", "2",
                                         "--engine-hang-timeout", "0", "--shutdown-timeout", "7.5"])
    config = server_config_from_namespace(ns)
    assert config.max_request_body_bytes == 1 << 20 and config.tokenizer_threads == 2
    assert config.engine_hang_timeout is None and config.shutdown_timeout == 7.5   # 0 = never
    defaults = server_config_from_namespace(make_serve_parser().parse_args([]))
    for name in ("max_request_body_bytes", "tokenizer_threads", "engine_hang_timeout",
                 "shutdown_timeout"):
        assert getattr(defaults, name) == getattr(ServerConfig(), name)
    assert server_config_from_namespace(
        make_serve_parser().parse_args(["--max-request-body-bytes", "0"])).max_request_body_bytes is None
    page = SERVING_PAGE.read_text()
    for flag in ("--max-request-body-bytes", "--tokenizer-threads", "--engine-hang-timeout",
                 "--shutdown-timeout"):
        assert re.search(rf"^\| `{flag}", page, re.MULTILINE), flag


@pytest.mark.parametrize(("text", "value"), [
    ("1024", 1024), ("4G", 4 * 10**9), ("4GB", 4 * 10**9), ("4Gi", 4 << 30), ("1.5GiB", 3 << 29),
    ("512Mi", 512 << 20), ("64k", 64_000),
])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("argv", [["--port", "70000"], ["--block-size", "0"],
                                  ["--gpu-memory-utilization", "1.5"],
                                  ["--kv-cache-memory-bytes", "lots"], ["--dtype", "int4"]])
def test_bad_flags_are_rejected_by_the_parser(argv, capsys):
    with pytest.raises(SystemExit) as info:
        make_serve_parser().parse_args(argv)
    assert info.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_tensor_parallel_beyond_one_node_is_rejected_clearly(capsys):
    assert main(["serve", "--tensor-parallel-size", "16"]) == 2
    assert "--tensor-parallel-size 16 is not supported: one replica spans at most 8 GPUs" in \
        capsys.readouterr().err


def test_offload_flags_need_engine_support():
    ns = make_serve_parser().parse_args(["--kv-offloading-size", "4",
                                         "--kv-offloading-backend", "native"])
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    if "kv_offloading_size" in fields:
        args = engine_args_from_namespace(ns)
        assert (args.kv_offloading_size, args.kv_offloading_backend) == (4.0, "native")
    else:
        with pytest.raises(ValueError, match="--kv-offloading-size is not supported in this build"):
            engine_args_from_namespace(ns)


def test_parser_module_imports_without_torch():
    code = ("import sys, kvpilot.engine.server.args as a; a.make_serve_parser().parse_args([]); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def _stats(**overrides) -> EngineStats:
    """A real EngineStats: every counter 0 (whatever fields this build has; a field holding a
    record of its own, such as speculative decoding's counts, keeps its default) but ``overrides``."""
    numbers = ("int", "float", "bool")
    values = {f.name: 0 for f in dataclasses.fields(EngineStats)
              if str(f.type).split(" | ")[0] in numbers}
    values.update({"kv_cache_usage": 0.0, "num_gpu_blocks": 100, "num_free_blocks": 100, **overrides})
    return EngineStats(**values)


def test_stats_line_reports_interval_rates_and_is_quiet_when_idle():
    lines: list[str] = []
    logger = StatsLogger(log=lines.append)
    assert logger.update(_stats(), now=0.0) is None  # first snapshot: nothing to compare
    busy = _stats(num_running_reqs=3, num_waiting_reqs=1, kv_cache_usage=0.25,
                  prefix_cache_queries=1000, prefix_cache_hits=400, prompt_tokens=1000,
                  generation_tokens=50)
    line = logger.update(busy, now=10.0)
    assert line == lines[-1]
    assert "Avg prompt throughput: 100.0 tokens/s" in line
    assert "Avg generation throughput: 5.0 tokens/s" in line
    assert "Running: 3 reqs, Waiting: 1 reqs" in line
    assert "KV cache usage: 25.0%" in line and "Prefix cache hit rate: 40.0%" in line
    drained = dataclasses.replace(busy, num_running_reqs=0, num_waiting_reqs=0, kv_cache_usage=0.0,
                                  generation_tokens=60)
    assert logger.update(drained, now=20.0) is not None  # the tail of the load is still reported
    assert logger.update(drained, now=30.0) is None      # then silence while idle
    assert logger.update(drained, now=40.0) is None
    assert len(lines) == 2


def test_token_buckets_follow_1_2_5_up_to_the_limit():
    assert token_buckets(2048) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
    assert token_buckets(1) == (1,)
    with pytest.raises(ValueError):
        token_buckets(0)


@pytest.mark.parametrize(("value", "checked"), [(None, False), ("0", False), ("1", True), ("true", True)])
def test_vllms_nan_check_variable_reaches_the_engine(monkeypatch, value, checked):
    if value is None:
        monkeypatch.delenv("VLLM_COMPUTE_NANS_IN_LOGITS", raising=False)
    else:
        monkeypatch.setenv("VLLM_COMPUTE_NANS_IN_LOGITS", value)
    args = engine_args_from_namespace(make_serve_parser().parse_args([]))
    assert args.compute_nans_in_logits is checked
