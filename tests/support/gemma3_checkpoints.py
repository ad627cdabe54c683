"""Tiny random ``Gemma3ForCausalLM`` checkpoints, built with transformers.

Shapes follow the released checkpoints where it matters to the engine: 5 local
(sliding-window) layers to 1 global, head_dim 256 with more query heads than KV heads
(gemma-3-1b: 4 heads, 1 KV head), a head size times heads that is not the hidden size,
tied embeddings. ``query_pre_attn_scalar`` is not head_dim (as in gemma-3-27b) and the
local and global rope bases differ, so a wrong softmax scale or rope changes the tokens.
Every norm weight is random: Gemma's ``1 + weight`` gain would hide a ``weight`` gain
at HF's zero init. The post-attention and post-MLP norms get gains around 3: with tied
(sharpened) embeddings the scaled input embedding otherwise dominates the residual
stream and the model mostly repeats its last token.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

WINDOW = 32
GEMMA3 = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
              num_attention_heads=2, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=96,
              sliding_window=WINDOW, max_position_embeddings=1024, rms_norm_eps=1e-6,
              rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
              tie_word_embeddings=True, bos_token_id=0, eos_token_id=2, pad_token_id=1)


def build_gemma3(path: Path, seed: int = 0, **overrides) -> Path:
    """Save a random tiny Gemma 3 (config.json in transformers 5's layout + safetensors)
    into ``path``; ``overrides`` replace ``GEMMA3``'s config fields."""
    import transformers

    config = transformers.Gemma3TextConfig(**{**GEMMA3, **overrides})
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(config).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(2.0 if ".post_" in name else 0.0, 0.5)
        # Random init leaves logits nearly flat; sharpen them so greedy ties are unlikely
        # (the embedding is the LM head: the input norm undoes the factor for the layers).
        model.get_output_embeddings().weight.mul_(8.0)
    model.save_pretrained(path, safe_serialization=True)
    return path


def as_4x_layout(path: Path, rope_scaling: dict | None = None) -> Path:
    """Rewrite ``path``'s config.json the way checkpoints on the hub have it (transformers
    4.x: ``sliding_window_pattern``, ``rope_theta``, ``rope_local_base_freq`` and
    ``rope_scaling`` for the global layers; no ``layer_types`` / ``rope_parameters``)."""
    file = path / "config.json"
    cfg = json.loads(file.read_text())
    ropes = cfg.pop("rope_parameters")
    types = cfg.pop("layer_types")
    pattern = types.index("full_attention") + 1
    assert types == ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                     for i in range(len(types))]
    cfg.update(sliding_window_pattern=pattern, rope_theta=ropes["full_attention"]["rope_theta"],
               rope_local_base_freq=ropes["sliding_attention"]["rope_theta"], rope_scaling=rope_scaling,
               torch_dtype=cfg.pop("dtype", "float32"))
    file.write_text(json.dumps(cfg, indent=2))
    return path
