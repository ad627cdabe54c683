"""What adapter slots cost (torch-free): the engine shrinks the KV budget by it and the
planner can count it the same way."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpilot.engine.core.constants import MODEL_DTYPE_BYTES
from kvpilot.engine.lora.config import LoRAConfig, projection_shapes

if TYPE_CHECKING:
    from kvpilot.engine.model.hf_config import ArchConfig


def lora_slot_bytes(arch: ArchConfig, config: LoRAConfig, model_dtype: str, num_slots: int) -> int:
    """``num_slots x max_lora_rank x sum(in + out) of the targeted projections x layers x
    dtype bytes``: each slot holds A ``[rank, in]`` and B ``[rank, out]`` per projection."""
    per_layer = sum(i + o for i, o in projection_shapes(arch).values())
    dtype_bytes = MODEL_DTYPE_BYTES[config.dtype_name(model_dtype)]
    return num_slots * config.max_lora_rank * per_layer * arch.num_hidden_layers * dtype_bytes


def lora_device_bytes(arch: ArchConfig, config: LoRAConfig, model_dtype: str) -> int:
    """The device slots (``max_loras`` of them)."""
    return lora_slot_bytes(arch, config, model_dtype, config.max_loras)


def lora_host_bytes(arch: ArchConfig, config: LoRAConfig, model_dtype: str) -> int:
    """Host memory for ``max_cpu_loras`` adapters of the largest rank (an upper bound)."""
    return lora_slot_bytes(arch, config, model_dtype, config.host_capacity)
