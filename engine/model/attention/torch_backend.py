"""Pure-torch paged attention: the CPU path and the reference the kernels are checked against.

Decode-only sequences are attended as one padded batch; sequences with several new
tokens (prefill, chunked prefill on top of a prefix hit) are attended one by one with a
causal mask offset by their cached context. With a decode kernel, a sequence of up to
``KERNEL_MAX_QUERY`` new tokens (a speculative step's verification, a short chunk after a
prefix hit) goes to the kernel too, as one decode row per token whose sequence ends at
that token: the kernel's causal mask is the row's length. Accumulation is float32 when the inputs are
16-bit; fp8 caches are dequantized with the per-tensor scales on load.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from kvpilot.kernels.attention_metadata import AttentionMetadata
from kvpilot.kernels.fp8 import FP8_DTYPES  # torch-only module: no triton import

# New tokens of one sequence up to which a decode kernel attends them, one decode row per
# token (each row reads the sequence's keys again: cheap next to a masked SDPA per layer for
# a handful of queries, which gathers, converts and masks the whole context each time).
# A speculative step verifies 1 + num_speculative_tokens tokens.
KERNEL_MAX_QUERY = 16


def quantize_kv(x: torch.Tensor, scale: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """Cast new K or V to the cache dtype; fp8 divides by ``scale`` and saturates."""
    if cache_dtype not in FP8_DTYPES:
        return x.to(cache_dtype)
    limit = torch.finfo(cache_dtype).max
    return (x.float() / scale).clamp_(-limit, limit).to(cache_dtype)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if x.dtype not in FP8_DTYPES:
        return x.to(dtype)
    return (x.float() * scale).to(dtype)


def store_kv(
    key: torch.Tensor,           # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,         # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,      # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    num_actual_tokens: int | None = None,
) -> None:
    """Write the step's K/V into their slots.

    ``num_actual_tokens`` (the metadata's count of leading real rows) lets the engine skip
    padding by slicing, with no device sync; without it (tests, references) slots of -1
    are masked out, which reads the mask back to the host.
    """
    if num_actual_tokens is not None:
        key, value = key[:num_actual_tokens], value[:num_actual_tokens]
        slot_mapping = slot_mapping[:num_actual_tokens]
    else:
        num_tokens = slot_mapping.shape[0]
        key, value = key[:num_tokens], value[:num_tokens]
        valid = slot_mapping >= 0
        if not bool(valid.all()):
            key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    k_new = quantize_kv(key, k_scale, kv_cache.dtype)
    v_new = quantize_kv(value, v_scale, kv_cache.dtype)
    if kv_cache.dtype in FP8_DTYPES:
        # index_put_ is not implemented for fp8 on every device; write the bytes.
        flat = flat.view(torch.uint8)
        k_new, v_new = k_new.view(torch.uint8), v_new.view(torch.uint8)
    flat[0].index_copy_(0, slot_mapping, k_new)
    flat[1].index_copy_(0, slot_mapping, v_new)


def gather_kv(
    kv_cache: torch.Tensor,      # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,   # [num_blocks_used] int32 for one sequence, or [n, blocks]
    num_tokens: int,

) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the first ``num_tokens`` tokens of one or more sequences, in cache dtype.

    Whole blocks (a block of one layer's K or V is contiguous) are read with one
    ``index_select`` along the first dimension for K and one for V: on CPU that is about
    four times as fast as one ``index_select`` of K and V together along the blocks
    dimension, and twice as fast as advanced indexing.
    """
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    index = block_table.reshape(-1)
    shape = (*block_table.shape[:-1], -1, num_kv_heads, head_dim)
    k = kv_cache[0].view(num_blocks, -1).index_select(0, index).view(shape)
    v = kv_cache[1].view(num_blocks, -1).index_select(0, index).view(shape)
    return k[..., :num_tokens, :, :], v[..., :num_tokens, :, :]


def step_rows(metadata: AttentionMetadata) -> tuple[list[int], list[int], list[int]]:
    """``(each sequence's first token row and the end, the one-token sequences, the
    others)``, from the host copies (no device sync); kept in the step's metadata."""
    rows = metadata.torch_scratch.get("rows")
    if rows is None:
        query_lens = metadata.query_lens_cpu
        rows = metadata.torch_scratch["rows"] = (
            [0, *itertools.accumulate(query_lens)],
            [i for i, q in enumerate(query_lens) if q == 1],
            [i for i, q in enumerate(query_lens) if q > 1])
    return rows


def paged_attention(
    query: torch.Tensor,          # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,       # [2, num_blocks, block_size, num_kv_heads, head_dim]
    metadata: AttentionMetadata,
    scale: float,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    sliding_window: int | None = None,
    decode_kernel: DecodeKernel | None = None,
) -> torch.Tensor:
    """Causal attention of every query row over its sequence's paged K/V (padding rows: 0).

    ``sliding_window``: a query at position ``p`` sees keys ``p - window + 1 .. p`` only;
    blocks wholly before a sequence's first visible key are never read (the KV cache
    manager may have released them). ``decode_kernel``: attends the decode rows instead
    of the padded torch batches where it ``supports`` the query and cache.
    """
    starts, decode_ids, other_ids = step_rows(metadata)
    use_kernel = decode_kernel is not None and decode_kernel.supports(query, kv_cache)
    n = len(decode_ids)
    if use_kernel and n == len(metadata.query_lens_cpu) == query.shape[0] == metadata.num_actual_tokens:
        # every row is one sequence's decode row, in order: the kernel's output is the result
        tables, lens = metadata.block_tables, metadata.seq_lens
        return decode_kernel.paged_decode(query, kv_cache, tables if tables.shape[0] == n else tables[:n],
                                          lens if lens.shape[0] == n else lens[:n], scale, sliding_window)
    out = torch.zeros_like(query)
    if use_kernel:
        other_ids = _attend_with_kernel(out, query, kv_cache, metadata, scale, sliding_window, starts,
                                        decode_kernel)
    elif decode_ids:
        _decode(out, query, kv_cache, metadata, scale, k_scale, v_scale, sliding_window,
                decode_ids, starts)
    compute_dtype = torch.float32 if query.dtype != torch.float64 else query.dtype
    block_size = kv_cache.shape[2]
    for i in other_ids:
        start, end = starts[i], starts[i + 1]
        q_len, seq_len = end - start, metadata.seq_lens_cpu[i]
        context = seq_len - q_len
        first_block = _first_visible(context, sliding_window) // block_size
        num_blocks = -(-seq_len // block_size)
        first_key = first_block * block_size
        k, v = gather_kv(kv_cache, metadata.block_tables[i, first_block:num_blocks], seq_len - first_key)
        # A leading batch dim of 1: CPU SDPA takes its flash kernel for 4-D inputs only
        # (3-D ones fall back to the unfused math path, ~5x slower for a 512-token chunk).
        k = dequantize_kv(k, k_scale, compute_dtype).transpose(0, 1)[None]   # [1, kv_heads, L, dim]
        v = dequantize_kv(v, v_scale, compute_dtype).transpose(0, 1)[None]
        q = query[start:end].to(compute_dtype).transpose(0, 1)[None]          # [1, heads, q_len, dim]
        if context == 0 and sliding_window is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            pos_q = torch.arange(context, seq_len, device=query.device)[:, None]
            pos_k = torch.arange(first_key, seq_len, device=query.device)[None, :]
            mask = pos_k <= pos_q
            if sliding_window is not None:
                mask &= pos_k > pos_q - sliding_window
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1).to(query.dtype)
    return out


class DecodeKernel(Protocol):
    """A kernel for decode rows (one query per sequence) over the paged cache, such as
    ``kvpilot.kernels.paged_decode_cpu``."""

    def supports(self, query: torch.Tensor, kv_cache: torch.Tensor) -> bool: ...

    def paged_decode(self, query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float,
                     sliding_window: int | None = None) -> torch.Tensor: ...


def _attend_with_kernel(out, query, kv_cache, metadata, scale, sliding_window,
                        starts: list[int], kernel: DecodeKernel) -> list[int]:
    """Every sequence of at most ``KERNEL_MAX_QUERY`` new tokens through ``kernel``, into
    ``out``, one decode row per token (``kernel_rows``); returns the sequences left for the
    masked path."""
    token_rows, tables, row_lens, rest = kernel_rows(metadata, starts)
    if len(token_rows) and not rest:
        # every sequence is the kernel's, so its rows are the step's tokens in order (one
        # sequence's verification, say): no gather and no scatter
        n = len(token_rows)
        out[:n] = kernel.paged_decode(query[:n], kv_cache, tables, row_lens, scale, sliding_window)
    elif len(token_rows):
        out[token_rows] = kernel.paged_decode(query[token_rows], kv_cache, tables, row_lens, scale,
                                              sliding_window)
    return rest


def kernel_rows(metadata: AttentionMetadata, starts: list[int]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """The decode rows of the step's sequences of at most ``KERNEL_MAX_QUERY`` new tokens,
    one per token: ``(token rows, block tables, lengths, other sequences)``, a row's table
    its sequence's and its length the sequence's up to and including that token
    (``starts``: each sequence's first token row). Worked out by the step's first layer
    and kept in its metadata."""
    plan = metadata.torch_scratch.get("kernel-rows")
    if plan is None:
        token_rows: list[int] = []
        seq_rows: list[int] = []
        row_lens: list[int] = []
        rest: list[int] = []
        for i, q_len in enumerate(metadata.query_lens_cpu):
            if q_len > KERNEL_MAX_QUERY:
                rest.append(i)
                continue
            context = metadata.seq_lens_cpu[i] - q_len
            token_rows.extend(range(starts[i], starts[i] + q_len))
            seq_rows.extend([i] * q_len)
            row_lens.extend(range(context + 1, context + q_len + 1))
        device = metadata.block_tables.device
        plan = metadata.torch_scratch["kernel-rows"] = (
            torch.tensor(token_rows, device=device, dtype=torch.long),
            metadata.block_tables[torch.tensor(seq_rows, device=device, dtype=torch.long)],
            torch.tensor(row_lens, device=device, dtype=torch.int32), rest)
    return plan


def _first_visible(position: int, sliding_window: int | None) -> int:
    """The first key a query at ``position`` sees."""
    return 0 if sliding_window is None else max(0, position - sliding_window + 1)


def decode_groups(lens: list[int], max_waste: float = 0.5) -> list[list[int]]:
    """Positions in ``lens`` grouped for padded decode attention, longest first.

    A padded batch reads every row up to its longest row's length, so one long sequence
    among short ones multiplies the K/V read (and the attention) of the whole batch. Rows
    are sorted by length and a new group starts where a row is shorter than
    ``max_waste`` times its group's longest, which bounds the padding to about that
    share while adding at most log2(longest / shortest) groups; equal lengths give one group.
    """
    order = sorted(range(len(lens)), key=lens.__getitem__, reverse=True)
    groups: list[list[int]] = []
    width = 0
    for i in order:
        if not groups or lens[i] <= width * max_waste:
            groups.append([])
            width = lens[i]
        groups[-1].append(i)
    return groups


@dataclass(frozen=True, slots=True)
class DecodeRows:
    """One padded batch of decode sequences: what a layer needs besides its own cache.

    The same for every layer of a step (same sequences, tables and lengths), so it is
    built once per step (``_decode_plan``) and kept in the metadata's ``torch_scratch``.
    """

    num_rows: int
    rows: torch.Tensor | None       # their query rows (None: rows 0..num_rows-1 in order)
    tables: torch.Tensor            # [num_rows, blocks] the blocks to read, in key order
    width: int                      # keys read per row
    mask: torch.Tensor | None       # [num_rows, 1, 1, width] visible keys (None: all)


def _decode(out, query, kv_cache, metadata, scale, k_scale, v_scale, sliding_window,
            decode_ids: list[int], starts: list[int]) -> None:
    """Decode-only sequences (one query each) as padded batches of similar lengths, into ``out``."""
    key = ("decode", sliding_window)
    plan = metadata.torch_scratch.get(key)
    if plan is None:
        plan = metadata.torch_scratch[key] = _decode_plan(
            metadata, sliding_window, decode_ids, starts, kv_cache.shape[2], query.device)
    compute_dtype = torch.float32 if query.dtype != torch.float64 else query.dtype
    for part in plan:
        k, v = gather_kv(kv_cache, part.tables, part.width)
        # Slots past a shorter sequence's end are read and masked out. That is only safe
        # because cache slots are always finite (zero-initialised, written with saturated
        # values): 0 x NaN would still be NaN. Zeroing them here cost ~15% of a decode step.
        k = dequantize_kv(k, k_scale, compute_dtype)   # [n, L, kv_heads, dim]
        v = dequantize_kv(v, v_scale, compute_dtype)
        q = query[:part.num_rows] if part.rows is None else query[part.rows]
        n, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[2]
        # The query heads that share a KV head become that head's rows of queries: no K/V
        # expansion for GQA/MQA, and a [group, L] score tile per KV head.
        q = q.to(compute_dtype).reshape(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
        o = F.scaled_dot_product_attention(
            q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=part.mask, scale=scale,
        ).reshape(n, num_heads, head_dim).to(query.dtype)
        if part.rows is None:
            out[:n] = o
        else:
            out[part.rows] = o


def _decode_plan(metadata, sliding_window, decode_ids: list[int], starts: list[int],
                 block_size: int, device: torch.device) -> list[DecodeRows]:
    """The step's decode sequences as padded batches (one per ``decode_groups`` group)."""
    all_decode = len(decode_ids) == len(metadata.query_lens_cpu) == metadata.num_actual_tokens
    lens = [metadata.seq_lens_cpu[i] for i in decode_ids]
    # Windowed rows read at most the window (plus a block) each: one group.
    groups = [list(range(len(lens)))] if sliding_window is not None else decode_groups(lens)
    if len(groups) == 1 and all_decode:
        return [_decode_rows(metadata, sliding_window, lens, None, None, block_size, device)]
    plan = []
    for group in groups:
        ids = [decode_ids[j] for j in group]
        plan.append(_decode_rows(metadata, sliding_window, [lens[j] for j in group],
                                 torch.tensor(ids, device=device),
                                 torch.tensor([starts[i] for i in ids], device=device),
                                 block_size, device))
    return plan


def _decode_rows(metadata, sliding_window, lens: list[int], idx: torch.Tensor | None,
                 rows: torch.Tensor | None, block_size: int, device: torch.device) -> DecodeRows:
    """One padded batch: ``idx`` the sequences' positions in the metadata and ``rows`` their
    query rows (both None: every sequence, rows in order)."""
    seq_lens = (metadata.seq_lens if idx is None else metadata.seq_lens[idx]).long()
    first_blocks = [_first_visible(n - 1, sliding_window) // block_size for n in lens]
    num_blocks = max(-(-n // block_size) - b for n, b in zip(lens, first_blocks, strict=True))
    tables = metadata.block_tables if idx is None else metadata.block_tables[idx]
    if any(first_blocks):
        # Each row's window of blocks (stale entries past a row's end are masked out).
        offsets = torch.tensor(first_blocks, device=device)[:, None]
        cols = (offsets + torch.arange(num_blocks, device=device)).clamp_(max=tables.shape[1] - 1)
        tables = tables.gather(1, cols)
    else:
        tables = tables[:, :num_blocks]
    # Without a window every row starts at key 0: gather up to the longest row only.
    width = num_blocks * block_size if sliding_window is not None else max(lens)
    mask = None
    if sliding_window is not None or min(lens) < width:
        first_key = torch.tensor([b * block_size for b in first_blocks], device=device)
        pos_k = first_key[:, None] + torch.arange(width, device=device)[None, :]
        visible = pos_k < seq_lens[:, None]
        if sliding_window is not None:
            visible &= pos_k >= seq_lens[:, None] - sliding_window
        mask = visible[:, None, None, :]
    return DecodeRows(len(lens), rows, tables, width, mask)


class KVWriter(Protocol):
    """A kernel that writes K and V rows into their cache slots, such as
    ``kvpilot.kernels.cpu_layer_ops`` (no fp8: ``store_kv`` above handles those)."""

    def supports(self, x: torch.Tensor) -> bool: ...

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, num_tokens: int | None = None) -> None: ...


class TorchAttentionBackend:
    """The pure-torch path; with ``decode_kernel``, its decode rows go to that kernel, and
    with ``kv_writer`` the new K/V of a cache of their own dtype are written by that one."""

    def __init__(self, decode_kernel: DecodeKernel | None = None, name: str = "torch",
                 kv_writer: KVWriter | None = None) -> None:
        self.name = name
        self.decode_kernel = decode_kernel
        self.kv_writer = kv_writer

    def forward(self, query, key, value, kv_cache, metadata, scale, k_scale, v_scale,
                sliding_window=None):
        writer = self.kv_writer
        if writer is not None and kv_cache.dtype == key.dtype and writer.supports(key):
            writer.store_kv(key, value, kv_cache, metadata.slot_mapping, metadata.num_actual_tokens)
        else:
            store_kv(key, value, kv_cache, metadata.slot_mapping, k_scale, v_scale,
                     metadata.num_actual_tokens)
        return paged_attention(query, kv_cache, metadata, scale, k_scale, v_scale, sliding_window,
                               self.decode_kernel)
