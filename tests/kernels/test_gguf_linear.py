"""GGUF weights kept as blocks (``engine/model/layers/gguf_linear.py``, the CPU kernel
``kvpilot.kernels.gguf_matmul_cpu``) against the ``gguf`` package's own dequantizer:
``F.linear(x, gguf.quants.dequantize(blocks))`` is the oracle for every type, batch size
(the q8 path, the vector path and the tiled prefill path), activation dtype, fused layer of mixed types
and permuted rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as reference_dequantize

from kvpilot.engine.model.layers.gguf_linear import (
    dequantize,
    llama_qk_row_order,
    load_gguf_weight,
    resident_bytes,
    use_gguf_weight,
    uses_q8,
)
from kvpilot.engine.model.parallel.group import TPGroup
from kvpilot.engine.model.parallel.linear import ColumnParallelLinear, RowParallelLinear
from kvpilot.engine.model.parallel.sharding import Shard
from kvpilot.kernels import gguf_matmul_cpu

from support.gguf_blocks import random_blocks

FAST_TYPES = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K)
BATCHES = (1, 5, gguf_matmul_cpu.MAX_VECTOR_BATCH + 7)   # the last takes the tiled path

pytestmark = pytest.mark.skipif(gguf_matmul_cpu.load() is None, reason="no C++ compiler here")


def _column_layer(part_rows: list[int], columns: int, qtypes, bias: bool = False) -> ColumnParallelLinear:
    with torch.device("meta"):
        layer = ColumnParallelLinear(columns, [Shard(r, 0, r) for r in part_rows], bias=bias)
        assert use_gguf_weight(layer, qtypes) is None
    return layer.to_empty(device="cpu")


def _check_close(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 q8: bool = False) -> None:
    """``y`` against float32 ``F.linear`` of the same inputs: float32 within float32
    rounding; bfloat16 at least as close as bfloat16 ``F.linear`` itself gets, or on the
    q8 path (8-bit activations: ``tests/gguf/test_gguf_q8_dot.py``) within 1.5 % of the
    largest output."""
    truth = F.linear(x.float(), weight, None if bias is None else bias.float())
    assert y.dtype == x.dtype and y.shape == truth.shape
    err = (y.float() - truth).abs().max().item()
    scale = truth.abs().max().item()
    if x.dtype == torch.float32:
        assert err <= 2e-5 * scale, (err, scale)
    elif q8:
        assert err <= 1.5e-2 * scale, (err, scale)
    else:
        plain = F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
        assert err <= max(1.25 * (plain.float() - truth).abs().max().item(), 4e-3 * scale), (err, scale)


@pytest.mark.parametrize("qtype", [*FAST_TYPES, T.Q2_K, T.Q3_K], ids=lambda t: t.name)
def test_dequantize_matches_the_gguf_package(qtype):
    raw = random_blocks(qtype, 24, 512, np.random.default_rng(int(qtype)))
    got = dequantize(raw, int(qtype))    # Q2_K/Q3_K: no kernel, the gguf package decodes
    torch.testing.assert_close(got, torch.from_numpy(reference_dequantize(raw, qtype)), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("qtype", FAST_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_16_bit_dequantize_rounds_the_gguf_packages_values_once(qtype, dtype):
    # the large-batch path's tiles: decoded straight to the activation dtype
    raw = random_blocks(qtype, 24, 512, np.random.default_rng(int(qtype) + 7))
    raw[0, :2] = np.frombuffer(np.float16(np.nan).tobytes(), dtype=np.uint8)   # a NaN scale stays NaN
    got = gguf_matmul_cpu.dequantize(torch.from_numpy(raw), int(qtype), dtype)
    want = torch.from_numpy(reference_dequantize(raw, qtype)).to(dtype)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        gguf_matmul_cpu.dequantize(torch.from_numpy(raw), int(qtype), torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("qtype", FAST_TYPES, ids=lambda t: t.name)
def test_layer_matches_f_linear_over_the_dequantized_weight(qtype, dtype):
    rng = np.random.default_rng(100 + int(qtype))
    rows, columns = 96, 768
    raw = random_blocks(qtype, rows, columns, rng)
    layer = _column_layer([rows], columns, int(qtype), bias=True).to(dtype)   # the bias in the model dtype
    load_gguf_weight(layer, raw, int(qtype))
    layer.load_weight("bias", torch.randn(rows), None)
    weight = torch.from_numpy(reference_dequantize(raw, qtype))
    assert resident_bytes(layer) == raw.nbytes + rows * layer.bias.element_size()  # the file's bytes, and the bias
    for batch in BATCHES:
        x = torch.randn(batch, columns).to(dtype)
        _check_close(layer(x), x, weight, layer.bias, uses_q8(dtype, int(qtype), batch))
    x3 = torch.randn(2, 3, columns).to(dtype)                  # leading dims are kept
    assert layer(x3).shape == (2, 3, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_layer_of_mixed_types_and_permuted_rows(dtype):
    """q/k/v of a Q4_K_M-style file (Q4_K, Q4_K, Q6_K) fused into one layer, q and k
    rows in llama.cpp's rope order, undone while loading."""
    rng = np.random.default_rng(7)
    columns, heads, kv_heads, head_dim = 512, 4, 2, 32
    sizes, qtypes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], [T.Q4_K, T.Q4_K, T.Q6_K]
    layer = _column_layer(sizes, columns, [int(q) for q in qtypes])
    parts = []
    for shard, (rows, qtype, n) in enumerate(zip(sizes, qtypes, [heads, kv_heads, None], strict=True)):
        raw = random_blocks(qtype, rows, columns, rng)
        order = llama_qk_row_order(rows, n) if n else None
        load_gguf_weight(layer, raw, int(qtype), shard_id=shard, row_order=order)
        dense = torch.from_numpy(reference_dequantize(raw, qtype))
        parts.append(dense if order is None else dense[order])
    weight = torch.cat(parts)
    assert len(layer.gguf.segments) == 2                      # the two Q4_K parts are one call
    for batch in BATCHES:
        x = torch.randn(batch, columns).to(dtype)
        _check_close(layer(x), x, weight, None)


def test_row_order_undoes_llama_cpps_qk_permutation():
    """convert_hf_to_gguf.py permutes q/k rows as ``reshape(heads, 2, d/2).swapaxes(1, 2)``."""
    heads, head_dim, columns = 3, 8, 5
    hf = torch.randn(heads * head_dim, columns)
    in_file = hf.reshape(heads, 2, head_dim // 2, columns).swapaxes(1, 2).reshape(hf.shape)
    assert torch.equal(in_file[llama_qk_row_order(heads * head_dim, heads)], hf)


def test_row_parallel_layer_and_gate_up():
    rng = np.random.default_rng(3)
    hidden, inter = 256, 512
    with torch.device("meta"):
        down = RowParallelLinear(inter, hidden, bias=False, tp=TPGroup())
        assert use_gguf_weight(down, int(T.Q6_K)) is None
    down = down.to_empty(device="cpu")
    raw = random_blocks(T.Q6_K, hidden, inter, rng)
    load_gguf_weight(down, raw, int(T.Q6_K))
    x = torch.randn(3, inter)
    _check_close(down(x), x, torch.from_numpy(reference_dequantize(raw, T.Q6_K)), None)


def test_types_without_a_fast_path_are_dequantized_at_load(caplog):
    rng = np.random.default_rng(11)
    rows, columns = 64, 512
    raw = random_blocks(T.Q3_K, rows, columns, rng)
    with torch.device("meta"):
        layer = ColumnParallelLinear(columns, [Shard(rows, 0, rows)], bias=False)
        with caplog.at_level("INFO"):
            reason = use_gguf_weight(layer, int(T.Q3_K))
        cuda = ColumnParallelLinear(columns, [Shard(rows, 0, rows)], bias=False)
        assert "CPU only" in use_gguf_weight(cuda, int(T.Q4_K), device="cuda")
    assert reason == "no kernel decodes Q3_K" and "dequantized at load: no kernel decodes Q3_K" in caplog.text
    layer = layer.to_empty(device="cpu").to(torch.bfloat16)
    load_gguf_weight(layer, raw, int(T.Q3_K))
    assert layer.gguf is None and layer.weight.dtype == torch.bfloat16
    weight = torch.from_numpy(reference_dequantize(raw, T.Q3_K))
    torch.testing.assert_close(layer.weight, weight.to(torch.bfloat16))
    assert resident_bytes(layer) == rows * columns * 2


def test_a_tensor_that_does_not_fit_is_refused():
    rng = np.random.default_rng(5)
    layer = _column_layer([64], 512, int(T.Q4_K))
    with pytest.raises(ValueError, match="does not fit part 0"):
        load_gguf_weight(layer, random_blocks(T.Q6_K, 64, 512, rng), int(T.Q6_K))
    with pytest.raises(ValueError, match="does not fit part 0"):
        load_gguf_weight(layer, random_blocks(T.Q4_K, 32, 512, rng), int(T.Q4_K))
    with torch.device("meta"):
        odd = ColumnParallelLinear(96, [Shard(8, 0, 8)], bias=False)
        assert "not a whole number of Q4_K blocks" in use_gguf_weight(odd, int(T.Q4_K))
        with pytest.raises(ValueError, match="2 ggml types for a layer of 1 parts"):
            use_gguf_weight(odd, [int(T.Q4_K)] * 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_1, T.Q6_K], ids=lambda t: t.name)
def test_embedding_decodes_only_the_rows_it_reads(qtype, dtype):
    """The token embedding (and a tied LM head) kept as blocks: lookups equal
    ``F.embedding`` over the dequantized table in the model dtype."""
    from kvpilot.engine.model.layers.gguf_linear import use_gguf_embedding
    from kvpilot.engine.model.parallel.linear import VocabParallelEmbedding

    vocab, hidden = 300, 256
    raw = random_blocks(qtype, vocab, hidden, np.random.default_rng(21))
    with torch.device("meta"):
        emb = VocabParallelEmbedding(vocab, hidden, TPGroup()).to(dtype)
        assert use_gguf_embedding(emb, int(qtype)) is None
    emb = emb.to_empty(device="cpu")
    load_gguf_weight(emb, raw, int(qtype))
    assert resident_bytes(emb) == raw.nbytes
    table = torch.from_numpy(reference_dequantize(raw, qtype))
    ids = torch.tensor([[0, 299, 5], [17, 17, 42]])
    got = emb(ids)
    assert got.dtype == dtype and got.shape == (2, 3, hidden)
    torch.testing.assert_close(got, F.embedding(ids, table).to(dtype), rtol=0, atol=0)
