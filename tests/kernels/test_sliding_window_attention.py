"""Sliding-window attention in the unified and split-KV kernels and the engine's torch path.

A query at position ``p`` sees keys ``p - window + 1 .. p`` (HF's mask). The dense
reference computes that on the intact cache; then every block wholly before a sequence's
first visible key is overwritten with NaN (what a block released by the KV cache manager
and reused by another request may hold, in the worst case): kernel and torch path must
still agree with the reference and stay finite, so they never read those blocks.
Runs under TRITON_INTERPRET=1 on CPU.
"""

from __future__ import annotations

import pytest
import torch

from kvpilot.engine.model.attention.torch_backend import paged_attention
from kvpilot.kernels.paged_batch import fill_unused, make_paged_batch
from kvpilot.kernels.unified_attention import (
    AttentionTiling,
    unified_attention,
    unified_attention_ref,
)

from support.attention_helpers import assert_attention_close, attend, stored

# (context_len, query_len): chunked prefill past the window, a prefill longer than the
# window, decodes far past it, one inside it
SPECS = ((50, 13), (0, 37), (70, 1), (45, 1), (5, 1), (90, 1))


def _poison_released_blocks(batch, window: int) -> int:
    """NaN into every block before each sequence's first visible key; returns how many."""
    m, block_size = batch.metadata, batch.kv_cache.shape[2]
    poisoned = 0
    for i, (q_len, seq_len) in enumerate(zip(m.query_lens_cpu, m.seq_lens_cpu, strict=True)):
        first_key = max(0, seq_len - q_len - window + 1)
        for b in m.block_tables[i, : first_key // block_size].tolist():
            fill_unused(batch.kv_cache[:, b], "nan")
            poisoned += 1
    return poisoned


@pytest.mark.parametrize(("window", "block_size", "tiling"), [
    (16, 16, None),
    (24, 16, AttentionTiling(block_m=16, tile_n=16)),   # window no multiple of the block
    (40, 32, AttentionTiling(block_m=32, tile_n=64)),
])
def test_window_matches_reference_without_reading_released_blocks(window, block_size, tiling):
    batch = stored(make_paged_batch(SPECS, num_heads=4, num_kv_heads=2, head_dim=64,
                                     block_size=block_size, fill="zero"))
    ref = attend(batch, unified_attention_ref, sliding_window=window)
    full = attend(batch, unified_attention_ref)
    assert not torch.allclose(ref, full), "the window must change the result"
    engine_before = paged_attention(batch.query, batch.kv_cache, batch.metadata, batch.scale,
                                    batch.k_scale, batch.v_scale, window)
    torch.testing.assert_close(engine_before, ref, atol=1e-5, rtol=1e-5)
    assert _poison_released_blocks(batch, window) >= 1
    out = attend(batch, unified_attention, tiling=tiling, sliding_window=window)
    assert_attention_close(out, ref, torch.float32)
    engine = paged_attention(batch.query, batch.kv_cache, batch.metadata, batch.scale,
                             batch.k_scale, batch.v_scale, window)
    assert_attention_close(engine, ref, torch.float32)


def test_split_kv_applies_the_window():
    window = 48
    batch = stored(make_paged_batch(((300, 1), (130, 1)), num_heads=4, num_kv_heads=2, head_dim=64,
                                     num_padding_tokens=0, fill="zero"))
    ref = attend(batch, unified_attention_ref, sliding_window=window)
    _poison_released_blocks(batch, window)
    out = attend(batch, unified_attention, num_kv_splits=3, sliding_window=window)
    assert_attention_close(out, ref, torch.float32)


def test_window_must_be_positive():
    batch = stored(make_paged_batch(((5, 1),), num_heads=4, num_kv_heads=2, num_padding_tokens=0))
    with pytest.raises(ValueError, match="sliding_window"):
        attend(batch, unified_attention, sliding_window=0)
