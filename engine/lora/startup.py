"""LoRA at engine start-up: the adapter registry over ``max_loras`` device slots.

Built before the model runner, which wraps the model's projections around its slots,
with the ``--lora-modules`` read (a bad one stops start-up); its device slots are
allocated after the memory profile (``allocate_slots``: ``device_bytes`` is what they
take from the KV cache's budget). ``LLMEngine`` calls both once; torch-heavy imports stay
inside them, so an engine without LoRA never loads them.
"""

from __future__ import annotations

import logging

import torch

from kvpilot.engine.config import ModelConfig

logger = logging.getLogger(__name__)


def device_bytes(lora_config, model_config: ModelConfig) -> int:
    """Device memory the adapter slots take (0 with LoRA off)."""
    if lora_config is None:
        return 0
    from kvpilot.engine.lora.memory import lora_device_bytes

    return lora_device_bytes(model_config.arch, lora_config, model_config.dtype)


def start_lora(lora_config, model_config: ModelConfig, device: torch.device):
    """(the adapter registry, its slots not yet allocated, and its request counters), or
    (None, None) when LoRA is off."""
    if lora_config is None:
        return None, None
    from kvpilot.contract.lora_slots import projection_shapes
    from kvpilot.engine.lora.checkpoint import read_peft_adapter
    from kvpilot.engine.lora.counters import LoRACounters
    from kvpilot.engine.lora.layers import LoRASlots
    from kvpilot.engine.lora.registry import LoRARegistry
    from kvpilot.engine.model.runner import TORCH_DTYPES

    arch = model_config.arch
    shapes = projection_shapes(arch)
    dtype = TORCH_DTYPES[lora_config.dtype_name(model_config.dtype)]
    slots = LoRASlots(shapes, arch.num_hidden_layers, lora_config.max_loras, lora_config.max_lora_rank,
                      dtype, device)
    registry = LoRARegistry(
        lambda path: read_peft_adapter(path, shapes, arch.num_hidden_layers,
                                       lora_config.max_lora_rank, dtype),
        slots, lora_config.host_capacity)
    for module in lora_config.modules:
        registry.add(module.name, module.path, module.base_model_name)
    return registry, LoRACounters()


def allocate_slots(registry, lora_config) -> None:
    """The registry's device slots, once the KV cache's budget is known."""
    slots = registry.slots
    slots.allocate()
    logger.info("LoRA: %d device slots of rank %d (%.1f MiB), %d adapters in host memory at most",
                lora_config.max_loras, lora_config.max_lora_rank, slots.num_bytes / (1 << 20),
                lora_config.host_capacity)
