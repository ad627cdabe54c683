"""Valid GGUF block bytes of each quantized type, for the GGUF kernel and layer tests.

``gguf.quants.quantize`` quantizes Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 but not the k-quants
(it only dequantizes those); their blocks here are random codes and scales with finite,
small fp16 super-block scales written over the fp16 fields (any codes are valid), so both
the code under test and ``gguf.quants.dequantize`` decode the same bytes.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize

QUANTIZABLE = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1)
# byte offsets of each k-quant block's fp16 fields (ggml-common.h: block_q*_K)
K_QUANT_HALVES = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def random_blocks(qtype: T, rows: int, columns: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 ``[rows, bytes_per_row]`` GGUF data of ``qtype`` for a ``[rows, columns]`` weight."""
    if qtype in QUANTIZABLE:
        return quantize(rng.standard_normal((rows, columns)).astype(np.float32), qtype)
    block, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, columns // block, type_size), dtype=np.uint8)
    for offset in K_QUANT_HALVES[qtype]:
        scale = (rng.random((rows, columns // block)) * 0.01 + 0.001).astype(np.float16)
        raw[:, :, offset:offset + 2] = scale.view(np.uint8).reshape(rows, columns // block, 2)
    return raw.reshape(rows, -1)
