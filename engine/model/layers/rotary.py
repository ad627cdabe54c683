"""Rotary position embedding with the common scaling variants.

Inverse frequencies follow the published recipes (and transformers' implementations,
against which the tests check them): ``default``, ``linear`` (position interpolation),
``dynamic`` (NTK-aware: transformers only rescales once a sequence exceeds
``max_position_embeddings``, which a KV cache cannot follow mid-sequence, so the engine
keeps the unscaled frequencies that apply within that length), ``llama3`` (frequency-band interpolation) and
``yarn`` (ramped interpolation plus an attention temperature). Rotation is the
"rotate half" (non-interleaved) layout of HF Llama/Qwen checkpoints.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kvpilot.contract.arch_config import ArchConfig
from kvpilot.contract.rope import RopeConfig


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig, max_pos: int) -> torch.Tensor:
    old_len = rope.original_max_position_embeddings or max_pos
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(rope: RopeConfig, dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    base, factor = rope.theta, rope.factor
    original = rope.original_max_position_embeddings or max_pos
    attention = rope.attention_factor
    if attention is None:
        attention = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    inv_extrap, inv_interp = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    inv_freq = inv_interp * (1 - extrapolation_weight) + inv_extrap * extrapolation_weight
    return inv_freq, float(attention)


def compute_inv_freq(rope: RopeConfig, head_dim: int, max_pos: int) -> tuple[torch.Tensor, float, int]:
    """(inverse frequencies, attention scaling, rotary dim) for a rope config."""
    dim = int(head_dim * rope.partial_rotary_factor)
    scaling = 1.0
    if rope.rope_type == "yarn":
        inv_freq, scaling = _yarn(rope, dim, max_pos)
        return inv_freq, scaling, dim
    inv_freq = _base_inv_freq(rope.theta, dim)
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        inv_freq = _llama3(inv_freq, rope, max_pos)
    return inv_freq, scaling, dim


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """Applies rope to q and k of shape ``[num_tokens, heads, head_dim]`` at ``positions``."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_position: int, original_max_pos: int) -> None:
        super().__init__()
        inv_freq, scaling, self.rotary_dim = compute_inv_freq(rope, head_dim, original_max_pos)
        self.scaling = scaling
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._table_len = 0
        self._kernel = None
        self.register_buffer("cos_table", torch.empty(0), persistent=False)
        self.register_buffer("sin_table", torch.empty(0), persistent=False)
        self._ensure_table(max_position)

    def _ensure_table(self, length: int) -> None:
        if length <= self._table_len:
            return
        pos = torch.arange(length, dtype=torch.float32, device=self.inv_freq.device)
        freqs = pos[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_table = emb.cos() * self.scaling
        self.sin_table = emb.sin() * self.scaling
        self._table_len = length

    def use_kernel(self, kernel) -> None:
        """Rotate with ``kernel`` (``kvpilot.kernels.rotary.rotary_embedding``, or on CPU
        ``kvpilot.kernels.cpu_layer_ops.rotary_inplace``; in place)."""
        self._kernel = kernel

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._kernel is not None:
            return self._kernel(positions, q, k, self.cos_table, self.sin_table, self.rotary_dim)
        cos = self.cos_table[positions].to(q.dtype).unsqueeze(1)   # [T, 1, rotary_dim]
        sin = self.sin_table[positions].to(q.dtype).unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.rotary_dim == x.shape[-1]:
            return x * cos + _rotate_half(x) * sin
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim:]
        return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)


def layer_rotaries(cfg: ArchConfig, max_model_len: int) -> list[RotaryEmbedding]:
    """Each layer's rotary embedding (``ArchConfig.layer_rope``), one module per distinct
    rope: one for a Llama, two for Gemma 3 (local and global layers)."""
    built: dict[RopeConfig, RotaryEmbedding] = {}
    for i in range(cfg.num_hidden_layers):
        rope = cfg.layer_rope(i)
        if rope not in built:
            built[rope] = RotaryEmbedding(rope, cfg.head_dim, max(max_model_len, 1),
                                          cfg.max_position_embeddings)
    return [built[cfg.layer_rope(i)] for i in range(cfg.num_hidden_layers)]
