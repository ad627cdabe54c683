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


def test_a_gguf_file_on_a_cpu_without_bf16_takes_8_bit_activations_for_decode(tmp_path, monkeypatch, caplog,
                                                                               tiny_checkpoint):
    """``--dtype auto`` for a GGUF file where bfloat16 is not native: float32, and decode
    tokens on the q8 path (``ModelConfig.gguf_float32_q8``), as 16-bit models and llama.cpp
    run them; ``--dtype float32`` asks for the exact float path, and an HF checkpoint or a
    CPU with native bfloat16 never sets it."""
    from kvpilot.engine.model import auto_dtype

    from support.gguf_files import write_gguf

    gguf = str(write_gguf(tmp_path / "model.gguf", "llama", "Q4_1", seed=1))
    zen3, amx = tmp_path / "zen3", tmp_path / "amx"
    zen3.write_text(f"model name\t: Zen 3\n{ZEN3}")
    amx.write_text(f"model name\t: Sapphire Rapids\n{SAPPHIRE_RAPIDS}")

    def configs(cpuinfo, **kwargs):
        monkeypatch.setattr(auto_dtype, "cpu_info", lambda: cpu_info(cpuinfo))
        return EngineArgs(device="cpu", **kwargs).create_configs()[0]

    with caplog.at_level(logging.INFO, logger="kvpilot.engine.engine_args"):
        auto = configs(zen3, model=gguf)
    assert (auto.dtype, auto.gguf_float32_q8) == ("float32", True)
    assert "GGUF decode tokens take 8-bit activations (--dtype float32: exact)" in caplog.text
    exact = configs(zen3, model=gguf, dtype="float32")
    assert (exact.dtype, exact.gguf_float32_q8) == ("float32", False)
    bf16 = configs(amx, model=gguf)
    assert (bf16.dtype, bf16.gguf_float32_q8) == ("bfloat16", False)
    checkpoint = configs(zen3, model=str(tiny_checkpoint("qwen3")))
    assert (checkpoint.dtype, checkpoint.gguf_float32_q8) == ("float32", False)
