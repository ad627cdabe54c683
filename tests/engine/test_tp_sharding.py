"""Which part of each weight a tensor-parallel rank holds (no processes needed).

Oracles: grouped-query attention's own head grouping (query head ``h`` reads KV head
``h // (heads / kv_heads)``, as HF's ``repeat_kv`` does) for the KV head assignment, and
the unsharded ``F.linear`` for the layers: the ranks' column-parallel outputs
concatenated, and their row-parallel partial products summed, must give it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from kvpilot.contract.kv_layout import tensor_parallel_split_error
from kvpilot.engine.model.parallel.group import TPGroup
from kvpilot.engine.model.parallel.linear import ColumnParallelLinear, RowParallelLinear
from kvpilot.engine.model.parallel.sharding import Shard, even_shard, kv_head_shard, read_shard

LAYOUTS = [(32, 8), (32, 4), (64, 8), (28, 4), (16, 2), (8, 1), (4, 4)]


@pytest.mark.parametrize("num_heads, num_kv_heads", LAYOUTS)
def test_each_rank_holds_the_kv_heads_its_query_heads_read(num_heads, num_kv_heads):
    group = num_heads // num_kv_heads
    for tp in (1, 2, 4, 8):
        if tensor_parallel_split_error(num_heads, num_kv_heads, 256, tp) is not None:
            continue
        for rank in range(tp):
            q = even_shard(num_heads, rank, tp)
            kv = kv_head_shard(num_kv_heads, rank, tp)
            needed = sorted({h // group for h in range(q.start, q.start + q.size)})
            assert needed == list(range(kv.start, kv.start + kv.size)), (tp, rank)
            # locally, query head i reads KV head i // (local heads / local KV heads) too
            for i, h in enumerate(range(q.start, q.start + q.size)):
                assert kv.start + i // (q.size // kv.size) == h // group


def test_read_shard_cuts_checkpoint_slices_in_their_own_dtype(tmp_path):
    weight = torch.randn(8, 6).to(torch.float8_e4m3fn)
    block_scale = torch.rand(4, 3)                 # one per 2 x 2 block of the weight
    path = tmp_path / "w.safetensors"
    save_file({"w": weight, "s": block_scale, "t": torch.tensor(0.5)}, path)
    with safe_open(str(path), framework="pt") as f:
        rows = read_shard(f.get_slice("w"), 0, Shard(8, 4, 4))
        cols = read_shard(f.get_slice("w"), 1, Shard(6, 2, 2))
        scale_rows = read_shard(f.get_slice("s"), 0, Shard(8, 4, 4))
        scalar = read_shard(f.get_slice("t"), 0, Shard(8, 4, 4))
    assert rows.dtype == torch.float8_e4m3fn
    assert torch.equal(rows.view(torch.uint8), weight[4:8].view(torch.uint8))
    assert torch.equal(cols.view(torch.uint8), weight[:, 2:4].view(torch.uint8))
    assert torch.equal(scale_rows, block_scale[2:4])   # rows 4..8 of the weight = scale rows 2..4
    assert scalar.item() == 0.5                        # per-tensor: replicated
    with pytest.raises(ValueError, match="cannot follow a shard"):
        read_shard(block_scale, 0, Shard(8, 3, 4))


def test_column_and_row_parallel_shards_recompose_the_full_layer():
    torch.manual_seed(0)
    hidden, q_out, kv_out, inter = 16, 8, 4, 12
    x = torch.randn(5, hidden)
    q, k, v = torch.randn(q_out, hidden), torch.randn(kv_out, hidden), torch.randn(kv_out, hidden)
    bias = [torch.randn(q_out), torch.randn(kv_out), torch.randn(kv_out)]
    down = torch.randn(hidden, inter)
    full_qkv = F.linear(x, torch.cat([q, k, v]), torch.cat(bias))
    outs, partials = [], []
    for rank in range(2):
        parts = [even_shard(q_out, rank, 2), even_shard(kv_out, rank, 2), even_shard(kv_out, rank, 2)]
        layer = ColumnParallelLinear(hidden, parts, bias=True)
        for i, (w, b) in enumerate(zip((q, k, v), bias, strict=True)):
            layer.load_weight("weight", w, i)
            layer.load_weight("bias", b, i)
        outs.append(layer(x).split(layer.output_sizes, dim=-1))
        row = RowParallelLinear(inter, hidden, bias=False, tp=TPGroup(rank, 2))
        row.load_weight("weight", down, None)
        shard = row.shard
        partials.append(F.linear(torch.ones(5, inter)[:, shard.start:shard.start + shard.size], row.weight))
    for j in range(3):        # q, k, v: rank 0's rows then rank 1's
        got = torch.cat([outs[0][j], outs[1][j]], dim=-1)
        want = full_qkv.split([q_out, kv_out, kv_out], dim=-1)[j]
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(partials[0] + partials[1], F.linear(torch.ones(5, inter), down))
