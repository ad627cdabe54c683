"""RMSNorm, optionally fused with the residual add before it: one pass over each row.

Semantics are HF transformers' Llama/Qwen RMSNorm, which the engine's torch layer
implements: ``y = weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)`` with the mean and
the scaling in float32. The fused form first adds the residual in the input dtype,
``x = x + residual``, returns ``y`` and that new residual (vLLM's
``fused_add_rms_norm``), which is what a pre-norm decoder layer needs between its
attention and MLP halves. One program normalises one row (hidden sizes that are not a
power of two are padded with a mask); the launcher writes new tensors, the inputs are
left unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels.fp8 import COMPUTE_DTYPES, check_kernel_device


@triton.jit
def rms_norm_kernel(
    out_ptr,            # [num_tokens, hidden]
    residual_out_ptr,   # [num_tokens, hidden], written only when HAS_RESIDUAL
    x_ptr,              # [num_tokens, hidden]
    residual_ptr,       # [num_tokens, hidden], read only when HAS_RESIDUAL
    weight_ptr,         # [hidden]
    eps,                # float
    hidden,
    stride_out, stride_res_out, stride_x, stride_res,
    BLOCK: tl.constexpr,          # power of two >= hidden
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    # Arithmetic in fp32, rounded to the tensor dtype where torch rounds (the sum, the
    # normalised value, the product): the same results as torch's 16-bit ops, which
    # compute in fp32 too; the interpreter cannot do 16-bit float arithmetic itself.
    dtype = x_ptr.dtype.element_ty
    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h += tl.load(residual_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        h = h.to(dtype)
        tl.store(residual_out_ptr + row * stride_res_out + cols, h, mask=mask)
        h = h.to(tl.float32)
    inv_rms = tl.math.rsqrt(tl.sum(h * h, axis=0) / hidden + eps)
    normed = (h * inv_rms).to(dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of each row of ``x`` ``[num_tokens, hidden]``; with ``residual`` (same
    shape), of ``x + residual``, returning ``(normed, x + residual)``."""
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"x must be [num_tokens, hidden] and weight [hidden]; got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype not in COMPUTE_DTYPES or weight.dtype not in COMPUTE_DTYPES:
        raise TypeError(f"x and weight must be one of {COMPUTE_DTYPES}; got {x.dtype}, {weight.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual must match x ({tuple(x.shape)}, {x.dtype}); got "
                         f"{tuple(residual.shape)}, {residual.dtype}")
    for name, t in (("x", x), ("weight", weight), ("residual", residual)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    check_kernel_device(x.device)
    num_tokens, hidden = x.shape
    out = torch.empty_like(x, dtype=torch.promote_types(x.dtype, weight.dtype))
    residual_out = torch.empty_like(x) if residual is not None else out
    if num_tokens:
        block = triton.next_power_of_2(hidden)
        rms_norm_kernel[(num_tokens,)](
            out, residual_out, x, residual if residual is not None else x, weight, float(eps),
            hidden, out.stride(0), residual_out.stride(0), x.stride(0),
            residual.stride(0) if residual is not None else x.stride(0),
            BLOCK=block, HAS_RESIDUAL=residual is not None,
            num_warps=min(16, max(1, block // 256)),
        )
    return (out, residual_out) if residual is not None else out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Reference (HF's formula, float32 statistics)."""
    if residual is not None:
        x = x + residual
    h = x.float()
    normed = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (normed, x) if residual is not None else normed
