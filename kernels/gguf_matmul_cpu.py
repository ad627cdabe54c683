"""GGUF block-quantized matmul on CPU: a C++ kernel (``csrc/gguf_matmul_cpu.cpp``) that
reads the weight's GGUF bytes as they are, built on first use like the paged-decode
kernel (``kvpilot.kernels.cpu_extension``).

A weight is uint8 ``[rows, bytes_per_row]``: each row is its output feature's blocks
along the input dimension, exactly as ``gguf.GGUFReader`` hands a tensor out, so rows can
be permuted, sliced and concatenated freely. ``matmul`` decodes one block (32 or 256
values) at a time and multiplies it into every activation row (float32 accumulation):
the weight bytes are read once per call and no dequantized matrix exists. ``dequantize``
writes float32 rows (the large-batch path decodes a few rows at a time with it).

The types are ggml's ids (``gguf.GGMLQuantizationType``): ``QTYPES``. ``load()`` returns
None where the kernel cannot be built; callers then dequantize at load time.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import torch

from kvpilot.kernels.cpu_extension import load_cpu_extension
from kvpilot.kernels.paged_decode_cpu import ISA_FLAGS

SOURCE = Path(__file__).parent / "csrc" / "gguf_matmul_cpu.cpp"
# ggml type id -> (values per block, bytes per block), as ggml-common.h defines them
QTYPES = {
    2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
}
# Tokens the vector path multiplies at once (kMaxVectorBatch in the source): one 16-lane
# accumulator each; past it the caller decodes tiles for F.linear.
MAX_VECTOR_BATCH = 16
# -fopenmp: ATen's parallel_for is an inline OpenMP region in torch's CPU builds.
CFLAGS = ["-O3", "-ffast-math", "-fopenmp"]
LDFLAGS = ("-lm", "-fopenmp")


def variant(isa: str | None) -> tuple[str, list[str]]:
    """The module name and compiler flags of the kernel for ``isa`` (None or unknown: baseline)."""
    flags = ISA_FLAGS.get(isa or "", [])
    return f"kvpilot_gguf_matmul_cpu_{isa.lower() if flags else 'baseline'}", [*CFLAGS, *flags]


@functools.cache
def load() -> ModuleType | None:
    """The compiled kernel module, or None if it cannot be built."""
    name, flags = variant(torch.backends.cpu.get_cpu_capability())
    return load_cpu_extension(name, SOURCE, flags, "CPU GGUF matmul kernel",
                              "GGUF weights are dequantized when they load", LDFLAGS)


def _module() -> ModuleType:
    module = load()
    if module is None:
        raise RuntimeError("the CPU GGUF matmul kernel is not available on this machine")
    return module


def _check(weight: torch.Tensor, qtype: int) -> None:
    if qtype not in QTYPES:
        raise ValueError(f"ggml type {qtype} has no CPU kernel; those with one: "
                         f"{sorted(name for name, _, _ in QTYPES.values())}")
    if weight.dtype != torch.uint8 or weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(f"the weight must be CPU uint8 [rows, bytes per row]; got {weight.dtype} "
                         f"{tuple(weight.shape)} on {weight.device}")


def dequantize(weight: torch.Tensor, qtype: int) -> torch.Tensor:
    """float32 ``[rows, columns]`` of a GGUF weight's bytes."""
    _check(weight, qtype)
    return _module().dequantize(weight.contiguous(), qtype)


def matmul(x: torch.Tensor, weight: torch.Tensor, qtype: int) -> torch.Tensor:
    """``x @ dequantize(weight).T`` in float32, for ``x`` of shape ``[batch, columns]``."""
    _check(weight, qtype)
    return _module().matmul(x.to(torch.float32).contiguous(), weight.contiguous(), qtype)
