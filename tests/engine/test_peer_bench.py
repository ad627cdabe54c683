"""``kvpilot bench peer`` at toy sizes: the harness runs a server through every part of the
load, skips a peer that is not installed with the command that
installs it, divides kvpilot's figures by each peer's and states each server's roofline.
Timings here mean nothing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvpilot.engine.bench.peer import ratios, served_dtype
from kvpilot.engine.bench.peer_servers import LLAMA_CPP, VLLM_CPU
from kvpilot.engine.model.cpu_info import CPUInfo, cpu_info


def test_cpu_info_reads_the_model_and_the_kernel_flags(tmp_path):
    fake = tmp_path / "cpuinfo"
    fake.write_text("processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: fpu avx2 fma avx512f avx512_bf16\n\n"
                    "processor\t: 1\nmodel name\t: Test CPU 9000\nflags\t\t: fpu avx2 fma avx512f avx512_bf16\n")
    cpu = cpu_info(fake)
    assert cpu.model == "Test CPU 9000"
    assert cpu.has_avx512 and cpu.has_bf16
    assert "avx512_bf16" in cpu.describe() and "fpu" not in cpu.describe()


def test_vllm_cpu_is_refused_without_avx512_and_llama_cpp_is_not():
    avx2_only = CPUInfo("old", 2, frozenset({"avx2", "fma"}))
    assert "AVX-512" in VLLM_CPU.unavailable(avx2_only)
    assert LLAMA_CPP.unavailable(avx2_only) is None


def test_ratios_divide_each_kvpilot_variant_by_each_peer():
    figures = {"kvpilot-gguf": {"tok/s@1": 120.0, "ttft_cold": 50.0, "itl_p50@1": None},
               "llama.cpp": {"tok/s@1": 150.0, "ttft_cold": 100.0, "itl_p50@1": 7.0},
               "vLLM-CPU": {"tok/s@1": 60.0, "ttft_cold": 0.0, "itl_p50@1": 20.0}}
    table = ratios(figures)
    assert set(table) == {("kvpilot-gguf", "llama.cpp"), ("kvpilot-gguf", "vLLM-CPU")}
    assert table[("kvpilot-gguf", "llama.cpp")] == {"tok/s@1": 0.8, "ttft_cold": 0.5}
    assert table[("kvpilot-gguf", "vLLM-CPU")] == {"tok/s@1": 2.0}   # no division by 0 / None


def test_each_server_is_counted_in_the_dtype_it_serves_in():
    bf16_cpu, plain_cpu = CPUInfo("new", 2, frozenset({"avx512f", "avx512_bf16"})), CPUInfo("old", 2, frozenset())
    assert served_dtype("kvpilot-gguf", bf16_cpu, "float32") == "bfloat16"   # --dtype auto
    assert served_dtype("kvpilot-gguf", plain_cpu, "float32") == "float32"
    assert served_dtype("kvpilot-bf16", plain_cpu, "float32") == "bfloat16"  # its --dtype flag
    assert served_dtype("llama.cpp", bf16_cpu, "float32") == "float16"       # llama-server's KV type


def test_bench_peer_runs_kvpilot_through_the_whole_load(tiny_checkpoint, tmp_path):
    out = tmp_path / "peer.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvpilot.engine.cli.main", "bench", "peer",
         "--servers", "kvpilot-f32,llama.cpp", "--checkpoint", str(tiny_checkpoint("llama")),
         "--peers-dir", str(tmp_path / "no-peers"), "--threads", "1", "--repeats", "1",
         "--streams", "1,2", "--input-len", "8", "--output-len", "4", "--requests-per-stream", "1",
         "--prefix-len", "32", "--cold-len", "40", "--kv-cache-gib", "0.01", "--json-out", str(out)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert "--install-peers" in result["skipped"]["llama.cpp"]
    runs = result["runs"]["kvpilot-f32"]
    assert len(runs) == 1
    for figures in runs:
        assert set(figures) == {"tok/s@1", "itl_p50@1", "decode_tok/s@1", "tok/s@2", "itl_p50@2",
                                "ttft_cached_prefix", "ttft_cold"}
        assert figures["decode_tok/s@1"] > 0
        assert figures["tok/s@1"] > 0 and figures["tok/s@2"] > 0
        assert figures["ttft_cached_prefix"] > 0 and figures["ttft_cold"] > 0
    assert result["median"]["kvpilot-f32"]["tok/s@2"] > 0
    assert result["targets"] == []   # no peer ran: nothing to compare with
    assert "CPU:" in proc.stdout
    roof = result["roofline"]["kvpilot-f32"]     # float32 weights, float32 KV at 8 + (4 - 1) / 2 tokens
    assert roof["context"] == 10 and roof["read_bandwidth_gb_s"] == result["read_bandwidth_gb_s"] > 0
    assert roof["ceiling_tok_s"] == pytest.approx(roof["read_bandwidth_gb_s"] * 1e9 / roof["bytes_per_token"])
    assert roof["share"] == pytest.approx(result["median"]["kvpilot-f32"]["tok/s@1"] / roof["ceiling_tok_s"])
    # decode alone (tokens after the first over the time after it), against the same ceiling
    assert roof["decode_tok_s"] == result["median"]["kvpilot-f32"]["decode_tok/s@1"]
    assert roof["decode_share"] == pytest.approx(roof["decode_tok_s"] / roof["ceiling_tok_s"])
    assert "roofline (1 stream" in proc.stdout and "kvpilot-f32" in proc.stdout
    assert "roofline, decode alone" in proc.stdout
