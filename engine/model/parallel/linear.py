"""Megatron-style tensor-parallel layers (identical to ``nn.Linear`` / ``nn.Embedding``
at one rank).

- ``ColumnParallelLinear``: output rows split across ranks, no communication; fused
  layers (q/k/v, gate/up) shard each part separately (``parts``), so a rank's fused
  weight is its q rows, then its k rows, then its v rows.
- ``RowParallelLinear``: input columns split; the partial products are summed with an
  all-reduce, then the (replicated) bias is added once.
- ``VocabParallelEmbedding``: vocabulary rows split (padded to equal shards); a rank
  embeds the ids it holds, zeros the rest, and an all-reduce sums the ranks. The LM
  head uses the same row split; ``vocab_parallel_logits`` gathers the rank's logits
  columns to the driver.

Each layer loads its parameters from checkpoint tensors with ``load_weight(name, src,
shard_id)``: ``src`` is read only where this rank's shard lies (``sharding.read_shard``)
and converted to the parameter's dtype afterwards, whatever that dtype is. The linear
layers may hold FP8 weights with a ``weight_scale`` (``layers.fp8_linear``); a one-value
checkpoint tensor (a per-tensor scale) fills its part's rows. They may instead hold GGUF
block bytes (``layers.gguf_linear``, loaded by its ``load_gguf_weight``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.engine.model.layers.fp8_linear import fp8_linear
from kvpilot.engine.model.layers.gguf_linear import gguf_embedding, gguf_linear
from kvpilot.engine.model.layers.packed_linear import can_pack, pack, packed_linear
from kvpilot.engine.model.parallel.group import TPGroup
from kvpilot.engine.model.parallel.sharding import (
    Shard,
    even_shard,
    padded_shard,
    read_shard,
    shape_of,
)


class ShapeMismatch(ValueError):
    """A checkpoint tensor's (whole) shape is not what the layer expects."""

    def __init__(self, got: tuple[int, ...], expected: tuple[int, ...]) -> None:
        super().__init__(f"shape {got}, expected {expected}")
        self.got, self.expected = got, expected


def check_shape(src: Any, expected: tuple[int, ...]) -> None:
    got = shape_of(src)
    if got != tuple(expected):
        raise ShapeMismatch(got, tuple(expected))


def _copy(dst: torch.Tensor, rows: torch.Tensor) -> None:
    dst.copy_(rows.to(dst.dtype))


def _use_packed_weight(layer: nn.Module) -> bool:
    """Replace a loaded plain bfloat16 CPU weight by its oneDNN packing (``layers.
    packed_linear``; same bytes, same results, no per-call reorder); False where the
    layer keeps its weight (FP8, GGUF blocks, another dtype or device)."""
    if layer.packed or layer.fp8 is not None or layer.gguf is not None or not can_pack(layer.weight):
        return layer.packed
    layer.weight = nn.Parameter(pack(layer.weight), requires_grad=False)
    layer.packed = True
    return True


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with W's output rows split across ranks.

    Args:
        input_size: features in (whole on every rank).
        parts: this rank's shard of each fused output (one part for a plain layer); the
            checkpoint tensor of part ``i`` is loaded with ``shard_id=i``.
        bias: whether the layer has a bias (sharded like the rows).
    """

    def __init__(self, input_size: int, parts: Sequence[Shard], bias: bool) -> None:
        super().__init__()
        self.input_size = input_size
        self.parts = tuple(parts)
        self.offsets = tuple(itertools.accumulate((p.size for p in self.parts), initial=0))
        self.weight = nn.Parameter(torch.empty(self.offsets[-1], input_size))
        self.bias = nn.Parameter(torch.empty(self.offsets[-1])) if bias else None
        self.fp8 = None    # an Fp8WeightConfig once ``use_fp8_weight`` made the weight FP8
        self.gguf = None   # a GgufLayout once ``use_gguf_weight`` gave it GGUF blocks
        self.packed = False   # the weight prepacked for oneDNN (``use_packed_weight``)

    @property
    def output_sizes(self) -> list[int]:
        """This rank's rows of each part (to split the output)."""
        return [p.size for p in self.parts]

    def load_weight(self, name: str, src: Any, shard_id: int | None) -> None:
        param = getattr(self, name)
        index = shard_id or 0
        part = self.parts[index]
        if name in ("weight", "bias"):
            check_shape(src, (part.full, *param.shape[1:]))
        rows = read_shard(src, 0, part)
        if param.ndim == 0:                  # a per-tensor value (a scale): replicated
            _copy(param.data, rows)
            return
        # the part's place in the fused parameter, in the parameter's own rows (a tensor
        # attached to the weight may have one row per block of weight rows)
        start = self.offsets[index] * param.shape[0] // self.offsets[-1]
        if math.prod(shape_of(src)) == 1:    # one value for the whole part: fill its rows
            stop = self.offsets[index + 1] * param.shape[0] // self.offsets[-1]
            _copy(param.data[start:stop], rows.reshape(()))
            return
        _copy(param.data[start:start + rows.shape[0]], rows)

    def use_packed_weight(self) -> bool:
        return _use_packed_weight(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return packed_linear(x, self.weight, self.bias)
        if self.fp8 is not None:
            return fp8_linear(x, self.weight, self.weight_scale, self.bias, self.fp8)
        if self.gguf is not None:
            return gguf_linear(x, self.weight, self.bias, self.gguf)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = sum over ranks(x_r W_r^T) + b``: W's input columns split across ranks; ``x``
    arrives split the same way (a column-parallel layer's output)."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.shard = even_shard(input_size, tp.rank, tp.world_size, "input size")
        self.weight = nn.Parameter(torch.empty(output_size, self.shard.size))
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None
        self.fp8 = None    # an Fp8WeightConfig once ``use_fp8_weight`` made the weight FP8
        self.gguf = None   # a GgufLayout once ``use_gguf_weight`` gave it GGUF blocks
        self.packed = False   # the weight prepacked for oneDNN (``use_packed_weight``)

    def load_weight(self, name: str, src: Any, shard_id: int | None) -> None:
        param = getattr(self, name)
        if name == "weight":
            check_shape(src, (param.shape[0], self.shard.full))
        elif name == "bias":
            check_shape(src, tuple(param.shape))
        _copy(param.data, read_shard(src, 1, self.shard))

    def use_packed_weight(self) -> bool:
        return _use_packed_weight(self)

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed:
            return packed_linear(x, self.weight, bias)
        if self.fp8 is not None:
            return fp8_linear(x, self.weight, self.weight_scale, bias, self.fp8)
        if self.gguf is not None:
            return gguf_linear(x, self.weight, bias, self.gguf)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return self._linear(x, self.bias)
        y = self.tp.all_reduce(self._linear(x, None))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split across ranks (equal, padded shards); also the LM head's weight."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.shard = padded_shard(vocab_size, tp.rank, tp.world_size)
        self.weight = nn.Parameter(torch.empty(self.shard.size, hidden_size))
        self.gguf = None   # a GgufLayout once ``use_gguf_embedding`` gave it GGUF blocks

    def load_weight(self, name: str, src: Any, shard_id: int | None) -> None:
        check_shape(src, (self.vocab_size, self.weight.shape[1]))
        rows = read_shard(src, 0, self.shard)
        _copy(self.weight.data[:rows.shape[0]], rows)
        self.weight.data[rows.shape[0]:].zero_()     # padding rows: logits 0, sliced off

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.gguf is not None:         # one rank only (use_gguf_embedding)
            return gguf_embedding(input_ids, self.weight, self.gguf, self.gguf_dtype)
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.shard.start
        outside = (local < 0) | (local >= self.shard.num_real)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)


def vocab_parallel_logits(local: torch.Tensor, tp: TPGroup, vocab_size: int) -> torch.Tensor | None:
    """Float32 logits ``[rows, vocab_size]`` from each rank's ``[rows, shard]`` columns: on
    the driver; None on the other ranks (which must call this too: it is a collective)."""
    if tp.world_size == 1:
        return local.float()
    parts = tp.gather_to_driver(local)
    if parts is None:
        return None
    return torch.cat(parts, dim=-1)[:, :vocab_size].float()
