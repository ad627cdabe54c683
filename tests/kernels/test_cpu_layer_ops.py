"""The fused C++ CPU layer ops against their pure-torch references (the torch code they replace).

Oracles: ``*_ref`` in ``kvpilot.kernels.cpu_layer_ops`` (the layers' own torch code), HF
transformers' ``Qwen3RMSNorm``, ``Gemma3RMSNorm`` and ``apply_rotary_pos_emb``, and the
engine's ``RotaryEmbedding`` torch path. The ops round where torch rounds and the norms sum in
torch's order, so the norms and rotary are bit-identical to the torch code in every dtype; SiLU's
exp is another polynomial, so its results are within an ulp (a few 16-bit elements round
the other way). Odd shapes on purpose: hidden sizes that are no multiple of 8, strided
rows (views of a fused projection), token counts of 1 and primes, partial rotary.
"""

from __future__ import annotations

import pytest
import torch

from kvpilot.contract.rope import RopeConfig
from kvpilot.engine.model.layers.rotary import RotaryEmbedding
from kvpilot.kernels import cpu_layer_ops as ops

pytestmark = pytest.mark.skipif(ops.load() is None, reason="the fused CPU layer ops cannot be built here")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


ULP = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


def _close(got, want, dtype):
    """Within an ulp or two everywhere; 16-bit results the same bits but in a few elements
    (where a float32 mean an ulp apart rounds the other way)."""
    torch.testing.assert_close(got, want, atol=2 * ULP[dtype], rtol=2 * ULP[dtype])
    if dtype != torch.float32:
        assert (got != want).float().mean() < 0.01


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "hidden"), [(1, 576), (7, 577), (13, 64), (40, 1000)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_the_torch_code(dtype, rows, hidden, with_residual):
    gen = torch.Generator().manual_seed(rows * hidden)
    # a strided x: rows of a wider projection, as a decoder layer's outputs can be
    x = ((torch.randn(rows, hidden + 5, generator=gen) * 3).to(dtype))[:, :hidden]
    residual = torch.randn(rows, hidden, generator=gen).to(dtype) if with_residual else None
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    x_in = x.clone()
    r_in = None if residual is None else residual.clone()
    got = ops.add_rms_norm(x, weight, 1e-6, residual)
    want = ops.add_rms_norm_ref(x, weight, 1e-6, residual)
    if with_residual:
        assert torch.equal(got[1], want[1]), "the new residual is the plain sum"
        got, want = got[0], want[0]
        assert torch.equal(residual, r_in)
    # the mean of squares is summed in torch's order: the same bits, float32 included
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()
    assert torch.equal(x, x_in), "inputs are left unchanged"


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_matches_hf(dtype):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(5, 96, generator=gen) * 2).to(dtype)
    weight = (1 + 0.1 * torch.randn(96, generator=gen)).to(dtype)
    norm = Qwen3RMSNorm(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        want = norm(x)
    assert torch.equal(ops.add_rms_norm(x, weight, 1e-5), want)


def test_add_rms_norm_rejects_bad_arguments():
    x = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.add_rms_norm(x, torch.ones(7), 1e-6)
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.add_rms_norm(x, torch.ones(8, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(RuntimeError, match="residual must be"):
        ops.add_rms_norm(x, torch.ones(8), 1e-6, torch.randn(2, 8))
    with pytest.raises(RuntimeError, match="contiguous rows"):
        ops.add_rms_norm(torch.randn(8, 3).t(), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="CPU tensor"):
        ops.add_rms_norm(x.double(), torch.ones(8, dtype=torch.float64), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "hidden"), [(1, 640), (7, 577), (13, 64), (40, 1000)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_gemma_rms_norm_matches_the_torch_code(dtype, rows, hidden, with_residual):
    gen = torch.Generator().manual_seed(rows * hidden + 1)
    x = ((torch.randn(rows, hidden + 5, generator=gen) * 3).to(dtype))[:, :hidden]
    residual = torch.randn(rows, hidden, generator=gen).to(dtype) if with_residual else None
    gain = 1.0 + (0.3 * torch.randn(hidden, generator=gen)).to(dtype).float()
    x_in = x.clone()
    got = ops.gemma_rms_norm(x, gain, 1e-6, residual)
    want = ops.gemma_rms_norm_ref(x, gain, 1e-6, residual)
    if with_residual:
        assert torch.equal(got[1], want[1]), "the new residual is the plain sum"
        got, want = got[0], want[0]
    # rounded once, after the gain, and summed in torch's order: the same bits in every dtype
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()
    assert torch.equal(x, x_in), "inputs are left unchanged"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "heads", "head_dim"), [(1, 4, 256), (5, 8, 128), (3, 2, 72)])
def test_gemma_rms_norm_of_heads_in_a_fused_projection(dtype, tokens, heads, head_dim):
    """q and k norms run on views of the qkv projection ([tokens, heads, head_dim], rows at
    a stride): the same bits as the torch code on the view."""
    gen = torch.Generator().manual_seed(tokens * heads)
    qkv = (torch.randn(tokens, 2 * heads + 2, head_dim, generator=gen) * 2).to(dtype)
    gain = 1.0 + 0.3 * torch.randn(head_dim, generator=gen)
    for view in (qkv.narrow(1, 0, heads), qkv.narrow(1, heads, 1), qkv.narrow(1, 2 * heads, 2)):
        got = ops.gemma_rms_norm(view, gain, 1e-6)
        assert got.shape == view.shape and got.is_contiguous()
        assert torch.equal(got, ops.gemma_rms_norm_ref(view, gain, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_rms_norm_matches_hf(dtype):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(5, 640, generator=gen) * 2).to(dtype)
    norm = Gemma3RMSNorm(640, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(0.3 * torch.randn(640, generator=gen))
        want = norm(x)
    assert torch.equal(ops.gemma_rms_norm(x, 1.0 + norm.weight.float(), 1e-6), want)


def test_gemma_rms_norm_rejects_bad_arguments():
    x = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match="gain must be"):
        ops.gemma_rms_norm(x, torch.ones(7), 1e-6)
    with pytest.raises(RuntimeError, match="gain must be"):
        ops.gemma_rms_norm(x, torch.ones(8, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(RuntimeError, match="residual must be"):
        ops.gemma_rms_norm(x, torch.ones(8), 1e-6, torch.randn(2, 8))
    with pytest.raises(RuntimeError, match="a residual needs a 2-D x"):
        ops.gemma_rms_norm(x[None], torch.ones(8), 1e-6, x[None])
    with pytest.raises(RuntimeError, match="contiguous last dim"):
        ops.gemma_rms_norm(torch.randn(8, 3).t(), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="CPU tensor"):
        ops.gemma_rms_norm(x.double(), torch.ones(8), 1e-6)


def _rope(rope: RopeConfig, head_dim: int) -> RotaryEmbedding:
    return RotaryEmbedding(rope, head_dim, 4096, 4096)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("head_dim", "num_heads", "num_kv_heads", "num_tokens", "rope"), [
    (64, 9, 3, 1, RopeConfig()),
    (64, 9, 3, 7, RopeConfig(theta=100000.0)),
    (128, 4, 1, 13, RopeConfig(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024)),
    (80, 2, 2, 5, RopeConfig(partial_rotary_factor=0.5)),   # partial: dims 40.. left alone
])
def test_rotary_matches_the_torch_code_in_place(dtype, head_dim, num_heads, num_kv_heads, num_tokens, rope):
    gen = torch.Generator().manual_seed(head_dim + num_tokens)
    rot = _rope(rope, head_dim)
    # q, k, v as views of one fused projection, as the decoder layer makes them
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, _ = qkv.view(num_tokens, -1, head_dim).split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    positions = torch.randperm(4096, generator=gen)[:num_tokens]
    want_q, want_k = rot(positions, q.clone(), k.clone())   # the module's torch path
    ref_q, ref_k = ops.rotary_ref(positions, q, k, rot.cos_table, rot.sin_table, rot.rotary_dim)
    assert torch.equal(ref_q, want_q) and torch.equal(ref_k, want_k)
    v_before = qkv[:, (num_heads + num_kv_heads) * head_dim:].clone()
    got_q, got_k = ops.rotary_inplace(positions, q, k, rot.cos_table, rot.sin_table, rot.rotary_dim)
    assert got_q is q and got_k is k, "rotated in place"
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_dim:], v_before), "v untouched"


def test_rotary_matches_hf():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    rot = _rope(RopeConfig(), 64)
    q, k = torch.randn(6, 9, 64), torch.randn(6, 3, 64)
    positions = torch.tensor([0, 1, 17, 300, 4095, 2])
    cos, sin = rot.cos_table[positions][None], rot.sin_table[positions][None]
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    got_q, got_k = ops.rotary_inplace(positions, q.clone(), k.clone(), rot.cos_table, rot.sin_table, 64)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), atol=1e-6, rtol=1e-6)


def test_rotary_rejects_bad_arguments():
    rot = _rope(RopeConfig(), 64)
    q, k = torch.randn(2, 4, 64), torch.randn(2, 2, 64)
    cos, sin = rot.cos_table, rot.sin_table
    with pytest.raises(RuntimeError, match="outside the table"):
        ops.rotary_inplace(torch.tensor([0, 4096]), q, k, cos, sin, 64)
    with pytest.raises(RuntimeError, match="positions must be"):
        ops.rotary_inplace(torch.tensor([0, 1], dtype=torch.int32), q, k, cos, sin, 64)
    with pytest.raises(RuntimeError, match="rotary_dim must be"):
        ops.rotary_inplace(torch.tensor([0, 1]), q, k, cos, sin, 65)
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.rotary_inplace(torch.tensor([0, 1]), q, k.bfloat16(), cos, sin, 64)
    with pytest.raises(RuntimeError, match="one token count"):
        ops.rotary_inplace(torch.tensor([0, 1]), q, torch.randn(3, 2, 64), cos, sin, 64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "inner"), [(1, 1536), (7, 1537), (33, 16)])
def test_silu_mul_matches_the_torch_code(dtype, rows, inner):
    gen = torch.Generator().manual_seed(rows + inner)
    gate_up = (torch.randn(rows, 2 * inner, generator=gen) * 6).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -20.0])   # the exp's range ends
    _close(ops.silu_mul(gate_up), ops.silu_mul_ref(gate_up), dtype)
    strided = torch.randn(rows, 2 * inner + 3, generator=gen).to(dtype)[:, :2 * inner]
    _close(ops.silu_mul(strided), ops.silu_mul_ref(strided), dtype)


def test_silu_mul_rejects_bad_arguments():
    with pytest.raises(RuntimeError, match=r"gate_up must be \[rows, 2 \* inner\]"):
        ops.silu_mul(torch.randn(3, 7))
    with pytest.raises(RuntimeError, match=r"gate_up must be"):
        ops.silu_mul(torch.randn(2, 3, 8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_matches_index_copy(dtype):
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(2, 6, 4, 3, 8, generator=gen).to(dtype)
    kv = torch.randn(5, 2 * 3 * 8 + 4, generator=gen).to(dtype)   # strided rows of a projection
    key = kv[:, :24].view(5, 3, 8)
    value = kv[:, 24:48].view(5, 3, 8)
    slots = torch.tensor([3, 22, -1, 0, 9])
    want = cache.clone()
    ops.store_kv_ref(key, value, want, slots)
    got = cache.clone()
    ops.store_kv(key, value, got, slots)
    assert torch.equal(got, want)
    # num_tokens: only the leading rows (the rest is padding)
    want2, got2 = cache.clone(), cache.clone()
    ops.store_kv_ref(key, value, want2, slots, num_tokens=2)
    ops.store_kv(key, value, got2, slots, num_tokens=2)
    assert torch.equal(got2, want2) and not torch.equal(got2, want)


def test_store_kv_rejects_bad_arguments():
    cache = torch.zeros(2, 2, 4, 3, 8)
    key = torch.randn(2, 3, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.store_kv(key, key, cache, torch.tensor([0, 8]))
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.store_kv(key, key, cache.bfloat16(), torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="tokens, but key has"):
        ops.store_kv(key, key, cache, torch.tensor([0, 1]), num_tokens=3)
    with pytest.raises(RuntimeError, match="of those heads"):
        ops.store_kv(torch.randn(2, 2, 8), torch.randn(2, 2, 8), cache, torch.tensor([0, 1]))


def test_the_model_uses_the_ops_on_cpu_and_keeps_torch_elsewhere():
    """``use_cpu_layer_ops`` swaps RMSNorm, Gemma's, rotary and SiLU * up, each for an op
    that gives the same bits; other activations and dtypes the ops do not take keep their
    torch code."""
    from kvpilot.engine.model.layers.norm import GemmaRMSNorm, RMSNorm
    from kvpilot.engine.model.models.llama import MLP

    norm, gemma = RMSNorm(16, 1e-6), GemmaRMSNorm(16, 1e-6)
    x, r = torch.randn(3, 16), torch.randn(3, 16)
    want = norm(x, r)
    norm.use_kernel(ops.add_rms_norm)
    got = norm(x, r)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(norm(x[None]), want_3d := RMSNorm(16, 1e-6)(x[None]))   # 3-D: reshaped
    assert want_3d.shape == (1, 3, 16)
    with torch.no_grad():
        gemma.weight.normal_(0, 0.3)
    heads = torch.randn(3, 6, 16)[:, 1:5]   # a view of a fused projection's heads
    want_gemma = gemma(x, r), gemma(heads)
    calls = []

    def counted(*args):
        calls.append(args[0].shape)
        return ops.gemma_rms_norm(*args)

    gemma.use_kernel(counted)
    got_gemma = gemma(x, r), gemma(heads)
    assert calls == [x.shape, heads.shape], "both calls took the op (the residual add, a strided 3-D view)"
    assert torch.equal(got_gemma[0][0], want_gemma[0][0]) and torch.equal(got_gemma[0][1], want_gemma[0][1])
    assert torch.equal(got_gemma[1], want_gemma[1])
    assert hasattr(MLP, "use_act_mul")
