"""Reading a PEFT LoRA checkpoint and checking it against the base model.

A PEFT checkpoint is a directory with ``adapter_config.json`` (``r``, ``lora_alpha``,
``use_rslora``, ``target_modules``, ...) and ``adapter_model.safetensors`` holding, per
targeted module, ``...layers.{i}.{self_attn|mlp}.{proj}.lora_A.weight`` ``[r, in]`` and
``lora_B.weight`` ``[out, r]``. PEFT's forward is ``base(x) + B(A(x)) * scaling`` with
``scaling = lora_alpha / r`` (rsLoRA: ``lora_alpha / sqrt(r)``). Anything kvpilot would
not apply exactly as PEFT does (DoRA, LoRA biases, embedding or LM-head adapters,
per-module rank or alpha patterns, extra trained modules) is refused with a ``LoRACheckpointError`` naming it, as are a rank above
``max_lora_rank`` and tensors whose shapes do not fit the base model.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from kvpilot.contract.lora_slots import TARGET_MODULES

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoRACheckpointError(ValueError):
    """The adapter cannot be served (missing, malformed, too large, wrong base model)."""


@dataclass(frozen=True, slots=True)
class LoRAWeights:
    """One adapter in host memory: ``weights[(layer, module)] = (A [r, in], B^T [r, out])``
    in the slots' dtype; ``scaling`` multiplies the rank-space activations."""

    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    digest: str                     # sha256 of the config and the weights file

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for a, b in self.weights.values())


def _config(path: Path) -> dict:
    file = path / CONFIG_FILE
    if not file.is_file():
        raise LoRACheckpointError(f"{path} holds no {CONFIG_FILE} (not a PEFT LoRA checkpoint)")
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LoRACheckpointError(f"{file} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise LoRACheckpointError(f"{file} must hold a JSON object")
    return config


def _check_config(config: dict, max_rank: int) -> tuple[int, float]:
    """``(rank, scaling)``; LoRACheckpointError for what kvpilot cannot apply."""
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise LoRACheckpointError(f"peft_type {peft_type!r} is not LORA")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRACheckpointError(f"adapter_config.json: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoRACheckpointError(f"the adapter's rank {rank} exceeds --max-lora-rank {max_rank}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise LoRACheckpointError(f"adapter_config.json: lora_alpha must be a number, got {alpha!r}")
    unsupported = {
        "use_dora": bool(config.get("use_dora")),
        "lora_bias": bool(config.get("lora_bias")),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
        "bias": config.get("bias", "none") not in (None, "none"),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
        "modules_to_save": bool(config.get("modules_to_save")),
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise LoRACheckpointError(f"adapter_config.json sets {', '.join(bad)}, which kvpilot does not "
                                  "serve (plain LoRA on q/k/v/o and the MLP projections only)")
    targets = config.get("target_modules")
    if isinstance(targets, list | tuple):
        extra = sorted(set(targets) - set(TARGET_MODULES))
        if extra:
            raise LoRACheckpointError(f"the adapter targets {extra}; kvpilot serves adapters on "
                                      f"{list(TARGET_MODULES)} only")
    scale = math.sqrt(rank) if config.get("use_rslora") else rank
    return rank, float(alpha) / scale


def _digest(config: dict, weights_file: Path) -> str:
    h = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    with weights_file.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_peft_adapter(path: str | Path, shapes: dict[str, tuple[int, int]], num_layers: int,
                      max_rank: int, dtype: torch.dtype) -> LoRAWeights:
    """The adapter at ``path`` checked against the base model.

    Args:
        shapes: ``(in, out)`` of each targeted projection (``contract.lora_slots.projection_shapes``).
        num_layers: the base model's layers.
        max_rank: ``--max-lora-rank``.
        dtype: the slots' dtype.
    Raises LoRACheckpointError naming what is wrong.
    """
    path = Path(path)
    if not path.is_dir():
        raise LoRACheckpointError(f"LoRA adapter directory {path} does not exist")
    config = _config(path)
    rank, scaling = _check_config(config, max_rank)
    weights_file = path / WEIGHTS_FILE
    if not weights_file.is_file():
        raise LoRACheckpointError(f"{path} holds no {WEIGHTS_FILE} (pickled adapter_model.bin "
                                  "is not loaded)")
    try:
        tensors = load_file(weights_file)
    except (SafetensorError, OSError, ValueError) as exc:
        raise LoRACheckpointError(f"{weights_file} is not a readable safetensors file: {exc}") from None
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None:
            raise LoRACheckpointError(f"{WEIGHTS_FILE}: tensor {key!r} is not a LoRA A/B weight of "
                                      f"{list(TARGET_MODULES)}")
        layer, module, side = int(match[1]), match[2], match[3]
        if module not in shapes:
            raise LoRACheckpointError(f"{WEIGHTS_FILE}: {key!r} targets {module!r}; kvpilot serves "
                                      f"adapters on {list(TARGET_MODULES)} only")
        if layer >= num_layers:
            raise LoRACheckpointError(f"{WEIGHTS_FILE}: {key!r} is for layer {layer}, but the base "
                                      f"model has {num_layers} layers")
        pairs.setdefault((layer, module), {})[side] = tensor
    if not pairs:
        raise LoRACheckpointError(f"{WEIGHTS_FILE} holds no LoRA weights")
    weights = {}
    for (layer, module), sides in sorted(pairs.items()):
        if set(sides) != {"A", "B"}:
            raise LoRACheckpointError(f"{WEIGHTS_FILE}: layer {layer} {module} has lora_{''.join(sides)} "
                                      "but not both lora_A and lora_B")
        a, b = sides["A"], sides["B"]
        fan_in, fan_out = shapes[module]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise LoRACheckpointError(
                f"{WEIGHTS_FILE}: layer {layer} {module} has lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}; rank {rank} on this base model needs {(rank, fan_in)} and "
                f"{(fan_out, rank)} (an adapter of another base model?)")
        if not (a.is_floating_point() and b.is_floating_point()):
            raise LoRACheckpointError(f"{WEIGHTS_FILE}: layer {layer} {module} is not floating point")
        weights[(layer, module)] = (a.to(dtype).contiguous(), b.t().to(dtype).contiguous())
    return LoRAWeights(rank, scaling, weights, _digest(config, weights_file))
