"""Split-KV ("flash-decoding") attention against the dense reference, in the interpreter.

Odd shapes on purpose: head sizes 64/80/96/128 (80 and 96 padded to a power of two
with a mask), context lengths that are no power of two and no block or tile multiple,
GQA (4 and 3 query heads per KV head) and MQA, split counts that do not divide the
tiles (so the last split is short or empty), fp8 caches, padding rows after the real
tokens, and NaN in every unused cache slot. Tolerances as in test_unified_attention.
"""

from __future__ import annotations

import pytest
import torch

from kvpilot.kernels.paged_batch import make_paged_batch
from kvpilot.kernels.split_kv_attention import MAX_KV_SPLITS, choose_num_kv_splits
from kvpilot.kernels.unified_attention import unified_attention, unified_attention_ref

from support.attention_helpers import assert_attention_close, attend, stored

E4M3 = torch.float8_e4m3fn


@pytest.mark.parametrize(
    ("head_dim", "num_heads", "num_kv_heads", "dtype", "cache_dtype", "splits", "specs"),
    [
        (64, 8, 2, torch.float32, None, 3, ((300, 1), (37, 1), (129, 1))),     # GQA 4
        (80, 6, 2, torch.float16, None, 5, ((211, 1), (5, 1))),                # GQA 3, head 80
        (96, 4, 1, torch.bfloat16, None, 2, ((333, 1), (190, 1))),             # MQA, head 96
        (128, 4, 4, torch.float32, None, 4, ((257, 1),)),                      # MHA, head 128
        (128, 8, 2, torch.float16, E4M3, 3, ((150, 1), (61, 1))),              # fp8 cache
        (80, 4, 2, torch.float32, None, 3, ((40, 13), (0, 19), (100, 1))),     # prefill rows too
    ],
)
def test_split_kv_matches_reference(head_dim, num_heads, num_kv_heads, dtype, cache_dtype,
                                    splits, specs):
    batch = stored(make_paged_batch(specs, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                     head_dim=head_dim, block_size=16, dtype=dtype,
                                     cache_dtype=cache_dtype, num_padding_tokens=3))
    out = attend(batch, unified_attention, num_kv_splits=splits)
    assert_attention_close(out, attend(batch, unified_attention_ref), dtype)
    n = batch.metadata.num_actual_tokens
    assert bool((out[n:] == 0).all()), "padding rows must stay as allocated (zero)"


def test_split_equals_unsplit_kernel():
    """One split is the unified kernel; more splits only reorder the same sums."""
    batch = stored(make_paged_batch(((177, 1), (90, 1), (3, 1)), num_heads=4, num_kv_heads=2,
                                     head_dim=64))
    whole = attend(batch, unified_attention, num_kv_splits=1)
    for splits in (2, 7):
        torch.testing.assert_close(attend(batch, unified_attention, num_kv_splits=splits), whole,
                                   atol=1e-5, rtol=1e-5)


def test_heuristic_splits_only_small_long_decode_batches():
    # decode, 2 seqs x 2 KV heads = 4 programs, long context: split to fill 132 SM pairs
    assert choose_num_kv_splits(2, 2, 1, 32_768, target_programs=264) == MAX_KV_SPLITS
    # short contexts: no split below MIN_KEYS_PER_SPLIT keys per segment
    assert choose_num_kv_splits(2, 2, 1, 300, target_programs=264) == 1
    assert choose_num_kv_splits(2, 2, 1, 1024, target_programs=264) == 4
    # enough programs already, a prefill, or no host length bound: unified kernel
    assert choose_num_kv_splits(256, 8, 1, 32_768, target_programs=264) == 1
    assert choose_num_kv_splits(2, 2, 7, 32_768, target_programs=264) == 1
    assert choose_num_kv_splits(2, 2, 1, None, target_programs=264) == 1
    assert choose_num_kv_splits(16, 8, 1, 32_768, target_programs=264) == 3


def test_automatic_choice_splits_in_the_interpreter():
    """With max_seq_len given, a small long-context decode batch takes the split path."""
    batch = stored(make_paged_batch(((600, 1),), num_heads=4, num_kv_heads=2, head_dim=64,
                                     num_padding_tokens=0))
    m = batch.metadata
    assert choose_num_kv_splits(1, 2, 1, 601, target_programs=16) == 2
    out = unified_attention(batch.query, batch.kv_cache[0], batch.kv_cache[1], m.block_tables,
                            m.seq_lens, m.query_start_loc, 1, batch.scale, max_seq_len=601)
    assert_attention_close(out, attend(batch, unified_attention_ref), torch.float32)
    with pytest.raises(ValueError, match="num_kv_splits"):
        attend(batch, unified_attention, num_kv_splits=0)
