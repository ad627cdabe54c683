"""A GGUF file's tensors as the loader's sources (``loader.load_model``).

Each tensor comes as a ``GGUFWeight``: its rows exactly as stored (quantized blocks or
floats), already in HF's row order (``tensor_names``), its GGML type and its logical
shape. ``place_tensor`` puts one into the engine's module: a layer given GGUF storage
before loading (``layers.gguf_linear.use_gguf_weight`` / ``use_gguf_embedding``, chosen
by the loader from ``layer_part_types``) takes the raw rows as they are (the rows of fused
q/k/v and gate/up parts are whole GGUF rows); any other parameter gets the tensor
dequantized to its dtype with ``gguf.quants.dequantize`` (llama.cpp's reference decoder).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from kvpilot.contract.arch_config import ArchConfig
from kvpilot.contract.gguf import BLOCK_TENSOR, IGNORED, KEPT_WHOLE, LINEAR_KINDS
from kvpilot.engine.model.gguf.files import open_reader
from kvpilot.engine.model.gguf.tensor_names import map_tensor, rotary_row_order
from kvpilot.engine.model.param_names import param_target

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GGUFWeight:
    """One GGUF tensor, rows as stored (HF row order), not yet decoded."""

    name: str                  # the GGUF name
    qtype: Any                 # gguf.GGMLQuantizationType
    shape: tuple[int, ...]     # logical shape, torch order ([rows, columns])
    raw: np.ndarray            # [rows, bytes per row] (quantized) or [rows, columns] (float)
    shift: float = 0.0         # subtracted after decoding (Gemma norms)

    def get_shape(self) -> tuple[int, ...]:
        return self.shape

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    def dequantize(self) -> torch.Tensor:
        """The values in float32, with the shift undone."""
        from gguf.quants import dequantize

        values = np.ascontiguousarray(dequantize(self.raw, self.qtype))
        if not values.flags.writeable:   # F32 comes back as the read-only memory map itself
            values = values.copy()
        values = torch.from_numpy(values).reshape(self.shape)
        return values - self.shift if self.shift else values


class GGUFCheckpoint:
    """The tensors of GGUF file ``path`` under HF names, for ``cfg``'s model."""

    def __init__(self, path: str | Path, cfg: ArchConfig) -> None:
        self.path = Path(path)
        self.reader = open_reader(path)
        field = self.reader.fields["general.architecture"]
        self.architecture = field.contents()
        self.cfg = cfg

    def _mapped(self) -> Iterator[tuple[Any, Any]]:
        for tensor in self.reader.tensors:
            if tensor.name in IGNORED:
                logger.info("GGUF tensor %s ignored (the engine computes it from the config)", tensor.name)
                continue
            yield tensor, map_tensor(tensor.name, self.architecture, self.cfg.num_attention_heads,
                                     self.cfg.num_key_value_heads)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """HF name -> shape of every tensor, from the header (unknown names as they are)."""
        return {(m.hf_name if m else t.name): tuple(int(n) for n in reversed(t.shape.tolist()))
                for t, m in self._mapped()}

    def tensors(self) -> Iterator[tuple[str, GGUFWeight]]:
        for tensor, mapping in self._mapped():
            shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
            raw = tensor.data.reshape(shape[0], -1) if len(shape) > 1 else tensor.data
            if mapping is None:
                yield tensor.name, GGUFWeight(tensor.name, tensor.tensor_type, shape, raw)
                continue
            if mapping.rotary_heads is not None:
                raw = raw[rotary_row_order(shape[0], mapping.rotary_heads)]
            yield mapping.hf_name, GGUFWeight(tensor.name, tensor.tensor_type, shape, raw, mapping.shift)

    def linear_types(self) -> dict[str, set[str]]:
        """Engine linear layer (``layers.0.self_attn.qkv_proj``, ...) -> the GGML type names
        of the GGUF weights fused into it: where there is one type the layer can hold them
        quantized (``use_gguf_weight`` on the meta-device model, before loading)."""
        types: dict[str, set[str]] = {}
        for tensor, mapping in self._mapped():
            m = BLOCK_TENSOR.match(tensor.name)
            if mapping is not None and m is not None and m.group(2) in LINEAR_KINDS and m.group(3) == "weight":
                target, _ = param_target(mapping.hf_name)
                types.setdefault(target.removesuffix(".weight"), set()).add(tensor.tensor_type.name)
        return types

    def layer_part_types(self) -> dict[str, dict[int | None, int]]:
        """Engine module (``layers.0.self_attn.qkv_proj``, ``embed_tokens``, ``lm_head``) ->
        fused part (None: the whole weight) -> GGML type id of the GGUF weight loaded into
        it, for the decoder's linear layers, the token embedding and the LM head."""
        types: dict[str, dict[int | None, int]] = {}
        for tensor, mapping in self._mapped():
            m = BLOCK_TENSOR.match(tensor.name)
            linear = m is not None and m.group(2) in LINEAR_KINDS and m.group(3) == "weight"
            if mapping is not None and (linear or tensor.name in KEPT_WHOLE):
                target, shard = param_target(mapping.hf_name)
                types.setdefault(target.removesuffix(".weight"), {})[shard] = int(tensor.tensor_type)
        return types

    def file_tensor_bytes(self) -> int:
        """Bytes of all tensor data in the file."""
        return sum(int(t.n_bytes) for t in self.reader.tensors)


def place_tensor(module: nn.Module, param_name: str, src: GGUFWeight, shard: int | None,
                 load_one) -> None:
    """Put GGUF tensor ``src`` into ``module``'s ``param_name`` (part ``shard`` of a fused
    layer): a weight the layer keeps as GGUF blocks (``module.gguf`` set) takes
    ``src.raw`` as stored; anything else is dequantized to the parameter's dtype through
    ``load_one`` (the loader's copy of one tensor). The tensors kept are those
    ``contract.gguf.keeps_quantized`` names (the planner counts by that rule)."""
    if param_name == "weight" and getattr(module, "gguf", None) is not None:
        from kvpilot.engine.model.layers.gguf_linear import load_gguf_weight

        if src.shift:
            raise ValueError(f"GGUF tensor {src.name} is stored shifted; it cannot stay in blocks")
        raw = src.raw if src.raw.flags.writeable else np.array(src.raw)   # torch wants writable memory
        load_gguf_weight(module, raw, int(src.qtype), shard)
        return
    load_one(module, param_name, src.dequantize(), shard)


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes the model's parameters hold (the embedding once when tied to the LM head)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total
