"""Checkpoint tensor names -> the engine's parameters (torch-free).

HF checkpoints store q/k/v and gate/up as separate tensors; the engine's layers fuse them
(``self_attn.qkv_proj``, ``mlp.gate_up_proj``), so a tensor goes to one part (shard) of a
fused parameter. The safetensors loader and the GGUF reader (whose tensors are renamed
to HF's first) both place tensors by this mapping.
"""

from __future__ import annotations

import re

LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# checkpoint sub-name -> (fused parameter, shard index among the fused parts)
FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
# checkpoint suffix -> engine parameter (FP8 scales: both formats multiply)
SUFFIXES = {".weight": ".weight", ".bias": ".bias", ".weight_scale": ".weight_scale",
            ".weight_scale_inv": ".weight_scale"}


def param_target(name: str) -> tuple[str, int | None]:
    """Engine parameter name (and fused shard index) for a checkpoint tensor name."""
    m = LAYER.match(name)
    if m:
        layer, rest = m.groups()
        for suffix, param in SUFFIXES.items():
            if rest.endswith(suffix):
                base = rest[: -len(suffix)]
                if base in FUSED:
                    fused, shard = FUSED[base]
                    return f"layers.{layer}.{fused}{param}", shard
                return f"layers.{layer}.{base}{param}", None
        return f"layers.{layer}.{rest}", None
    if name.startswith("model."):
        return name[len("model."):], None
    return name, None
