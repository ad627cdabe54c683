"""``kvpilot bench gguf-matmul --model-pass``: one decode step's matmuls over all of
SmolLM2-135M-Instruct.Q4_1's GGUF matrices (30 layers of qkv 960x576, o 576x576, gate/up
3072x576, down 576x1536, all Q4_1, and the tied Q8_0 LM head 49152x576), per method:

- ``float``: the exact float kernel (``gguf_matmul_cpu.matmul``, float32 activations; past
  ``MAX_VECTOR_BATCH`` tokens the prefill path: tiles decoded for bfloat16 ``F.linear``);
- ``q8``: the q8-activation kernel (``gguf_matmul_cpu.matmul_q8``, bfloat16 in and out);
- ``q8i``: the same over the interleaved layout (``matmul_q8_interleaved``; AVX512-VNNI
  or AVX2, else left out), as the engine's q8 layers hold such weights;
- ``bf16``: ``F.linear`` over dense bfloat16 weights of the same shapes (4x the bytes).

Rounds alternate the methods (the machine may be shared); the median round is reported
in milliseconds per pass, with each method's ratio to q8.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

# (rows, columns, ggml type, copies per pass)
SMOLLM2_PASS = ((960, 576, 3, 30), (576, 576, 3, 30), (3072, 576, 3, 30), (576, 1536, 3, 30),
                (49152, 576, 8, 1))
METHODS = ("float", "q8", "q8i", "bf16")


@dataclass(frozen=True, slots=True)
class PassResult:
    batch: int
    ms: dict[str, float]     # method -> median milliseconds per pass


def methods() -> tuple[str, ...]:
    """The methods this machine runs (``q8i`` needs AVX512-VNNI or AVX2)."""
    from kvpilot.kernels import gguf_matmul_cpu as g

    return METHODS if g.q8_isa() is not None else tuple(m for m in METHODS if m != "q8i")


def _weights(rng):
    import torch
    from gguf.quants import quantize

    from kvpilot.kernels import gguf_matmul_cpu as g

    interleaved = "q8i" in methods()
    out = []
    for rows, columns, qtype, copies in SMOLLM2_PASS:
        w = rng.standard_normal((rows, columns)).astype("float32")
        raw = torch.from_numpy(quantize(w, qtype))
        dense = torch.from_numpy(w).to(torch.bfloat16)
        # distinct copies, so that a pass streams its weights from memory as a model does
        packed = g.interleave(raw, qtype) if interleaved else None
        out += [(raw.clone(), dense.clone(), qtype, columns, None if packed is None else packed.clone())
                for _ in range(copies)]
    return out


def _pass(method: str, weights, xs) -> float:
    import torch.nn.functional as F

    from kvpilot.engine.model.layers.gguf_linear import TILE_ELEMENTS
    from kvpilot.kernels import gguf_matmul_cpu as g

    start = time.perf_counter()
    for raw, dense, qtype, columns, packed in weights:
        x32, x16 = xs[columns]
        if method == "q8":
            g.matmul_q8(x16, raw, qtype)
        elif method == "q8i":
            g.matmul_q8_interleaved(x16, packed, qtype)
        elif method == "bf16":
            F.linear(x16, dense)
        elif x32.shape[0] <= g.MAX_VECTOR_BATCH:
            g.matmul(x32, raw, qtype)
        else:
            tile = max(1, TILE_ELEMENTS // columns)
            for r in range(0, raw.shape[0], tile):
                F.linear(x16, g.dequantize(raw[r:r + tile], qtype, x16.dtype))
    return (time.perf_counter() - start) * 1e3


def measure(batches: list[int], rounds: int) -> list[PassResult]:
    import numpy as np
    import torch

    weights = _weights(np.random.default_rng(0))
    results = []
    for batch in batches:
        xs = {}
        for columns in {c for _, c, _, _ in SMOLLM2_PASS}:
            x = torch.randn(batch, columns)
            xs[columns] = (x, x.to(torch.bfloat16))
        runs = methods()
        times = {m: [] for m in runs}
        for m in runs:      # warm-up
            _pass(m, weights, xs)
        for _ in range(rounds):
            for m in runs:
                times[m].append(_pass(m, weights, xs))
        results.append(PassResult(batch, {m: statistics.median(v) for m, v in times.items()}))
    return results


def report(results: list[PassResult]) -> None:
    shown = [m for m in METHODS if results and m in results[0].ms]
    ratios = [m for m in shown if m != "q8"]
    print(f"{'batch':>5}" + "".join(f"{m + ' ms':>11}" for m in shown) + "".join(f"{m + '/q8':>10}" for m in ratios))
    for r in results:
        q8 = r.ms["q8"]
        print(f"{r.batch:>5}" + "".join(f"{r.ms[m]:>11.2f}" for m in shown)
              + "".join(f"{r.ms[m] / q8:>10.2f}" for m in ratios), flush=True)
