"""Loading HF safetensors checkpoints into the engine's model (never pickle).

The checkpoint's separate q/k/v and gate/up tensors go into their parts of the fused
projections. Under tensor parallelism each rank reads only its own slice of every
tensor (safetensors slices), straight into parameters allocated on its device. Missing
or unexpected tensors are an error that names them; per-layer fp8 KV scales
(``...k_scale`` / ``...v_scale``) are picked up when present.

FP8-weight checkpoints (``ArchConfig.quantization``): the decoder's linear layers are
built with FP8 storage before loading (``layers.fp8_linear``), their e4m3 weights are
copied byte for byte (a weight that is not e4m3 there is an error) and their scales
(``weight_scale``, or ``weight_scale_inv`` in the fine-grained format) go into
``weight_scale``; static activation scales (``input_scale``) are not used.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from torch import nn

from kvpilot.contract.arch_config import ArchConfig
from kvpilot.contract.gguf import find_gguf
from kvpilot.contract.pipeline_stages import StageLayers
from kvpilot.contract.weight_quant import Fp8WeightConfig
from kvpilot.engine.model import huge_pages
from kvpilot.engine.model.checkpoint_checks import (
    check_shard_names,
    check_tensor_list,
    checkpoint_shapes,
)
from kvpilot.engine.model.layers.fp8_linear import use_fp8_weight
from kvpilot.engine.model.layers.rotary import layer_rotaries
from kvpilot.engine.model.models import model_class
from kvpilot.engine.model.models.llama import LlamaForCausalLM
from kvpilot.engine.model.parallel.group import TPGroup
from kvpilot.engine.model.parallel.linear import ShapeMismatch, check_shape
from kvpilot.engine.model.parallel.sharding import read_shard
from kvpilot.engine.model.param_names import LAYER, param_target

if TYPE_CHECKING:
    from kvpilot.engine.model.attention import AttentionBackend


logger = logging.getLogger(__name__)

_KV_SCALE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:attn\.)?([kv])_scale$")
# engine linear layer -> the checkpoint modules fused into it
_LINEARS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files (sharded via the index, or all *.safetensors)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        check_shard_names(model_dir, weight_map)
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


def iter_checkpoint(model_dir: Path) -> Iterator[tuple[str, Any]]:
    """``(name, safetensors slice)`` for every tensor: nothing is read until sliced."""
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open is not iterable)
                yield name, f.get_slice(name)


def _load_one(module: nn.Module, param_name: str, src: Any, shard: int | None) -> None:
    """This rank's part of ``src`` into ``module``'s parameter (tensor-parallel layers
    shard it; anything else is replicated whole)."""
    load = getattr(module, "load_weight", None)
    if load is not None:
        load(param_name, src, shard)
        return
    param = getattr(module, param_name)
    check_shape(src, tuple(param.shape))
    param.data.copy_(read_shard(src, 0, None).to(param.dtype))


# For modules built outside ``load_model`` from checkpoint tensors (an EAGLE head's layer):
# loading one tensor into its engine parameter (``param_names.param_target`` names it).
load_tensor = _load_one


def _stage_target(name: str, stage: StageLayers, num_layers: int, tied: bool) -> str | None:
    """``name`` as this pipeline stage's model names it (decoder layer ``i`` is the stage's
    ``layers[i - first_layer]``), or None when the tensor belongs to another stage."""
    m = LAYER.match(name)
    if m:
        layer = int(m.group(1))
        if layer not in stage.layers(num_layers):
            return None
        return f"model.layers.{layer - stage.first_layer}.{m.group(2)}"
    if name == "model.embed_tokens.weight":
        return name if stage.is_first or (stage.is_last and tied) else None
    if name in ("model.norm.weight", "lm_head.weight"):
        return name if stage.is_last else None
    return name


def load_model(model_dir: str | Path, cfg: ArchConfig, max_model_len: int,
               dtype: torch.dtype, device: torch.device, tp: TPGroup | None = None,
               stage: StageLayers | None = None, *, float32_q8: bool = False) -> LlamaForCausalLM:
    """The model with this rank's shard of the checkpoint's weights (all of them at one
    rank), in ``dtype`` on ``device``; each rank reads only its own slices, and a pipeline
    stage (``stage``) only its own layers' tensors. ``model_dir`` may also be a GGUF file
    (or a directory holding one): see ``kvpilot.engine.model.gguf``; ``float32_q8``: its
    float32 decode tokens take the q8 path (``layers.gguf_linear``)."""
    model_dir = Path(model_dir)
    stage = stage or StageLayers()
    if stage.num_stages > 1 and find_gguf(model_dir) is not None:
        raise ValueError("pipeline parallelism is not implemented for GGUF checkpoints")
    gguf_file = find_gguf(model_dir)
    if gguf_file is not None:
        from kvpilot.engine.model.gguf.weights import GGUFCheckpoint, place_tensor

        checkpoint = GGUFCheckpoint(gguf_file, cfg)
        shapes, tensors = checkpoint.shapes(), checkpoint.tensors()

        def place(module: nn.Module, param_name: str, src: Any, shard: int | None) -> None:
            place_tensor(module, param_name, src, shard, _load_one)
    else:
        files = safetensors_files(model_dir)
        shapes, tensors, place = checkpoint_shapes(files), iter_checkpoint(model_dir), _load_one
    check_tensor_list(shapes, cfg, model_dir)  # before allocating
    with torch.device("meta"):
        staged = {"stage": stage} if stage.num_stages > 1 else {}
        model = model_class(cfg.architecture)(cfg, max_model_len, tp, **staged).to(dtype)
        if cfg.quantization is not None:
            _use_fp8_weights(model, cfg.quantization, stage.first_layer)
        kept = _use_gguf_weights(model, checkpoint, device, float32_q8) if gguf_file is not None else None
        model.holds_gguf = bool(kept)
    model = model.to_empty(device=device)
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    loaded: dict[str, set[int | None]] = {}
    unexpected: list[str] = []
    kv_scales: dict[tuple[int, str], float] = {}
    for name, src in tensors:
        name = _stage_target(name, stage, cfg.num_hidden_layers, cfg.tie_word_embeddings)
        if name is None:
            continue
        scale = _KV_SCALE.match(name)
        if scale:
            value = read_shard(src, 0, None).float().reshape(-1)[0]
            kv_scales[(int(scale.group(1)), scale.group(2))] = float(value)
            continue
        if "rotary_emb.inv_freq" in name or (cfg.quantization is not None and name.endswith(".input_scale")):
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        target, shard = param_target(name)
        if target not in params:
            unexpected.append(name)
            continue
        module_name, _, param_name = target.rpartition(".")
        if params[target].dtype == torch.float8_e4m3fn and src.get_dtype() != "F8_E4M3":
            raise ValueError(f"weight {name} is {src.get_dtype()}, but config.json declares FP8 "
                             f"weights ({cfg.quantization.name}) for this layer")
        try:
            place(modules[module_name], param_name, src, shard)
        except ShapeMismatch as exc:
            raise ValueError(f"weight {name} has shape {exc.got}, expected {exc.expected} "
                             f"for this config") from None
        loaded.setdefault(target, set()).add(shard)
    missing = sorted(set(params) - set(loaded))
    incomplete = [t for t, shards in loaded.items() if None not in shards
                  and len(shards) != len(modules[t.rpartition(".")[0]].parts)]
    if missing or incomplete or unexpected:
        raise ValueError(
            f"checkpoint in {model_dir} does not match {cfg.architecture}: "
            f"missing weights {missing or 'none'}; incomplete fused weights {incomplete or 'none'}; "
            f"unexpected weights {unexpected[:10] or 'none'}")
    # Non-persistent buffers (rope tables, kv scales) were created on meta: rebuild them.
    _materialize_buffers(model, cfg, max_model_len, stage.first_layer)
    model = model.to(device)
    model.load_kv_scales(kv_scales)
    if gguf_file is not None:
        _log_gguf_bytes(checkpoint, model, shapes, kept)
    return model.eval()


def _use_gguf_weights(model: LlamaForCausalLM, checkpoint: Any, device: torch.device,
                      float32_q8: bool = False) -> dict[str, int]:
    """GGUF block storage (``layers.gguf_linear``) for every linear layer, the token
    embedding and the LM head whose GGML types the CPU kernel multiplies; the rest keep
    the model dtype and are dequantized as they load (logged, with why). Returns the
    modules kept per type combination (``Q4_K`` or ``Q4_K/Q6_K``: a fused layer's parts)."""
    from kvpilot.engine.model.layers.gguf_linear import (
        qtype_name,
        use_gguf_embedding,
        use_gguf_weight,
    )

    part_types = checkpoint.layer_part_types()
    if model.tp.world_size > 1:
        logger.info("GGUF %s: every weight dequantized at load to the model dtype: the quantized "
                    "layers run on one rank only (tensor parallelism %d splits them)",
                    checkpoint.path.name, model.tp.world_size)
        return {}
    if device.type != "cpu":
        logger.info("GGUF %s: every weight dequantized at load to the model dtype: the GGUF matmul "
                    "kernel is CPU-only (device %s)", checkpoint.path.name, device)
        return {}
    modules = dict(model.named_modules())
    kept: dict[str, int] = {}
    dequantized: dict[str, list[str]] = {}
    for name, parts in part_types.items():
        module = modules.get(name)
        if module is None or not hasattr(module, "gguf"):
            continue
        qtypes = [parts[k] for k in sorted(parts, key=lambda k: -1 if k is None else k)]
        label = "/".join(dict.fromkeys(qtype_name(q) for q in qtypes))
        if name in ("embed_tokens", "lm_head"):
            reason = use_gguf_embedding(module, qtypes[0], device, float32_q8=float32_q8)
        else:
            reason = use_gguf_weight(module, qtypes[0] if len(set(qtypes)) == 1 else qtypes, device,
                                     float32_q8=float32_q8)
        if reason is None:
            kept[label] = kept.get(label, 0) + 1
        else:
            dequantized.setdefault(f"{label} ({reason})", []).append(name)
    for why, names in dequantized.items():
        logger.info("GGUF %s: %d weight(s) dequantized at load: %s, e.g. %s",
                    checkpoint.path.name, len(names), why, ", ".join(names[:3]))
    return kept


def _log_gguf_bytes(checkpoint: Any, model: nn.Module, shapes: dict[str, tuple[int, ...]],
                    kept: dict[str, int]) -> None:
    """The load log's weight bytes: resident vs the file's tensor bytes vs a float32 load."""
    from kvpilot.engine.model.gguf.weights import resident_weight_bytes

    resident = resident_weight_bytes(model)
    float32 = 4 * sum(math.prod(s) for s in shapes.values())
    file_bytes = checkpoint.file_tensor_bytes()
    held = ", ".join(f"{n} {label}" for label, n in sorted(kept.items())) or "none"
    logger.info("GGUF %s: resident weights %.1f MB = %.2fx the file's tensor bytes (%.1f MB); a float32 "
                "load holds %.1f MB (%.2fx). Kept as GGUF blocks: %s", checkpoint.path.name,
                resident / 1e6, resident / file_bytes, file_bytes / 1e6, float32 / 1e6,
                float32 / file_bytes, held)


def _use_fp8_weights(model: LlamaForCausalLM, config: Fp8WeightConfig, first_layer: int = 0) -> None:
    """FP8 storage for the linear layers the checkpoint quantized (not those it ignores)."""
    for i, layer in enumerate(model.layers, start=first_layer):
        for engine_name, sources in _LINEARS.items():
            quantized = {config.quantizes(f"model.layers.{i}.{src}") for src in sources}
            if len(quantized) != 1:
                raise ValueError(f"layer {i}: {', '.join(sources)} must be all FP8 or all unquantized "
                                 f"(they are fused into one matmul)")
            if quantized.pop():
                use_fp8_weight(layer.get_submodule(engine_name), config)


def _materialize_buffers(model: LlamaForCausalLM, cfg: ArchConfig, max_model_len: int,
                         first_layer: int = 0) -> None:
    rotaries = layer_rotaries(cfg, max_model_len)[first_layer:first_layer + len(model.layers)]
    for layer, rotary in zip(model.layers, rotaries, strict=True):
        attn = layer.self_attn
        attn.rotary = rotary
        attn.k_scale = torch.tensor(1.0)
        attn.v_scale = torch.tensor(1.0)


def prepare_for_device(model: torch.nn.Module, device: torch.device, backend: AttentionBackend,
                       dtype: torch.dtype, has_head: bool = True) -> None:
    """The loaded model's kernels for ``device`` and ``backend``: on CPU a transposed (or
    packed) LM head (``has_head``), packed projections and the parameters in huge pages
    (``huge_pages``: every decode step streams them); the Triton or compiled CPU layer ops
    (not under the pure-torch reference backend)."""
    if device.type == "cpu" and has_head:
        model.use_transposed_output_weight()
    if device.type == "cpu":
        model.use_packed_weights()
        huge_pages.gather_parameters(model)
    if backend.name == "triton":
        model.use_triton_kernels()
    elif backend.name == "cpu":   # the compiled CPU path (not the pure-torch reference)
        model.use_cpu_layer_ops(dtype)
