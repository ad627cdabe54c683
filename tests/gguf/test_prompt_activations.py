"""Prompt tokens keep float activations; only decode tokens take the 8-bit (q8) path
(``gguf_linear.float_activations``, ``AttentionMetadata.computes_prompt``).

The failure this guards against: asked the README's question a second time, the built-in
SmolLM2 answered nonsense. The repeat found 32 of the prompt's 37 tokens in the prefix
cache and computed the last 5 on the q8 path (few enough rows), where the cold prompt had
computed all 37 in bfloat16; the 8-bit rounding flipped a near tie. Here, on a bfloat16
engine over a Q4_1 file (interleaved weights, the fused decode step), every call of the q8
kernels is recorded with the step it ran in: prompt steps of 8 and 20 tokens after prefix
hits (each within the q8 path's bound, one within the fused step's) must not make one,
not even the LM head's sampling row (the prompt's first output token is the float one),
and decode steps must. The same on a float32 engine that ``--dtype auto`` chose on a CPU
without native bfloat16, where decode tokens take the q8 path in float32 too
(``ModelConfig.gguf_float32_q8``). ``tests/gguf/test_builtin_server.py`` asks the real
model twice.
"""

from __future__ import annotations

import pytest
import torch

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.model import auto_dtype, fused_decode
from kvpilot.engine.model.cpu_info import CPUInfo
from kvpilot.kernels import fused_decode_cpu, gguf_matmul_cpu

from support.gguf_files import write_gguf

pytestmark = pytest.mark.skipif(
    gguf_matmul_cpu.load() is None or gguf_matmul_cpu.q8_isa() is None or fused_decode_cpu.load() is None,
    reason="needs the q8 GGUF path (AVX2 or AVX512-VNNI) and a C++ compiler")


ZEN3 = CPUInfo("AMD EPYC 7B13", 2, frozenset({"avx2", "fma", "f16c"}))   # no native bfloat16


@pytest.mark.parametrize("dtype", ["bfloat16", "auto-float32"])
def test_prompt_tokens_after_a_prefix_hit_never_take_the_q8_path(tmp_path, monkeypatch, dtype):
    # a tied embedding (Q4_1, in GGUF blocks) is the LM head: its prompt rows are checked too
    path = write_gguf(tmp_path / "model.gguf", "llama", "Q4_1", seed=3, overrides={"tie_word_embeddings": True})
    if dtype == "auto-float32":   # what --dtype auto picks on this CPU
        monkeypatch.setattr(auto_dtype, "cpu_info", lambda: ZEN3)
    llm = LLM(str(path), dtype=dtype.removeprefix("auto-float32") or "auto", num_gpu_blocks=64, max_model_len=256,
              max_num_seqs=4)
    try:
        runner = llm.llm_engine.runner
        assert runner.dtype == (torch.bfloat16 if dtype == "bfloat16" else torch.float32)
        assert llm.llm_engine.model_config.gguf_float32_q8 == (dtype == "auto-float32")
        head = runner.model.output_module.gguf
        assert head is not None and head.interleaved
        assert runner.model.fused_decode is not None and runner.model.fused_decode.quantizes
        step_kind = {"prompt": None}
        prompt_rows, q8_calls, fused_steps = [], [], []
        real_forward = runner.forward_step

        def forward_step(step, calibrate=False):
            step_kind["prompt"] = step.metadata.computes_prompt
            if step.metadata.computes_prompt:
                prompt_rows.append(step.metadata.num_actual_tokens)
            try:
                return real_forward(step, calibrate)
            finally:
                step_kind["prompt"] = None

        def spy(name):
            real = getattr(gguf_matmul_cpu, name)

            def call(x, weight, *args, **kwargs):
                q8_calls.append((step_kind["prompt"], x.shape[0], weight.shape[0]))
                return real(x, weight, *args, **kwargs)
            return call

        real_run = fused_decode.FusedDecode.run

        def run(self, *args):
            out = real_run(self, *args)
            if out is not None:
                fused_steps.append(step_kind["prompt"])
            return out

        monkeypatch.setattr(runner, "forward_step", forward_step)
        for name in ("matmul_q8", "matmul_q8_interleaved"):
            monkeypatch.setattr(gguf_matmul_cpu, name, spy(name))
        monkeypatch.setattr(fused_decode.FusedDecode, "run", run)

        prompt = [(7 * i) % 200 + 3 for i in range(40)]
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        for ids in (prompt, prompt, prompt[:32] + [5] * 20):   # cold, then two prefix hits
            llm.generate([ids], params)
        assert llm.get_stats().prefix_cache_hits >= 64
    finally:
        llm.llm_engine.close()
    assert prompt_rows == [40, 8, 20]   # the two hits leave rows the q8 path would take
    in_prompts = [c for c in q8_calls if c[0]]
    assert in_prompts == [], in_prompts
    assert (False, 1, head.rows) in q8_calls   # a decode step's head: 8 bits
    assert True not in fused_steps and False in fused_steps, fused_steps   # decode: fused, 8 bits
