"""The two CPU attention benchmarks at toy sizes: ``bench cpu-attention`` (the C++ decode
kernel against the pure-torch path on one paged cache) and ``bench overhead
--attention-backends cpu,torch`` (both engine paths side by side). Timings here mean
nothing; the tests check that both paths ran and agreed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvpilot.kernels import gguf_matmul_cpu, paged_decode_cpu

needs_kernel = pytest.mark.skipif(paged_decode_cpu.load() is None,
                                  reason="the CPU decode kernel cannot be built here (no C++ compiler)")


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvpilot.engine.cli.main", "bench", *args],
                          capture_output=True, text=True, timeout=300)


@needs_kernel
def test_cpu_attention_bench_compares_both_paths(tmp_path):
    out = tmp_path / "cpu-attention.json"
    proc = _bench("cpu-attention", "--shapes", "3x4/2x16x40,2x8/1x64x100", "--repeats", "1",
                  "--json-out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert [r["shape"] for r in results] == ["3x4/2x16x40", "2x8/1x64x100"]
    for r in results:
        assert r["torch_ms"] > 0 and r["kernel_ms"] > 0
        assert r["speedup"] == pytest.approx(r["torch_ms"] / r["kernel_ms"])
        assert r["max_abs_diff"] < 1e-5     # the same attention, float32
    assert "speedup" in proc.stdout


@needs_kernel
def test_cpu_attention_bench_refuses_a_bad_shape():
    proc = _bench("cpu-attention", "--shapes", "3x4x16x40")
    assert proc.returncode == 2
    assert "is not SEQSxHEADS/KV_HEADSxHEAD_SIZExCONTEXT" in proc.stderr


@needs_kernel
@pytest.mark.slow
def test_overhead_bench_runs_each_attention_backend(tmp_path):
    out = tmp_path / "overhead.json"
    proc = _bench("overhead", "--batch-sizes", "2", "--prompt-len", "8", "--output-len", "4",
                  "--attention-backends", "cpu,torch", "--json-out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert [r["attention_backend"] for r in results] == ["cpu", "torch"]
    assert all(r["batch_size"] == 2 and r["ms_per_step"] > 0 and r["decode_steps"] > 0 for r in results)


def test_overhead_rows_show_an_unmeasured_share_as_a_dash():
    """On CUDA the forward is not timed (kernels run asynchronously): no share to print."""
    from kvpilot.engine.bench.overhead import OverheadResult, format_row

    cuda = format_row(OverheadResult(256, "triton", 120, 3.5, 0.0, None, 70000.0))
    cpu = format_row(OverheadResult(256, "cpu", 120, 8.0, 6.0, 0.25, 30000.0))
    assert cuda.split() == ["256", "triton", "3.50", "0.00", "-", "70000"]
    assert cpu.split() == ["256", "cpu", "8.00", "6.00", "25%", "30000"]


@pytest.mark.skipif(gguf_matmul_cpu.load() is None, reason="the CPU GGUF kernel cannot be built here")
def test_gguf_matmul_bench_shows_each_type_beside_f32_and_bf16(tmp_path):
    """Resident bytes are the GGUF block bytes (ggml's block sizes, read from the gguf
    package); a type whose blocks do not tile the columns is shown as not applicable."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    out = tmp_path / "gguf.json"
    proc = _bench("gguf-matmul", "--shapes", "64x512,32x96", "--types", "Q8_0,Q4_K", "--batches", "1,3",
                  "--copies", "2", "--repeats", "1", "--json-out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {(r["shape"], r["method"]): r for r in json.loads(out.read_text())}
    for shape, rows, columns in (("64x512", 64, 512), ("32x96", 32, 96)):
        assert results[(shape, "float32")]["resident_bytes"] == rows * columns * 4
        assert results[(shape, "bfloat16")]["resident_bytes"] == rows * columns * 2
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_0]
        assert results[(shape, "Q8_0")]["resident_bytes"] == rows * columns // block * size
        assert set(results[(shape, "Q8_0")]["us_per_call"]) == {"1", "3"}
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType.Q4_K]
    assert results[("64x512", "Q4_K")]["resident_bytes"] == 64 * 512 // block * size
    assert results[("32x96", "Q4_K")]["us_per_call"] == {}
    assert "96 columns are not whole blocks of this type" in proc.stdout
    assert "CPU: " in proc.stdout
