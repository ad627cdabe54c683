"""Quantize a tiny HF checkpoint's linear layers to FP8 (e4m3) in the two served formats.

Used by the engine tests. ``quantize`` writes
the FP8 checkpoint (config.json with its ``quantization_config``, e4m3 weights and their
scales, everything else copied) and, for the HF transformers oracle, the same model with
every quantized weight replaced by its dequantization ``weight x scale`` in float32.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# format name -> (quantization_config, scale tensor suffix, block size)
FORMATS = {
    "ct-tensor": ({"quant_method": "compressed-tensors", "format": "float-quantized",
                   "config_groups": {"group_0": {
                       "targets": ["Linear"],
                       "weights": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                   "symmetric": True, "dynamic": False},
                       "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                             "dynamic": True}}},
                   "ignore": ["lm_head"], "quantization_status": "compressed"}, "weight_scale", None),
    "ct-channel": None,   # filled below: ct-tensor with per-channel scales
    "fp8-block": ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                   "weight_block_size": [32, 32]}, "weight_scale_inv", (32, 32)),
}
_channel = json.loads(json.dumps(FORMATS["ct-tensor"][0]))
_channel["config_groups"]["group_0"]["weights"]["strategy"] = "channel"
FORMATS["ct-channel"] = (_channel, "weight_scale", None)


def _is_linear(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith(".weight") and \
        name.split(".")[-2] in LINEARS


def quantize_weight(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scale) with the checkpoint's scale shape for ``fmt``."""
    w = w.float()
    rows, cols = w.shape
    if fmt == "ct-tensor":
        scale = (w.abs().amax() / FP8_MAX).reshape(1)
        full = scale
    elif fmt == "ct-channel":
        scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX          # [rows, 1]
        full = scale
    else:
        n, k = FORMATS[fmt][2]
        blocks = w.reshape(rows // n, n, cols // k, k)
        scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX                # [rows / n, cols / k]
        full = scale.repeat_interleave(n, 0).repeat_interleave(k, 1)
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale.float()


def quantize(src: Path, dst: Path, fmt: str) -> tuple[Path, Path]:
    """Write the ``fmt`` FP8 checkpoint of ``src`` to ``dst`` and its float32
    dequantization to ``dst.with_name(dst.name + "-dequant")``; returns both."""
    from transformers import AutoModelForCausalLM

    quant_config, scale_suffix, _ = FORMATS[fmt]
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quant_config
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {}
    dequantized = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if not _is_linear(name):
            tensors[name] = w
            continue
        q, scale = quantize_weight(w, fmt)
        tensors[name] = q
        tensors[name[: -len("weight")] + scale_suffix] = scale
        full = scale if scale.shape[0] == w.shape[0] or scale.numel() == 1 else \
            scale.repeat_interleave(w.shape[0] // scale.shape[0], 0).repeat_interleave(
                w.shape[1] // scale.shape[1], 1)
        dequantized[name] = q.float() * full
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    oracle = dst.with_name(dst.name + "-dequant")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    missing = set(dequantized) - set(model.state_dict())
    assert not missing, missing
    model.load_state_dict(dequantized, strict=False)
    model.save_pretrained(oracle, safe_serialization=True)
    return dst, oracle
