"""``--dtype auto`` (``engine/model/auto_dtype.py``): bfloat16 on a CPU whose /proc/cpuinfo
lists AVX512-BF16 or AMX, as vLLM-CPU picks for float32 checkpoints; float32 on other CPUs;
the checkpoint's dtype on a GPU. Each choice is logged with its reason."""

from __future__ import annotations

import logging

import pytest
import torch

from kvpilot.engine import LLM, EngineArgs
from kvpilot.engine.model.auto_dtype import resolve_auto_dtype
from kvpilot.engine.model.cpu_info import cpu_info

SAPPHIRE_RAPIDS = "flags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile\n"
ZEN3 = "flags\t\t: fpu sse2 avx2 fma f16c\n"
ICELAKE = "flags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_vnni\n"


@pytest.mark.parametrize("cpuinfo, expected", [(SAPPHIRE_RAPIDS, "bfloat16"), (ZEN3, "float32"),
                                               (ICELAKE, "float32")], ids=["amx", "avx2", "avx512-no-bf16"])
@pytest.mark.parametrize("checkpoint", ["float32", "bfloat16", "float16"])
def test_cpu_choice_follows_the_cpus_bf16_flags(tmp_path, cpuinfo, expected, checkpoint):
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nmodel name\t: Some CPU\n{cpuinfo}")
    dtype, why = resolve_auto_dtype(checkpoint, "cpu", cpu_info(path))
    assert dtype == expected
    assert ("native bfloat16 (avx512_bf16, amx_bf16)" in why) == (expected == "bfloat16")
    assert ("no native bfloat16" in why) == (expected == "float32")


def test_gpu_keeps_the_checkpoints_dtype():
    assert resolve_auto_dtype("float32", "cuda")[0] == "float32"
    assert resolve_auto_dtype("float16", "cuda")[0] == "float16"
    assert resolve_auto_dtype("float8_e4m3fn", "cuda")[0] == "bfloat16"


def test_engine_on_this_cpu_logs_its_choice(tiny_checkpoint, caplog):
    """A float32 checkpoint: bfloat16 here iff this machine's CPU has native bf16."""
    expected = "bfloat16" if cpu_info().has_bf16 else "float32"
    with caplog.at_level(logging.INFO, logger="kvpilot.engine.engine_args"):
        model_config, _, _ = EngineArgs(str(tiny_checkpoint("qwen3")), device="cpu").create_configs()
    assert model_config.dtype == expected
    assert f"--dtype auto: computing in {expected}" in caplog.text
    explicit, _, _ = EngineArgs(str(tiny_checkpoint("qwen3")), device="cpu", dtype="float32").create_configs()
    assert explicit.dtype == "float32"


@pytest.mark.skipif(not cpu_info().has_bf16, reason="this CPU has no native bfloat16")
def test_auto_runs_the_model_in_bfloat16_on_a_bf16_cpu(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("qwen3")), num_gpu_blocks=32, max_model_len=128)
    weights = {p.dtype for p in llm.llm_engine.runner.model.parameters()}
    assert weights == {torch.bfloat16}
