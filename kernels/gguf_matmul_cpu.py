"""GGUF block-quantized matmul on CPU: a C++ kernel (``csrc/gguf_matmul_cpu.cpp``) that
reads the weight's GGUF bytes as they are, built on first use like the paged-decode
kernel (``kvpilot.kernels.cpu_extension``).

A weight is uint8 ``[rows, bytes_per_row]``: each row is its output feature's blocks
along the input dimension, exactly as ``gguf.GGUFReader`` hands a tensor out, so rows can
be permuted, sliced and concatenated freely. ``matmul`` decodes one block (32 or 256
values) at a time and multiplies it into every activation row (float32 accumulation):
the weight bytes are read once per call and no dequantized matrix exists. ``dequantize``
writes float32 rows (the large-batch path decodes a few rows at a time with it).

``matmul_q8`` is llama.cpp's way: each token's activations (float32, bfloat16 or float16)
are quantized per 32-value block to int8 with one float scale (``amax / 127``, codes
rounded to nearest even), and each block's dot product is an integer one of the weight's
codes by the activation codes (AVX512-VNNI ``dpbusd`` where the CPU has it, else AVX2
``maddubs`` + ``madd``), scaled in float32; the weight's min (Q4_1, Q5_1) multiplies the
block's activation sum. The result comes out in the activation dtype. Its numerics differ
from ``matmul`` by the activation rounding (about 0.4 % of a block's largest value per
value, like llama.cpp's). It serves the 32-value types (``Q8_TYPES``) at any width (the
kernel decodes a wide row a tile's width at a time); the k-quants keep the float path. ``KVPILOT_GGUF_Q8_ISA`` (``vnni``, ``avx2``, ``off``) overrides the
run-time choice of instruction set (``q8_isa``).

``interleave`` rearranges the rows of a Q4_0, Q4_1 or Q8_0 weight (a multiple of 16 of
them) into groups of 16, block by block: the 16 rows' scales (and mins) side by side, then
their codes four bytes per row at a time. The bytes are the same in number, only placed
so that ``matmul_q8_interleaved`` multiplies 4 codes of 16 rows by one instruction
(AVX512-VNNI; on AVX2 two halves of 8 rows, maddubs + madd, the same integer sums and the
same bits) and keeps each row's sum in its own lane: no tile is decoded and stored, no
horizontal sum is taken. On SmolLM2-135M's matrices it streams the weights about twice as
fast as ``matmul_q8`` at 1 to 16 tokens (``kvpilot bench gguf-matmul --model-pass``), on
an AVX2 EPYC about 9x at 1 token (36 against 3.9 GB/s, SmolLM2's gate/up). On AVX2 the
tiles of up to 8 tokens prefetch 4 KiB ahead (a core streaming from memory otherwise waited
on it), and larger batches take one half-group at a time over chunks of 64 tokens (the
tiles' codes do not fit AVX2's 16 registers); the sums, and so the bits, are the same. Its
results are ``matmul_q8``'s up to the float32 order of the per-block terms, and a token's
result does not depend on how many tokens share the call. ``dequantize_interleaved`` decodes
an interleaved weight's values in the file's row order (the large-batch path's tiles, the
embedding lookup) without turning the bytes back into rows first (whole groups into float32
with AVX2, a float32 model's prefill tiles); ``matmul_interleaved_float``
multiplies a few float32 rows by them without 8-bit activations (AVX2).

The engine takes it (``gguf_linear``) where the model runs in bfloat16/float16 (the
serving default on a CPU with AVX512-BF16, ``--dtype auto``), or in float32 where
``--dtype auto`` chose float32 for a GGUF file (a CPU without native bfloat16), for up to
``Q8_MAX_BATCH`` decode tokens (prompt tokens never, nor the logits of a prompt's last
token: ``gguf_linear.float_activations``); an explicit float32 model always keeps the
exact float path (token-identical to transformers). ``$KVPILOT_GGUF_Q8=0`` turns it off
(``q8_enabled``). Measured on SmolLM2-135M-Instruct.Q4_1 in bfloat16: it moves the first
answer token's log-probabilities by up to ~0.3 nats against the float path (twice
bfloat16's own shift from float32); run over the whole 37-token prompt of the README's
"What is the capital of France?" it flips a near tie (0.08 nats in float32) and the
answer derails, which is why prompt tokens keep the float/tile paths, however few of them a
step computes (after a prefix-cache hit, the last 5 of those 37: once the same derailment).
In float32 the same tie flipped in the LM head alone, 8-bit activations over the last
prompt token's hidden state: hence its logits are the float ones too.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from types import ModuleType

import torch

from kvpilot.kernels.cpu_extension import load_cpu_extension
from kvpilot.kernels.cpu_isa import isa_variant

SOURCE = Path(__file__).parent / "csrc" / "gguf_matmul_cpu.cpp"
# ggml type id -> (values per block, bytes per block), as ggml-common.h defines them
QTYPES = {
    2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
}
# Tokens the vector path multiplies at once (kMaxVectorBatch in the source): one 16-lane
# accumulator each; past it the caller decodes tiles for F.linear.
MAX_VECTOR_BATCH = 16
# the types matmul_q8 multiplies (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)
Q8_TYPES = frozenset({2, 3, 6, 7, 8})
# Tokens up to which the q8 path beats decoding tiles for bfloat16 F.linear (measured on
# an AVX512-VNNI EPYC, two threads, over SmolLM2-135M's matrices, tiles decoded straight to
# bfloat16: `kvpilot bench gguf-matmul --model-pass`: tiles/q8 1.32 at 16 tokens, 0.92 at
# 24, 0.86 at 32).
Q8_MAX_BATCH = 24
# The same bound for a weight in the interleaved layout, which stays ahead of the tiles longer
# (same bench, ms per pass of q8i/tiles: 28/60 at 32 tokens, 48/70 at 64): it takes decode
# steps of up to 32 streams (prompt tokens keep float activations, whatever their number:
# ``gguf_linear``).
Q8_INTERLEAVED_MAX_BATCH = 32
# the types the interleaved layout takes, and the rows it groups
INTERLEAVE_TYPES = frozenset({2, 3, 8})
# Float32 rows up to which ``matmul_interleaved_float`` beats decoding tiles for F.linear
# (a 2-core AVX2 EPYC, SmolLM2-135M's Q4_1 layers: 47 / 65 / 82 ms at 16 / 24 / 32 rows
# against 90 ms or more for the tiles; a cached-prefix request's 28 new tokens take it).
INTERLEAVED_FLOAT_MAX_BATCH = 32
INTERLEAVE_ROWS = 16
Q8_ISA_ENV = "KVPILOT_GGUF_Q8_ISA"
Q8_ENV = "KVPILOT_GGUF_Q8"
ISA_IDS = {"vnni": 1, "avx2": 2}
# -fopenmp: ATen's parallel_for is an inline OpenMP region in torch's CPU builds.
CFLAGS = ["-O3", "-ffast-math", "-fopenmp"]
LDFLAGS = ("-lm", "-fopenmp")


def variant(isa: str | None) -> tuple[str, list[str]]:
    """The module name and compiler flags of the kernel for ``isa`` (None or unknown: baseline)."""
    return isa_variant("kvpilot_gguf_matmul_cpu", isa, CFLAGS)


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


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dequantize writes float32, bfloat16 or float16; got {dtype}")


def dequantize(weight: torch.Tensor, qtype: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[rows, columns]`` of a GGUF weight's bytes in ``dtype`` (float32, or bfloat16/float16
    rounded once from the decoded float32 value)."""
    _check(weight, qtype)
    _check_dtype(dtype)
    return _module().dequantize(weight.contiguous(), qtype, dtype)


def matmul(x: torch.Tensor, weight: torch.Tensor, qtype: int) -> torch.Tensor:
    """``x @ dequantize(weight).T`` in float32, for ``x`` of shape ``[batch, columns]``."""
    _check(weight, qtype)
    return _module().matmul(x.to(torch.float32).contiguous(), weight.contiguous(), qtype)


def q8_enabled() -> bool:
    """Whether the engine's 16-bit GGUF layers take the q8 path (default yes;
    ``$KVPILOT_GGUF_Q8=0`` turns it off)."""
    return os.environ.get(Q8_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def q8_isa() -> str | None:
    """The instruction set ``matmul_q8`` uses here: ``"vnni"`` (AVX512-VNNI), ``"avx2"``,
    or None (no q8 path: the kernel is missing, the CPU has neither, or
    ``$KVPILOT_GGUF_Q8_ISA=off``). The environment variable picks a supported one."""
    return _q8_isa(os.environ.get(Q8_ISA_ENV, "").strip().lower())


@functools.cache
def _q8_isa(wanted: str) -> str | None:
    module = load()
    if module is None or wanted == "off":
        return None
    best = {1: "vnni", 2: "avx2"}.get(module.q8_isa())
    if wanted in ("", "auto") or best is None:
        return best
    if wanted not in ISA_IDS:
        raise ValueError(f"${Q8_ISA_ENV}={wanted!r}: expected one of vnni, avx2, off, auto")
    if wanted == "vnni" and best != "vnni":
        raise ValueError(f"${Q8_ISA_ENV}=vnni but this CPU lacks AVX512-VNNI")
    return wanted


def matmul_q8(x: torch.Tensor, weight: torch.Tensor, qtype: int, bias: torch.Tensor | None = None,
              isa: str | None = None) -> torch.Tensor:
    """``x @ dequantize(weight).T + bias`` through q8 activations (module docstring), in
    ``x``'s dtype (float32, bfloat16 or float16), for ``x`` of shape ``[batch, columns]``;
    ``isa``: ``"vnni"`` or ``"avx2"`` (default: ``q8_isa()``)."""
    _check(weight, qtype)
    if qtype not in Q8_TYPES:
        raise ValueError(f"ggml type {qtype} has no q8 path")
    chosen = isa or q8_isa()
    if chosen not in ISA_IDS:
        raise RuntimeError("the q8 path is not available on this machine")
    b = None if bias is None else bias.to(torch.float32).contiguous()
    return _module().matmul_q8(x.contiguous(), weight.contiguous(), qtype, b, ISA_IDS[chosen])


def interleave(weight: torch.Tensor, qtype: int) -> torch.Tensor:
    """A Q4_0/Q4_1/Q8_0 weight's rows (a multiple of ``INTERLEAVE_ROWS``) in the
    interleaved layout (module docstring): a tensor of the same shape and size."""
    _check_interleaved(weight, qtype)
    return _module().interleave(weight.contiguous(), qtype, True)


def deinterleave(weight: torch.Tensor, qtype: int) -> torch.Tensor:
    """The GGUF rows of an interleaved weight (``interleave``'s inverse)."""
    _check_interleaved(weight, qtype)
    return _module().interleave(weight.contiguous(), qtype, False)


def dequantize_interleaved(weight: torch.Tensor, qtype: int, dtype: torch.dtype = torch.float32,
                           rows: torch.Tensor | None = None) -> torch.Tensor:
    """``dequantize(deinterleave(weight), qtype, dtype)`` bit for bit, without the
    deinterleaved copy: the values of an interleaved weight, rows in the file's order; or,
    given ``rows`` (int64 row indices), ``dequantize(deinterleave(weight), ...)[rows]``:
    only those rows are decoded (an embedding lookup)."""
    _check_interleaved(weight, qtype)
    _check_dtype(dtype)
    if rows is not None:
        rows = rows.reshape(-1).to(torch.int64).contiguous()
    return _module().dequantize_interleaved(weight.contiguous(), qtype, dtype, rows)


def matmul_q8_interleaved(x: torch.Tensor, weight: torch.Tensor, qtype: int,
                          bias: torch.Tensor | None = None, isa: str | None = None) -> torch.Tensor:
    """``matmul_q8`` for an interleaved weight; ``isa``: ``"vnni"`` or ``"avx2"`` (default:
    ``q8_isa()``), the same bits either way. The kernel checks the shapes and types itself
    (a RuntimeError names what is wrong): this call runs for every layer of every decode
    step, so it adds no checks of its own."""
    b = None if bias is None else bias.to(torch.float32).contiguous()
    chosen = isa or q8_isa()
    if chosen not in ISA_IDS:
        raise RuntimeError("the q8 path is not available on this machine")
    return _module().matmul_q8_interleaved(x.contiguous(), weight, qtype, b, ISA_IDS[chosen])


def matmul_interleaved_float(x: torch.Tensor, weight: torch.Tensor, qtype: int,
                             bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequantize(deinterleave(weight)).T + bias`` in float32 (``x`` converted to
    float32; no 8-bit activations): the float path of a few rows over an interleaved weight
    (AVX2), without decoding the whole weight into tiles."""
    _check_interleaved(weight, qtype)
    b = None if bias is None else bias.to(torch.float32).contiguous()
    return _module().matmul_interleaved_float(x.to(torch.float32).contiguous(), weight.contiguous(), qtype, b)


def interleaves(qtype: int, rows: int) -> bool:
    """Whether a weight of ``rows`` rows of ``qtype`` (any number of columns) can take the
    interleaved layout on this machine (the type, whole groups, a q8 path: AVX512-VNNI or AVX2)."""
    return qtype in INTERLEAVE_TYPES and rows % INTERLEAVE_ROWS == 0 and q8_enabled() and q8_isa() is not None


def _check_interleaved(weight: torch.Tensor, qtype: int) -> None:
    _check(weight, qtype)
    if qtype not in INTERLEAVE_TYPES:
        raise ValueError(f"ggml type {qtype} has no interleaved layout; those with one: "
                         f"{sorted(QTYPES[t][0] for t in INTERLEAVE_TYPES)}")
    if weight.shape[0] % INTERLEAVE_ROWS:
        raise ValueError(f"the interleaved layout takes a multiple of {INTERLEAVE_ROWS} rows; "
                         f"got {weight.shape[0]}")
