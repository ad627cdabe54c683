"""Adapter slots on the device and the wrapper that adds their low-rank delta.

All tokens of a step are one flat batch ``[num_tokens, in]``; each token row belongs to
one request, so to one adapter or to none (the base model). ``LoRASlots`` holds, per
layer and targeted module, every slot's A stacked as ``[slots * max_rank, in]`` (those of
a fused projection's parts stacked once more, so one product serves q, k and v) and B^T
as ``[slots * max_rank, out]`` (a smaller rank is zero-padded, an untargeted module is
zero). One step's delta is then two dense products over all slots with the rank-space
activations of each row multiplied by a per-row, per-slot factor, the adapter's scaling
for the row's own slot and 0 for the others::

    delta = ((x @ A_all^T) * mask[row, slot]) @ B_all

so rows of different adapters and base rows share one forward (the punica / S-LoRA idea in
pure torch: the rows' gathered low-rank products, without a Python loop over adapters).
Masked terms are exact zeros, so a base row gets exactly its base output.

``LoRALinear`` wraps a projection of the built model (``apply_lora``), so the model
classes stay as they are; fused q/k/v and gate/up projections get one delta per part.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from kvpilot.engine.lora.checkpoint import LoRAWeights

# The model's projections and the PEFT modules whose outputs they hold, in order.
FUSED_PROJECTIONS = {
    ("self_attn", "qkv_proj"): ("q_proj", "k_proj", "v_proj"),
    ("self_attn", "o_proj"): ("o_proj",),
    ("mlp", "gate_up_proj"): ("gate_proj", "up_proj"),
    ("mlp", "down_proj"): ("down_proj",),
}
_MODULES_OF = {proj: modules for (_, proj), modules in FUSED_PROJECTIONS.items()}


class LoRASlots:
    """``num_slots`` adapters of rank <= ``max_rank`` on ``device``.

    Args:
        shapes: ``(in, out)`` per targeted module (``contract.lora_slots.projection_shapes``).
    """

    def __init__(self, shapes: dict[str, tuple[int, int]], num_layers: int, num_slots: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        self.num_slots, self.max_rank, self.dtype, self.device = num_slots, max_rank, dtype, device
        self._shapes, self._num_layers = shapes, num_layers
        # A of a fused projection's parts stacked, so one product serves them all:
        # a[(layer, proj)] is [parts * slots * rank, in]; b[(layer, module)] is [slots * rank, out].
        # Empty until ``allocate`` (after the memory profile, which counts them by formula).
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        self.scaling = [0.0] * num_slots
        # [num_tokens, 1, num_slots, 1]: this step's factor per row and slot; None: no row
        # of the step has an adapter (the projections run as the base model's).
        self.mask: torch.Tensor | None = None

    def allocate(self) -> None:
        """Allocate the slots' device memory (zeroed)."""
        width, shapes, dtype, device = self.num_slots * self.max_rank, self._shapes, self.dtype, self.device
        self.a = {(layer, proj): torch.zeros(len(modules) * width, shapes[modules[0]][0],
                                             dtype=dtype, device=device)
                  for layer in range(self._num_layers) for (_, proj), modules in FUSED_PROJECTIONS.items()}
        self.b = {(layer, m): torch.zeros(width, fan_out, dtype=dtype, device=device)
                  for layer in range(self._num_layers) for m, (_, fan_out) in shapes.items()}

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.a.values(), *self.b.values()))

    def load(self, slot: int, weights: LoRAWeights) -> None:
        """Copy an adapter into ``slot`` (zeroing what it does not target)."""
        width, rank = self.num_slots * self.max_rank, weights.rank
        start = slot * self.max_rank
        for (layer, proj), a in self.a.items():
            for part, module in enumerate(_MODULES_OF[proj]):
                base = part * width + start
                b = self.b[(layer, module)]
                a[base:base + self.max_rank].zero_()
                b[start:start + self.max_rank].zero_()
                pair = weights.weights.get((layer, module))
                if pair is not None:
                    a[base:base + rank].copy_(pair[0], non_blocking=True)
                    b[start:start + rank].copy_(pair[1], non_blocking=True)
        self.scaling[slot] = weights.scaling

    def set_token_slots(self, token_slots: np.ndarray | None) -> None:
        """This step's slot per token row (-1: the base model); None or all -1: no delta."""
        if token_slots is None or not (token_slots >= 0).any():
            self.mask = None
            return
        num_tokens = len(token_slots)
        factors = np.zeros((num_tokens, self.num_slots), dtype=np.float32)
        rows = np.flatnonzero(token_slots >= 0)
        slots = token_slots[rows]
        factors[rows, slots] = np.asarray(self.scaling, dtype=np.float32)[slots]
        self.mask = torch.from_numpy(factors).to(self.device, self.dtype)[:, None, :, None]

    def delta(self, x: torch.Tensor, layer: int, proj: str) -> torch.Tensor:
        """The adapters' output of projection ``proj`` (its parts concatenated, as the fused
        projection's output) for every row of ``x`` ``[num_tokens, in]``."""
        modules = _MODULES_OF[proj]
        num_tokens = x.shape[0]
        xa = x @ self.a[(layer, proj)].t()                       # [tokens, parts * slots * rank]
        xa = xa.view(num_tokens, len(modules), self.num_slots, self.max_rank) * self.mask
        parts = [xa[:, p].reshape(num_tokens, -1) @ self.b[(layer, m)] for p, m in enumerate(modules)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


class LoRALinear(nn.Module):
    """``base(x)`` plus the adapters' delta of projection ``proj`` (one PEFT module, or the
    parts of a fused projection in their order)."""

    def __init__(self, base: nn.Module, slots: LoRASlots, layer: int, proj: str) -> None:
        super().__init__()
        self.base = base
        self.slots = slots
        self.layer = layer
        self.proj = proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        slots = self.slots
        if slots.mask is None:
            return y
        return y + slots.delta(x.to(slots.dtype), self.layer, self.proj).to(y.dtype)


def apply_lora(model: nn.Module, slots: LoRASlots) -> None:
    """Wrap every targeted projection of ``model``'s decoder layers (Llama family, Gemma 3)."""
    for i, layer in enumerate(model.layers):
        for block_name, proj in FUSED_PROJECTIONS:
            block = getattr(layer, block_name, None)
            base = getattr(block, proj, None)
            if base is None:
                raise ValueError(f"LoRA is not implemented for {type(model).__name__}: layer {i} "
                                 f"has no {block_name}.{proj}")
            if not isinstance(base, LoRALinear):
                setattr(block, proj, LoRALinear(base, slots, i, proj))
