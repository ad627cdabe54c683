"""``scripts/gpu-check.sh`` on a machine without a GPU: a clean exit with a clear message,
and every section of its Python part run at toy sizes on CPU (kernels through the Triton
interpreter), so what runs on the GPU later is code that has run before. Timings here
mean nothing; the test checks that each section produced its figures and its checks passed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvpilot.engine.bench import gpu_check

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu-check.sh"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")
def test_script_exits_cleanly_without_cuda(tmp_path):
    out = tmp_path / "gpu.json"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(SCRIPT), str(out)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device found" in proc.stdout
    assert not out.exists()


@pytest.mark.slow
def test_every_section_runs_at_toy_sizes(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    assert gpu_check.main(["--smoke", "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["failures"] == []
    names = [c["name"] for c in report["kernels"]["checks"]]
    for kind in ("store", "attn", "split-kv", "rms_norm", "rms_norm+residual", "rotary"):
        assert any(n.startswith(kind) for n in names), kind
    assert all(c["ok"] for c in report["kernels"]["checks"])
    assert {c["kind"] for c in report["kernels"]["attention_bench"]["cases"]} == {"decode", "prefill"}
    quantized = report["quantized_matmul"]["cases"]
    assert {(c["strategy"], c["batch"]) for c in quantized} == {(s, b) for s in ("channel", "block") for b in (1, 64)}
    assert all(c["ok"] and c["path"] == "dequantize" for c in quantized)   # no GPU: the dequantize path
    ehf = report["engine_vs_hf"]
    assert ehf["ratio"] > 0 and ehf["engine"]["decode_ms_per_step"] > 0
    graphs = report["cuda_graphs"]
    assert set(graphs) == {"batch_1", f"batch_{ehf['batch']}"}
    assert all(g["on_ms_per_step"] > 0 and g["off_ms_per_step"] > 0 for g in graphs.values())
    assert all(g["captured"] is torch.cuda.is_available() for g in graphs.values())
    assert report["overhead"]["ms_per_step"] > 0
