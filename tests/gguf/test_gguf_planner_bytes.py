"""The planner's weight bytes for a GGUF file (its header, torch-free) match what the
engine holds once it has loaded the file (within 2%; the rule is shared:
``contract.gguf.resident_tensor_bytes``): in blocks on one CPU rank, and
dequantized where the engine has no block kernel (a GPU, which is what the planner plans
for by default)."""

from __future__ import annotations

import pytest

from kvpilot.engine import LLM
from kvpilot.engine.model.builtin_model import packaged_smollm2
from kvpilot.engine.model.gguf.weights import resident_weight_bytes
from kvpilot.engine.model.layers import gguf_linear
from kvpilot.operator.planner.catalog import model_from_path
from kvpilot.operator.planner.gguf_model import gguf_model

from support.gguf_files import write_gguf


def engine_resident(path) -> int:
    llm = LLM(str(path), dtype="bfloat16", num_gpu_blocks=8, max_model_len=64)
    return resident_weight_bytes(llm.llm_engine.runner.model)


@pytest.mark.slow
def test_smollm2_planner_bytes_match_the_engine():
    path = packaged_smollm2()
    planned = gguf_model(path, blocks=True)      # this CPU engine keeps the blocks
    resident = engine_resident(path)
    print(f"\nSmolLM2 GGUF: planner {planned.weight_bytes:,} B, engine resident {resident:,} B "
          f"(bfloat16, {planned.weight_bytes / resident - 1:+.2%}), file {path.stat().st_size:,} B")
    assert abs(planned.weight_bytes - resident) <= 0.02 * resident
    assert planned.num_layers == 30 and planned.num_kv_heads == 3


def test_tiny_qwen2_planner_bytes_match_the_engine(tmp_path, monkeypatch):
    write_gguf(tmp_path / "m.gguf", "qwen2", "Q4_K")
    in_blocks = gguf_model(tmp_path / "m.gguf", blocks=True)
    assert abs(in_blocks.weight_bytes - engine_resident(tmp_path / "m.gguf")) <= 0.02 * in_blocks.weight_bytes
    planned = model_from_path(tmp_path)          # the directory holding it; a GPU plan
    # an engine without the block kernel (as on a GPU) dequantizes every tensor at load
    monkeypatch.setattr(gguf_linear, "fast_path_reason", lambda *a: "no block kernel (as on a GPU)")
    dequantized = engine_resident(tmp_path / "m.gguf")
    assert abs(planned.weight_bytes - dequantized) <= 0.02 * planned.weight_bytes
    assert planned.weight_bytes > 2 * in_blocks.weight_bytes     # never the file's size on a GPU


def test_the_planners_kept_types_are_the_kernels():
    from kvpilot.contract.gguf import KEPT_QUANTIZED
    from kvpilot.kernels.gguf_matmul_cpu import QTYPES

    assert {name for name, _, _ in QTYPES.values()} == KEPT_QUANTIZED
