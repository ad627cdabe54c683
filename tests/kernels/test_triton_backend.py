"""The engine's Triton backend against its torch backend (the engine contract), interpreted."""

from __future__ import annotations

import pytest
import torch

from kvpilot.engine.model.attention import select_attention_backend
from kvpilot.engine.model.attention.torch_backend import TorchAttentionBackend
from kvpilot.engine.model.attention.triton_backend import TritonAttentionBackend
from kvpilot.kernels import paged_decode_cpu
from kvpilot.kernels.paged_batch import make_paged_batch

TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@pytest.mark.parametrize(
    ("dtype", "cache_dtype", "num_heads", "num_kv_heads", "head_dim", "block_size"),
    [
        (torch.float32, None, 4, 2, 64, 16),
        (torch.bfloat16, None, 8, 2, 128, 32),
        (torch.float16, torch.float8_e4m3fn, 6, 2, 80, 16),
        (torch.bfloat16, torch.float8_e5m2, 4, 4, 64, 32),
    ],
)
def test_triton_backend_matches_torch_backend(dtype, cache_dtype, num_heads, num_kv_heads,
                                              head_dim, block_size):
    # Zero-filled cache: the torch backend's decode path turns stale NaNs into NaN output.
    batch = make_paged_batch(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                             block_size=block_size, dtype=dtype, cache_dtype=cache_dtype,
                             fill="zero")
    results = []
    for backend in (TritonAttentionBackend(), TorchAttentionBackend()):
        cache = batch.kv_cache.clone()
        out = backend.forward(batch.query, batch.key, batch.value, cache, batch.metadata,
                              batch.scale, batch.k_scale, batch.v_scale)
        results.append((out, cache))
    (out, cache), (out_ref, cache_ref) = results
    assert torch.equal(cache.view(torch.uint8), cache_ref.view(torch.uint8))
    assert out.shape == batch.query.shape and out.dtype == dtype
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), out_ref.float(), atol=tol, rtol=tol)


def test_selection():
    cpu = torch.device("cpu")
    assert select_attention_backend("triton", cpu).name == "triton"
    # auto on CPU: the compiled decode kernel where it builds, else the pure-torch path
    built = paged_decode_cpu.load() is not None
    assert select_attention_backend("auto", cpu).name == ("cpu" if built else "torch")
    assert isinstance(select_attention_backend("triton", cpu), TritonAttentionBackend)


def test_rejects_a_whole_model_cache():
    batch = make_paged_batch(num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match=r"one layer's \[2, num_blocks"):
        TritonAttentionBackend().forward(batch.query, batch.key, batch.value, batch.kv_cache[None],
                                         batch.metadata, batch.scale, batch.k_scale, batch.v_scale)
