"""Every row of the vLLM flag table (``kvpilot.engine.server.vllm_flags``): a refused flag
stops ``kvpilot serve`` with one line naming it; an honoured flag parses and reaches the
setting it controls. Flags whose effect lives outside the configs have behaviour tests
of their own (``test_server_flags.py``, ``tests/engine/test_flag_behaviour.py``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvpilot.engine.cli.main import main
from kvpilot.engine.config import StructuredOutputsConfig
from kvpilot.engine.server.args import (
    engine_args_from_namespace,
    make_serve_parser,
    server_config_from_namespace,
)
from kvpilot.engine.server.vllm_flags import (
    HONOURED,
    VLLM_FLAGS,
    honoured,
    refusal_message,
    refused,
    render_markdown,
)

SERVING_PAGE = Path(__file__).resolve().parents[2] / "docs" / "serving.md"
TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"


def _refused_cases():
    for flag in refused():
        for option in flag.option_strings:
            yield pytest.param(flag, option, id=option)


@pytest.mark.parametrize(("flag", "option"), list(_refused_cases()))
def test_refused_flag_stops_with_one_line_naming_it(flag, option, capsys):
    for argv in (["serve", option], ["serve", option, "some-value", "--port", "9000"],
                 ["serve", "--port", "9000", f"{option}=x"] if option.startswith("--") else None):
        if argv is None:
            continue
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert err == f"kvpilot serve: error: {refusal_message(flag)}\n", argv
        assert flag.name in err and "not supported by kvpilot" in err
        assert "unrecognized arguments" not in err


def _parse(argv: list[str]):
    ns = make_serve_parser().parse_args(argv)
    return ns, engine_args_from_namespace(ns), server_config_from_namespace(ns)


# flag -> (argv, check(namespace, EngineArgs, ServerConfig)); one case per honoured row.
HONOURED_CASES = {
    "MODEL": (["/models/x"], lambda ns, ea, sc: ea.model == "/models/x"),
    "--model": (["--model", "/models/x"], lambda ns, ea, sc: ea.model == "/models/x"),
    "--served-model-name": (["--served-model-name", "a", "b"],
                            lambda ns, ea, sc: ea.served_model_name == "a"
                            and sc.served_model_names == ("a", "b")),
    "--tokenizer": (["--tokenizer", "/tok"], lambda ns, ea, sc: ea.tokenizer == "/tok"),
    "--hf-config-path": (["--hf-config-path", "/cfg"], lambda ns, ea, sc: ea.hf_config_path == "/cfg"),
    "--tokenizer-mode": (["--tokenizer-mode", "hf"], lambda ns, ea, sc: ns.tokenizer_mode == "hf"),
    "--trust-remote-code": (["--trust-remote-code"], lambda ns, ea, sc: ns.trust_remote_code),
    "--load-format": (["--load-format", "safetensors"],
                      lambda ns, ea, sc: ns.load_format == "safetensors"),
    "--dtype": (["--dtype", "half"], lambda ns, ea, sc: ea.dtype == "float16"),
    "--max-model-len": (["--max-model-len", "4096"], lambda ns, ea, sc: ea.max_model_len == 4096),
    "--seed": (["--seed", "7"], lambda ns, ea, sc: ea.seed == 7),
    "--generation-config": (["--generation-config", "vllm"],
                            lambda ns, ea, sc: ea.generation_config == "vllm"),
    "--override-generation-config": (
        ["--override-generation-config", '{"temperature": 0.5}'],
        lambda ns, ea, sc: ea.override_generation_config == {"temperature": 0.5}),
    "--max-logprobs": (["--max-logprobs", "5"], lambda ns, ea, sc: ea.max_logprobs == 5),
    "--enforce-eager": (["--enforce-eager"], lambda ns, ea, sc: ea.enforce_eager),
    "--device": (["--device", "cpu"], lambda ns, ea, sc: ea.device == "cpu"),
    "--block-size": (["--block-size", "32"], lambda ns, ea, sc: ea.block_size == 32),
    "--gpu-memory-utilization": (["--gpu-memory-utilization", "0.5"],
                                 lambda ns, ea, sc: ea.gpu_memory_utilization == 0.5),
    "--kv-cache-memory-bytes": (["--kv-cache-memory-bytes", "2Gi"],
                                lambda ns, ea, sc: ea.kv_cache_memory_bytes == 2 << 30),
    "--num-gpu-blocks-override": (["--num-gpu-blocks-override", "100"],
                                  lambda ns, ea, sc: ea.num_gpu_blocks == 100),
    "--kv-cache-dtype": (["--kv-cache-dtype", "fp8_e4m3"],
                         lambda ns, ea, sc: ea.kv_cache_dtype == "fp8_e4m3"),
    "--calculate-kv-scales": (["--calculate-kv-scales"], lambda ns, ea, sc: ea.calculate_kv_scales),
    "--enable-prefix-caching": (["--no-enable-prefix-caching"],
                                lambda ns, ea, sc: ea.enable_prefix_caching is False),
    "--kv-transfer-config": (
        ["--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_role": "kv_consumer", '
                                 '"kv_load_failure_policy": "recompute"}'],
        lambda ns, ea, sc: ea.kv_transfer_config is not None and ea.kv_transfer_config.is_kv_consumer
        and not ea.kv_transfer_config.is_kv_producer
        and ea.kv_transfer_config.kv_load_failure_policy == "recompute"),
    "--kv-events-config": (["--kv-events-config", '{"enable_kv_cache_events": true, "topic": "t"}'],
                           lambda ns, ea, sc: ea.kv_events_config is not None
                           and ea.kv_events_config.enabled and ea.kv_events_config.topic == "t"),
    "--speculative-config": (
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'],
        lambda ns, ea, sc: ea.speculative_config is not None and (
                           ea.speculative_config.method, ea.speculative_config.num_speculative_tokens,
                            ea.speculative_config.prompt_lookup_min,
                            ea.speculative_config.prompt_lookup_max) == ("ngram", 3, 4, 4)),
    "--kv-offloading-size": (["--kv-offloading-size", "4"],
                             lambda ns, ea, sc: ea.kv_offloading_size == 4.0),
    "--kv-offloading-backend": (["--kv-offloading-backend", "lmcache"],
                                lambda ns, ea, sc: ea.kv_offloading_backend == "lmcache"),
    "--max-num-seqs": (["--max-num-seqs", "8"], lambda ns, ea, sc: ea.max_num_seqs == 8),
    "--max-num-batched-tokens": (["--max-num-batched-tokens", "512"],
                                 lambda ns, ea, sc: ea.max_num_batched_tokens == 512),
    "--stream-interval": (["--stream-interval", "8"], lambda ns, ea, sc: ea.stream_interval == 8),
    "--enable-chunked-prefill": (["--no-enable-chunked-prefill"],
                                 lambda ns, ea, sc: ea.enable_chunked_prefill is False),
    "--scheduling-policy": (["--scheduling-policy", "priority"],
                            lambda ns, ea, sc: ea.scheduling_policy == "priority"),
    "--tensor-parallel-size": (["-tp", "2"], lambda ns, ea, sc: ea.tensor_parallel_size == 2),
    "--pipeline-parallel-size": (["-pp", "2"], lambda ns, ea, sc: ea.pipeline_parallel_size == 2
                                 and ea.rendezvous is None),   # no LeaderWorkerSet environment here
    "--structured-outputs-config": (
        ["--structured-outputs-config",
         '{"backend": "xgrammar", "disable_any_whitespace": false, "reasoning_parser": "qwen3"}'],
        lambda ns, ea, sc: ea.structured_outputs_config == StructuredOutputsConfig(
            "xgrammar", False, "qwen3") and sc.chat.reasoning_parser == "qwen3"),
    "--guided-decoding-backend": (["--guided-decoding-backend", "xgrammar"],
                                  lambda ns, ea, sc: ea.structured_outputs_config.backend == "xgrammar"),
    "--enable-auto-tool-choice": (["--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
                                  lambda ns, ea, sc: sc.chat.enable_auto_tool_choice),
    "--tool-call-parser": (["--tool-call-parser", "llama3_json"],
                           lambda ns, ea, sc: sc.chat.tool_call_parser == "llama3_json"),
    "--exclude-tools-when-tool-choice-none": (
        ["--exclude-tools-when-tool-choice-none"],
        lambda ns, ea, sc: sc.chat.exclude_tools_when_tool_choice_none),
    "--reasoning-parser": (["--reasoning-parser", "qwen3"],
                           lambda ns, ea, sc: sc.chat.reasoning_parser == "qwen3"
                           and ea.structured_outputs_config.reasoning_parser == "qwen3"),
    "--chat-template": (["--chat-template", TEMPLATE],
                        lambda ns, ea, sc: sc.chat.chat_template == TEMPLATE),
    "--default-chat-template-kwargs": (
        ["--default-chat-template-kwargs", '{"enable_thinking": false}'],
        lambda ns, ea, sc: dict(sc.chat.default_template_kwargs) == {"enable_thinking": False}),
    "--host": (["--host", "127.0.0.1"], lambda ns, ea, sc: ns.host == "127.0.0.1"),
    "--port": (["--port", "9000"], lambda ns, ea, sc: ns.port == 9000),
    "--api-key": (["--api-key", "k"], lambda ns, ea, sc: sc.api_key == "k"),
    "--root-path": (["--root-path", "/llm"], lambda ns, ea, sc: ns.root_path == "/llm"),
    "--allowed-origins": (["--allowed-origins", '["https://a.example"]'],
                          lambda ns, ea, sc: sc.cors.allowed_origins == ("https://a.example",)),
    "--allowed-methods": (["--allowed-methods", '["POST"]'],
                          lambda ns, ea, sc: sc.cors.allowed_methods == ("POST",)),
    "--allowed-headers": (["--allowed-headers", '["x-a"]'],
                          lambda ns, ea, sc: sc.cors.allowed_headers == ("x-a",)),
    "--allow-credentials": (["--allow-credentials"], lambda ns, ea, sc: sc.cors.allow_credentials),
    "--ssl-keyfile": (["--ssl-keyfile", "k.pem"], lambda ns, ea, sc: ns.ssl_keyfile == "k.pem"),
    "--ssl-certfile": (["--ssl-certfile", "c.pem"], lambda ns, ea, sc: ns.ssl_certfile == "c.pem"),
    "--ssl-ca-certs": (["--ssl-ca-certs", "ca.pem"], lambda ns, ea, sc: ns.ssl_ca_certs == "ca.pem"),
    "--ssl-cert-reqs": (["--ssl-cert-reqs", "2"], lambda ns, ea, sc: ns.ssl_cert_reqs == 2),
    "--uvicorn-log-level": (["--uvicorn-log-level", "warning"],
                            lambda ns, ea, sc: ns.uvicorn_log_level == "warning"),
    "--disable-uvicorn-access-log": (["--disable-uvicorn-access-log"],
                                     lambda ns, ea, sc: ns.disable_uvicorn_access_log),
    "--disable-fastapi-docs": (["--disable-fastapi-docs"],
                               lambda ns, ea, sc: sc.disable_fastapi_docs),
    "--enable-request-id-headers": (["--enable-request-id-headers"],
                                    lambda ns, ea, sc: sc.enable_request_id_headers),
    "--enable-prompt-tokens-details": (["--enable-prompt-tokens-details"],
                                       lambda ns, ea, sc: ns.enable_prompt_tokens_details),
    "--enable-log-requests": (["--enable-log-requests"], lambda ns, ea, sc: sc.enable_log_requests),
    "--disable-log-requests": (["--enable-log-requests", "--disable-log-requests"],
                               lambda ns, ea, sc: not sc.enable_log_requests),
    "--max-log-len": (["--max-log-len", "40"], lambda ns, ea, sc: sc.max_log_len == 40),
    "--disable-log-stats": (["--disable-log-stats"], lambda ns, ea, sc: sc.log_stats_interval == 0),
    "--kv-cache-metrics": (["--kv-cache-metrics"], lambda ns, ea, sc: ea.kv_cache_metrics),
    "--kv-cache-metrics-sample": (["--kv-cache-metrics-sample", "0.5"],
                                  lambda ns, ea, sc: ea.kv_cache_metrics_sample == 0.5),
    "--enable-mfu-metrics": (["--enable-mfu-metrics"], lambda ns, ea, sc: ea.enable_mfu_metrics),
    "--enable-lora": (["--enable-lora"], lambda ns, ea, sc: ea.create_lora_config() is not None),
    "--lora-modules": (["--enable-lora", "--lora-modules", "sql=/a/sql",
                        '{"name": "chat", "path": "/a/chat", "base_model_name": "base"}'],
                       lambda ns, ea, sc: [(m.name, m.path, m.base_model_name)
                                           for m in ea.lora_modules or ()]
                       == [("sql", "/a/sql", None), ("chat", "/a/chat", "base")]),
    "--max-loras": (["--max-loras", "4"], lambda ns, ea, sc: ea.max_loras == 4),
    "--max-lora-rank": (["--max-lora-rank", "64"], lambda ns, ea, sc: ea.max_lora_rank == 64),
    "--max-cpu-loras": (["--max-cpu-loras", "8"], lambda ns, ea, sc: ea.max_cpu_loras == 8),
    "--lora-dtype": (["--lora-dtype", "bfloat16"], lambda ns, ea, sc: ea.lora_dtype == "bfloat16"),
}


def test_every_honoured_flag_has_a_case():
    assert set(HONOURED_CASES) == {f.name for f in honoured()}


@pytest.mark.parametrize("name", sorted(HONOURED_CASES))
def test_honoured_flag_reaches_its_setting(name):
    argv, check = HONOURED_CASES[name]
    ns, engine_args, server_config = _parse(argv)
    assert check(ns, engine_args, server_config)
    # ... and the defaults do not already satisfy the check (the flag changed something),
    # except where the flag spells out the default (--disable-log-requests)
    if name != "--disable-log-requests":
        assert not check(*_parse([]))


def test_honoured_flags_are_documented_serve_flags():
    parser = make_serve_parser()
    for flag in honoured():
        for option in flag.option_strings:
            action = parser._option_string_actions[option]
            assert action.help and action.help != "==SUPPRESS==", option
    assert any(a.dest == "model_tag" for a in parser._actions)


def test_table_is_consistent_and_counts_both_kinds():
    names = [f.name for f in VLLM_FLAGS]
    assert len(names) == len(set(names))
    assert all(f.meaning and f.status in (HONOURED, "refused") for f in VLLM_FLAGS)
    assert len(honoured()) >= 50 and len(refused()) >= 50
    # the examples of vLLM flags kvpilot used to reject are all in the table
    for flag in ("--enable-chunked-prefill", "--disable-log-requests", "--trust-remote-code",
                 "--enforce-eager", "--chat-template", "--tokenizer", "--revision",
                 "--max-logprobs", "--disable-log-stats", "--root-path", "--allowed-origins",
                 "--load-format", "--generation-config", "--quantization", "--scheduling-policy",
                 "--enable-auto-tool-choice", "--tool-call-parser", "--reasoning-parser",
                 "--enable-lora", "--speculative-config", "--pipeline-parallel-size",
                 "--data-parallel-size", "--limit-mm-per-prompt", "--kv-transfer-config"):
        assert flag in names, flag


def test_the_serving_page_shows_the_rendered_table():
    text = SERVING_PAGE.read_text()
    match = re.search(r"<!-- vllm-flags:begin -->\n(.*?)<!-- vllm-flags:end -->", text, re.DOTALL)
    assert match, "docs/serving.md lacks the vllm-flags markers"
    assert match.group(1) == render_markdown(), (
        "docs/serving.md's vLLM flag table is stale: paste kvpilot.engine.server.vllm_flags.render_markdown()")


def test_bad_values_of_honoured_flags_are_clear(capsys):
    for argv, needle in ((["--allowed-origins", "*"], "--allowed-origins"),
                         (["--structured-outputs-config", '{"backend": "outlines"}'], "outlines"),
                         (["--structured-outputs-config", '{"nope": 1}'], "nope"),
                         (["--load-format", "pt"], "--load-format"),
                         (["--override-generation-config", "[1]"], "JSON object"),
                         (["--speculative-config", '{"method": "medusa", "num_speculative_tokens": 2}'], "medusa"),
                         (["--speculative-config", '{"method": "ngram"}'], "num_speculative_tokens"),
                         (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, "k": 1}'], "'k'"),
                         (["--speculative-config", '{"method": "draft_model", "num_speculative_tokens": 2}'], "needs `model`"),
                         (["--lora-modules", "no-path"], "name=path"),
                         (["--lora-modules", '{"name": "x"}'], "JSON object with name, path")):
        with pytest.raises(SystemExit):
            make_serve_parser().parse_args(argv)
        assert needle in capsys.readouterr().err
    assert main(["serve", "--enable-auto-tool-choice"]) == 2
    assert "--enable-auto-tool-choice requires --tool-call-parser" in capsys.readouterr().err
    assert main(["serve", "/a", "--model", "/b"]) == 2
    assert "differ" in capsys.readouterr().err
    assert main(["serve", "--chat-template", "no-such-file.jinja"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_json_flags_round_trip_through_the_parser():
    ns, ea, sc = _parse(["--allowed-origins", json.dumps(["https://a", "https://b"])])
    assert sc.cors.allowed_origins == ("https://a", "https://b")
