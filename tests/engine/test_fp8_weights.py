"""FP8-weight checkpoints (compressed-tensors per-tensor / per-channel, fine-grained
``quant_method: fp8`` with 32 x 32 blocks) give the greedy tokens of HF transformers
running the same weights dequantized to float32, and stay FP8 in the engine's memory."""

from __future__ import annotations

import json
import random

import pytest
import torch

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.model.layers.fp8_linear import fp8_weight_bytes

from support.fp8_checkpoints import FORMATS, quantize
from support.hf_oracle import hf_greedy

SHAPE = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def bf16_checkpoint(tiny_checkpoint):
    return tiny_checkpoint("qwen3", dtype="bfloat16", **SHAPE)


def _prompts() -> list[list[int]]:
    rng = random.Random(4)
    shared = [rng.randrange(3, 512) for _ in range(40)]
    return [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 9, 60)] + [shared + [7, 8], shared + [9]]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_fp8_checkpoint_matches_hf_on_dequantized_weights(fmt, bf16_checkpoint, tmp_path, capsys):
    path, oracle = quantize(bf16_checkpoint, tmp_path / fmt, fmt)
    prompts = _prompts()
    expected = hf_greedy(oracle, prompts)
    llm = LLM(str(path), dtype="float32", num_gpu_blocks=64, max_model_len=256, max_num_batched_tokens=32)
    model = llm.llm_engine.runner.model
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert {attn.qkv_proj.weight.dtype, attn.o_proj.weight.dtype, mlp.gate_up_proj.weight.dtype,
            mlp.down_proj.weight.dtype} == {torch.float8_e4m3fn}
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert llm.get_stats().prefix_cache_hits > 0
    if fmt == "fp8-block":       # each rank reads its slices of the weights and of the scales
        tp = LLM(str(path), dtype="float32", num_gpu_blocks=64, max_model_len=256, tensor_parallel_size=2)
        try:
            assert [o.outputs[0].token_ids for o in tp.generate(prompts, GREEDY)] == expected
        finally:
            tp.llm_engine.close()
    # Weight memory in a 16-bit engine: the FP8 checkpoint against the bf16 one it came from.
    fp8 = fp8_weight_bytes(LLM(str(path), dtype="bfloat16", num_gpu_blocks=16,
                               max_model_len=64).llm_engine.runner.model)
    bf16 = fp8_weight_bytes(LLM(str(bf16_checkpoint), dtype="bfloat16", num_gpu_blocks=16,
                                max_model_len=64).llm_engine.runner.model)
    linear = sum(p.numel() for n, p in model.named_parameters() if n.endswith("proj.weight"))
    assert fp8 < 0.6 * bf16
    with capsys.disabled():
        print(f"\nA3 {fmt}: greedy tokens == HF float32 on the dequantized weights for "
              f"{len(prompts)} prompts; engine weight memory {fp8:,} B vs 16-bit {bf16:,} B = "
              f"{fp8 / bf16:.3f} (linear weights {linear:,} x 1 B + scales; embeddings, LM head "
              f"and norms stay 16-bit)")


def test_unsupported_quantization_fails_at_load_naming_the_method(bf16_checkpoint, tmp_path):
    import shutil

    path = tmp_path / "awq"
    shutil.copytree(bf16_checkpoint, path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported quantization method 'awq'"):
        LLM(str(path), dtype="float32", num_gpu_blocks=16, max_model_len=64)
    config["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {
        "g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="int 4-bit"):
        LLM(str(path), dtype="float32", num_gpu_blocks=16, max_model_len=64)


def test_a_16_bit_weight_under_an_fp8_config_is_refused(bf16_checkpoint, tmp_path):
    import shutil

    path = tmp_path / "mislabelled"
    shutil.copytree(bf16_checkpoint, path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = FORMATS["ct-tensor"][0]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="declares FP8"):
        LLM(str(path), dtype="float32", num_gpu_blocks=16, max_model_len=64)
