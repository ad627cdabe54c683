"""Fused per-layer CPU ops: residual add + RMSNorm (Llama's, Gemma's), rotary in place, SiLU(gate) * up, KV store.

A single-stream decode step on CPU spends about as long dispatching a decoder layer's small
torch ops (a norm is nine of them, rope fourteen) as in its matrix products. Each op here is
one call that does the arithmetic of the torch code it replaces with the same roundings
(``csrc/cpu_layer_ops.cpp`` says where), so float32 results match HF transformers' to
within an ulp and 16-bit ones to the bit in almost every element.

``load()`` builds the source like the paged-decode kernel (prebuilt in the engine image,
else compiled on first use into the kernel cache, ``kernel_cache``; None where it cannot be built,
and the layers keep their torch code). The launchers check what Python must (device and
dtype support, via ``supports_*``); shapes and strides are checked in C++ (``TORCH_CHECK``
raises a RuntimeError), which costs less per call than Python checks would on a path that
runs five times per layer per token. Each op has a pure-torch ``*_ref``.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import torch

from kvpilot.kernels.cpu_extension import load_cpu_extension
from kvpilot.kernels.cpu_isa import isa_variant

SOURCE = Path(__file__).parent / "csrc" / "cpu_layer_ops.cpp"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# No -ffast-math and no FMA contraction: the ops must round where the torch code rounds.
CFLAGS = ["-O3", "-ffp-contract=off"]
LDFLAGS = ("-lm",)


def variant(isa: str | None) -> tuple[str, list[str]]:
    """The module name and compiler flags of the ops for ``isa`` (None or unknown: baseline)."""
    return isa_variant("kvpilot_cpu_layer_ops", isa, CFLAGS)


@functools.cache
def load() -> ModuleType | None:
    """The compiled module (prebuilt, or built on the first call), or None if it cannot be built."""
    name, flags = variant(torch.backends.cpu.get_cpu_capability())
    return load_cpu_extension(name, SOURCE, flags, "fused CPU layer ops",
                              "norms, rotary and activations run as torch ops", LDFLAGS)


def _module() -> ModuleType:
    module = load()
    if module is None:
        raise RuntimeError("the fused CPU layer ops are not available on this machine")
    return module


def supports(x: torch.Tensor) -> bool:
    """Whether the ops take activations like ``x`` (a CPU tensor of float32, float16 or bfloat16)."""
    return x.device.type == "cpu" and x.dtype in DTYPES


def add_rms_norm(x: torch.Tensor,                  # [rows, hidden], rows contiguous
                 weight: torch.Tensor,             # [hidden], x's dtype
                 eps: float,
                 residual: torch.Tensor | None = None,   # [rows, hidden] like x
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``norm(x)``, or ``(norm(x + residual), x + residual)``: Llama's RMSNorm (float32 math,
    rounded to the dtype before the weight), new tensors; the inputs are left unchanged."""
    if not supports(x):
        raise ValueError(f"needs a CPU tensor of one of {DTYPES}; got {x.dtype} on {x.device}")
    out = _module().add_rms_norm(x, residual, weight, eps)
    return (out[0], out[1]) if residual is not None else out[0]


def add_rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                     residual: torch.Tensor | None = None):
    """The torch code ``add_rms_norm`` replaces (``RMSNorm.forward``'s)."""
    if residual is not None:
        x = x + residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    normed = weight * h.to(x.dtype)
    return (normed, x) if residual is not None else normed


def gemma_rms_norm(x: torch.Tensor,                 # [rows, dim] or [tokens, heads, dim], last dim contiguous
                   gain: torch.Tensor,              # [dim] float32: 1 + the norm's weight
                   eps: float,
                   residual: torch.Tensor | None = None,   # [rows, dim] like a 2-D x
                   ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``norm(x)``, or ``(norm(x + residual), x + residual)``: Gemma's RMSNorm (float32 math
    times ``gain``, rounded to the dtype once), new contiguous tensors; inputs left unchanged."""
    if not supports(x):
        raise ValueError(f"needs a CPU tensor of one of {DTYPES}; got {x.dtype} on {x.device}")
    out = _module().gemma_rms_norm(x, residual, gain, eps)
    return (out[0], out[1]) if residual is not None else out[0]


def gemma_rms_norm_ref(x: torch.Tensor, gain: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None):
    """The torch code ``gemma_rms_norm`` replaces (``GemmaRMSNorm.forward``'s, ``gain`` its
    ``1.0 + weight.float()``)."""
    if residual is not None:
        x = x + residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    normed = (h * gain).to(x.dtype)
    return (normed, x) if residual is not None else normed


def rotary_inplace(positions: torch.Tensor,   # [tokens] int64
                   q: torch.Tensor,           # [tokens, heads, head_dim], rotated in place
                   k: torch.Tensor,           # [tokens, kv_heads, head_dim], rotated in place
                   cos_table: torch.Tensor,   # [table_len, >= rotary_dim] float32
                   sin_table: torch.Tensor,   # [table_len, >= rotary_dim] float32
                   rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rope of the first ``rotary_dim`` dims of every head of q and k at
    ``positions`` (the tables hold each half twice, as ``RotaryEmbedding``'s do); returns
    ``(q, k)``, the same tensors."""
    if not supports(q):
        raise ValueError(f"needs a CPU tensor of one of {DTYPES}; got {q.dtype} on {q.device}")
    _module().rotary_inplace(positions, q, k, cos_table, sin_table, rotary_dim)
    return q, k


def rotary_ref(positions, q, k, cos_table, sin_table, rotary_dim):
    """The torch code ``rotary_inplace`` replaces (``RotaryEmbedding.forward``'s), out of place."""
    def rotate(x, cos, sin):
        rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
        half = rotary_dim // 2
        turned = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        return torch.cat((rot * cos + turned * sin, rest), dim=-1)

    cos = cos_table[positions, :rotary_dim].to(q.dtype).unsqueeze(1)
    sin = sin_table[positions, :rotary_dim].to(q.dtype).unsqueeze(1)
    return rotate(q, cos, sin), rotate(k, cos, sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:   # [rows, 2 * inner], rows contiguous
    """``silu(gate) * up`` of a fused projection's output ``[gate | up]``: ``[rows, inner]``."""
    if not supports(gate_up):
        raise ValueError(f"needs a CPU tensor of one of {DTYPES}; got {gate_up.dtype} on {gate_up.device}")
    return _module().silu_mul(gate_up)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def store_kv(key: torch.Tensor,            # [tokens, kv_heads, head_dim]
             value: torch.Tensor,          # [tokens, kv_heads, head_dim]
             kv_cache: torch.Tensor,       # [2, num_blocks, block_size, kv_heads, head_dim], key's dtype
             slot_mapping: torch.Tensor,   # [>= num_tokens] int64, -1: skip
             num_tokens: int | None = None,
             ) -> None:
    """Write the first ``num_tokens`` (None: ``len(slot_mapping)``) rows of K and V into
    their slots of ``kv_cache`` (of their dtype: no fp8 scaling)."""
    if not supports(key):
        raise ValueError(f"needs a CPU tensor of one of {DTYPES}; got {key.dtype} on {key.device}")
    _module().store_kv(key, value, kv_cache, slot_mapping,
                       slot_mapping.shape[0] if num_tokens is None else num_tokens)


def store_kv_ref(key, value, kv_cache, slot_mapping, num_tokens=None) -> None:
    flat = kv_cache.view(2, -1, kv_cache.shape[3], kv_cache.shape[4])
    n = slot_mapping.shape[0] if num_tokens is None else num_tokens
    key, value, slot_mapping = key[:n], value[:n], slot_mapping[:n]
    valid = slot_mapping >= 0
    flat[0].index_copy_(0, slot_mapping[valid], key[valid])
    flat[1].index_copy_(0, slot_mapping[valid], value[valid])
