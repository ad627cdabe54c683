"""Which part of each weight a rank holds, and reading just that part of a checkpoint.

A ``Shard`` is a rank's run of rows along one dimension. Sharding is decided on the
checkpoint's own tensor and before any dtype conversion: ``read_shard`` asks safetensors
for the rank's slice only (other ranks' bytes are never read), in whatever dtype the
checkpoint stores, so a quantized weight (fp8) and its scales shard the same way as a
16-bit one. Tensors attached to a layer whose extent along the split dimension is a
fraction of the weight's (block-wise scales: one per 128 rows) are cut in proportion;
tensors without that dimension, or with extent 1 (per-tensor scales), are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvpilot.contract.kv_layout import kv_heads_per_rank


@dataclass(frozen=True, slots=True)
class Shard:
    """Rows ``[start, start + size)`` of a dimension of ``full`` rows held by one rank.

    ``size`` may run past ``full`` (the vocabulary's last shard is padded so that every
    rank's shard has one size); ``num_real`` counts the rows that exist.
    """

    full: int
    start: int
    size: int

    @property
    def num_real(self) -> int:
        return max(0, min(self.size, self.full - self.start))

    def scaled(self, factor: int) -> Shard:
        """The same shard counted in units ``factor`` times finer (heads -> rows)."""
        return Shard(self.full * factor, self.start * factor, self.size * factor)


def even_shard(full: int, rank: int, world_size: int, what: str = "dimension") -> Shard:
    """Rank ``rank``'s equal share of ``full`` rows; ValueError when they do not split."""
    if full % world_size:
        raise ValueError(f"{what} of {full} does not split evenly over {world_size} ranks")
    size = full // world_size
    return Shard(full, rank * size, size)


def padded_shard(full: int, rank: int, world_size: int) -> Shard:
    """``ceil(full / world_size)`` rows per rank; the last rank's tail is padding."""
    size = -(-full // world_size)
    return Shard(full, rank * size, size)


def kv_head_shard(num_kv_heads: int, rank: int, world_size: int) -> Shard:
    """The KV heads rank ``rank`` holds (in heads).

    Split evenly when there are at least as many heads as ranks; otherwise each head is
    replicated on ``world_size / num_kv_heads`` consecutive ranks: exactly the ranks
    whose query heads attend to it under grouped-query attention.
    """
    per_rank = kv_heads_per_rank(num_kv_heads, world_size)
    if num_kv_heads >= world_size:
        return Shard(num_kv_heads, rank * per_rank, per_rank)
    return Shard(num_kv_heads, rank // (world_size // num_kv_heads), 1)


def shape_of(src: Any) -> tuple[int, ...]:
    """Shape of a torch tensor or a safetensors slice (``get_slice``)."""
    get_shape = getattr(src, "get_shape", None)
    return tuple(get_shape()) if get_shape is not None else tuple(src.shape)


def read_shard(src: Any, dim: int, shard: Shard | None) -> torch.Tensor:
    """This rank's part of ``src`` (a tensor or a safetensors slice) along ``dim``.

    ``shard`` is counted in the weight's rows; ``src`` may be the weight itself or a
    tensor attached to it (see the module docstring). ``None``: all of ``src``.
    """
    shape = shape_of(src)
    if shard is None or dim >= len(shape) or shape[dim] == 1:
        return src[()] if not shape else src[(slice(None),) * len(shape)]
    extent = shape[dim]
    start, stop = shard.start, shard.start + shard.num_real
    if extent != shard.full:
        ratio, rest = divmod(shard.full, extent)
        if rest or start % ratio or stop % ratio:
            raise ValueError(f"a tensor of extent {extent} along dim {dim} cannot follow a shard "
                             f"of rows {start}..{stop} of {shard.full}")
        start, stop = start // ratio, stop // ratio
    return src[(slice(None),) * dim + (slice(start, stop),)]
