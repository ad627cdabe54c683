"""Triton RMSNorm (+ fused residual add) and rotary kernels in the interpreter.

Oracles are HF transformers' own modules: ``Qwen3RMSNorm`` for the norm (the residual
add is plain tensor addition) and ``apply_rotary_pos_emb`` for rope, fed the engine's
``RotaryEmbedding`` tables (default and YaRN scaling, full and partial rotary). Odd
shapes on purpose: hidden sizes that are no power of two, head sizes 64/80/96/128,
GQA / MQA head counts, token counts of 1 and primes, unsorted positions.
Tolerances: fp32 1e-5, fp16 2e-3, bf16 2e-2 (a few ulps: the kernels compute in fp32
where HF computes part of the product in the tensor dtype, and Triton 3.9's
interpreter truncates fp32 -> bf16 casts instead of rounding them).
"""

from __future__ import annotations

import pytest
import torch

from kvpilot.contract.rope import RopeConfig
from kvpilot.engine.model.layers.rotary import RotaryEmbedding
from kvpilot.kernels.rms_norm import rms_norm, rms_norm_ref
from kvpilot.kernels.rotary import rotary_embedding, rotary_embedding_ref

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _hf_norm(hidden, eps, weight, dtype):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    norm = Qwen3RMSNorm(hidden, eps=eps).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm


@pytest.mark.parametrize(("num_tokens", "hidden", "dtype", "with_residual"), [
    (1, 64, torch.float32, False),
    (7, 80, torch.float16, True),
    (13, 96, torch.bfloat16, True),
    (5, 1000, torch.float32, True),     # no power of two: masked padding to 1024
    (3, 2560, torch.bfloat16, False),
])
def test_rms_norm_matches_hf(num_tokens, hidden, dtype, with_residual):
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(num_tokens, hidden, generator=gen) * 3).to(dtype)
    residual = torch.randn(num_tokens, hidden, generator=gen).to(dtype) if with_residual else None
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    x_in = x.clone()
    got = rms_norm(x, weight, 1e-6, residual)
    summed = x + residual if with_residual else x
    with torch.no_grad():
        expected = _hf_norm(hidden, 1e-6, weight, dtype)(summed)
    out = got[0] if with_residual else got
    tol = TOL[dtype]
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    torch.testing.assert_close(out, rms_norm_ref(x, weight, 1e-6, residual)[0] if with_residual
                               else rms_norm_ref(x, weight, 1e-6), atol=tol, rtol=tol)
    if with_residual:   # the new residual: the plain sum (the interpreter truncates fp32 -> bf16)
        torch.testing.assert_close(got[1], summed, atol=0, rtol=0 if dtype != torch.bfloat16 else 1e-2)
    assert torch.equal(x, x_in), "inputs are left unchanged"


def test_rms_norm_rejects_bad_arguments():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, torch.ones(8), 1e-6, torch.randn(3, 9))
    with pytest.raises(TypeError):
        rms_norm(x.double(), torch.ones(8), 1e-6)


def _hf_rope(positions, q, k, rope: RotaryEmbedding):
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    rot = rope.rotary_dim
    cos = rope.cos_table[positions][None].to(q.dtype)     # [1, T, rot]
    sin = rope.sin_table[positions][None].to(q.dtype)
    qr, kr = apply_rotary_pos_emb(q[..., :rot].transpose(0, 1)[None], k[..., :rot].transpose(0, 1)[None],
                                  cos, sin)
    return (torch.cat((qr[0].transpose(0, 1), q[..., rot:]), dim=-1),
            torch.cat((kr[0].transpose(0, 1), k[..., rot:]), dim=-1))


@pytest.mark.parametrize(("head_dim", "num_heads", "num_kv_heads", "num_tokens", "dtype", "rope"), [
    (64, 8, 2, 1, torch.float32, RopeConfig()),                                   # GQA 4
    (80, 6, 2, 13, torch.float16, RopeConfig(theta=1e6)),                         # head 80, 6 heads
    (96, 4, 1, 7, torch.bfloat16, RopeConfig(partial_rotary_factor=2 / 3)),       # MQA, partial 64/96
    (128, 5, 5, 11, torch.float32, RopeConfig(rope_type="yarn", factor=4.0,
                                              original_max_position_embeddings=256)),
])
def test_rotary_matches_hf(head_dim, num_heads, num_kv_heads, num_tokens, dtype, rope):
    gen = torch.Generator().manual_seed(head_dim)
    table = RotaryEmbedding(rope, head_dim, 1024, 1024)
    positions = torch.randint(0, 1024, (num_tokens,), generator=gen)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)   # strided views,
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(  # as in the model
        num_tokens, num_kv_heads, head_dim)
    expected = _hf_rope(positions, q.clone(), k.clone(), table)
    engine = table(positions, q.clone(), k.clone())
    ref = rotary_embedding_ref(positions, q, k, table.cos_table, table.sin_table, table.rotary_dim)
    got = rotary_embedding(positions, q, k, table.cos_table, table.sin_table, table.rotary_dim)
    assert got[0].data_ptr() == q.data_ptr(), "rotated in place"
    tol = TOL[dtype]
    for mine, hf, eng, r in zip(got, expected, engine, ref, strict=True):
        torch.testing.assert_close(mine, hf, atol=tol, rtol=tol)
        torch.testing.assert_close(mine, eng, atol=tol, rtol=tol)
        torch.testing.assert_close(mine, r, atol=tol, rtol=tol)


def test_rotary_rejects_bad_arguments():
    q, k = torch.randn(3, 4, 16), torch.randn(3, 2, 16)
    cos = sin = torch.ones(8, 16)
    pos = torch.arange(3)
    with pytest.raises(ValueError, match="rotary_dim"):
        rotary_embedding(pos, q, k, cos, sin, 15)
    with pytest.raises(ValueError, match="positions"):
        rotary_embedding(pos[:2], q, k, cos, sin, 16)
    with pytest.raises(ValueError, match="same tokens"):
        rotary_embedding(pos, q, k[:2], cos, sin, 16)
