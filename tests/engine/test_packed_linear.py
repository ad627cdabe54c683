"""bfloat16 projections prepacked for oneDNN (``layers.packed_linear``): the same bits as
``F.linear`` over the plain weight up to 32 rows, and beyond (where a CPU with AMX runs
another oneDNN kernel for ``F.linear``) as close to the float32 product as ``F.linear``
is (a bfloat16 rounding of a float32 sum); the engine packs its
bfloat16 CPU layers and leaves float32 (the HF-parity dtype), FP8 and GGUF layers alone;
a bfloat16 engine's greedy tokens are those of the same engine with packing off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.model.layers import packed_linear as pl
from kvpilot.engine.model.parallel.group import TPGroup
from kvpilot.engine.model.parallel.linear import ColumnParallelLinear, RowParallelLinear
from kvpilot.engine.model.parallel.sharding import Shard

pytestmark = pytest.mark.skipif(not pl.available(), reason="this torch build has no oneDNN linear ops")


@pytest.mark.parametrize("rows", [0, 1, 3, 16, 33, 256])
@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (64, 1536), (4099, 128)])
def test_packed_linear_equals_f_linear_bit_for_bit(rows, out_features, in_features):
    gen = torch.Generator().manual_seed(rows * 7 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, in_features + 5, generator=gen).to(torch.bfloat16)[:, :in_features]  # strided rows
    packed = pl.pack(weight)
    assert packed.shape == weight.shape and packed.dtype == torch.bfloat16
    for b in (None, bias):
        got, want = pl.packed_linear(x, packed, b), F.linear(x, weight, b)
        if rows <= 32:   # every decode step of up to 32 sequences: the same kernel, the same bits
            assert torch.equal(got, want)
            continue
        # Another kernel, another float32 summation order: each result is the bfloat16
        # rounding (half a step: 2^-8 of the value) of a float32 sum whose error grows with
        # the sum of the magnitudes it adds; F.linear meets the same bound (the oracle's check).
        exact = F.linear(x.float(), weight.float(), None if b is None else b.float())
        scale = x.float().abs() @ weight.float().abs().t()
        bound = exact.abs() * 2.0 ** -8 + scale * 2.0 ** -16
        for result in (want, got):
            assert bool(((result.float() - exact).abs() <= bound).all())


def test_only_plain_bfloat16_cpu_layers_are_packed():
    tp = TPGroup()
    column = ColumnParallelLinear(64, [Shard(0, 96, 96)], bias=True).to(torch.bfloat16)
    row = RowParallelLinear(96, 64, bias=False, tp=tp).to(torch.bfloat16)
    f32 = ColumnParallelLinear(64, [Shard(0, 96, 96)], bias=False)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():   # every parameter set (an empty bias is uninitialised memory, NaNs included)
        for layer in (column, row, f32):
            for param in layer.parameters():
                param.copy_(torch.randn(param.shape, generator=gen).to(param.dtype))
    x = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    want = column(x)
    plain_bytes = sum(p.numel() * p.element_size() for p in column.parameters())
    assert column.use_packed_weight() and column.packed and column.weight.is_mkldnn
    assert torch.equal(column(x), want)
    assert sum(p.numel() * p.element_size() for p in column.parameters()) == plain_bytes
    h = torch.randn(5, 96, generator=gen).to(torch.bfloat16)
    want_row = row(h)
    assert row.use_packed_weight() and torch.equal(row(h), want_row)
    assert not f32.use_packed_weight() and not f32.weight.is_mkldnn   # float32: F.linear stays


def test_a_bfloat16_engine_answers_as_without_packing(monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):", "1 2 3 4"]
    packed_llm = LLM("demo", dtype="bfloat16", max_num_seqs=4)
    model = packed_llm.llm_engine.runner.model
    assert model.layers[0].mlp.gate_up_proj.packed and hasattr(model, "output_weight_packed")
    packed = [o.outputs[0].token_ids for o in packed_llm.generate(prompts, params)]
    monkeypatch.setattr(pl, "can_pack", lambda weight: False)
    monkeypatch.setattr("kvpilot.engine.model.parallel.linear.can_pack", lambda weight: False)
    monkeypatch.setattr("kvpilot.engine.model.models.llama.can_pack", lambda weight: False)
    plain_llm = LLM("demo", dtype="bfloat16", max_num_seqs=4)
    assert not plain_llm.llm_engine.runner.model.layers[0].mlp.gate_up_proj.packed
    plain = [o.outputs[0].token_ids for o in plain_llm.generate(prompts, params)]
    assert packed == plain
