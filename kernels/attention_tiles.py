"""Triton building blocks shared by the paged attention kernels (unified and split-KV).

``_query_block`` finds a program's sequence (binary search over ``query_start_loc``) and
loads its block of query rows: ``BLOCK_Q`` new tokens times the ``NUM_QUERIES_PER_KV``
query heads that share one KV head. ``_attend_tiles`` runs the online softmax over a
range of ``TILE_N``-key tiles, each key's cache block looked up in the block table.
``_attend_segment`` is a whole program's work: its query block, then segment ``split``
of ``num_splits`` of the tiles it may see (all of them when ``num_splits == 1``).
``sliding_window`` > 0 limits a query at position ``p`` to keys ``p - window + 1 .. p``:
tiles wholly before the program's first visible key are skipped and keys before it
masked, so blocks released outside the window are never read.
See ``kvpilot.kernels.unified_attention`` for the batch layout.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _find_seq_idx(
    query_start_loc_ptr,   # [num_seqs + 1] int32
    q_block_id,
    num_seqs,
    BLOCK_Q: tl.constexpr,
):
    # Sequence i's first query block has global id query_start_loc[i] // BLOCK_Q + i,
    # which strictly increases with i; find the last i whose id is <= q_block_id.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= q_block_id:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _query_block(
    query_ptr, query_start_loc_ptr, seq_lens_ptr, num_seqs, q_block_id, kv_head, stride_q_tok,
    stride_q_head, sliding_window,
    NUM_QUERIES_PER_KV: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_SIZE_PADDED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    """This program's sequence and query rows; ``q_len == 0`` in the result means no work."""
    seq = _find_seq_idx(query_start_loc_ptr, q_block_id, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = q_block_id - (q_start // BLOCK_Q + seq)
    q_len = tl.where(q_block * BLOCK_Q >= q_len, 0, q_len)   # a spare program of the grid
    context_len = tl.load(seq_lens_ptr + seq) - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_SIZE_PADDED)
    q_tok = q_block * BLOCK_Q + offs_m // NUM_QUERIES_PER_KV   # index among the new tokens
    head = kv_head * NUM_QUERIES_PER_KV + offs_m % NUM_QUERIES_PER_KV
    row_ok = (offs_m < BLOCK_Q * NUM_QUERIES_PER_KV) & (q_tok < q_len)
    dim_ok = offs_d < HEAD_SIZE
    q_pos = context_len + q_tok                                   # absolute token position
    rows = (q_start + q_tok).to(tl.int64)
    q = tl.load(query_ptr + rows[:, None] * stride_q_tok + head[:, None] * stride_q_head
                + offs_d[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(DOT_DTYPE)
    # Keys first_key .. last_key are the most any row of this program may see.
    last_key = context_len + tl.minimum((q_block + 1) * BLOCK_Q, q_len) - 1
    first_key = tl.where(sliding_window > 0,
                         tl.maximum(context_len + q_block * BLOCK_Q - sliding_window + 1, 0), 0)
    return seq, q_len, q, rows, head, row_ok, dim_ok, offs_d, q_pos, first_key, last_key


@triton.jit
def _attend_tiles(
    q, m_i, l_i, acc, key_cache_ptr, value_cache_ptr, block_row, kv_head, q_pos, row_ok, offs_d,
    dim_ok, first_key, last_key, sliding_window, qk_scale, tile_start, tile_end,
    stride_kc_block, stride_kc_off, stride_kc_head, stride_vc_block, stride_vc_off, stride_vc_head,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online softmax over keys ``tile_start * TILE_N ..`` (tiles up to ``tile_end``)."""
    # A row sees keys after ``window_floor`` (-1: all keys from 0).
    window_floor = tl.where(sliding_window > 0, q_pos - sliding_window, -1)
    for tile in range(tile_start, tile_end):
        offs_n = tile * TILE_N + tl.arange(0, TILE_N)
        key_ok = (offs_n <= last_key) & (offs_n >= first_key)
        block = tl.load(block_row + offs_n // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        offset = offs_n % BLOCK_SIZE
        k_off = block * stride_kc_block + offset * stride_kc_off + kv_head * stride_kc_head
        v_off = block * stride_vc_block + offset * stride_vc_off + kv_head * stride_vc_head
        # Masked lanes read 0, so stale NaNs in unused slots never reach the sums.
        k = tl.load(key_cache_ptr + k_off[None, :] + offs_d[:, None],
                    mask=dim_ok[:, None] & key_ok[None, :], other=0.0)    # [HEAD_PAD, TILE_N]
        v = tl.load(value_cache_ptr + v_off[:, None] + offs_d[None, :],
                    mask=key_ok[:, None] & dim_ok[None, :], other=0.0)    # [TILE_N, HEAD_PAD]
        k = k.to(DOT_DTYPE)   # exact for fp8 (every fp8 value fits 16/32-bit); else a no-op
        v = v.to(DOT_DTYPE)

        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        visible = row_ok[:, None] & (offs_n[None, :] <= q_pos[:, None]) \
            & (offs_n[None, :] > window_floor[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)    # rows with nothing visible yet
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _attend_segment(
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr,
    query_start_loc_ptr, k_scale_ptr, softmax_scale, sliding_window, num_seqs, q_block_id,
    kv_head, split, num_splits,
    stride_q_tok, stride_q_head, stride_kc_block, stride_kc_off, stride_kc_head,
    stride_vc_block, stride_vc_off, stride_vc_head, stride_bt_seq,
    NUM_QUERIES_PER_KV: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr, IS_FP8: tl.constexpr, DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """(q_len, rows, head, row_ok, dim_ok, offs_d, m, l, acc) of one program; q_len 0: no work."""
    seq, q_len, q, rows, head, row_ok, dim_ok, offs_d, q_pos, first_key, last_key = _query_block(
        query_ptr, query_start_loc_ptr, seq_lens_ptr, num_seqs, q_block_id, kv_head,
        stride_q_tok, stride_q_head, sliding_window, NUM_QUERIES_PER_KV, HEAD_SIZE, HEAD_SIZE_PADDED, BLOCK_M,
        BLOCK_Q, DOT_DTYPE)
    qk_scale = softmax_scale * 1.4426950408889634   # exp2 units
    if IS_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    first_tile = first_key // TILE_N
    num_tiles = tl.where(q_len == 0, 0, tl.cdiv(last_key + 1, TILE_N) - first_tile)
    per_split = tl.cdiv(num_tiles, num_splits)
    tile_start = first_tile + split * per_split
    tile_end = tl.minimum(tile_start + per_split, first_tile + num_tiles)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE_PADDED], tl.float32)
    m_i, l_i, acc = _attend_tiles(
        q, m_i, l_i, acc, key_cache_ptr, value_cache_ptr,
        block_tables_ptr + seq.to(tl.int64) * stride_bt_seq, kv_head, q_pos, row_ok, offs_d,
        dim_ok, first_key, last_key, sliding_window, qk_scale, tile_start, tile_end,
        stride_kc_block, stride_kc_off, stride_kc_head, stride_vc_block, stride_vc_off,
        stride_vc_head, BLOCK_SIZE, TILE_N, DOT_DTYPE, DOT_PRECISION)
    return q_len, rows, head, row_ok, dim_ok, offs_d, m_i, l_i, acc
