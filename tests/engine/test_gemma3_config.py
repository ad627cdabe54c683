"""Gemma 3 config.json reading (torch-free, fast): the hub's layout (transformers 4.x)
and transformers 5's, against what transformers' own ``Gemma3TextConfig`` derives from
the same dict (local/global layers, the two ropes), and the planner's view of them.

The hub dicts are the published ``google/gemma-3-1b-it`` config and the text part of
``google/gemma-3-4b-it`` (linear rope scaling x8 on the global layers).
"""

from __future__ import annotations

import pytest

from kvpilot.contract.arch_config import kv_cache_groups
from kvpilot.engine.model.hf_config import parse_arch_config
from kvpilot.operator.planner.model_spec import model_from_config

GEMMA_3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attn_logit_softcapping": None,
    "bos_token_id": 2, "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "intermediate_size": 6912,
    "max_position_embeddings": 32768, "model_type": "gemma3_text", "num_attention_heads": 4,
    "num_hidden_layers": 26, "num_key_value_heads": 1, "pad_token_id": 0, "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16", "vocab_size": 262144,
}
GEMMA_3_4B_TEXT = {
    **GEMMA_3_1B, "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
    "num_attention_heads": 8, "num_key_value_heads": 4, "sliding_window": 1024,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "max_position_embeddings": 131072,
    "vocab_size": 262208,
}
GLOBAL_1B = (5, 11, 17, 23)


def _hf_config(cfg: dict):
    from transformers import Gemma3TextConfig

    kwargs = {k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")}
    return Gemma3TextConfig(**kwargs, dtype=cfg["torch_dtype"])


@pytest.mark.parametrize("cfg", [GEMMA_3_1B, GEMMA_3_4B_TEXT], ids=["1b", "4b-text"])
def test_hub_layout_reads_as_transformers_does(cfg):
    arch = parse_arch_config(cfg)
    hf = _hf_config(cfg)
    assert arch.sliding_window_layers == tuple(i for i, t in enumerate(hf.layer_types) if t == "sliding_attention")
    assert arch.sliding_window == cfg["sliding_window"]
    full, local = hf.rope_parameters["full_attention"], hf.rope_parameters["sliding_attention"]
    assert (arch.rope.theta, arch.rope.rope_type, arch.rope.factor) == (
        full["rope_theta"], full["rope_type"], full.get("factor", 1.0))
    assert (arch.sliding_rope.theta, arch.sliding_rope.rope_type) == (local["rope_theta"], "default")
    assert arch.attention_scale == hf.query_pre_attn_scalar ** -0.5
    assert arch.tie_word_embeddings and arch.hidden_act == "gelu_pytorch_tanh" and arch.qk_norm
    assert arch.final_logit_softcapping is None and arch.eos_token_ids == (1, 106)
    # transformers 5's layout of the same config reads the same
    hf_dict = {**hf.to_dict(), "architectures": ["Gemma3ForCausalLM"]}
    assert parse_arch_config(hf_dict) == arch


def test_one_b_layers_ropes_and_kv_groups():
    arch = parse_arch_config(GEMMA_3_1B)
    assert [i for i in range(26) if i not in arch.sliding_window_layers] == list(GLOBAL_1B)
    assert arch.layer_rope(5) is arch.rope and arch.layer_rope(4) is arch.sliding_rope
    assert (arch.rope.theta, arch.sliding_rope.theta) == (1e6, 1e4)
    groups = kv_cache_groups(arch, 4096)
    assert [i for i, g in enumerate(groups) if g == 0] == list(GLOBAL_1B)
    assert kv_cache_groups(arch, 512) is None          # nothing outgrows the window


def test_the_planner_reads_the_same_layers():
    for cfg in (GEMMA_3_1B, GEMMA_3_4B_TEXT, {**_hf_config(GEMMA_3_1B).to_dict(),
                                             "architectures": ["Gemma3ForCausalLM"]}):
        arch, spec = parse_arch_config(cfg), model_from_config(cfg, "gemma3")
        assert spec.num_sliding_layers == len(arch.sliding_window_layers)
        assert spec.sliding_window == arch.sliding_window
        assert (spec.head_dim, spec.num_kv_heads, spec.tied_embeddings) == (256, arch.num_key_value_heads, True)
        assert spec.hybrid_kv(4096) == (kv_cache_groups(arch, 4096) is not None)
        # the engine's context limit: max_position_embeddings already counts the scaling
        assert spec.max_position_embeddings == arch.max_position_embeddings == cfg["max_position_embeddings"]


def test_config_values_override_the_defaults():
    arch = parse_arch_config({**GEMMA_3_1B, "query_pre_attn_scalar": 168, "final_logit_softcapping": 30.0,
                              "tie_word_embeddings": False, "attention_bias": True,
                              "layer_types": ["full_attention"] * 25 + ["sliding_attention"]})
    assert arch.attention_scale == 168 ** -0.5
    assert arch.final_logit_softcapping == 30.0
    assert not arch.tie_word_embeddings and arch.qkv_bias and arch.o_bias
    assert arch.sliding_window_layers == (25,)
    no_window = parse_arch_config({**GEMMA_3_1B, "sliding_window": None})
    assert no_window.sliding_window is None and no_window.sliding_window_layers == ()


def test_bidirectional_attention_is_refused():
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        parse_arch_config({**GEMMA_3_1B, "use_bidirectional_attention": True})
