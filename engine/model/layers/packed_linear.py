"""bfloat16 linear layers on CPU with their weights prepacked for oneDNN.

``F.linear`` over a plain ``[out, in]`` bfloat16 weight makes oneDNN copy the weight into
its blocked layout on every call (``brgemm_matmul ... copy_b_chunk`` in a profile): a
decode step, which streams every weight once, reads each weight twice and writes it once.
``pack`` reorders a weight into that layout once, at load (``torch.ops.mkldnn.
_reorder_linear_weight``, the op torch's inductor uses for frozen CPU weights), and
``packed_linear`` multiplies by it (``torch.ops.mkldnn._linear_pointwise``). Up to 32
rows (every decode step of up to 32 sequences) the results are bit-identical to
``F.linear`` over the plain weight: the same oneDNN kernel runs. Beyond that, on a CPU
with AMX, oneDNN picks another kernel for ``F.linear``'s per-call layout than for the
packed one, and the two may round differently (each is the bfloat16 rounding of a float32
sum, in another order; both as close to the float32 product); elsewhere they stay
identical.
``tests/engine/test_packed_linear.py`` checks both for every batch size a step has. The
packed weight replaces the plain one, so the memory stays the same.
Measured over SmolLM2-135M's matrices on 2 cores of an AVX512-BF16 EPYC: 10.9 -> 7.2 ms
per pass at 1 token, 12.2 -> 8.3 at 8, 19.1 -> 14.1 at 32.

Only bfloat16: a float32 weight keeps ``F.linear`` (MKL's sgemm; oneDNN's would round
differently, and float32 is the dtype of the token-identical HF parity tests).
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def available() -> bool:
    """Whether this torch build has the oneDNN ops (and they run here)."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    try:
        w = torch.ones(4, 8, dtype=torch.bfloat16)
        out = packed_linear(torch.ones(1, 8, dtype=torch.bfloat16), pack(w))
        return bool(torch.equal(out, torch.full((1, 4), 8.0, dtype=torch.bfloat16)))
    except RuntimeError:
        return False


def can_pack(weight: torch.Tensor) -> bool:
    """Whether ``weight`` (a plain 2-D CPU bfloat16 tensor) can be packed here."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and weight.layout == torch.strided and available())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` in oneDNN's blocked layout (an opaque mkldnn tensor of the
    same shape and dtype), for ``packed_linear``. The layout is chosen for one token rows
    and serves any number of rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``packed = pack(weight)``; ``x`` ``[..., in]``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
