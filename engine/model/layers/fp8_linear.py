"""FP8 (e4m3) weights in the decoder's linear layers (``kvpilot.contract.weight_quant``).

The weight stays in float8 e4m3 (one byte per element) next to a float32 ``weight_scale``
of shape ``[rows, 1]`` (per-tensor and per-channel scales: a per-tensor scale fills its
part's rows, so a fused q/k/v layer keeps each part's own scale) or
``[ceil(rows / n), ceil(columns / k)]`` (n x k blocks). The dequantized weight is
``weight x scale`` broadcast over each scale's rows and block.

Matmul: on a CUDA GPU of compute capability 9.0 or more, with bfloat16 activations and
row / channel scales, ``torch._scaled_mm`` multiplies FP8 activations (quantized
dynamically per token) by the FP8 weight with per-row scales on both sides. NOTE: that
path is untested here (no GPU on the machines this was written on); everywhere else,
block scales included, the layer's weight is dequantized to the activation dtype at each
call and multiplied with ``F.linear`` (a transient full-precision copy of one layer).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.contract.weight_quant import Fp8WeightConfig

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def scale_shape(rows: int, columns: int, config: Fp8WeightConfig) -> tuple[int, int]:
    """Shape of the engine's ``weight_scale`` for a ``[rows, columns]`` weight."""
    if config.block_size is None:
        return (rows, 1)
    n, k = config.block_size
    return (-(-rows // n), -(-columns // k))


def use_fp8_weight(linear: nn.Module, config: Fp8WeightConfig) -> None:
    """Give a (meta-device) linear layer FP8 storage: ``weight`` in e4m3 and a float32
    ``weight_scale``; its forward then goes through ``fp8_linear``."""
    rows, columns = linear.weight.shape
    device = linear.weight.device
    linear.weight = nn.Parameter(torch.empty(rows, columns, dtype=FP8, device=device), requires_grad=False)
    linear.weight_scale = nn.Parameter(
        torch.empty(scale_shape(rows, columns, config), dtype=torch.float32, device=device),
        requires_grad=False)
    linear.fp8 = config


def dequantize(weight: torch.Tensor, scale: torch.Tensor, config: Fp8WeightConfig,
               dtype: torch.dtype) -> torch.Tensor:
    """``weight x scale`` in ``dtype`` (the scales broadcast over their rows / blocks)."""
    rows, columns = weight.shape
    if config.block_size is not None:
        n, k = config.block_size
        scale = scale.repeat_interleave(n, 0)[:rows].repeat_interleave(k, 1)[:, :columns]
    return (weight.to(torch.float32) * scale).to(dtype)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None, config: Fp8WeightConfig) -> torch.Tensor:
    """``x W^T + b`` for an FP8 ``W`` (see the module docstring for the two paths)."""
    if _scaled_mm_supported(x, weight, config):
        return _scaled_mm(x, weight, scale, bias)
    return F.linear(x, dequantize(weight, scale, config, x.dtype), bias)


def _scaled_mm_supported(x: torch.Tensor, weight: torch.Tensor, config: Fp8WeightConfig) -> bool:
    rows, columns = weight.shape
    return (x.is_cuda and config.block_size is None and x.dtype == torch.bfloat16
            and hasattr(torch, "_scaled_mm") and rows % 16 == 0 and columns % 16 == 0
            and torch.cuda.get_device_capability(x.device) >= (9, 0))


def _scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    """Row-wise scaled FP8 matmul: per-token activation scales x per-row weight scales."""
    flat = x.reshape(-1, x.shape[-1])
    x_scale = flat.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    x_fp8 = (flat.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    out = torch._scaled_mm(x_fp8, weight.t(), scale_a=x_scale, scale_b=scale.t().contiguous(),
                           bias=bias, out_dtype=x.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def fp8_weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters as held (FP8 weights count one byte each)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
