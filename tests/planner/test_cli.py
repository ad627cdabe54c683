"""``kvpilot plan`` end to end in subprocesses: output formats, exit codes, no torch."""

from __future__ import annotations

import json
import math
import shlex
import subprocess
import sys

import pytest
import yaml

QWEN_H100 = ["--model", "qwen3-8b", "--gpu", "h100-80gb", "--gpus", "1", "--max-context", "32768",
             "--concurrency", "64", "--p95-prompt-tokens", "4096", "--p95-output-tokens", "1024",
             "--ttft-p95-ms", "1000", "--itl-p95-ms", "50", "--shared-prefix-tokens", "1024",
             "--distinct-prefixes", "600"]
TOO_BIG = ["--model", "qwen3-8b", "--gpu", "l4", "--gpus", "1", "--max-context", "32768",
           "--p95-prompt-tokens", "8000", "--p95-output-tokens", "1000"]


def kvpilot(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvpilot.engine.cli.main", "plan", *args],
                          capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def as_json():
    result = kvpilot(*QWEN_H100, "-o", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_json_has_the_fields(as_json):
    for name in ("feasible", "binding_constraint", "kv_bytes_per_token", "kv_cache_dtype",
                 "gpu_memory_utilization", "kv_cache_memory_bytes", "num_gpu_blocks", "block_size",
                 "kv_token_capacity", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                 "tensor_parallel_size", "replicas", "cpu_offload_gib", "disk_offload_gib", "pod_memory_gib",
                 "shm_gib", "derivation", "warnings", "suggestions", "serve_args"):
        assert name in as_json, name
    assert as_json["feasible"] is True and as_json["max_model_len"] == 32768
    assert as_json["cpu_offload_gib"] > 0                     # 600 prefixes do not all fit on the GPU
    assert all(isinstance(line, str) for line in as_json["derivation"])


def test_yaml_matches_json(as_json):
    result = kvpilot(*QWEN_H100, "-o", "yaml")
    assert result.returncode == 0
    assert yaml.safe_load(result.stdout) == as_json


def test_args_parse_with_the_serve_parser(as_json):
    args_module = pytest.importorskip("kvpilot.engine.server.args")
    result = kvpilot(*QWEN_H100, "-o", "args")
    assert result.returncode == 0
    flags = shlex.split(result.stdout)
    assert flags == as_json["serve_args"]
    ns = args_module.make_serve_parser().parse_args(flags)       # the engine's own parser
    assert ns.max_model_len == as_json["max_model_len"]
    assert ns.max_num_seqs == as_json["max_num_seqs"]
    assert ns.max_num_batched_tokens == as_json["max_num_batched_tokens"]
    assert ns.block_size == as_json["block_size"]
    assert ns.kv_cache_dtype == as_json["kv_cache_dtype"]
    assert ns.gpu_memory_utilization == as_json["gpu_memory_utilization"]
    assert ns.kv_cache_memory_bytes == as_json["kv_cache_memory_bytes"]
    assert ns.enable_prefix_caching is True and ns.tensor_parallel_size == 1
    assert ns.kv_offloading_size == as_json["cpu_offload_gib"]
    assert ns.kv_offloading_backend == as_json["offload_backend"] == "native"
    assert ns.kv_offloading_disk_path is None


def test_text_report():
    result = kvpilot(*QWEN_H100)
    assert result.returncode == 0
    for heading in ("Result: FEASIBLE", "Engine settings", "Derivation", "kvpilot serve flags"):
        assert heading in result.stdout


def test_infeasible_exits_2_with_the_structured_answer():
    result = kvpilot(*TOO_BIG, "-o", "json")
    assert result.returncode == 2
    plan = json.loads(result.stdout)
    assert plan["feasible"] is False and plan["binding_constraint"] == "kv_capacity"
    assert plan["suggestions"]
    text = kvpilot(*TOO_BIG)
    assert text.returncode == 2 and "INFEASIBLE" in text.stdout and "Suggestions" in text.stdout
    args = kvpilot(*TOO_BIG, "-o", "args")
    assert args.returncode == 2 and args.stdout == "" and "infeasible (kv_capacity)" in args.stderr


@pytest.mark.parametrize("args, message", [
    (["--model", "qwen3-8b", "--gpu", "tpu-v9", "--max-context", "4096", "--p95-prompt-tokens", "100",
      "--p95-output-tokens", "100"], "unknown GPU 'tpu-v9'; known GPUs: l4, a10g"),
    (["--model", "nope-7b", "--gpu", "l4", "--max-context", "4096", "--p95-prompt-tokens", "100",
      "--p95-output-tokens", "100"], "unknown model 'nope-7b'"),
    (["--gpu", "l4", "--max-context", "4096"], "missing required flag(s): --model"),
    (["--model", "qwen3-8b", "--gpu", "l4", "--max-context", "many"], "invalid int value: 'many'"),
    (["--model", "qwen3-8b", "--gpu", "l4", "--max-ctx", "4096"], "unrecognized arguments: --max-ctx 4096"),
    (["--model", "qwen3-8b", "--gpu", "l4", "--max-context", "4096", "--p95-prompt-tokens", "4000",
      "--p95-output-tokens", "1000"], "exceed max_context"),
    (["--model", "qwen3-8b", "--gpu", "custom", "--max-context", "4096", "--p95-prompt-tokens", "100",
      "--p95-output-tokens", "100", "--gpu-memory-gib", "48"], "a custom GPU needs memory_bandwidth_gbps"),
])
def test_bad_input_exits_1_with_a_clear_message(args, message):
    result = kvpilot(*args)
    assert result.returncode == 1
    assert message in result.stderr
    assert result.stdout == ""


def test_a_first_plan_needs_only_the_model_and_the_gpu():
    """Without the service-level flags the plan serves the model's own context, as vLLM's
    default max_model_len does, and its derivation says what was assumed and how to pin it."""
    result = kvpilot("--model", "qwen3-8b", "--gpu", "l4", "-o", "json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["feasible"] and plan["max_model_len"] == 40960      # Qwen3-8B's max_position_embeddings
    note = plan["derivation"][0]
    assert note.startswith("Assumed (not given): --max-context 40960 (the model's own context")
    assert "--p95-prompt-tokens 20480 and --p95-output-tokens 20480" in note
    assert json.loads(kvpilot("--model", "qwen3-8b", "--gpu", "l4", "--max-context", "8192", "--p95-prompt-tokens",
                              "1000", "-o", "json").stdout)["derivation"][0] == (
        "Assumed (not given): --p95-output-tokens 7192 (the rest of the context). Pin them with the flags "
        "named to plan for your own workload.")
    pinned = json.loads(kvpilot(*QWEN_H100, "-o", "json").stdout)
    assert not any(line.startswith("Assumed") for line in pinned["derivation"])
    text = kvpilot("--model", "qwen3-8b", "--gpu", "l4")
    assert text.returncode == 0 and "Assumed (not given): --max-context 40960" in " ".join(text.stdout.split())


def test_list_names_models_and_gpus():
    result = kvpilot("--list")
    assert result.returncode == 0 and "gemma-2-9b" in result.stdout and "h200" in result.stdout


def test_planner_imports_without_torch():
    code = ("import kvpilot.operator.planner, kvpilot.operator.planner.cli, sys; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_text_derivation_shows_every_reserve_term_with_value_and_source():
    """Llama-3.1-70B in FP8 over 2 H100s with CUDA graphs: every term is non-zero."""
    result = kvpilot("--model", "llama-3.1-70b", "--gpu", "h100-80gb", "--gpus", "2", "--max-context", "16000",
                     "--p95-prompt-tokens", "2048", "--p95-output-tokens", "512", "--max-num-seqs", "256",
                     "--max-num-batched-tokens", "8192", "--weight-quantization", "fp8", "--cuda-graphs",
                     "--kv-safety-margin", "0.05", "-o", "json")
    plan = json.loads(result.stdout)
    derivation = " ".join(" ".join(plan["derivation"]).split())
    m = plan["memory"]

    def gib(num_bytes: float) -> str:
        return f"{num_bytes / 2**30:,.2f} GiB"

    # the numbers, recomputed here from the documented model (see operator/planner/reserve.py)
    forward = 8192 * 3 * (8192 + 28672 // 2) * 2
    sampler = math.ceil(256 * 128256 * 39.6)
    expected = {"cuda_runtime": 288 * 2**20, "nccl": 256 * 2**20, "forward": forward, "sampler": sampler,
                "cuda_graphs": int(0.65 * 2**30)}
    for name, num_bytes in expected.items():
        assert m[f"reserve_{name}_bytes"] == num_bytes, name
    assert m["reserve_bytes"] == (288 + 256) * 2**20 + max(forward, sampler) + int(0.65 * 2**30)
    for text in (f"Reserve term cuda_runtime: {gib(288 * 2**20)} (non-torch memory",
                 f"Reserve term nccl: {gib(256 * 2**20)} (NCCL and custom all-reduce buffers at TP > 1, fitted on "
                 "the public vLLM logs",
                 f"forward 8,192 tokens x 3 x (8,192 hidden + 14,336 intermediate/TP) x 2 B = {gib(forward)} "
                 "(slope of vLLM's reported activation peak",
                 f"sampler 256 seqs x 128,256 vocab x 39.6 B = {gib(sampler)} (mean of vLLM's reported",
                 f"Reserve term cuda_graphs: {gib(int(0.65 * 2**30))} (largest graph pool in the logs",
                 "sampler dominates", "operator/planner/calibration/vllm_startup_logs.yaml",
                 "median |error| 2.9%, worst over-prediction +5.1% before the safety margin",
                 f"- {gib(m['reserve_bytes'])} reserve = {gib(m['kv_estimate_bytes'])}; less the 5.0% safety "
                 f"margin = {gib(m['kv_available_bytes'])}",
                 "79.11 GiB as CUDA reports it (CUDA total 79.11 GiB (github.com/vllm-project/vllm/issues/27508)"):
        assert text in derivation, text
    assert m["kv_available_bytes"] == int(m["kv_estimate_bytes"] * 0.95)
