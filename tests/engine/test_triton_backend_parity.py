"""The HF-parity check with ``attention_backend=triton``: on CPU the kernels run through
the Triton interpreter (TRITON_INTERPRET=1, set by the root conftest), so the engine's
whole path through the kernels is checked without a GPU. Shapes are small because the
interpreter is slow."""

from __future__ import annotations

import os
import random

import pytest
import torch

from kvpilot.engine import LLM, SamplingParams

pytestmark = pytest.mark.slow


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs CUDA or the Triton interpreter")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_triton_backend_matches_hf_and_torch_backend(tiny_checkpoint, kv_cache_dtype):
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint("qwen3")
    rng = random.Random(11)
    shared = [rng.randrange(3, 512) for _ in range(40)]
    prompts = [shared + [rng.randrange(3, 512) for _ in range(n)] for n in (3, 9)] + [[17], [rng.randrange(3, 512) for _ in range(21)]]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    # chunked prefill (budget 32) on top of prefix hits (the shared 40-token prefix)
    kw = dict(num_gpu_blocks=64, max_model_len=256, max_num_batched_tokens=32, kv_cache_dtype=kv_cache_dtype,
              dtype="float32")
    triton = LLM(str(path), attention_backend="triton", **kw)
    assert triton.llm_engine.runner.backend.name == "triton"
    got = [o.outputs[0].token_ids for o in triton.generate(prompts, params)]
    assert triton.get_stats().prefix_cache_hits > 0
    torch_path = LLM(str(path), attention_backend="torch", **kw)
    assert got == [o.outputs[0].token_ids for o in torch_path.generate(prompts, params)]
    if kv_cache_dtype == "auto":     # float32 end to end: HF transformers is the oracle
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            for p, g in zip(prompts, got, strict=True):
                ids = torch.tensor([p])
                ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                                  min_new_tokens=4, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
                assert g == ref
