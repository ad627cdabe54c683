"""FP8 KV-cache helpers shared by the kernels: dtypes, limits, the torch quantizer, device checks.

Semantics (the engine's contract): stored = saturate(x / scale) cast to fp8 with
round-to-nearest-even; loaded = fp8.float() * scale. ``scale`` is a per-tensor float32
(a 0-dim tensor), 1.0 unless calibrated. ``e4m3`` (``torch.float8_e4m3fn``, max 448)
keeps more mantissa; ``e5m2`` (``torch.float8_e5m2``, max 57344) more range.

This module imports no triton, so the engine may import it eagerly.
"""

from __future__ import annotations

import os
import sys

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, *FP8_DTYPES)
COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an fp8 dtype (448 for e4m3fn, 57344 for e5m2)."""
    if dtype not in FP8_DTYPES:
        raise TypeError(f"{dtype} is not an fp8 dtype; expected one of {FP8_DTYPES}")
    return float(torch.finfo(dtype).max)


def quantize_fp8_ref(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``saturate(x / scale)`` cast to ``dtype`` (round to nearest even), computed in fp32."""
    limit = fp8_max(dtype)
    return (x.float() / scale.float()).clamp(-limit, limit).to(dtype)


def dequantize_fp8_ref(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x.float() * scale`` for an fp8 tensor, in float32."""
    return x.float() * scale.float()


def check_kernel_device(device: torch.device) -> None:
    """Compiled Triton needs CUDA tensors; CPU tensors only work under the interpreter."""
    if device.type != "cuda" and not is_interpreting():
        raise ValueError(
            f"the Triton kernels need CUDA tensors, got {device}; to run them on CPU set "
            "TRITON_INTERPRET=1 before triton is first imported (or use the torch backend)")


def is_interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``).

    Triton reads the variable once, at its first import, so once triton is imported its
    own knob is the truth; before that the environment is (and triton is not imported
    here, so callers that must stay triton-free may ask too).
    """
    triton = sys.modules.get("triton")
    if triton is not None and hasattr(triton, "knobs"):
        return bool(triton.knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")
