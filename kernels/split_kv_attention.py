"""Split-KV ("flash-decoding") paged attention for long contexts with few query rows.

The unified kernel gives each (query block, KV head) one program that walks all of its
keys. A decode batch of a few sequences then has too few programs to fill a GPU, and
each walks a long context alone. Here the keys of every (query block, KV head) are cut
into ``num_splits`` segments of whole tiles, one program each, over grid axis 2. Each
program writes its unnormalised partial result (running max ``m``, sum ``l`` and
accumulator ``acc``, fp32) into scratch; a second kernel merges the splits of every
query row: ``M = max(m_s)``, ``out = sum(acc_s * 2^(m_s - M)) / sum(l_s * 2^(m_s - M))``.

The number of splits is a launch parameter, not a function of the lengths: a program
sizes its segment from its own sequence's length (``cdiv(tiles, num_splits)``), so one
choice serves any lengths (a captured CUDA graph replays with new ones). Splits with
no keys write ``m = -inf, l = 0, acc = 0`` and weigh nothing in the merge.
``choose_num_kv_splits`` is the heuristic that picks it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels.attention_tiles import _attend_segment

# A split below this many keys costs more in its merge than it saves.
MIN_KEYS_PER_SPLIT = 256
MAX_KV_SPLITS = 16


def choose_num_kv_splits(num_seqs: int, num_kv_heads: int, max_query_len: int,
                         max_seq_len: int | None, target_programs: int) -> int:
    """Splits per (query block, KV head): 1 (the unified kernel) unless the batch is
    decode-only (``max_query_len == 1``) and has fewer programs than ``target_programs``
    (about two per streaming multiprocessor), in which case enough splits to reach it,
    each of at least ``MIN_KEYS_PER_SPLIT`` keys, at most ``MAX_KV_SPLITS``."""
    if max_query_len != 1 or max_seq_len is None:
        return 1
    programs = max(1, num_seqs * num_kv_heads)
    if programs >= target_programs:
        return 1
    by_length = max_seq_len // MIN_KEYS_PER_SPLIT
    return max(1, min(MAX_KV_SPLITS, -(-target_programs // programs), by_length))


@triton.jit
def split_kv_attention_kernel(
    part_acc_ptr,          # [num_tokens, num_heads, NUM_SPLITS, HEAD_SIZE_PADDED] float32
    part_ml_ptr,           # [2, num_tokens, num_heads, NUM_SPLITS] float32: m, then l
    query_ptr,             # [num_tokens, num_heads, head_dim]
    key_cache_ptr,         # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,       # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,      # [num_seqs, max_num_blocks_per_seq] int32
    seq_lens_ptr,          # [num_seqs] int32, cached context + new tokens
    query_start_loc_ptr,   # [num_seqs + 1] int32
    k_scale_ptr,           # [] float32, read only when IS_FP8
    softmax_scale,         # float
    sliding_window,        # int: keys p - window + 1 .. p for a query at p (0: all keys)
    num_seqs,
    stride_pa_tok, stride_pa_head,
    stride_pml_half, stride_pml_tok, stride_pml_head,
    stride_q_tok, stride_q_head,
    stride_kc_block, stride_kc_off, stride_kc_head,
    stride_vc_block, stride_vc_off, stride_vc_head,
    stride_bt_seq,
    NUM_SPLITS: tl.constexpr,
    NUM_QUERIES_PER_KV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    IS_FP8: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    split = tl.program_id(2)
    q_len, rows, head, row_ok, dim_ok, offs_d, m_i, l_i, acc = _attend_segment(
        query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr,
        query_start_loc_ptr, k_scale_ptr, softmax_scale, sliding_window, num_seqs,
        tl.program_id(0),
        tl.program_id(1), split, NUM_SPLITS,
        stride_q_tok, stride_q_head, stride_kc_block, stride_kc_off, stride_kc_head,
        stride_vc_block, stride_vc_off, stride_vc_head, stride_bt_seq,
        NUM_QUERIES_PER_KV, BLOCK_SIZE, HEAD_SIZE, HEAD_SIZE_PADDED, BLOCK_M, BLOCK_Q, TILE_N,
        IS_FP8, DOT_DTYPE, DOT_PRECISION)
    if q_len == 0:
        return
    # Every real row writes its partials, empty segment or not (m = -inf, l = 0, acc = 0).
    pa = part_acc_ptr + rows[:, None] * stride_pa_tok + head[:, None] * stride_pa_head \
        + split * HEAD_SIZE_PADDED + offs_d[None, :]
    tl.store(pa, acc, mask=row_ok[:, None])
    pml = part_ml_ptr + rows * stride_pml_tok + head * stride_pml_head + split
    tl.store(pml, m_i, mask=row_ok)
    tl.store(pml + stride_pml_half, l_i, mask=row_ok)


@triton.jit
def merge_splits_kernel(
    out_ptr,               # [num_tokens, num_heads, head_dim]
    part_acc_ptr,          # [num_tokens, num_heads, NUM_SPLITS, HEAD_SIZE_PADDED] float32
    part_ml_ptr,           # [2, num_tokens, num_heads, NUM_SPLITS] float32
    query_start_loc_ptr,   # [num_seqs + 1] int32: rows from query_start_loc[num_seqs] are padding
    v_scale_ptr,           # [] float32, read only when IS_FP8
    num_seqs,
    stride_o_tok, stride_o_head,
    stride_pa_tok, stride_pa_head,
    stride_pml_half, stride_pml_tok, stride_pml_head,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PADDED: tl.constexpr,     # power of two >= NUM_SPLITS
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    IS_FP8: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    if token >= tl.load(query_start_loc_ptr + num_seqs):
        return   # padding row: never attended, left as the caller allocated it
    tok = token.to(tl.int64)
    offs_s = tl.arange(0, SPLITS_PADDED)
    offs_d = tl.arange(0, HEAD_SIZE_PADDED)
    split_ok = offs_s < NUM_SPLITS
    pml = part_ml_ptr + tok * stride_pml_tok + head * stride_pml_head + offs_s
    m = tl.load(pml, mask=split_ok, other=float("-inf"))
    l_s = tl.load(pml + stride_pml_half, mask=split_ok, other=0.0)
    m_max = tl.max(m, axis=0)
    weight = tl.where(m == float("-inf"), 0.0, tl.math.exp2(m - m_max))
    total = tl.sum(l_s * weight, axis=0)
    acc = tl.load(part_acc_ptr + tok * stride_pa_tok + head * stride_pa_head
                  + offs_s[:, None] * HEAD_SIZE_PADDED + offs_d[None, :],
                  mask=split_ok[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    if IS_FP8:
        out = out * tl.load(v_scale_ptr)
    tl.store(out_ptr + tok * stride_o_tok + head * stride_o_head + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_SIZE)


def split_kv_attention(out, query, key_cache, value_cache, block_tables, seq_lens,
                       query_start_loc, scale, k_scale, v_scale, sliding_window: int = 0, *,
                       num_splits: int,
                       block_m: int, block_q: int, tile_n: int, is_fp8: bool, dot_dtype,
                       num_warps: int, num_stages: int) -> torch.Tensor:
    """Launch both kernels into ``out`` (arguments already checked by ``unified_attention``)."""
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    head_padded = max(16, triton.next_power_of_2(head_size))
    part_acc = torch.empty((num_tokens, num_heads, num_splits, head_padded), dtype=torch.float32,
                           device=query.device)
    part_ml = torch.empty((2, num_tokens, num_heads, num_splits), dtype=torch.float32,
                          device=query.device)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    split_kv_attention_kernel[grid](
        part_acc, part_ml, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        k_scale, float(scale), sliding_window, num_seqs,
        part_acc.stride(0), part_acc.stride(1),
        part_ml.stride(0), part_ml.stride(1), part_ml.stride(2),
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        NUM_SPLITS=num_splits,
        NUM_QUERIES_PER_KV=num_heads // num_kv_heads,
        BLOCK_SIZE=key_cache.shape[1],
        HEAD_SIZE=head_size,
        HEAD_SIZE_PADDED=head_padded,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        TILE_N=tile_n,
        IS_FP8=is_fp8,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )
    merge_splits_kernel[(num_tokens, num_heads)](
        out, part_acc, part_ml, query_start_loc, v_scale, num_seqs,
        out.stride(0), out.stride(1),
        part_acc.stride(0), part_acc.stride(1),
        part_ml.stride(0), part_ml.stride(1), part_ml.stride(2),
        NUM_SPLITS=num_splits,
        SPLITS_PADDED=triton.next_power_of_2(num_splits),
        HEAD_SIZE=head_size,
        HEAD_SIZE_PADDED=head_padded,
        IS_FP8=is_fp8,
        num_warps=4 if head_padded >= 128 else 2,
    )
    return out
