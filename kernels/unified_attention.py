"""Unified paged attention: one kernel for prefill, chunked prefill and decode.

A step's queries are one varlen batch: sequence ``i`` owns query rows
``query_start_loc[i]:query_start_loc[i + 1]``, the last ``q_len`` of its ``seq_lens[i]``
tokens, whose K/V are already in the paged cache (the KV store ran first). Query row
``r`` of sequence ``i`` sits at position ``context + r`` (``context = seq_len - q_len``)
and attends causally to keys ``0 .. context + r``. Decode is ``q_len == 1``; prefill is
``context == 0``; chunked prefill on a prefix hit has both; ``q_len == 0`` sequences are
skipped.

Work split: one program per (block of ``BLOCK_Q`` query tokens of one sequence, KV head).
Its ``BLOCK_M = BLOCK_Q * num_queries_per_kv`` rows are those tokens times the query
heads that share the KV head (GQA/MQA), so each K/V tile is loaded once per group.
Programs find their sequence by binary search over ``query_start_loc``, so the grid
needs no host-side bookkeeping. Keys are visited ``TILE_N`` at a time, each key's cache
block looked up in the block table, with an online softmax in fp32. Head sizes that are
not powers of two are padded with a mask. An fp8 cache is upcast exactly to the query
dtype and its scales are applied outside the matmuls: ``k_scale`` folds into the
softmax scale and ``v_scale`` multiplies the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvpilot.kernels.attention_tiles import _attend_segment
from kvpilot.kernels.fp8 import (
    CACHE_DTYPES,
    COMPUTE_DTYPES,
    check_kernel_device,
    is_fp8,
    is_interpreting,
)
from kvpilot.kernels.split_kv_attention import choose_num_kv_splits, split_kv_attention

_DOT_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@dataclass(frozen=True, slots=True)
class AttentionTiling:
    """Launch shape: ``block_m`` query rows and ``tile_n`` keys per step (powers of two >= 16)."""

    block_m: int
    tile_n: int
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_m", "tile_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v}")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"bad num_warps={self.num_warps} / num_stages={self.num_stages}")


def default_tiling(max_query_len: int, num_queries_per_kv: int, head_size: int = 128,
                   dtype: torch.dtype = torch.bfloat16) -> AttentionTiling:
    """Small row blocks for decode (only ``num_queries_per_kv`` rows are real), up to 128 for prefill.

    Head sizes above 128 and fp32 operands (whose matmuls are not on tensor cores) get
    smaller tiles, and big accumulators 8 warps, so that ptxas does not spill registers
    on sm_90 (checked by tests/kernels/aot_sm90.py).
    """
    head_padded = max(16, triton.next_power_of_2(head_size))
    big = head_padded > 128 or dtype == torch.float32
    elt_cost = 4 if dtype == torch.float32 else 1   # fp32 dots run on FMA units, not in fragments
    rows = triton.next_power_of_2(max(1, max_query_len) * num_queries_per_kv)
    block_m = max(16, triton.next_power_of_2(num_queries_per_kv), min(rows, 64 if big else 128))
    return AttentionTiling(block_m=block_m, tile_n=32 if big else 64,
                           num_warps=8 if block_m * head_padded * elt_cost >= 128 * 128 else 4,
                           num_stages=3 if block_m <= 32 else 2)


@triton.jit
def unified_attention_kernel(
    out_ptr,               # [num_tokens, num_heads, head_dim]
    query_ptr,             # [num_tokens, num_heads, head_dim]
    key_cache_ptr,         # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,       # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,      # [num_seqs, max_num_blocks_per_seq] int32
    seq_lens_ptr,          # [num_seqs] int32, cached context + new tokens
    query_start_loc_ptr,   # [num_seqs + 1] int32
    k_scale_ptr,           # [] float32, read only when IS_FP8
    v_scale_ptr,           # [] float32, read only when IS_FP8
    softmax_scale,         # float
    sliding_window,        # int: keys p - window + 1 .. p for a query at p (0: all keys)
    num_seqs,
    stride_o_tok, stride_o_head,
    stride_q_tok, stride_q_head,
    stride_kc_block, stride_kc_off, stride_kc_head,
    stride_vc_block, stride_vc_off, stride_vc_head,
    stride_bt_seq,
    NUM_QUERIES_PER_KV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,        # tokens per cache block
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,  # power of two >= max(HEAD_SIZE, 16)
    BLOCK_M: tl.constexpr,           # query rows per program (tokens x heads of one group)
    BLOCK_Q: tl.constexpr,           # query tokens per program = BLOCK_M // NUM_QUERIES_PER_KV
    TILE_N: tl.constexpr,            # keys per inner step
    IS_FP8: tl.constexpr,            # cache holds fp8; apply k_scale / v_scale
    DOT_DTYPE: tl.constexpr,         # matmul operand dtype: the query dtype (see launcher)
    DOT_PRECISION: tl.constexpr,     # "ieee" for fp32 operands, else "tf32" (ignored by 16-bit)
):
    q_len, rows, head, row_ok, dim_ok, offs_d, m_i, l_i, acc = _attend_segment(
        query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr,
        query_start_loc_ptr, k_scale_ptr, softmax_scale, sliding_window, num_seqs,
        tl.program_id(0),
        tl.program_id(1), 0, 1,
        stride_q_tok, stride_q_head, stride_kc_block, stride_kc_off, stride_kc_head,
        stride_vc_block, stride_vc_off, stride_vc_head, stride_bt_seq,
        NUM_QUERIES_PER_KV, BLOCK_SIZE, HEAD_SIZE, HEAD_SIZE_PADDED, BLOCK_M, BLOCK_Q, TILE_N,
        IS_FP8, DOT_DTYPE, DOT_PRECISION)
    if q_len == 0:
        return
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if IS_FP8:
        out = out * tl.load(v_scale_ptr)
    tl.store(out_ptr + rows[:, None] * stride_o_tok + head[:, None] * stride_o_head
             + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])


def unified_attention(
    query: torch.Tensor,            # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,        # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,     # [num_seqs, max_num_blocks_per_seq] int32
    seq_lens: torch.Tensor,         # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    max_query_len: int,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    tiling: AttentionTiling | None = None,
    max_seq_len: int | None = None,
    num_kv_splits: int | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of every query row over its sequence's paged K/V.

    ``max_query_len`` (a host int, the longest ``q_len``) only picks the tiling. ``scale``
    is the softmax scale (usually ``head_dim ** -0.5``). ``k_scale`` / ``v_scale`` (0-dim
    float32) are required for an fp8 cache and ignored otherwise. Returns ``out`` in the
    query dtype: when None it is allocated zeroed, so rows after ``query_start_loc[-1]``
    (padding) are 0; a given ``out`` keeps whatever those rows held.

    ``num_kv_splits`` > 1 cuts each sequence's keys into that many segments run in
    parallel (split-KV, ``kvpilot.kernels.split_kv_attention``); None lets
    ``choose_num_kv_splits`` decide from ``max_seq_len`` (a host int, the longest
    sequence; None: no split) and the device's size.

    ``sliding_window``: a query at position ``p`` attends to keys ``p - window + 1 .. p``
    only (None: all earlier keys); blocks before a program's first visible key are not read.
    """
    _check_attention_args(query, key_cache, value_cache, block_tables, seq_lens,
                          query_start_loc, k_scale, v_scale, out, max_query_len)
    if out is None:
        out = torch.zeros_like(query)
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    qpk = num_heads // num_kv_heads
    tiling = tiling or default_tiling(max_query_len, qpk, head_size, query.dtype)
    if tiling.block_m < qpk:
        raise ValueError(f"tiling.block_m={tiling.block_m} is below num_queries_per_kv={qpk}")
    block_q = tiling.block_m // qpk
    fp8 = is_fp8(key_cache.dtype)
    dot_dtype = _DOT_DTYPES[query.dtype]
    if dot_dtype == tl.bfloat16 and is_interpreting():
        # Triton 3.9's interpreter multiplies bf16 operands as their raw uint16 bits in
        # tl.dot; fp32 operands give the right sums (without rounding P to bf16).
        dot_dtype = tl.float32
    if not fp8:   # never read by the kernel; any pointer will do
        k_scale = v_scale = seq_lens
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    window = sliding_window or 0
    if num_kv_splits is None:
        keys = max_seq_len if max_seq_len is None or not window else min(max_seq_len, window)
        num_kv_splits = choose_num_kv_splits(num_seqs, num_kv_heads, max_query_len, keys,
                                             _target_programs(query.device))
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
    if num_kv_splits > 1:
        return split_kv_attention(
            out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
            k_scale, v_scale, window, num_splits=num_kv_splits, block_m=tiling.block_m, block_q=block_q,
            tile_n=tiling.tile_n, is_fp8=fp8, dot_dtype=dot_dtype, num_warps=tiling.num_warps,
            num_stages=tiling.num_stages)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    unified_attention_kernel[grid](
        out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        k_scale, v_scale, float(scale), window, num_seqs,
        out.stride(0), out.stride(1),
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        NUM_QUERIES_PER_KV=qpk,
        BLOCK_SIZE=key_cache.shape[1],
        HEAD_SIZE=head_size,
        HEAD_SIZE_PADDED=max(16, triton.next_power_of_2(head_size)),
        BLOCK_M=tiling.block_m,
        BLOCK_Q=block_q,
        TILE_N=tiling.tile_n,
        IS_FP8=fp8,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",
        num_warps=tiling.num_warps,
        num_stages=tiling.num_stages,
    )
    return out


def _target_programs(device: torch.device) -> int:
    """About two programs per streaming multiprocessor (16 when interpreting)."""
    if device.type != "cuda":
        return 16
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def _check_attention_args(query, key_cache, value_cache, block_tables, seq_lens,
                          query_start_loc, k_scale, v_scale, out, max_query_len) -> None:
    named = (("query", query), ("key_cache", key_cache), ("value_cache", value_cache),
             ("block_tables", block_tables), ("seq_lens", seq_lens),
             ("query_start_loc", query_start_loc))
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_dim], got {tuple(query.shape)}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError("key_cache and value_cache must both be [num_blocks, block_size, "
                         f"num_kv_heads, head_dim]; got {tuple(key_cache.shape)} and "
                         f"{tuple(value_cache.shape)}")
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != head_size:
        raise ValueError(f"query head_dim {head_size} != cache head_dim {key_cache.shape[3]}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    if query.dtype not in COMPUTE_DTYPES:
        raise TypeError(f"query must be one of {COMPUTE_DTYPES}, got {query.dtype}")
    if key_cache.dtype != value_cache.dtype or key_cache.dtype not in CACHE_DTYPES:
        raise TypeError(f"key_cache and value_cache must share one of {CACHE_DTYPES}; "
                        f"got {key_cache.dtype} and {value_cache.dtype}")
    if not is_fp8(key_cache.dtype) and key_cache.dtype != query.dtype:
        raise TypeError(f"a {key_cache.dtype} cache needs {key_cache.dtype} queries (the matmuls run "
                        f"in the query dtype); got {query.dtype}. Only fp8 caches may differ.")
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [num_seqs, max_blocks], got {tuple(block_tables.shape)}")
    if seq_lens.dim() != 1 or seq_lens.shape[0] != block_tables.shape[0]:
        raise ValueError(f"seq_lens must be [num_seqs={block_tables.shape[0]}], "
                         f"got {tuple(seq_lens.shape)}")
    if query_start_loc.shape != (seq_lens.shape[0] + 1,):
        raise ValueError(f"query_start_loc must be [num_seqs + 1 = {seq_lens.shape[0] + 1}], "
                         f"got {tuple(query_start_loc.shape)}")
    for name, t in named[3:]:
        if t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    for name, t in named[:3]:
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim (stride 1), "
                             f"got strides {t.stride()}")
    if not isinstance(max_query_len, int) or max_query_len < 0:
        raise ValueError(f"max_query_len must be a non-negative int, got {max_query_len!r}")
    devices = {t.device for _, t in named}
    if out is not None:
        if out.shape != query.shape or out.dtype != query.dtype:
            raise ValueError(f"out must match query ({tuple(query.shape)}, {query.dtype}); "
                             f"got {tuple(out.shape)}, {out.dtype}")
        if out.stride(-1) != 1:
            raise ValueError("out must be contiguous in head_dim (stride 1)")
        devices.add(out.device)
    if is_fp8(key_cache.dtype):
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not isinstance(s, torch.Tensor):
                raise TypeError(f"an fp8 KV cache needs {name} as a float32 tensor, "
                                f"got {type(s).__name__}")
            if s.dtype != torch.float32 or s.numel() != 1:
                raise ValueError(f"{name} must hold one float32 value, got {s.dtype} of shape "
                                 f"{tuple(s.shape)}")
            devices.add(s.device)
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    check_kernel_device(devices.pop())


def unified_attention_ref(query, key_cache, value_cache, block_tables, seq_lens,
                          query_start_loc, scale, k_scale=None, v_scale=None,
                          sliding_window=None) -> torch.Tensor:
    """Reference: per sequence, gather K/V token by token, dense causal attention in fp32
    (with ``sliding_window``: keys ``p - window + 1 .. p`` for a query at ``p``)."""
    out = torch.zeros_like(query)
    num_heads = query.shape[1]
    group = num_heads // key_cache.shape[2]
    block_size = key_cache.shape[1]
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        if end == start:
            continue
        table = block_tables[i].tolist()
        slots = [(table[t // block_size], t % block_size) for t in range(seq_len)]
        k = torch.stack([key_cache[b, o] for b, o in slots]).float()     # [seq_len, kv_heads, D]
        v = torch.stack([value_cache[b, o] for b, o in slots]).float()
        if is_fp8(key_cache.dtype):
            k, v = k * k_scale.float(), v * v_scale.float()
        k = k.repeat_interleave(group, dim=1)                             # [seq_len, heads, D]
        v = v.repeat_interleave(group, dim=1)
        q = query[start:end].float()                                      # [q_len, heads, D]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(seq_len - (end - start), seq_len)
        causal = torch.arange(seq_len)[None, :] <= q_pos[:, None]          # [q_len, seq_len]
        if sliding_window is not None:
            causal &= torch.arange(seq_len)[None, :] > q_pos[:, None] - sliding_window
        probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out
