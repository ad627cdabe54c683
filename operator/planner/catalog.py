"""Built-in model presets: the fields of each model's published ``config.json`` plus its
published parameter count, and the resolver from a ``--model`` argument to a ModelSpec.

Parameter counts are the totals the model publishers report (exact where the hub
lists them; Qwen3's model cards round to 0.1 B and the architecture formula
reproduces those). Tied embeddings (Qwen3 <= 4B, Gemma 2) are counted once, as
they sit on the GPU once. "mistral-7b" is Mistral-7B-Instruct-v0.3 (no sliding
window; v0.1's 4,096-token window is gone in v0.3).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvpilot.contract.gguf import find_gguf
from kvpilot.operator.planner.gguf_model import gguf_model
from kvpilot.operator.planner.model_spec import ModelSpec, model_from_config
from kvpilot.operator.planner.weights import checkpoint_weight_bytes


def _cfg(model_type: str, layers: int, hidden: int, inter: int, heads: int, kv: int, vocab: int,
         max_pos: int, theta: float, dtype: str = "bfloat16", tied: bool = False,
         **extra: Any) -> dict[str, Any]:
    return {"model_type": model_type, "num_hidden_layers": layers, "hidden_size": hidden,
            "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv,
            "vocab_size": vocab, "max_position_embeddings": max_pos, "rope_theta": theta,
            "torch_dtype": dtype, "tie_word_embeddings": tied, **extra}


_QWEN3 = {"head_dim": 128, "sliding_window": None, "use_sliding_window": False}
_QWEN25 = {"use_sliding_window": False, "sliding_window": 131072}
_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}

# key -> (hub id, config.json fields, published parameter count)
MODEL_PRESETS: dict[str, tuple[str, dict[str, Any], int]] = {
    "qwen3-0.6b": ("Qwen/Qwen3-0.6B",
                   _cfg("qwen3", 28, 1024, 3072, 16, 8, 151936, 40960, 1e6, tied=True, **_QWEN3),
                   596_049_920),
    "qwen3-1.7b": ("Qwen/Qwen3-1.7B",
                   _cfg("qwen3", 28, 2048, 6144, 16, 8, 151936, 40960, 1e6, tied=True, **_QWEN3),
                   1_720_574_976),
    "qwen3-4b": ("Qwen/Qwen3-4B",
                 _cfg("qwen3", 36, 2560, 9728, 32, 8, 151936, 40960, 1e6, tied=True, **_QWEN3),
                 4_022_468_096),
    "qwen3-8b": ("Qwen/Qwen3-8B",
                 _cfg("qwen3", 36, 4096, 12288, 32, 8, 151936, 40960, 1e6, **_QWEN3),
                 8_190_735_360),
    "qwen3-14b": ("Qwen/Qwen3-14B",
                  _cfg("qwen3", 40, 5120, 17408, 40, 8, 151936, 40960, 1e6, **_QWEN3),
                  14_768_307_200),
    "qwen3-32b": ("Qwen/Qwen3-32B",
                  _cfg("qwen3", 64, 5120, 25600, 64, 8, 151936, 40960, 1e6, **_QWEN3),
                  32_762_123_264),
    "qwen2.5-7b": ("Qwen/Qwen2.5-7B-Instruct",
                   _cfg("qwen2", 28, 3584, 18944, 28, 4, 152064, 32768, 1e6, **_QWEN25),
                   7_615_616_512),
    "qwen2.5-72b": ("Qwen/Qwen2.5-72B-Instruct",
                    _cfg("qwen2", 80, 8192, 29568, 64, 8, 152064, 32768, 1e6, **_QWEN25),
                    72_706_203_648),
    "llama-3.1-8b": ("meta-llama/Llama-3.1-8B-Instruct",
                     _cfg("llama", 32, 4096, 14336, 32, 8, 128256, 131072, 5e5, rope_scaling=_LLAMA31_ROPE),
                     8_030_261_248),
    "llama-3.1-70b": ("meta-llama/Llama-3.1-70B-Instruct",
                      _cfg("llama", 80, 8192, 28672, 64, 8, 128256, 131072, 5e5, rope_scaling=_LLAMA31_ROPE),
                      70_553_706_496),
    # 126 layers x 3,187,703,808 + 2 x 128,256 x 16,384 embedding / LM head + 16,384 = the
    # published 405,853,388,800 (its safetensors index: 811,706,777,600 bytes in bfloat16)
    "llama-3.1-405b": ("meta-llama/Llama-3.1-405B-Instruct",
                       _cfg("llama", 126, 16384, 53248, 128, 8, 128256, 131072, 5e5, rope_scaling=_LLAMA31_ROPE),
                       405_853_388_800),
    # the same weights in compressed-tensors FP8 (llm-compressor; Linear layers in float 8-bit,
    # the LM head and embeddings in bfloat16), which the engine serves. Meta's own
    # meta-llama/Llama-3.1-405B-Instruct-FP8 is fbgemm_fp8, which it does not.
    "llama-3.1-405b-fp8": ("RedHatAI/Meta-Llama-3.1-405B-Instruct-FP8",
                           _cfg("llama", 126, 16384, 53248, 128, 8, 128256, 131072, 5e5,
                                rope_scaling=_LLAMA31_ROPE, quantization_config={
                                    "quant_method": "compressed-tensors", "format": "float-quantized",
                                    "ignore": ["lm_head"], "config_groups": {"group_0": {
                                        "targets": ["Linear"],
                                        "weights": {"type": "float", "num_bits": 8, "strategy": "channel"}}}}),
                           405_853_388_800),
    "llama-2-7b": ("meta-llama/Llama-2-7b-hf",
                   _cfg("llama", 32, 4096, 11008, 32, 32, 32000, 4096, 1e4, dtype="float16"),
                   6_738_415_616),
    "mistral-7b": ("mistralai/Mistral-7B-Instruct-v0.3",
                   _cfg("mistral", 32, 4096, 14336, 32, 8, 32768, 32768, 1e6, sliding_window=None),
                   7_248_023_552),
    # kvpilot's built-in demo checkpoint (engine/model/models/demo.py; not on the hub)
    "kvpilot-demo": ("kvpilot/demo-qwen3-tiny",
                     _cfg("qwen3", 8, 256, 768, 4, 2, 151936, 8192, 1e6, tied=True, head_dim=64,
                          sliding_window=None, use_sliding_window=False),
                     45_192_448),
    "gemma-2-9b": ("google/gemma-2-9b-it",
                   _cfg("gemma2", 42, 3584, 14336, 16, 8, 256000, 8192, 1e4, tied=True, head_dim=256,
                        sliding_window=4096),
                   9_241_705_984),
}


def model_presets() -> list[str]:
    """Names of the built-in model presets."""
    return list(MODEL_PRESETS)


def preset_key(name: str) -> str | None:
    """The preset key of a preset name or hub id (case-insensitive), else None."""
    key = name.strip().lower()
    if key in MODEL_PRESETS:
        return key
    for preset, (hub_id, _, _) in MODEL_PRESETS.items():
        if key == hub_id.lower():
            return preset
    return None


def preset_model(name: str) -> ModelSpec:
    """A catalogue model by preset name or hub id; ValueError lists the presets."""
    key = preset_key(name)
    if key is None:
        raise ValueError(f"unknown model {name!r}: not a preset and no such config.json or "
                         f"directory; presets: {', '.join(model_presets())}")
    hub_id, cfg, num_params = MODEL_PRESETS[key]
    return model_from_config(cfg, hub_id.split("/")[-1], num_params=num_params,
                             weight_source=f"catalogue: {hub_id} published parameter count")


def model_from_path(path: str | Path) -> ModelSpec:
    """A model from a config.json file or a checkpoint directory holding one.

    Weight bytes come from the directory's safetensors index or headers when present. A
    GGUF file (or a directory holding one) is read from its header: the config from its
    metadata, the weight bytes as the engine holds them (``gguf_model``).
    """
    path = Path(path)
    gguf_file = find_gguf(path)
    if gguf_file is not None:
        return gguf_model(gguf_file)
    config_path = path / "config.json" if path.is_dir() else path
    if not config_path.is_file():
        raise ValueError(f"{path}: no config.json found")
    try:
        cfg = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config_path} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{config_path} must hold a JSON object")
    weight_bytes, source = checkpoint_weight_bytes(config_path.parent)
    name = config_path.parent.name if path.is_dir() or config_path.name == "config.json" else path.stem
    return model_from_config(cfg, name or str(path), weight_bytes=weight_bytes,
                             weight_source=source or "parameter-count estimate from config.json")


def resolve_model(ref: str) -> ModelSpec:
    """``--model`` argument: an existing config.json / directory, else a preset name or hub id."""
    if Path(ref).exists():
        return model_from_path(ref)
    return preset_model(ref)

