"""The interleaved layout of the CPU GGUF kernel (``gguf_matmul_cpu.interleave`` and
``matmul_q8_interleaved``) and the layers that hold it.

Oracles: the file's rows (the layout turns back into exactly them); the pure-torch model
of the q8 path (``support.q8_reference``) (activation codes as the kernel rounds them, times
the ``gguf`` package's dequantization in float64), to float32 rounding; the same call one
token at a time (bit-identical: a verification step must equal single-token decoding);
float64 ``F.linear`` over the dequantized weight for a layer on both of its paths. The
product runs on each instruction set the CPU has (AVX512-VNNI, AVX2), and the two give the
same bits.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as reference_dequantize

from kvpilot.engine.model.layers import gguf_linear as gguf_linear_module
from kvpilot.engine.model.layers.gguf_linear import (
    build_layout,
    gguf_embedding,
    gguf_linear,
    interleaves,
)
from kvpilot.kernels import gguf_matmul_cpu

from support.gguf_blocks import random_blocks
from support.q8_reference import assert_matches_q8_reference

TYPES = (T.Q4_0, T.Q4_1, T.Q8_0)
_BEST = gguf_matmul_cpu.load().q8_isa() if gguf_matmul_cpu.load() is not None else 0
ISAS = {1: ("vnni", "avx2"), 2: ("avx2",)}.get(_BEST, ())   # a VNNI CPU has AVX2 as well

pytestmark = pytest.mark.skipif(not ISAS, reason="the interleaved layout needs AVX512-VNNI or AVX2")


def _weight(qtype: T, rows: int, columns: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    raw = random_blocks(qtype, rows, columns, np.random.default_rng(seed))
    return torch.from_numpy(raw), torch.from_numpy(reference_dequantize(raw, qtype)).double()


def _assert_product(x: torch.Tensor, packed: torch.Tensor, qtype: T, weight: torch.Tensor,
                    bias: torch.Tensor | None, isa: str) -> None:
    """The kernel's product in ``x``'s dtype on ``isa``: the q8 reference's to float32
    rounding, bit for bit the same one token at a time, and (a CPU with both) the same bits
    on the other instruction set."""
    y = gguf_matmul_cpu.matmul_q8_interleaved(x, packed, int(qtype), bias, isa=isa)
    assert y.dtype == x.dtype and y.shape == (x.shape[0], packed.shape[0])
    assert_matches_q8_reference(y, x, weight, bias)
    alone = torch.cat([gguf_matmul_cpu.matmul_q8_interleaved(x[i:i + 1], packed, int(qtype), bias, isa=isa)
                       for i in range(x.shape[0])])
    assert torch.equal(alone, y)
    for other in ISAS:
        assert torch.equal(gguf_matmul_cpu.matmul_q8_interleaved(x, packed, int(qtype), bias, isa=other), y)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_layout_holds_the_same_bytes_and_turns_back_into_the_rows(qtype):
    raw, _ = _weight(qtype, 48, 96, int(qtype))
    packed = gguf_matmul_cpu.interleave(raw, int(qtype))
    assert packed.shape == raw.shape and packed.dtype == torch.uint8
    assert not torch.equal(packed, raw)
    assert torch.equal(gguf_matmul_cpu.deinterleave(packed, int(qtype)), raw)
    # groups are independent: the second group's bytes are the second group's rows
    assert torch.equal(gguf_matmul_cpu.deinterleave(packed[16:32], int(qtype)), raw[16:32])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_kernel_matches_the_q8_reference_and_one_token_at_a_time(qtype, isa):
    torch.manual_seed(int(qtype))
    rows, columns = 48, 96
    raw, weight = _weight(qtype, rows, columns, 10 + int(qtype))
    packed = gguf_matmul_cpu.interleave(raw, int(qtype))
    bias = torch.randn(rows)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for batch in (1, 3, 4, 7, 8, 9, 24, 70):   # AVX2: tiles up to 8, chunks of 64 above
            x = (torch.randn(batch, columns) * torch.rand(batch, 1) * 4).to(dtype)
            x[0, :32] = 0                                    # an all-zero block: scale 0
            if qtype == T.Q8_0:   # codes -128 and 127 against activations of +-127: the extremes
                x[-1, 32:64] = torch.tensor([4.0, -4.0] * 16)
            _assert_product(x, packed, qtype, weight, bias if batch % 2 else None, isa)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_rows_wider_than_4096_columns_match_the_q8_reference(qtype, isa):
    """Qwen2.5-0.5B's down_proj width (4,864) and 8,192 + 32 (an odd number of blocks)."""
    torch.manual_seed(30 + int(qtype))
    rows = 32
    for columns in (4864, 8224):
        raw, weight = _weight(qtype, rows, columns, 30 + int(qtype))
        packed = gguf_matmul_cpu.interleave(raw, int(qtype))
        bias = torch.randn(rows)
        for dtype, batch in ((torch.bfloat16, 1), (torch.float16, 7)):
            x = (torch.randn(batch, columns) * torch.rand(batch, 1) * 4).to(dtype)
            _assert_product(x, packed, qtype, weight, bias, isa)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_an_interleaved_weight_dequantizes_to_the_files_values(qtype):
    """``dequantize_interleaved``: the row kernel's values of the file's rows, bit for bit
    in each dtype, rows in the file's order (the gguf package's dequantization in float32)."""
    raw, weight = _weight(qtype, 64, 4864, 30 + int(qtype))
    packed = gguf_matmul_cpu.interleave(raw, int(qtype))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = gguf_matmul_cpu.dequantize_interleaved(packed, int(qtype), dtype)
        assert got.dtype == dtype and got.shape == (64, 4864)
        assert torch.equal(got, gguf_matmul_cpu.dequantize(raw, int(qtype), dtype))
        assert torch.allclose(got.double(), weight.to(dtype).double(), rtol=1e-6, atol=0)
    # a group is its rows: a slice of whole groups decodes alone
    assert torch.equal(gguf_matmul_cpu.dequantize_interleaved(packed[16:48], int(qtype)),
                       gguf_matmul_cpu.dequantize(raw[16:48], int(qtype)))
    # chosen rows, in their order (repeats, group edges): those rows of the whole
    rows = torch.tensor([63, 0, 17, 16, 15, 17, 48])
    whole = gguf_matmul_cpu.dequantize(raw, int(qtype), torch.bfloat16)
    assert torch.equal(gguf_matmul_cpu.dequantize_interleaved(packed, int(qtype), torch.bfloat16, rows=rows),
                       whole[rows])
    assert gguf_matmul_cpu.dequantize_interleaved(packed, int(qtype), rows=rows[:0]).shape == (0, 4864)


def test_bad_weights_are_refused():
    raw, _ = _weight(T.Q4_1, 40, 64, 1)
    with pytest.raises(ValueError, match="multiple of 16 rows"):
        gguf_matmul_cpu.interleave(raw, int(T.Q4_1))
    k_quant, _ = _weight(T.Q4_K, 16, 256, 1)
    with pytest.raises(ValueError, match="no interleaved layout"):
        gguf_matmul_cpu.interleave(k_quant, int(T.Q4_K))
    with pytest.raises(ValueError, match="no interleaved layout"):
        gguf_matmul_cpu.interleave(_weight(T.Q5_0, 16, 64, 1)[0], int(T.Q5_0))
    # the product checks in the kernel (no Python checks on the decode path)
    packed = gguf_matmul_cpu.interleave(_weight(T.Q4_1, 32, 64, 2)[0], int(T.Q4_1))
    x = torch.randn(2, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="multiple of 16 rows"):
        gguf_matmul_cpu.matmul_q8_interleaved(x, packed[:24], int(T.Q4_1))
    with pytest.raises(RuntimeError, match="no interleaved layout"):
        gguf_matmul_cpu.matmul_q8_interleaved(x, packed, int(T.Q5_1))
    with pytest.raises(RuntimeError, match="columns"):
        gguf_matmul_cpu.matmul_q8_interleaved(torch.randn(2, 32).to(torch.bfloat16), packed, int(T.Q4_1))
    with pytest.raises(RuntimeError, match="uint8"):
        gguf_matmul_cpu.matmul_q8_interleaved(x, packed.float(), int(T.Q4_1))
    with pytest.raises(ValueError, match="multiple of 16 rows"):
        gguf_matmul_cpu.dequantize_interleaved(packed[:24], int(T.Q4_1))
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        gguf_matmul_cpu.dequantize_interleaved(packed, int(T.Q4_1), torch.float64)
    for bad in (32, -1):
        with pytest.raises(RuntimeError, match=f"row id {bad} is outside the weight's 32 rows"):
            gguf_matmul_cpu.dequantize_interleaved(packed, int(T.Q4_1), rows=torch.tensor([0, bad]))


def test_a_layer_chooses_the_layout_and_serves_both_paths(monkeypatch):
    monkeypatch.delenv(gguf_matmul_cpu.Q8_ENV, raising=False)
    q41, q80 = int(T.Q4_1), int(T.Q8_0)
    assert interleaves(torch.bfloat16, [32, 16], [q41, q80])
    assert not interleaves(torch.float32, [32], [q41])             # the exact float path stays
    assert interleaves(torch.float32, [32], [q41], float32_q8=True)   # --dtype auto, no bf16
    assert not interleaves(torch.bfloat16, [40], [q41])            # not whole groups
    assert not interleaves(torch.bfloat16, [32], [int(T.Q5_1)])
    monkeypatch.setenv(gguf_matmul_cpu.Q8_ENV, "0")
    assert not interleaves(torch.bfloat16, [32], [q41])            # the q8 path switched off
    monkeypatch.delenv(gguf_matmul_cpu.Q8_ENV)

    parts = [(_weight(T.Q4_1, 32, 256, 3)), (_weight(T.Q8_0, 16, 256, 4))]
    layout = build_layout(256, [32, 16], [q41, q80], interleaved=True)
    flat = torch.cat([gguf_matmul_cpu.interleave(raw, q).reshape(-1)
                      for (raw, _), q in zip(parts, (q41, q80), strict=True)])
    weight = torch.cat([w for _, w in parts])
    bias = torch.randn(48).to(torch.bfloat16)      # the model dtype, as a layer holds it
    calls = []
    real = gguf_matmul_cpu.matmul_q8_interleaved
    monkeypatch.setattr(gguf_matmul_cpu, "matmul_q8_interleaved", lambda *a, **k: calls.append(1) or real(*a, **k))
    bound = gguf_matmul_cpu.Q8_INTERLEAVED_MAX_BATCH
    for tile_rows in (48, 16):   # a part in one tile, or a tile of 16 rows at a time
        monkeypatch.setattr(gguf_linear_module, "TILE_ELEMENTS", tile_rows * 256)
        for batch in (1, gguf_matmul_cpu.Q8_MAX_BATCH + 1, bound, bound + 1):   # q8 up to the bound, then tiles
            calls.clear()
            x = torch.randn(batch, 256).to(torch.bfloat16)
            y = gguf_linear(x, flat, bias, layout)
            assert bool(calls) == (batch <= bound)
            truth = x.double() @ weight.T + bias.double()
            assert y.dtype == torch.bfloat16 and y.shape == (batch, 48)
            assert (y.double() - truth).abs().max() <= 3e-2 * truth.abs().max()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_an_interleaved_embedding_looks_up_the_files_rows(qtype):
    raw, weight = _weight(qtype, 64, 64, 20 + int(qtype))
    rows_layout = build_layout(64, [64], [int(qtype)])
    packed_layout = build_layout(64, [64], [int(qtype)], interleaved=True)
    ids = torch.tensor([[0, 17, 63, 17], [5, 16, 15, 48]])        # repeats, group edges
    packed = gguf_matmul_cpu.interleave(raw, int(qtype)).reshape(-1)
    for dtype in (torch.float32, torch.bfloat16):
        expected = gguf_embedding(ids, raw.reshape(-1), rows_layout, dtype)
        assert torch.equal(gguf_embedding(ids, packed, packed_layout, dtype), expected)
        assert torch.allclose(expected.double(), weight[ids].to(dtype).double())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_float_product_matches_float64_over_the_files_values(qtype):
    """``matmul_interleaved_float``: the few float rows of a prompt step (a float32 model's LM
    head, a prompt's last tokens after a prefix hit) times the file's values, no 8-bit
    activations: float64 ``x @ W.T + b`` to float32 rounding, any number of rows, rows wider
    than a block pair, bfloat16 input converted."""
    torch.manual_seed(40 + int(qtype))
    for rows, columns in ((48, 96), (32, 4864)):
        raw, weight = _weight(qtype, rows, columns, 40 + int(qtype))
        packed = gguf_matmul_cpu.interleave(raw, int(qtype))
        bias = torch.randn(rows)
        for batch in (1, 3, 4, 5, 16):
            x = torch.randn(batch, columns) * torch.rand(batch, 1) * 4
            for b in (bias, None):
                y = gguf_matmul_cpu.matmul_interleaved_float(x, packed, int(qtype), b)
                truth = x.double() @ weight.T + (0 if b is None else b.double())
                assert y.dtype == torch.float32 and y.shape == (batch, rows)
                assert (y.double() - truth).abs().max() <= 2e-6 * truth.abs().max()
                alone = torch.cat([gguf_matmul_cpu.matmul_interleaved_float(x[i:i + 1], packed, int(qtype), b)
                                   for i in range(batch)])
                assert torch.equal(alone, y)
        half = x.to(torch.bfloat16)
        assert torch.equal(gguf_matmul_cpu.matmul_interleaved_float(half, packed, int(qtype)),
                           gguf_matmul_cpu.matmul_interleaved_float(half.float(), packed, int(qtype)))
    with pytest.raises(RuntimeError, match="columns"):
        gguf_matmul_cpu.matmul_interleaved_float(torch.randn(2, 64), packed, int(qtype))


def test_a_float32_layer_takes_the_float_product_for_few_prompt_rows(monkeypatch):
    """A float32 layer loaded with ``float32_q8`` (``--dtype auto`` without native bfloat16):
    decode rows on the q8 kernel; inside ``float_activations`` (a prompt step) up to
    ``INTERLEAVED_FLOAT_MAX_BATCH`` rows on the float product, more on tiles for ``F.linear``."""
    monkeypatch.delenv(gguf_matmul_cpu.Q8_ENV, raising=False)
    q41 = int(T.Q4_1)
    raw, weight = _weight(T.Q4_1, 32, 256, 5)
    layout = build_layout(256, [32], [q41], interleaved=True, float32_q8=True)
    flat = gguf_matmul_cpu.interleave(raw, q41).reshape(-1)
    calls = []
    for name in ("matmul_q8_interleaved", "matmul_interleaved_float"):
        real = getattr(gguf_matmul_cpu, name)
        monkeypatch.setattr(gguf_matmul_cpu, name,
                            lambda *a, _name=name, _real=real, **k: calls.append(_name) or _real(*a, **k))
    small, large = gguf_matmul_cpu.INTERLEAVED_FLOAT_MAX_BATCH, gguf_matmul_cpu.INTERLEAVED_FLOAT_MAX_BATCH + 1
    for batch, prompt, expected in ((1, False, ["matmul_q8_interleaved"]), (small, True, ["matmul_interleaved_float"]),
                                    (large, True, [])):
        calls.clear()
        x = torch.randn(batch, 256)
        with gguf_linear_module.float_activations(prompt):
            y = gguf_linear(x, flat, None, layout)
        assert calls == expected and y.dtype == torch.float32
        truth = x.double() @ weight.T
        tolerance = 3e-2 if not prompt else 2e-6   # 8-bit activations, or float ones
        assert (y.double() - truth).abs().max() <= tolerance * truth.abs().max()
