"""Checkpoint variants (MHA, tied embeddings, rope scaling, sharded weights, both config
layouts) give HF transformers' greedy tokens; rope frequencies equal transformers'."""

from __future__ import annotations

import json
import random

import pytest
import torch

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.model.hf_config import load_arch_config, parse_arch_config
from kvpilot.engine.model.layers.rotary import compute_inv_freq

ROPE_CASES = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
}


@pytest.mark.parametrize("name", sorted(ROPE_CASES))
def test_inv_freq_matches_transformers(name):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=1024,
                                      rope_scaling=dict(ROPE_CASES[name]))
    ref, ref_scale = ROPE_INIT_FUNCTIONS[name](hf_cfg, torch.device("cpu"))
    cfg = json.loads(hf_cfg.to_json_string())
    cfg["architectures"] = ["LlamaForCausalLM"]
    arch = parse_arch_config(cfg)
    inv, scale, dim = compute_inv_freq(arch.rope, arch.head_dim, arch.max_position_embeddings)
    assert dim == 16
    torch.testing.assert_close(inv, ref.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale)


VARIANTS = {
    "llama-mha-tied": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "llama-rope-llama3": ("llama", dict(rope_scaling=ROPE_CASES["llama3"], rope_theta=50000.0)),
    "qwen2-yarn": ("qwen2", dict(rope_scaling=ROPE_CASES["yarn"])),
    "qwen3-mqa-linear": ("qwen3", dict(num_key_value_heads=1, rope_scaling=ROPE_CASES["linear"])),
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_parity(variant, tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    kind, overrides = VARIANTS[variant]
    path = tiny_checkpoint(kind, **overrides)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 40, 300)]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            expected.append(hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                                        min_new_tokens=6, do_sample=False, pad_token_id=0)[0, len(p):].tolist())
    llm = LLM(str(path), dtype="float32", num_gpu_blocks=128, max_model_len=1024)
    got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in got] == expected


@pytest.mark.slow
def test_sharded_checkpoint_and_4x_config_layout(tiny_checkpoint, tmp_path):
    """A sharded save (index + shards) rewritten in the transformers 4.x config layout."""
    from transformers import AutoModelForCausalLM

    src = tiny_checkpoint("qwen2")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "special_tokens_map.json"):
            (tmp_path / f.name).write_bytes(f.read_bytes())
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    cfg = json.loads((tmp_path / "config.json").read_text())
    rope = cfg.pop("rope_parameters", None) or {}
    cfg["rope_theta"] = rope.get("rope_theta", 10000.0)
    cfg["torch_dtype"] = cfg.pop("dtype", "float32")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    arch = load_arch_config(tmp_path)
    assert arch.rope.theta == rope.get("rope_theta", 10000.0) and arch.dtype == "float32"
    prompt = [[11, 22, 33, 44, 55, 66]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    sharded = LLM(str(tmp_path), dtype="float32", num_gpu_blocks=64, max_model_len=512).generate(prompt, params)
    single = LLM(str(src), dtype="float32", num_gpu_blocks=64, max_model_len=512).generate(prompt, params)
    assert sharded[0].outputs[0].token_ids == single[0].outputs[0].token_ids
