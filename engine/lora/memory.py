"""What adapter slots cost (torch-free): the engine shrinks the KV budget by it, with the
formula the planner uses (``kvpilot.contract.lora_slots``)."""

from __future__ import annotations

from kvpilot.contract.arch_config import ArchConfig
from kvpilot.contract.constants import MODEL_DTYPE_BYTES
from kvpilot.contract.lora_slots import lora_slot_bytes
from kvpilot.engine.lora.config import LoRAConfig


def _slot_bytes(arch: ArchConfig, config: LoRAConfig, model_dtype: str, num_slots: int) -> int:
    dtype_bytes = MODEL_DTYPE_BYTES[config.dtype_name(model_dtype)]
    return lora_slot_bytes(arch, config.max_lora_rank, dtype_bytes, num_slots)


def lora_device_bytes(arch: ArchConfig, config: LoRAConfig, model_dtype: str) -> int:
    """The device slots (``max_loras`` of them)."""
    return _slot_bytes(arch, config, model_dtype, config.max_loras)


def lora_host_bytes(arch: ArchConfig, config: LoRAConfig, model_dtype: str) -> int:
    """Host memory for ``max_cpu_loras`` adapters of the largest rank (an upper bound)."""
    return _slot_bytes(arch, config, model_dtype, config.host_capacity)
