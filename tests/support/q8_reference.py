"""A pure-torch model of the q8 path's activation rounding (``gguf_matmul_cpu``): the
oracle the q8 kernels' tests multiply by the ``gguf`` package's dequantized weights."""

from __future__ import annotations

import torch


def quantize_like_the_kernel(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``[batch, columns]`` of ``x``'s q8 blocks dequantized (``dx * a``), and
    ``dx`` where ``x * 127 / amax`` lies within float32 rounding of a half (the kernel's
    product may round to the other side of the tie: one code step either way), else 0."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    d = amax * torch.tensor(1.0 / 127.0, dtype=torch.float32)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    scaled = blocks * inv
    codes = torch.round(scaled)
    assert codes.abs().max() <= 127
    tie = ((scaled - scaled.floor() - 0.5).abs() < 1e-5 * (1 + scaled.abs())).double() * d.double()
    return (codes.double() * d.double()).reshape(x.shape), tie.reshape(x.shape)


def assert_matches_q8_reference(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                bias: torch.Tensor | None = None) -> None:
    """``y``, a q8 kernel's ``x @ weight.T + bias`` (``weight``: the float64 dequantized
    rows), equals the model (``x``'s q8 blocks times ``weight`` in float64, plus ``bias``)
    to float32 rounding of the scales and sums, and to one rounding to ``y``'s dtype."""
    xq, tie = quantize_like_the_kernel(x)
    ref = xq @ weight.T + (0 if bias is None else bias.double())
    bound = 2e-6 * (xq.abs() @ weight.abs().T + 1) + tie @ weight.abs().T  # float32 scales and sums
    if y.dtype != torch.float32:                      # one rounding to the output dtype
        bound = bound + ref.abs() * torch.finfo(y.dtype).eps
    err = (y.double() - ref).abs()
    assert (err <= bound).all(), (y.dtype, tuple(x.shape), (err / bound).max().item())
