"""The device memory LoRA adapter slots take, as the engine counts it (torch-free).

With ``--enable-lora`` the engine allocates ``max_loras`` device slots, each
``max_lora_rank`` wide, for every targeted projection (q, k, v, o, gate, up, down) of
every layer: A ``[rank, in]`` and B ``[rank, out]``::

    LoRA bytes = max_loras x max_lora_rank x sum(in + out) of the 7 projections x layers x dtype bytes

and subtracts them from the KV budget before sizing the cache. The shapes and the product
are the engine's own (``kvpilot.contract.lora_slots``: ``projection_shapes``,
``lora_slot_bytes``), so the planner's figure is the engine's
byte for byte (``tests/operator/test_planner_lora.py``). The engine serves LoRA on one GPU
per replica only (no tensor parallelism).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.contract.lora_slots import ProjectionSizes, lora_slot_bytes, projection_shapes
from kvpilot.operator.planner.model_spec import ModelSpec

DEFAULT_MAX_LORA_RANK = 16   # the engine's --max-lora-rank default


@dataclass(frozen=True, slots=True)
class LoRASlots:
    """``max_loras`` device slots of ``max_lora_rank`` for ``num_layers`` layers."""

    max_loras: int
    max_lora_rank: int
    dtype: str
    dtype_bytes: int
    per_layer: int          # sum(in + out) of the targeted projections of one layer
    num_layers: int
    num_bytes: int

    def derivation(self) -> str:
        return (f"LoRA slots per GPU = {self.max_loras} max_loras x rank {self.max_lora_rank} x "
                f"{self.per_layer:,} (sum of in + out of q, k, v, o, gate, up, down) x "
                f"{self.num_layers} layers x {self.dtype_bytes} B ({self.dtype}) = {self.num_bytes:,} B, "
                "taken from the KV budget")


def lora_slots(model: ModelSpec, max_loras: int | None, max_lora_rank: int | None,
               num_layers: int | None = None) -> LoRASlots | None:
    """The slots of ``max_loras`` adapters (None or 0: LoRA off) in the model's dtype;
    ``num_layers``: a pipeline stage's share (None: all layers)."""
    if not max_loras:
        return None
    rank = max_lora_rank or DEFAULT_MAX_LORA_RANK
    layers = num_layers or model.num_layers
    arch = ProjectionSizes(model.num_attention_heads, model.num_kv_heads, model.head_dim, model.hidden_size,
                      model.intermediate_size, layers)
    per_layer = sum(i + o for i, o in projection_shapes(arch).values())
    num_bytes = lora_slot_bytes(arch, rank, model.dtype_bytes, max_loras)
    return LoRASlots(max_loras, rank, model.dtype, model.dtype_bytes, per_layer, layers, num_bytes)
