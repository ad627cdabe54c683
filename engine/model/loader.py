"""Loading HF safetensors checkpoints into the engine's model (never pickle).

The checkpoint's separate q/k/v and gate/up tensors are concatenated into the fused
projections. Missing or unexpected tensors are an error that names them; per-layer fp8
KV scales (``...k_scale`` / ``...v_scale``) are picked up when present.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from kvpilot.engine.model.hf_config import ArchConfig
from kvpilot.engine.model.layers.rotary import RotaryEmbedding
from kvpilot.engine.model.models.llama import LlamaForCausalLM

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# checkpoint sub-name -> (fused parameter, shard index among the fused parts)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_KV_SCALE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:attn\.)?([kv])_scale$")


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files (sharded via the index, or all *.safetensors)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index.name} in {model_dir} lists missing shard(s): {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in model_dir.glob("*.bin")] + [p.name for p in model_dir.glob("*.pt")]
        hint = f" (found {', '.join(pickles)}: pickle checkpoints are not loaded for safety; convert to safetensors)" if pickles else ""
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}{hint}")
    return files


def iter_checkpoint(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open is not iterable)
                yield name, f.get_tensor(name)


def _target(name: str) -> tuple[str, int | None]:
    """Engine parameter name (and fused shard index) for a checkpoint tensor name."""
    m = _LAYER.match(name)
    if m:
        layer, rest = m.groups()
        for suffix in (".weight", ".bias"):
            if rest.endswith(suffix):
                base = rest[: -len(suffix)]
                if base in _FUSED:
                    fused, shard = _FUSED[base]
                    return f"layers.{layer}.{fused}{suffix}", shard
        return f"layers.{layer}.{rest}", None
    if name.startswith("model."):
        return name[len("model."):], None
    return name, None


def load_model(model_dir: str | Path, cfg: ArchConfig, max_model_len: int,
               dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    model_dir = Path(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_model_len)
    params = dict(model.named_parameters())
    parts: dict[str, dict[int, torch.Tensor]] = {}
    loaded: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    kv_scales: dict[tuple[int, str], float] = {}
    for name, tensor in iter_checkpoint(model_dir):
        scale = _KV_SCALE.match(name)
        if scale:
            kv_scales[(int(scale.group(1)), scale.group(2))] = float(tensor.float().reshape(-1)[0])
            continue
        if "rotary_emb.inv_freq" in name:
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        target, shard = _target(name)
        if target not in params:
            unexpected.append(name)
        elif shard is None:
            loaded[target] = tensor
        else:
            parts.setdefault(target, {})[shard] = tensor
    for target, shards in parts.items():
        loaded[target] = torch.cat([shards[i] for i in sorted(shards)], dim=0)
    missing = sorted(set(params) - set(loaded))
    incomplete = [t for t, s in parts.items() if len(s) != (3 if "qkv" in t else 2)]
    if missing or incomplete or unexpected:
        raise ValueError(
            f"checkpoint in {model_dir} does not match {cfg.architecture}: "
            f"missing weights {missing or 'none'}; incomplete fused weights {incomplete or 'none'}; "
            f"unexpected weights {unexpected[:10] or 'none'}")
    for target, tensor in loaded.items():
        if tuple(tensor.shape) != tuple(params[target].shape):
            raise ValueError(f"weight {target} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(params[target].shape)} for this config")
    model.load_state_dict({k: v.to(dtype) for k, v in loaded.items()}, strict=False, assign=True)
    # Non-persistent buffers (rope tables, kv scales) were created on meta: rebuild them.
    _materialize_buffers(model, cfg, max_model_len)
    model = model.to(device)
    for (layer, kind), value in kv_scales.items():
        getattr(model.layers[layer].self_attn, f"{kind}_scale").fill_(value)
    model.loaded_kv_scales = bool(kv_scales)
    return model.eval()


def _materialize_buffers(model: LlamaForCausalLM, cfg: ArchConfig, max_model_len: int) -> None:
    rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max(max_model_len, 1), cfg.max_position_embeddings)
    for layer in model.layers:
        attn = layer.self_attn
        attn.rotary = rotary
        attn.k_scale = torch.tensor(1.0)
        attn.v_scale = torch.tensor(1.0)
