"""KV store: write a step's new K/V rows into their slots of the paged cache.

Token ``t`` goes to slot ``slot_mapping[t]`` = ``block * block_size + offset`` of both the
key and the value cache (``[num_blocks, block_size, num_kv_heads, head_dim]`` each, i.e.
``kv_cache[0]`` and ``kv_cache[1]`` of one layer); slot ``-1`` marks padding and is
skipped. A 16/32-bit cache gets a plain cast; an fp8 cache gets
``saturate(x / scale)`` rounded to nearest even (see ``kvpilot.kernels.fp8``).

Interpreter note: Triton 3.9's CPU interpreter casts fp32 to fp8 wrongly (measured: a
rounding carry is not propagated into the exponent, so 127.2 becomes 64 instead of 128;
subnormal results are truncated; exact ties round away from zero; ~2% of N(0, 1)-spread
e4m3 values and ~5% of e5m2 values) and casts fp32 to bf16 by truncation. So while
interpreting, the launcher by default does any dtype conversion with torch first and the
kernel only moves bytes (``convert_in_kernel=None``). The tests also force
``convert_in_kernel=True`` on CPU and assert that every mismatch is one of those known
interpreter errors; ``python -m kvpilot.engine.bench.kernels_gpu`` checks the compiled in-kernel
conversion byte for byte against torch's cast.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels.fp8 import (
    CACHE_DTYPES,
    COMPUTE_DTYPES,
    check_kernel_device,
    fp8_max,
    is_fp8,
    is_interpreting,
)
from kvpilot.kernels.fp8 import quantize_fp8_ref as _quantize_fp8


@triton.jit
def kv_store_kernel(
    key_ptr,            # [num_tokens, num_kv_heads, head_dim]
    value_ptr,          # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,      # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,    # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,   # [num_tokens] int32/int64, -1 = padding (not stored)
    k_scale_ptr,        # [] float32, read only when QUANTIZE_FP8
    v_scale_ptr,        # [] float32, read only when QUANTIZE_FP8
    num_kv_heads,
    stride_k_tok, stride_k_head,
    stride_v_tok, stride_v_head,
    stride_kc_block, stride_kc_off, stride_kc_head,
    stride_vc_block, stride_vc_off, stride_vc_head,
    BLOCK_SIZE: tl.constexpr,        # tokens per cache block
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,  # next power of two >= HEAD_SIZE
    BLOCK_H: tl.constexpr,           # KV heads handled by one program (power of two)
    QUANTIZE_FP8: tl.constexpr,      # divide by the scale and saturate before the cast
    FP8_MAX: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE   # int64 before any stride multiply
    offset = slot % BLOCK_SIZE

    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HEAD_SIZE_PADDED)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < HEAD_SIZE)
    tok = token.to(tl.int64)

    k = tl.load(key_ptr + tok * stride_k_tok + heads[:, None] * stride_k_head + dims[None, :],
                mask=mask)
    v = tl.load(value_ptr + tok * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :],
                mask=mask)
    if QUANTIZE_FP8:
        # div_rn: plain `/` lowers to an approximate division on CUDA, and the stored
        # bytes must match torch's IEEE division exactly.
        k = tl.clamp(tl.div_rn(k.to(tl.float32), tl.load(k_scale_ptr)), -FP8_MAX, FP8_MAX)
        v = tl.clamp(tl.div_rn(v.to(tl.float32), tl.load(v_scale_ptr)), -FP8_MAX, FP8_MAX)

    kc = key_cache_ptr + block * stride_kc_block + offset * stride_kc_off
    vc = value_cache_ptr + block * stride_vc_block + offset * stride_vc_off
    tl.store(kc + heads[:, None] * stride_kc_head + dims[None, :],
             k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc + heads[:, None] * stride_vc_head + dims[None, :],
             v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_cache(
    key: torch.Tensor,           # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,         # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,     # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,   # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [n <= num_tokens] int32/int64, -1 = padding
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    convert_in_kernel: bool | None = None,
) -> None:
    """Write ``key[t]`` / ``value[t]`` into slot ``slot_mapping[t]`` of the caches, in place.

    Only the first ``len(slot_mapping)`` rows of ``key`` / ``value`` are read. ``k_scale`` /
    ``v_scale`` (0-dim float32 tensors on the cache's device) are required for an fp8 cache
    and ignored otherwise. ``convert_in_kernel``: cast (and quantize) inside the kernel;
    ``None`` means yes, except under the Triton interpreter, whose casts to fp8 and bf16
    round wrongly (then torch converts first and the kernel copies).
    """
    _check_store_args(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    cache_dtype = key_cache.dtype
    quantize = is_fp8(cache_dtype)
    if convert_in_kernel is None:
        convert_in_kernel = not is_interpreting()
    if not convert_in_kernel and key.dtype != cache_dtype:
        key, value = key[:num_tokens], value[:num_tokens]
        if quantize:
            key, value = _quantize_fp8(key, k_scale, cache_dtype), _quantize_fp8(value, v_scale, cache_dtype)
        else:
            key, value = key.to(cache_dtype), value.to(cache_dtype)
        quantize = False
    if k_scale is None:   # never read by the kernel (QUANTIZE_FP8 is off); any pointer will do
        k_scale = v_scale = slot_mapping

    num_kv_heads, head_size = key.shape[1], key.shape[2]
    head_size_padded = triton.next_power_of_2(head_size)
    block_h = max(1, min(triton.next_power_of_2(num_kv_heads), 4096 // head_size_padded))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    kv_store_kernel[grid](
        key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale,
        num_kv_heads,
        key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        BLOCK_SIZE=key_cache.shape[1],
        HEAD_SIZE=head_size,
        HEAD_SIZE_PADDED=head_size_padded,
        BLOCK_H=block_h,
        QUANTIZE_FP8=quantize,
        FP8_MAX=fp8_max(cache_dtype) if quantize else 0.0,
        num_warps=4,
    )


def _check_store_args(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale) -> None:
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache),
                    ("value_cache", value_cache), ("slot_mapping", slot_mapping)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"key and value must both be [num_tokens, num_kv_heads, head_dim]; "
                         f"got {tuple(key.shape)} and {tuple(value.shape)}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError("key_cache and value_cache must both be [num_blocks, block_size, "
                         f"num_kv_heads, head_dim]; got {tuple(key_cache.shape)} and "
                         f"{tuple(value_cache.shape)}")
    if key.shape[1:] != key_cache.shape[2:]:
        raise ValueError(f"key rows are [num_kv_heads, head_dim] = {tuple(key.shape[1:])} but the "
                         f"cache holds {tuple(key_cache.shape[2:])}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] > key.shape[0]:
        raise ValueError(f"slot_mapping must be 1-D with at most num_tokens={key.shape[0]} entries; "
                         f"got shape {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if key.dtype != value.dtype or key.dtype not in COMPUTE_DTYPES:
        raise TypeError(f"key and value must share one of {COMPUTE_DTYPES}; "
                        f"got {key.dtype} and {value.dtype}")
    if key_cache.dtype != value_cache.dtype or key_cache.dtype not in CACHE_DTYPES:
        raise TypeError(f"key_cache and value_cache must share one of {CACHE_DTYPES}; "
                        f"got {key_cache.dtype} and {value_cache.dtype}")
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache),
                    ("value_cache", value_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim (stride 1), "
                             f"got strides {t.stride()}")
    if not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping must be contiguous")
    devices = {t.device for t in (key, value, key_cache, value_cache, slot_mapping)}
    if is_fp8(key_cache.dtype):
        _check_scales(k_scale, v_scale, devices)
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    check_kernel_device(devices.pop())


def _check_scales(k_scale, v_scale, devices: set) -> None:
    """fp8 scales: one float32 value each, on the same device as the cache."""
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"an fp8 KV cache needs {name} as a float32 tensor, got {type(s).__name__}")
        if s.dtype != torch.float32 or s.numel() != 1:
            raise ValueError(f"{name} must hold one float32 value, got {s.dtype} of shape "
                             f"{tuple(s.shape)}")
        devices.add(s.device)


def store_kv_cache_ref(key, value, key_cache, value_cache, slot_mapping,
                       k_scale=None, v_scale=None) -> None:
    """Reference: one token at a time, the same arguments and effect as ``store_kv_cache``."""
    block_size = key_cache.shape[1]
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        for x, cache, s in ((key[token], key_cache, k_scale), (value[token], value_cache, v_scale)):
            if is_fp8(cache.dtype):
                x = _quantize_fp8(x, s, cache.dtype)
            cache[block, offset] = x.to(cache.dtype)
