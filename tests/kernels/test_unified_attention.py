"""Unified paged attention against its dense reference and the engine's torch path.

Runs under TRITON_INTERPRET=1 on CPU. The grid covers each axis without the full cross
product: GQA ratios 1/2/3/4 (and MQA), block sizes 16/32, head sizes 64/128 and 80/96
(padded to a power of two with a mask), fp32/fp16/bf16 queries, fp16/bf16/fp32 and fp8
e4m3/e5m2 caches, in a batch mixing chunked prefill on a cached prefix, prefill, decode
and a context-only sequence, with lengths that are no block multiple, shuffled block
tables and NaN in every unused cache slot.

Tolerances (|kernel - reference| <= atol + rtol * |reference|, reference in fp32 on the
same cache contents, so fp8 storage error is not part of it): fp32 1e-5 / 1e-5; fp16
4e-3 / 4e-3 (~4 fp16 ulps); bf16 3e-2 / 3e-2 (~4 bf16 ulps; the interpreter also
truncates instead of rounding the fp32 -> bf16 output cast).
"""

from __future__ import annotations

import pytest
import torch

from kvpilot.engine.model.attention.torch_backend import decode_groups, paged_attention
from kvpilot.kernels.paged_batch import MIXED_SPECS, make_paged_batch
from kvpilot.kernels.unified_attention import (
    AttentionTiling,
    default_tiling,
    unified_attention,
    unified_attention_ref,
)

from support.attention_helpers import assert_attention_close, attend, stored

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


CASES = [
    # dtype, cache dtype, num_heads, num_kv_heads, head_dim, block_size
    (torch.float32, None, 4, 4, 64, 16),          # GQA 1 (MHA)
    (torch.float16, None, 4, 2, 128, 32),         # GQA 2
    (torch.bfloat16, None, 8, 2, 80, 16),         # GQA 4, head 80 padded to 128
    (torch.float32, None, 6, 2, 96, 32),          # GQA 3: BLOCK_M rows not a multiple of the group
    (torch.float16, E4M3, 8, 2, 64, 16),
    (torch.bfloat16, E5M2, 4, 2, 128, 32),
    (torch.bfloat16, E4M3, 4, 1, 96, 16),         # MQA
]


@pytest.mark.parametrize(("dtype", "cache_dtype", "num_heads", "num_kv_heads", "head_dim",
                          "block_size"), CASES)
def test_mixed_batch_matches_reference(dtype, cache_dtype, num_heads, num_kv_heads, head_dim,
                                       block_size):
    batch = stored(make_paged_batch(num_heads=num_heads, num_kv_heads=num_kv_heads,
                                     head_dim=head_dim, block_size=block_size, dtype=dtype,
                                     cache_dtype=cache_dtype))
    out = attend(batch, unified_attention)
    assert_attention_close(out, attend(batch, unified_attention_ref), dtype)
    n = batch.metadata.num_actual_tokens
    assert bool((out[n:] == 0).all()), "padding rows must be zero"


@pytest.mark.parametrize(("dtype", "cache_dtype"), [(torch.bfloat16, None), (torch.float16, E5M2)])
def test_agrees_with_engine_torch_path(dtype, cache_dtype):
    """The engine's torch ``paged_attention`` is the contract; zero-filled cache (see report)."""
    batch = stored(make_paged_batch(num_heads=4, num_kv_heads=2, head_dim=80, dtype=dtype,
                                     cache_dtype=cache_dtype, fill="zero"))
    out = attend(batch, unified_attention)
    ref = paged_attention(batch.query, batch.kv_cache, batch.metadata, batch.scale,
                          batch.k_scale, batch.v_scale)
    assert_attention_close(out, ref, dtype)


@pytest.mark.parametrize("tiling", [AttentionTiling(block_m=16, tile_n=16),
                                    AttentionTiling(block_m=32, tile_n=64)])
def test_tilings_split_sequences_and_blocks(tiling):
    """Several query blocks per sequence (the binary search), tiles smaller and larger than a block."""
    batch = stored(make_paged_batch(num_heads=4, num_kv_heads=2, head_dim=64, block_size=32))
    out = attend(batch, unified_attention, tiling=tiling)
    assert_attention_close(out, attend(batch, unified_attention_ref), torch.float32)


def test_reference_matches_engine_torch_path():
    """Both oracles agree, so a kernel bug cannot hide behind a matching reference bug."""
    batch = stored(make_paged_batch(num_heads=6, num_kv_heads=2, head_dim=64, fill="zero"))
    ref = attend(batch, unified_attention_ref)
    engine = paged_attention(batch.query, batch.kv_cache, batch.metadata, batch.scale,
                             batch.k_scale, batch.v_scale)
    torch.testing.assert_close(ref, engine, atol=1e-5, rtol=1e-5)


# Decode rows up to 140x apart in length: the engine's torch path attends them in
# several padded groups (its ``decode_groups``), here alone and beside a chunked prefill
# and a context-only row.
UNEVEN_DECODE = ((700, 1), (5, 1), (300, 1), (16, 1), (31, 1), (64, 1), (699, 1), (150, 1))


@pytest.mark.parametrize("specs", [UNEVEN_DECODE, UNEVEN_DECODE + ((20, 13), (33, 0))],
                         ids=["decode-only", "with-prefill"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 2), (6, 2), (4, 1)])
def test_engine_torch_path_on_decode_rows_of_uneven_lengths(specs, num_heads, num_kv_heads):
    assert len(decode_groups([c + q for c, q in specs if q == 1])) >= 3
    batch = stored(make_paged_batch(specs, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                     head_dim=64, fill="zero", num_padding_tokens=0))
    engine = paged_attention(batch.query, batch.kv_cache, batch.metadata, batch.scale,
                             batch.k_scale, batch.v_scale)
    torch.testing.assert_close(engine, attend(batch, unified_attention_ref), atol=1e-5, rtol=1e-5)


def test_decode_groups_bound_the_padding():
    lens = [700, 5, 300, 16, 31, 64, 699, 150, 5, 351]
    groups = decode_groups(lens)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    for group in groups:
        longest = max(lens[i] for i in group)
        assert all(lens[i] > longest / 2 for i in group)
    assert decode_groups([128] * 256) == [list(range(256))]
    assert decode_groups([]) == []


def test_all_decode_and_all_prefill_batches():
    decode = stored(make_paged_batch(((5, 1), (17, 1), (40, 1)), num_heads=4, num_kv_heads=2))
    prefill = stored(make_paged_batch(((0, 19), (0, 3)), num_heads=4, num_kv_heads=2,
                                       num_padding_tokens=0))
    for batch in (decode, prefill):
        assert_attention_close(attend(batch, unified_attention), attend(batch, unified_attention_ref),
                      torch.float32)


def test_default_tiling():
    assert default_tiling(1, 4).block_m == 16                # decode: the group, padded to 16
    assert default_tiling(1, 32).block_m == 32               # MQA with 32 heads per KV head
    assert default_tiling(2048, 4).block_m == 128            # prefill
    with pytest.raises(ValueError, match="power of two"):
        AttentionTiling(block_m=24, tile_n=64)


def _args():
    batch = make_paged_batch(MIXED_SPECS[:2], num_heads=4, num_kv_heads=2, head_dim=64)
    m = batch.metadata
    return {"query": batch.query, "key_cache": batch.kv_cache[0], "value_cache": batch.kv_cache[1],
            "block_tables": m.block_tables, "seq_lens": m.seq_lens,
            "query_start_loc": m.query_start_loc, "max_query_len": m.max_query_len,
            "scale": batch.scale, "k_scale": None, "v_scale": None}


@pytest.mark.parametrize(
    ("mutate", "error", "match"),
    [
        (lambda a: {**a, "query": a["query"][0]}, ValueError, r"query must be \[num_tokens"),
        (lambda a: {**a, "query": a["query"][:, :, :32]}, ValueError, "head_dim 32"),
        (lambda a: {**a, "query": a["query"][:, :3]}, ValueError, "multiple of num_kv_heads"),
        (lambda a: {**a, "value_cache": a["value_cache"][:-1]}, ValueError, "key_cache and value_cache"),
        (lambda a: {**a, "query": a["query"].half()}, TypeError, "needs torch.float32 queries"),
        (lambda a: {**a, "query": a["query"].double()}, TypeError, "query must be one of"),
        (lambda a: {**a, "block_tables": a["block_tables"].float()}, TypeError, "block_tables must be int"),
        (lambda a: {**a, "block_tables": a["block_tables"][0]}, ValueError, "block_tables must be"),
        (lambda a: {**a, "seq_lens": a["seq_lens"][:1]}, ValueError, "seq_lens must be"),
        (lambda a: {**a, "query_start_loc": a["query_start_loc"][:-1]}, ValueError, "query_start_loc"),
        (lambda a: {**a, "max_query_len": -1}, ValueError, "max_query_len"),
        (lambda a: {**a, "query": a["query"].transpose(1, 2).contiguous().transpose(1, 2)},
         ValueError, "contiguous in head_dim"),
        (lambda a: {**a, "key_cache": a["key_cache"].to(E4M3), "value_cache": a["value_cache"].to(E4M3)},
         TypeError, "needs k_scale"),
        (lambda a: {**a, "key_cache": a["key_cache"].to(E4M3), "value_cache": a["value_cache"].to(E4M3),
                    "k_scale": torch.ones((), dtype=torch.float64), "v_scale": torch.ones(())},
         ValueError, "one float32 value"),
        (lambda a: {**a, "seq_lens": a["seq_lens"].to("meta")}, ValueError, "one device"),
    ],
)
def test_rejects_bad_arguments(mutate, error, match):
    with pytest.raises(error, match=match):
        unified_attention(**mutate(_args()))


def test_rejects_bad_out_and_tiling():
    args = _args()
    with pytest.raises(ValueError, match="out must match query"):
        unified_attention(**args, out=torch.empty_like(args["query"]).half())
    with pytest.raises(ValueError, match="below num_queries_per_kv"):
        unified_attention(**{**args, "query": args["query"].repeat(1, 16, 1)},
                          tiling=AttentionTiling(block_m=16, tile_n=16))


@pytest.mark.parametrize("seed", range(1, 7))
def test_random_batches(seed):
    """Random mixes of sequence shapes, group sizes, head sizes, block sizes and dtypes."""
    rng = torch.Generator().manual_seed(seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=rng))]

    specs = []
    for _ in range(int(torch.randint(2, 7, (1,), generator=rng))):
        kind = pick(["decode", "prefill", "chunk", "idle"])
        context = 0 if kind == "prefill" else int(torch.randint(1, 80, (1,), generator=rng))
        q_len = {"decode": 1, "idle": 0}.get(kind, int(torch.randint(2, 40, (1,), generator=rng)))
        specs.append((context, q_len))
    if all(q == 0 for _, q in specs):
        specs.append((0, 5))
    num_kv_heads, group = pick([(1, 4), (2, 2), (2, 3), (4, 1)])
    dtype = pick([torch.float32, torch.float16, torch.bfloat16])
    cache_dtype = pick([None, None, E4M3, E5M2])
    batch = stored(make_paged_batch(specs, num_heads=num_kv_heads * group,
                                     num_kv_heads=num_kv_heads, head_dim=pick([64, 80, 96, 128]),
                                     block_size=pick([16, 32]), dtype=dtype,
                                     cache_dtype=cache_dtype, seed=seed))
    assert_attention_close(attend(batch, unified_attention), attend(batch, unified_attention_ref), dtype)
