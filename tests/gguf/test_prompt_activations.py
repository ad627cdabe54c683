"""Prompt tokens keep float activations; only decode tokens take the 8-bit (q8) path
(``gguf_linear.float_activations``, ``AttentionMetadata.computes_prompt``).

The failure this guards against: asked the README's question a second time, the built-in
SmolLM2 answered nonsense. The repeat found 32 of the prompt's 37 tokens in the prefix
cache and computed the last 5 on the q8 path (few enough rows), where the cold prompt had
computed all 37 in bfloat16; the 8-bit rounding flipped a near tie. Here, on a bfloat16
engine over a Q4_1 file (interleaved weights, the fused decode step), every call of the q8
kernels is recorded with the step it ran in: prompt steps of 8 and 20 tokens after prefix
hits (each within the q8 path's bound, one within the fused step's) must not make one,
and decode steps must. ``tests/gguf/test_builtin_server.py`` asks the real model twice.
"""

from __future__ import annotations

import pytest

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.model import fused_decode
from kvpilot.kernels import fused_decode_cpu, gguf_matmul_cpu

from support.gguf_files import write_gguf

pytestmark = pytest.mark.skipif(
    gguf_matmul_cpu.load() is None or gguf_matmul_cpu.q8_isa() is None or fused_decode_cpu.load() is None,
    reason="needs the q8 GGUF path (AVX2 or AVX512-VNNI) and a C++ compiler")


def test_prompt_tokens_after_a_prefix_hit_never_take_the_q8_path(tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "model.gguf", "llama", "Q4_1", seed=3)
    llm = LLM(str(path), dtype="bfloat16", num_gpu_blocks=64, max_model_len=256, max_num_seqs=4)
    try:
        runner = llm.llm_engine.runner
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
    head = getattr(runner.model.output_module, "gguf", None)
    # in a prompt step only an LM head in GGUF blocks may (on the one row that samples)
    in_prompts = [c for c in q8_calls if c[0] and (head is None or c[2] != head.rows)]
    assert in_prompts == [], in_prompts
    assert True not in fused_steps and False in fused_steps, fused_steps   # decode: fused, 8 bits
