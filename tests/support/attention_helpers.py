"""Shared helpers of the attention kernel tests: run a paged batch through a kernel or its
reference, store its new K/V first, compare within the dtype's tolerance."""

from __future__ import annotations

import torch

from kvpilot.kernels.unified_attention import unified_attention

TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def attend(batch, fn, **kwargs):
    m = batch.metadata
    args = (batch.query, batch.kv_cache[0], batch.kv_cache[1], m.block_tables, m.seq_lens,
            m.query_start_loc)
    if fn is unified_attention:
        return fn(*args, m.max_query_len, batch.scale, batch.k_scale, batch.v_scale, **kwargs)
    return fn(*args, batch.scale, batch.k_scale, batch.v_scale, **kwargs)


def stored(batch):
    """The batch with its new tokens' K/V already in the cache (attention runs after the store)."""
    from kvpilot.kernels.kv_store import store_kv_cache_ref

    store_kv_cache_ref(batch.key, batch.value, batch.kv_cache[0], batch.kv_cache[1],
                       batch.metadata.slot_mapping, batch.k_scale, batch.v_scale)
    return batch


def assert_attention_close(out, ref, dtype):
    tol = TOL[dtype]
    assert out.dtype == dtype
    assert torch.isfinite(out.float()).all(), "NaN/inf leaked from an unused cache slot"
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
