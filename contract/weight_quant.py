"""A checkpoint's weight quantization, read from ``config.json`` (torch-free: the engine
and the planner read it with this one parser).

Two FP8 formats are served (float8 e4m3 weights, one float scale per group of weights,
dequantized as ``weight x scale``):

- ``quant_method: compressed-tensors`` with float 8-bit weights (llm-compressor's
  "FP8" / "FP8-dynamic" checkpoints): ``weights.strategy`` ``tensor`` (one scale per
  tensor), ``channel`` (one per output row) or ``block`` (``block_structure``); the
  scales are the ``weight_scale`` tensors; modules in ``ignore`` stay unquantized.
- ``quant_method: fp8`` (transformers' fine-grained FP8, Qwen3's and DeepSeek's official
  FP8 checkpoints): ``weight_block_size [n, k]`` gives one scale per n x k block in the
  ``weight_scale_inv`` tensors (a multiplier despite its name); without a block size one
  ``weight_scale`` per tensor. ``modules_to_not_convert`` stay unquantized.

Activation quantization settings (dynamic per-token, or static ``input_scale``) are not
needed for correctness: the engine dequantizes the weights, or on a capable GPU quantizes
activations dynamically per token itself; static ``input_scale`` tensors are ignored.
Any other method (AWQ, GPTQ, bitsandbytes, integer compressed-tensors, ...) is refused
with its name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

QUANT_METHODS = ("compressed-tensors", "fp8")
FP8_STRATEGIES = ("tensor", "channel", "block")


@dataclass(frozen=True, slots=True)
class Fp8WeightConfig:
    """FP8 (e4m3) weights of the decoder's linear layers.

    Args:
        method: the checkpoint's ``quant_method``.
        strategy: ``tensor``, ``channel`` or ``block`` scales.
        block_size: ``(rows, columns)`` of a scale's block (``block`` only).
        scale_name: the checkpoint's suffix of the scale tensors.
        ignore: module names (or ``re:`` patterns) left unquantized.
    """

    method: str
    strategy: str
    block_size: tuple[int, int] | None = None
    scale_name: str = "weight_scale"
    ignore: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.strategy not in FP8_STRATEGIES:
            raise ValueError(f"unsupported FP8 weight strategy {self.strategy!r}; "
                             f"supported: {', '.join(FP8_STRATEGIES)}")
        if (self.strategy == "block") != (self.block_size is not None):
            raise ValueError("block-wise FP8 scales need a block size (and only they have one)")
        if self.block_size is not None and min(self.block_size) < 1:
            raise ValueError(f"FP8 block size must be positive, got {self.block_size}")

    def quantizes(self, module_name: str) -> bool:
        """Whether the checkpoint module ``module_name`` (``model.layers.0.mlp.down_proj``)
        holds FP8 weights."""
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.fullmatch(entry[3:], module_name):
                    return False
            elif module_name == entry or module_name.endswith("." + entry):
                return False
        return True

    @property
    def name(self) -> str:
        """Short label: ``fp8`` and the scale layout (for logs and the planner)."""
        if self.block_size is not None:
            return f"fp8 ({self.method}, {self.block_size[0]}x{self.block_size[1]} blocks)"
        return f"fp8 ({self.method}, per-{self.strategy} scales)"


def parse_quantization_config(cfg: dict[str, Any]) -> Fp8WeightConfig | None:
    """The weight quantization of a config.json dict; None for an unquantized checkpoint.

    ValueError names the method (or the compressed-tensors scheme) when it is not served.
    """
    quant = cfg.get("quantization_config")
    if not quant:
        return None
    if not isinstance(quant, dict):
        raise ValueError("config.json quantization_config must be an object")
    method = str(quant.get("quant_method", "")).lower()
    if method == "fp8":
        return _fine_grained_fp8(quant)
    if method == "compressed-tensors":
        return _compressed_tensors(quant)
    raise ValueError(f"unsupported quantization method {method or '(none)'!r} in config.json; "
                     f"kvpilot serves FP8 weights only: {', '.join(QUANT_METHODS)}")


def _fine_grained_fp8(quant: dict[str, Any]) -> Fp8WeightConfig:
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"unsupported fp8 format {fmt!r} (quant_method fp8): only e4m3 weights")
    block = quant.get("weight_block_size")
    ignore = tuple(quant.get("modules_to_not_convert") or ())
    if block:
        return Fp8WeightConfig("fp8", "block", (int(block[0]), int(block[1])), "weight_scale_inv", ignore)
    return Fp8WeightConfig("fp8", "tensor", None, "weight_scale", ignore)


def _compressed_tensors(quant: dict[str, Any]) -> Fp8WeightConfig:
    groups = list((quant.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ValueError(f"unsupported compressed-tensors checkpoint: {len(groups)} config groups "
                         "(kvpilot serves one FP8 weight scheme for all Linear layers)")
    weights = groups[0].get("weights") or {}
    kind, bits = weights.get("type"), weights.get("num_bits")
    if kind != "float" or bits != 8:
        raise ValueError(f"unsupported compressed-tensors weight scheme ({kind} {bits}-bit, format "
                         f"{quant.get('format')!r}): kvpilot serves float 8-bit weights only")
    strategy = weights.get("strategy", "tensor")
    block = weights.get("block_structure") if strategy == "block" else None
    if strategy == "block" and not block:
        raise ValueError("compressed-tensors block strategy without block_structure")
    return Fp8WeightConfig("compressed-tensors", strategy, tuple(int(b) for b in block) if block else None,
                           "weight_scale", tuple(quant.get("ignore") or ()))
