"""Attention with Gemma 3's shapes on every backend: head_dim 256, 4 or 2 query heads per
KV head (gemma-3-1b: 4 on 1), a softmax scale from ``query_pre_attn_scalar`` instead of
``head_dim ** -0.5``, and a sliding window shorter than the sequences.

The Triton kernel (the interpreter on CPU), the engine's torch path and the compiled CPU
decode kernel (decode rows) against the dense reference on one mixed batch (chunked
prefill past the window, a prefill, decodes); the window and the scale each change the
reference, so a backend that ignored either would fail.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvpilot.engine.model.attention.torch_backend import paged_attention
from kvpilot.kernels import paged_decode_cpu
from kvpilot.kernels.paged_batch import make_paged_batch
from kvpilot.kernels.unified_attention import unified_attention, unified_attention_ref

from support.attention_helpers import assert_attention_close, attend, stored

# (context_len, query_len); the torch path reads zeroed slots past a row's end (finite)
SPECS = ((40, 9), (0, 30), (50, 1), (33, 1), (5, 1))
WINDOW = 24
SCALE = 96 ** -0.5     # query_pre_attn_scalar 96 with head_dim 256


@pytest.fixture(scope="module", params=[(torch.float32, 4, 1), (torch.bfloat16, 4, 2)],
                ids=["fp32-mqa4", "bf16-gqa2"])
def batch(request):
    dtype, heads, kv_heads = request.param
    b = stored(make_paged_batch(SPECS, num_heads=heads, num_kv_heads=kv_heads, head_dim=256,
                                block_size=16, dtype=dtype, num_padding_tokens=0, fill="zero"))
    b = dataclasses.replace(b, scale=SCALE)
    ref = attend(b, unified_attention_ref, sliding_window=WINDOW)
    assert not torch.allclose(ref, attend(b, unified_attention_ref), atol=1e-3), "the window matters"
    assert not torch.allclose(ref, attend(dataclasses.replace(b, scale=256 ** -0.5), unified_attention_ref,
                                          sliding_window=WINDOW), atol=1e-3), "the scale matters"
    return b, ref


def test_triton_kernel(batch):
    b, ref = batch
    assert_attention_close(attend(b, unified_attention, sliding_window=WINDOW), ref, b.query.dtype)


def test_torch_path(batch):
    b, ref = batch
    out = paged_attention(b.query, b.kv_cache, b.metadata, b.scale, b.k_scale, b.v_scale, WINDOW)
    assert_attention_close(out, ref, b.query.dtype)


@pytest.mark.skipif(paged_decode_cpu.load() is None, reason="the CPU decode kernel cannot be built here")
def test_cpu_decode_kernel(batch):
    b, ref = batch
    rows = []

    class Counting:   # the compiled kernel, recording the rows it attends
        supports = staticmethod(paged_decode_cpu.supports)

        @staticmethod
        def paged_decode(query, *args):
            rows.append(query.shape[0])
            return paged_decode_cpu.paged_decode(query, *args)

    metadata = dataclasses.replace(b.metadata)   # an empty scratch: plan the rows afresh
    out = paged_attention(b.query, b.kv_cache, metadata, b.scale, b.k_scale, b.v_scale, WINDOW,
                          decode_kernel=Counting)
    # the three decode rows and the 9-token chunk (up to KERNEL_MAX_QUERY new tokens: one row
    # per token); the 30-token prefill keeps the masked path
    assert rows == [3 + 9]
    assert_attention_close(out, ref, b.query.dtype)
