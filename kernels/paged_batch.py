"""Random varlen batches over a paged KV cache, for the kernel tests and the GPU bench.

A batch is described by ``(context_len, query_len)`` per sequence: the context's K/V are
written into the cache beforehand, the query tokens are the step's new tokens (their
K/V are returned, not yet stored). Blocks are handed out in a shuffled order, and every
slot that holds no real token (spare blocks, the tail of each sequence's last block, the
block that pads the block tables) is NaN by default, so a kernel that reads past a
sequence's length shows NaN in its output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpilot.kernels.attention_metadata import AttentionMetadata
from kvpilot.kernels.fp8 import is_fp8, quantize_fp8_ref

NAN_BYTE = 0x7F   # a NaN in float8_e4m3fn and in float8_e5m2

# (context_len, query_len): chunked prefill on a prefix hit, a prefill, decode steps, a
# context-only sequence with no new token, a first-token decode; no length a block multiple.
MIXED_SPECS = ((20, 13), (0, 37), (45, 1), (33, 0), (0, 1), (70, 1))


@dataclass(frozen=True, slots=True)
class PagedBatch:
    query: torch.Tensor      # [num_tokens, num_heads, head_dim]
    key: torch.Tensor        # [num_tokens, num_kv_heads, head_dim], the step's new tokens
    value: torch.Tensor      # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor   # [2, num_blocks, block_size, num_kv_heads, head_dim], context only
    metadata: AttentionMetadata
    k_scale: torch.Tensor    # [] float32
    v_scale: torch.Tensor
    scale: float             # softmax scale, head_dim ** -0.5


def fill_unused(cache: torch.Tensor, fill: str) -> torch.Tensor:
    """Fill a cache with NaN (``fill="nan"``) or zeros (``"zero"``), in place."""
    if fill == "zero":
        return cache.zero_()
    if fill != "nan":
        raise ValueError(f"fill must be 'nan' or 'zero', got {fill!r}")
    if is_fp8(cache.dtype):
        cache.view(torch.uint8).fill_(NAN_BYTE)
    else:
        cache.fill_(float("nan"))
    return cache


def make_paged_batch(
    specs=MIXED_SPECS,
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    cache_dtype: torch.dtype | None = None,
    num_padding_tokens: int = 3,
    fill: str = "nan",
    scales: tuple[float, float] | None = None,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> PagedBatch:
    """A batch per ``specs`` (``(context_len, query_len)`` per sequence).

    ``cache_dtype`` defaults to ``dtype``. K/V are N(0, 2^2); ``scales`` = (k_scale,
    v_scale) default to (0.02, 0.03) for an fp8 cache (so the scales matter: values
    reach ~400 before the cast) and 1.0 otherwise. ``num_padding_tokens`` rows with
    slot -1 follow the real tokens.
    """
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(seed)                  # block order (host)
    data_gen = torch.Generator(device=dev).manual_seed(seed)   # values, made on the device
    cache_dtype = cache_dtype or dtype
    blocks_per_seq = [-(-(c + q) // block_size) for c, q in specs]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    pad_block = order.pop()
    tables = torch.full((len(specs), max(blocks_per_seq) + 1), pad_block, dtype=torch.int32)
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)

    def rand(*shape, amp=1.0):
        return (torch.randn(*shape, generator=data_gen, device=dev) * amp).to(dtype)

    def slots_of(i, first, count):
        t = torch.arange(first, first + count)
        return (tables[i, t // block_size].long() * block_size + t % block_size).to(dev)

    fp8 = is_fp8(cache_dtype)
    k_s, v_s = scales or ((0.02, 0.03) if fp8 else (1.0, 1.0))
    k_scale = torch.tensor(float(k_s), device=dev)
    v_scale = torch.tensor(float(v_s), device=dev)
    kv_cache = fill_unused(torch.empty(2, num_blocks, block_size, num_kv_heads, head_dim,
                                       dtype=cache_dtype, device=dev), fill)

    ctx_slots = torch.cat([slots_of(i, 0, c) for i, (c, _) in enumerate(specs)])
    for half, s in ((0, k_scale), (1, v_scale)):
        x = rand(ctx_slots.numel(), num_kv_heads, head_dim, amp=2.0)
        x = quantize_fp8_ref(x, s, cache_dtype) if fp8 else x.to(cache_dtype)
        flat = kv_cache[half].view(-1, num_kv_heads, head_dim)
        if fp8:
            flat, x = flat.view(torch.uint8), x.view(torch.uint8)
        flat.index_copy_(0, ctx_slots, x)

    new_slots = torch.cat([slots_of(i, c, q) for i, (c, q) in enumerate(specs)])
    num_tokens = new_slots.numel() + num_padding_tokens
    slot_mapping = torch.cat([new_slots, torch.full((num_padding_tokens,), -1, device=dev)])
    query_lens = tuple(q for _, q in specs)
    seq_lens = tuple(c + q for c, q in specs)
    starts = torch.zeros(len(specs) + 1, dtype=torch.int32)
    starts[1:] = torch.tensor(query_lens).cumsum(0)
    metadata = AttentionMetadata(
        num_actual_tokens=new_slots.numel(),
        query_start_loc=starts.to(dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        block_tables=tables.to(dev),
        slot_mapping=slot_mapping.to(dev),
        max_query_len=max(query_lens),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )
    return PagedBatch(
        query=rand(num_tokens, num_heads, head_dim),
        key=rand(num_tokens, num_kv_heads, head_dim, amp=2.0),
        value=rand(num_tokens, num_kv_heads, head_dim, amp=2.0),
        kv_cache=kv_cache, metadata=metadata,
        k_scale=k_scale, v_scale=v_scale, scale=head_dim ** -0.5,
    )
