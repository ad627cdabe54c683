"""Rotary position embedding ("rotate half", the HF Llama/Qwen layout), in place on q and k.

For each token at ``position`` and each head, the first ``rotary_dim`` dims of the head
are split into halves ``x1 | x2`` and become ``x1*cos - x2*sin | x2*cos + x1*sin``, with
``cos = cos_table[position, :rotary_dim / 2]`` (the engine's tables hold each half
twice, already multiplied by any attention scaling such as YaRN's); dims past
``rotary_dim`` (partial rotary) are left alone. One program rotates every query and key
head of one token, in float32, and stores in the tensors' dtype. Head sizes and head
counts that are not powers of two are padded with masks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels.fp8 import COMPUTE_DTYPES, check_kernel_device


@triton.jit
def _rotate_heads(x_ptr, stride_tok, stride_head, token, num_heads, cos, sin,
                  HALF: tl.constexpr, HALF_PADDED: tl.constexpr, HEADS_PADDED: tl.constexpr):
    heads = tl.arange(0, HEADS_PADDED)
    dims = tl.arange(0, HALF_PADDED)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < HALF)
    base = x_ptr + token * stride_tok + heads[:, None] * stride_head + dims[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(base, (x1 * cos[None, :] - x2 * sin[None, :]).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(base + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(x_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def rotary_kernel(
    positions_ptr,     # [num_tokens] int64
    q_ptr,             # [num_tokens, num_heads, head_dim], rotated in place
    k_ptr,             # [num_tokens, num_kv_heads, head_dim], rotated in place
    cos_ptr,           # [max_position, >= rotary_dim / 2] float32
    sin_ptr,           # [max_position, >= rotary_dim / 2] float32
    num_heads, num_kv_heads,
    stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_cs,
    HALF: tl.constexpr,             # rotary_dim // 2
    HALF_PADDED: tl.constexpr,      # power of two >= HALF
    Q_HEADS_PADDED: tl.constexpr,
    K_HEADS_PADDED: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF_PADDED)
    cos = tl.load(cos_ptr + pos * stride_cs + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_cs + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, stride_q_tok, stride_q_head, token, num_heads, cos, sin, HALF,
                  HALF_PADDED, Q_HEADS_PADDED)
    _rotate_heads(k_ptr, stride_k_tok, stride_k_head, token, num_kv_heads, cos, sin, HALF,
                  HALF_PADDED, K_HEADS_PADDED)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_table: torch.Tensor, sin_table: torch.Tensor, rotary_dim: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` ``[T, heads, head_dim]`` and ``k`` ``[T, kv_heads, head_dim]`` in place
    at ``positions`` ``[T]``; returns them. Tables are ``[max_position, rotary_dim]``
    (or wider), float32, the engine's ``RotaryEmbedding`` buffers."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must be [num_tokens, heads, head_dim] with the same tokens and "
                         f"head_dim; got {tuple(q.shape)} and {tuple(k.shape)}")
    if positions.shape != (q.shape[0],) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be [{q.shape[0]}] int32/int64, got "
                         f"{tuple(positions.shape)} {positions.dtype}")
    head_dim = q.shape[2]
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim must be even and in (0, {head_dim}], got {rotary_dim}")
    if q.dtype not in COMPUTE_DTYPES or k.dtype != q.dtype:
        raise TypeError(f"q and k must share one of {COMPUTE_DTYPES}; got {q.dtype}, {k.dtype}")
    if cos_table.shape != sin_table.shape or cos_table.shape[1] < rotary_dim // 2:
        raise ValueError(f"cos/sin tables must share a [max_position, >= {rotary_dim // 2}] shape; "
                         f"got {tuple(cos_table.shape)} and {tuple(sin_table.shape)}")
    for name, t in (("q", q), ("k", k), ("cos_table", cos_table), ("sin_table", sin_table)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    check_kernel_device(q.device)
    num_tokens = q.shape[0]
    if num_tokens:
        half = rotary_dim // 2
        rotary_kernel[(num_tokens,)](
            positions, q, k, cos_table, sin_table, q.shape[1], k.shape[1],
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_table.stride(0),
            HALF=half, HALF_PADDED=triton.next_power_of_2(half),
            Q_HEADS_PADDED=triton.next_power_of_2(q.shape[1]),
            K_HEADS_PADDED=triton.next_power_of_2(k.shape[1]),
            num_warps=4,
        )
    return q, k


def rotary_embedding_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         cos_table: torch.Tensor, sin_table: torch.Tensor, rotary_dim: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference (new tensors): HF's ``x * cos + rotate_half(x) * sin`` in float32."""
    half = rotary_dim // 2
    cos = cos_table[positions.long(), :half].float()[:, None, :]
    sin = sin_table[positions.long(), :half].float()[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half].float(), x[..., half:rotary_dim].float()
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)

    return rotate(q), rotate(k)
