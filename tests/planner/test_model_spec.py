"""Reading architectures from config.json files and weight bytes from safetensors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from kvpilot.operator.planner import PlanRequest, make_plan, preset_model, resolve_model
from kvpilot.operator.planner.catalog import MODEL_PRESETS, model_from_path
from kvpilot.operator.planner.model_spec import model_from_config

# Qwen3-0.6B's config.json as published on the hub (transformers 4.x layout), trimmed.
QWEN3_06B_4X = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
    "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "use_sliding_window": False,
    "max_window_layers": 28, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
}


def _to_5x(cfg: dict) -> dict:
    """The same config in transformers 5.x layout: ``dtype`` and ``rope_parameters``."""
    out = {k: v for k, v in cfg.items() if k not in ("torch_dtype", "rope_theta", "rope_scaling")}
    out["dtype"] = cfg["torch_dtype"]
    out["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg["rope_theta"]}
    return out


def _write(tmp_path: Path, cfg: dict, name: str = "ckpt") -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("layout", ["4.x", "5.x"])
def test_config_layouts_read_the_same(tmp_path, layout):
    cfg = QWEN3_06B_4X if layout == "4.x" else _to_5x(QWEN3_06B_4X)
    spec = model_from_path(_write(tmp_path, cfg) / "config.json")
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype) == (28, 8, 128, "bfloat16")
    assert spec.rope_theta == 1e6
    assert spec.max_position_embeddings == 40960
    assert spec.num_sliding_layers == 0
    # no checkpoint next to it: parameters estimated from the architecture (tied embeddings once)
    assert spec.weight_bytes is None and "estimate" in spec.weight_source
    assert spec.num_params == preset_model("qwen3-0.6b").num_params


def test_head_dim_explicit_versus_derived_and_kv_heads_default(tmp_path):
    explicit = model_from_path(_write(tmp_path, QWEN3_06B_4X, "a"))
    assert explicit.head_dim == 128 != explicit.hidden_size // explicit.num_attention_heads
    derived_cfg = {k: v for k, v in QWEN3_06B_4X.items() if k not in ("head_dim", "num_key_value_heads")}
    derived = model_from_path(_write(tmp_path, derived_cfg, "b"))
    assert derived.head_dim == 1024 // 16 == 64
    assert derived.num_kv_heads == derived.num_attention_heads == 16
    null_head_dim = model_from_path(_write(tmp_path, {**QWEN3_06B_4X, "head_dim": None}, "c"))
    assert null_head_dim.head_dim == 64


def test_missing_dtype_means_float32_like_the_engine(tmp_path):
    cfg = {k: v for k, v in QWEN3_06B_4X.items() if k != "torch_dtype"}
    spec = model_from_path(_write(tmp_path, cfg))
    assert spec.dtype == "float32" and spec.dtype_bytes == 4


def test_yarn_rope_scaling_stretches_max_positions(tmp_path):
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    four = model_from_path(_write(tmp_path, {**QWEN3_06B_4X, "rope_scaling": yarn}, "a"))
    five = model_from_path(_write(tmp_path, {**_to_5x(QWEN3_06B_4X),
                                             "rope_parameters": {**yarn, "rope_theta": 1e6}}, "b"))
    assert four.max_position_embeddings == five.max_position_embeddings == 131072


def test_sliding_window_layers(tmp_path):
    gemma = preset_model("gemma-2-9b")
    assert (gemma.head_dim, gemma.sliding_window, gemma.num_sliding_layers) == (256, 4096, 21)
    # a 6,144-token step reads 6,144 tokens on the 21 global layers and 4,096 on the 21 local
    # ones, but the KV is all kept: the local layers share the global layers' block table
    assert gemma.kv_tokens_attended(6144) == (21 * 6144 + 21 * 4096) // 42
    assert gemma.kv_tokens_attended(4000) == 4000
    assert gemma.kv_release_window is None and gemma.kv_tokens(6144) == 6144
    types = ["sliding_attention", "full_attention", "full_attention", "full_attention"]
    listed = model_from_path(_write(tmp_path, {**QWEN3_06B_4X, "num_hidden_layers": 4, "layer_types": types,
                                               "sliding_window": 512}, "a"))
    assert (listed.sliding_window, listed.num_sliding_layers) == (512, 1)
    qwen_on = model_from_path(_write(tmp_path, {**QWEN3_06B_4X, "use_sliding_window": True,
                                                "sliding_window": 4096, "max_window_layers": 20}, "b"))
    assert qwen_on.num_sliding_layers == 8
    mistral = model_from_path(_write(tmp_path, {**QWEN3_06B_4X, "model_type": "mistral",
                                                "use_sliding_window": None, "sliding_window": 4096}, "c"))
    assert mistral.num_sliding_layers == 0          # use_sliding_window present but falsy
    v01 = {k: v for k, v in QWEN3_06B_4X.items() if k != "use_sliding_window"}
    mistral01 = model_from_path(_write(tmp_path, {**v01, "model_type": "mistral", "sliding_window": 4096}, "d"))
    assert mistral01.num_sliding_layers == 28
    assert mistral01.kv_release_window == 4096 and mistral01.kv_tokens(6144) == 4096


def test_bad_configs_give_clear_errors(tmp_path):
    cfg = {k: v for k, v in QWEN3_06B_4X.items() if k != "num_hidden_layers"}
    with pytest.raises(ValueError, match="missing required field 'num_hidden_layers'"):
        model_from_path(_write(tmp_path, cfg, "a"))
    with pytest.raises(ValueError, match="mixture-of-experts"):
        model_from_path(_write(tmp_path, {**QWEN3_06B_4X, "num_experts": 128}, "b"))
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        model_from_path(tmp_path / "c")
    with pytest.raises(ValueError, match=r"unknown model 'qwen9-1t'.*presets: qwen3-0.6b"):
        resolve_model("qwen9-1t")


def test_weight_bytes_from_safetensors_index(tmp_path):
    d = _write(tmp_path, QWEN3_06B_4X)
    index = {"metadata": {"total_size": 1_503_300_328}, "weight_map": {"lm_head.weight": "model-1.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    spec = resolve_model(str(d))
    assert spec.weight_bytes == 1_503_300_328
    assert spec.weight_source == "model.safetensors.index.json metadata.total_size"
    plan = make_plan(PlanRequest.from_dict({"model": {"path": str(d)}, "gpu": "l4", "slo": {
        "max_context": 4096, "p95_prompt_tokens": 1024, "p95_output_tokens": 256}}))
    assert plan.memory["weight_bytes_total"] == 1_503_300_328
    assert any("metadata.total_size" in line for line in plan.derivation)


def test_weight_bytes_from_safetensors_headers(tmp_path):
    d = _write(tmp_path, QWEN3_06B_4X)
    save_file({"a": np.zeros((64, 32), dtype=np.float16), "b": np.zeros(100, dtype=np.float32)},
              str(d / "model-00001-of-00002.safetensors"))
    save_file({"c": np.zeros((3, 5, 7), dtype=np.int8)}, str(d / "model-00002-of-00002.safetensors"))
    spec = resolve_model(str(d))
    assert spec.weight_bytes == 64 * 32 * 2 + 100 * 4 + 3 * 5 * 7
    assert spec.weight_source == "safetensors headers (2 file(s))"
    (d / "model-00002-of-00002.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        resolve_model(str(d))


def test_presets_resolve_by_name_and_hub_id():
    assert resolve_model("Qwen/Qwen3-8B") == resolve_model("qwen3-8b")
    for name in ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b", "qwen2.5-7b",
                 "qwen2.5-72b", "llama-3.1-8b", "llama-3.1-70b", "llama-2-7b", "mistral-7b", "gemma-2-9b"):
        assert name in MODEL_PRESETS


# Parameter counts as the publishers state them: exact where the hub lists them, model-card
# rounding (total, non-embedding) for Qwen3.
QWEN3_CARDS = {"qwen3-0.6b": (0.6, 0.44), "qwen3-1.7b": (1.7, 1.4), "qwen3-4b": (4.0, 3.6),
               "qwen3-8b": (8.2, 6.95), "qwen3-14b": (14.8, 13.2), "qwen3-32b": (32.8, 31.2)}


@pytest.mark.parametrize("name", sorted(QWEN3_CARDS))
def test_qwen3_parameter_counts_match_the_model_cards(name):
    spec = preset_model(name)
    total, non_embedding = QWEN3_CARDS[name]
    embedding = spec.vocab_size * spec.hidden_size * (1 if name in ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b") else 2)
    assert round(spec.num_params / 1e9, 1 if total >= 1 else 1) == pytest.approx(total, abs=0.051)
    assert (spec.num_params - embedding) / 1e9 == pytest.approx(non_embedding, abs=0.051)


@pytest.mark.slow
def test_catalogue_matches_transformers_architectures(tmp_path):
    """Each preset built by transformers (on the meta device: no memory) has exactly the
    catalogue's parameter count, and the planner's estimator reproduces it from the config;
    the config.json transformers 5.x writes for it reads back to the same architecture."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    for name, (_, cfg, published) in MODEL_PRESETS.items():
        kwargs = {k: v for k, v in cfg.items() if k not in ("model_type", "torch_dtype")}
        config = transformers.CONFIG_MAPPING[cfg["model_type"]](**kwargs, dtype=cfg["torch_dtype"])
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        counted = sum(p.numel() for p in model.parameters())     # shared (tied) tensors once
        assert published == counted == model_from_config(cfg, name).num_params, name
        config.save_pretrained(tmp_path / name)
        written = json.loads((tmp_path / name / "config.json").read_text())
        assert "rope_parameters" in written and "torch_dtype" not in written   # the 5.x layout
        spec, preset = model_from_path(tmp_path / name), preset_model(name)
        for field in ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim", "hidden_size",
                      "intermediate_size", "vocab_size", "max_position_embeddings", "dtype", "num_params",
                      "sliding_window", "num_sliding_layers", "rope_theta"):
            assert getattr(spec, field) == getattr(preset, field), (name, field)


def test_weight_bytes_follow_the_checkpoints_quantization():
    """A config.json declaring FP8 weights is planned at one byte per linear weight (the
    embeddings in the model dtype); a method the engine refuses is refused here too."""
    from kvpilot.operator.planner.weights import quantized_weight_bytes

    plain = model_from_config(QWEN3_06B_4X, "q")
    fp8 = model_from_config({**QWEN3_06B_4X, "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}, "q-fp8")
    assert (plain.weight_quantization, fp8.weight_quantization) == (None, "fp8")
    assert fp8.total_weight_bytes == quantized_weight_bytes(
        fp8.num_params, fp8.embedding_params, 2, "fp8") < 0.7 * plain.total_weight_bytes
    plan = make_plan(PlanRequest.from_dict({"model": fp8.to_dict(), "gpu": "l4", "slo": {
        "max_context": 4096, "p95_prompt_tokens": 1024, "p95_output_tokens": 256}}))
    weights = next(line for line in plan.derivation if line.startswith("2. Weights"))
    assert " in fp8 " in weights and f"= {fp8.total_weight_bytes:,} B" in weights
    assert not any(s.kind == "weight_quantization" for s in plan.suggestions)
    with pytest.raises(ValueError, match="unsupported quantization method 'gptq'"):
        model_from_config({**QWEN3_06B_4X, "quantization_config": {"quant_method": "gptq", "bits": 4}}, "q")
