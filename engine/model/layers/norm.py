"""RMSNorm, computed in float32 exactly as HF transformers' Llama/Qwen do (``RMSNorm``)
and as its Gemma 3 does (``GemmaRMSNorm``: a ``1 + weight`` gain, rounded once).

``forward(x, residual)`` also adds the residual first and returns the sum as the new
residual (vLLM's fused add + norm), so a decoder layer hands one tensor pair from norm
to norm. With a kernel on (``use_kernel``: Triton's on the CUDA path, the fused C++ op
on CPU) the whole thing is one kernel per call; otherwise torch ops.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self._kernel: Callable | None = None

    def use_kernel(self, kernel: Callable) -> None:
        """Run ``kernel`` (``kvpilot.kernels.rms_norm.rms_norm``, or on CPU
        ``kvpilot.kernels.cpu_layer_ops.add_rms_norm``) instead of torch ops."""
        self._kernel = kernel

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``norm(x)``, or with ``residual``: ``(norm(x + residual), x + residual)``."""
        if self._kernel is not None:
            if x.dim() == 2:   # the decoder's [tokens, hidden]: no reshapes
                if residual is None:
                    return self._kernel(x, self.weight, self.eps)
                return self._kernel(x, self.weight, self.eps, residual)
            shape = x.shape
            flat = x.reshape(-1, shape[-1])
            if residual is None:
                return self._kernel(flat, self.weight, self.eps).view(shape)
            out, summed = self._kernel(flat, self.weight, self.eps, residual.reshape(-1, shape[-1]))
            return out.view(shape), summed.view(shape)
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: ``(x * rsqrt(mean(x^2) + eps)) * (1 + weight)``, all in float32 and
    rounded to the input dtype once at the end (Llama rounds before the weight), as HF
    transformers' Gemma 3 computes it. The weight is stored as the checkpoint has it
    (zero-centred). ``forward(x, residual)`` adds the residual first, as ``RMSNorm`` does.

    On CPU ``use_kernel`` puts the compiled op (``cpu_layer_ops.gemma_rms_norm``: the same
    roundings and torch's order of the sum, so the same bits) in place of the torch ops,
    which are about ten dispatches a call and six calls a layer. The Triton RMSNorm kernel
    has Llama's rounding, so ``use_triton_kernels`` leaves these norms alone.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps
        self._kernel: Callable | None = None
        self._gain: torch.Tensor | None = None   # the kernel's float32 1 + weight

    def use_kernel(self, kernel: Callable) -> None:
        """Run ``kernel`` (``kvpilot.kernels.cpu_layer_ops.gemma_rms_norm``) instead of torch
        ops, with the weight as it is now (call it once the weights are loaded, as
        ``prepare_for_device`` does)."""
        with torch.no_grad():
            self._gain = 1.0 + self.weight.float()
        self._kernel = kernel

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``norm(x)``, or with ``residual``: ``(norm(x + residual), x + residual)``."""
        if self._kernel is not None and x.stride(-1) == 1 and (
                x.dim() == 2 and (residual is None or residual.stride(-1) == 1) or x.dim() == 3 and residual is None):
            return self._kernel(x, self._gain, self.eps, residual)
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)
