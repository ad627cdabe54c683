"""The device memory of LoRA adapter slots (torch-free): the engine takes it from the KV
budget before sizing the cache, and the planner counts it the same way.

With ``--enable-lora`` the engine holds ``max_loras`` slots, each ``max_lora_rank`` wide,
for every targeted projection of every layer: A ``[rank, in]`` and B ``[rank, out]``::

    LoRA bytes = slots x max_lora_rank x sum(in + out) of the 7 projections x layers x dtype bytes
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.contract.arch_config import ArchConfig

# PEFT's module names of the projections kvpilot applies adapters to, in layer order.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTENTION_MODULES + MLP_MODULES


@dataclass(frozen=True, slots=True)
class ProjectionSizes:
    """The architecture numbers the projections' shapes follow, where there is no
    ``ArchConfig`` (which has them under the same names): the planner's model."""

    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int


def projection_shapes(arch: ArchConfig | ProjectionSizes) -> dict[str, tuple[int, int]]:
    """``(in_features, out_features)`` of each targeted projection of one layer."""
    q = arch.num_attention_heads * arch.head_dim
    kv = arch.num_key_value_heads * arch.head_dim
    h, inter = arch.hidden_size, arch.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def lora_slot_bytes(arch: ArchConfig | ProjectionSizes, max_lora_rank: int, dtype_bytes: int, num_slots: int) -> int:
    """Bytes of ``num_slots`` slots of rank ``max_lora_rank`` over all of ``arch``'s layers,
    at ``dtype_bytes`` per element."""
    per_layer = sum(i + o for i, o in projection_shapes(arch).values())
    return num_slots * max_lora_rank * per_layer * arch.num_hidden_layers * dtype_bytes
