"""GGUF (ggml) block-quantized weights kept as they are in the file, in the linear layers.

A linear layer given GGUF storage (``use_gguf_weight``) holds its weight as the file's
block bytes, one flat uint8 ``weight``: each part of a fused layer (q/k/v, gate/up) is a
run of rows ``[rows, bytes_per_row]``, its blocks along the input dimension exactly as
``gguf.GGUFReader`` hands a tensor out, so each part keeps its own type (llama.cpp's
Q4_K_M files mix Q4_K and Q6_K within one attention layer). Rows are independent, so a
permutation of rows (llama.cpp's q/k rope order, ``llama_qk_row_order``) is applied to
the bytes before they are copied in (``load_gguf_weight(row_order=...)``).

Forward (``gguf_linear``) takes one of three paths per run of rows of one type:

- bfloat16/float16 activations, a 32-value type (``gguf_matmul_cpu.Q8_TYPES``: Q4_0,
  Q4_1, Q5_0, Q5_1, Q8_0) and up to ``gguf_matmul_cpu.Q8_MAX_BATCH`` tokens: the q8 path
  (``gguf_matmul_cpu.matmul_q8``, llama.cpp's way): activations quantized per block to
  int8, integer dot products with the weight codes, the result written in the activation
  dtype. It rounds the activations to 8 bits (as llama.cpp does), so it is used where the
  model already runs in a 16-bit dtype, and in a float32 model only when the layer was
  loaded with ``float32_q8`` (``--dtype auto`` chose float32 for a GGUF file on a CPU
  without native bfloat16, ``ModelConfig.gguf_float32_q8``: there 16-bit matmuls are slow,
  and without it every decode step took the float kernel, 73 ms on the built-in model
  against about 5.5 ms). An explicit float32 model keeps the exact float path below,
  token-identical to transformers in float32. ``$KVPILOT_GGUF_Q8=0`` turns
  it off (the measured numerics: ``gguf_matmul_cpu``'s docstring). Prompt tokens never
  take it: inside ``float_activations()`` (the model's forward for a step that computes
  prompt tokens, ``AttentionMetadata.computes_prompt``, and its LM head's logits) the
  float paths below run, whatever the row count. Otherwise a prompt whose prefix came
  from the cache would compute its last few tokens in 8 bits where the cold prompt, too
  long for the q8 path, computed them in 16 bits: a different KV, and on the built-in
  SmolLM2 a different answer to the README's question the second time it was asked. The
  head counts too: that question's first answer token is a near tie ("The" against "L",
  0.08 nats apart in float32), which the 8-bit rounding of the last hidden state flipped
  in a float32 model.
- otherwise up to ``gguf_matmul_cpu.MAX_VECTOR_BATCH`` tokens: the float kernel that
  decodes one block at a time into registers and multiplies every token by it (float32
  accumulation, result in the activation dtype): the weight bytes are read once, and no
  dequantized matrix exists. For an interleaved weight that is
  ``matmul_interleaved_float``, in a float32 model and up to
  ``INTERLEAVED_FLOAT_MAX_BATCH`` rows (a prompt step's LM head rows: 2.2 ms for SmolLM2's
  head where decoding it into tiles would cost more; the last tokens of a prompt after a
  prefix hit); a 16-bit one keeps the tiles below.
- more tokens (prefill): a tile of rows at a time is decoded to the activation dtype and
  handed to ``F.linear`` (a transient of ``TILE_ELEMENTS`` values, not the layer).

Where the layer's decode tokens take the q8 path (above) on an AVX512-VNNI or AVX2 CPU and
every part is Q4_0, Q4_1 or Q8_0 with a multiple of 16 rows, the layer holds its bytes in
the kernel's interleaved layout instead (``gguf_matmul_cpu.interleave``, as they load; the
same size): the q8 path then takes ``matmul_q8_interleaved`` (about twice ``matmul_q8``'s
speed with VNNI; on AVX2 about 9x: 3.9 against 36 GB/s for SmolLM2's gate/up) for up
to ``Q8_INTERLEAVED_MAX_BATCH`` tokens, and
the tile path decodes each tile straight into rows (``dequantize_interleaved``).

Layers without a fast path (a type the kernel does not decode, a GPU, no compiler, a
tensor-parallel split along the blocks) keep a model-dtype weight: ``load_gguf_weight``
dequantizes the bytes once as they load.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from kvpilot.kernels import gguf_matmul_cpu

logger = logging.getLogger(__name__)

# Values of the row tile the prefill path decodes at a time (8 MiB in float32; a small
# model's layers, SmolLM2's 3,072 x 576 gate/up included, in one tile).
TILE_ELEMENTS = 1 << 21
FLOAT_TYPES = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}   # ggml F32, F16, BF16
Q8_DTYPES = (torch.bfloat16, torch.float16)   # the activation dtypes the q8 path takes
# Set inside ``float_activations()``: the q8 path is off (module docstring).
_FLOAT_ACTIVATIONS: ContextVar[bool] = ContextVar("gguf_float_activations", default=False)


@contextmanager
def float_activations(on: bool = True) -> Iterator[None]:
    """Within it, GGUF layers keep activations in float (no q8 path) when ``on``: for a
    step that computes prompt tokens (module docstring)."""
    token = _FLOAT_ACTIVATIONS.set(on)
    try:
        yield
    finally:
        _FLOAT_ACTIVATIONS.reset(token)


@dataclass(frozen=True, slots=True)
class GgufPart:
    """One part's rows in the flat byte weight: ``rows`` x ``bytes_per_row`` from
    ``byte_offset``, output rows from ``row_offset``, all of ggml type ``qtype``."""

    qtype: int
    rows: int
    row_offset: int
    byte_offset: int
    bytes_per_row: int

    @property
    def num_bytes(self) -> int:
        return self.rows * self.bytes_per_row


@dataclass(frozen=True, slots=True)
class GgufLayout:
    """Where each part of a layer's GGUF weight lies; ``segments`` are runs of parts of
    one type, each multiplied by one kernel call."""

    columns: int
    parts: tuple[GgufPart, ...]
    segments: tuple[GgufPart, ...]
    interleaved: bool = False   # the bytes in the kernel's interleaved layout (module docstring)
    float32_q8: bool = False    # float32 activations take the q8 path too (module docstring)

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.parts)

    @property
    def num_bytes(self) -> int:
        return sum(p.num_bytes for p in self.parts)


def qtype_name(qtype: int) -> str:
    """ggml's name of a type id (``Q4_K``), or the id."""
    try:
        return GGMLQuantizationType(qtype).name
    except ValueError:
        return f"ggml type {qtype}"


def build_layout(columns: int, part_rows: Sequence[int], qtypes: Sequence[int],
                 interleaved: bool = False, float32_q8: bool = False) -> GgufLayout:
    """The layout of parts of ``part_rows`` rows and types ``qtypes`` (each with a kernel;
    ``columns`` a whole number of each type's blocks), interleaved or as the file's rows;
    ``float32_q8``: float32 activations take the q8 path too."""
    parts, row, byte = [], 0, 0
    for rows, qtype in zip(part_rows, qtypes, strict=True):
        _, block, type_size = gguf_matmul_cpu.QTYPES[qtype]
        if columns % block:
            raise ValueError(f"{columns} columns are not a whole number of {qtype_name(qtype)} "
                             f"blocks of {block}")
        parts.append(GgufPart(qtype, rows, row, byte, columns // block * type_size))
        row, byte = row + rows, byte + parts[-1].num_bytes
    segments = [parts[0]]
    for p in parts[1:]:
        last = segments[-1]
        if p.qtype == last.qtype:
            segments[-1] = GgufPart(last.qtype, last.rows + p.rows, last.row_offset, last.byte_offset,
                                    last.bytes_per_row)
        else:
            segments.append(p)
    return GgufLayout(columns, tuple(parts), tuple(segments), interleaved, float32_q8)


def q8_activations(dtype: torch.dtype, float32_q8: bool = False) -> bool:
    """Whether activations of ``dtype`` may take the q8 path: 16-bit ones, and float32 ones
    in a layer loaded with ``float32_q8`` (module docstring)."""
    return dtype in Q8_DTYPES or (float32_q8 and dtype == torch.float32)


def interleaves(dtype: torch.dtype, part_rows: Sequence[int], qtypes: Sequence[int],
                float32_q8: bool = False) -> bool:
    """Whether a layer of ``dtype`` with these parts keeps its bytes interleaved (module
    docstring): only where every call of up to ``Q8_INTERLEAVED_MAX_BATCH`` decode tokens
    takes the q8 path (the dtype, the type, whole groups of rows, AVX512-VNNI or AVX2, the
    q8 path switched on)."""
    return q8_activations(dtype, float32_q8) and all(
        gguf_matmul_cpu.interleaves(q, rows) for rows, q in zip(part_rows, qtypes, strict=True))


def fast_path_reason(linear: nn.Module, qtypes: Sequence[int], device: torch.device | str) -> str | None:
    """Why ``linear`` cannot keep GGUF blocks of ``qtypes`` on ``device`` (None: it can)."""
    if torch.device(device).type != "cpu":
        return f"no GGUF matmul kernel for {torch.device(device).type} (CPU only)"
    missing = sorted({qtype_name(q) for q in qtypes if q not in gguf_matmul_cpu.QTYPES})
    if missing:
        return f"no kernel decodes {', '.join(missing)}"
    tp = getattr(linear, "tp", None)
    if tp is not None and tp.world_size > 1:
        return "the layer's input columns are split across tensor-parallel ranks"
    if gguf_matmul_cpu.load() is None:
        return "the CPU GGUF matmul kernel could not be built"
    return None


def use_gguf_weight(linear: nn.Module, qtype: int | Sequence[int],
                    device: torch.device | str = "cpu", *, float32_q8: bool = False) -> str | None:
    """Give a (meta-device) linear layer GGUF storage for blocks of ``qtype`` (one type, or
    one per part of a fused layer) to run on ``device``. Returns None when it did, else
    why not (the layer then keeps its model-dtype weight and ``load_gguf_weight``
    dequantizes into it); the reason is logged. ``float32_q8``: float32 decode tokens take
    the q8 path too (module docstring)."""
    parts = getattr(linear, "output_sizes", None) or [linear.weight.shape[0]]
    qtypes = [qtype] * len(parts) if isinstance(qtype, int) else list(qtype)
    if len(qtypes) != len(parts):
        raise ValueError(f"{len(qtypes)} ggml types for a layer of {len(parts)} parts")
    columns = linear.weight.shape[1]
    reason = fast_path_reason(linear, qtypes, device)
    if reason is None:
        try:
            layout = build_layout(columns, parts, qtypes,
                                  interleaves(linear.weight.dtype, parts, qtypes, float32_q8), float32_q8)
        except ValueError as exc:
            reason = str(exc)
    if reason is not None:
        logger.info("GGUF %s weight [%d, %d] dequantized at load: %s",
                    "/".join(qtype_name(q) for q in qtypes), sum(parts), columns, reason)
        return reason
    linear.weight = nn.Parameter(torch.empty(layout.num_bytes, dtype=torch.uint8, device=linear.weight.device),
                                 requires_grad=False)
    linear.gguf = layout
    return None


def use_gguf_embedding(embedding: nn.Module, qtype: int, device: torch.device | str = "cpu", *,
                       float32_q8: bool = False) -> str | None:
    """GGUF storage for a (meta-device) ``VocabParallelEmbedding`` (the token embedding,
    and the LM head when the two are tied): a lookup decodes only the rows it reads
    (``gguf_embedding``), the LM head multiplies through ``gguf_linear``. None when it
    did, else why not (logged; the weight stays in the model dtype)."""
    rows, columns = embedding.weight.shape
    reason = fast_path_reason(embedding, [qtype], device)
    if reason is None:
        try:
            layout = build_layout(columns, [rows], [qtype],
                                  interleaves(embedding.weight.dtype, [rows], [qtype], float32_q8), float32_q8)
        except ValueError as exc:
            reason = str(exc)
    if reason is not None:
        logger.info("GGUF %s embedding [%d, %d] dequantized at load: %s", qtype_name(qtype), rows, columns, reason)
        return reason
    embedding.gguf_dtype = embedding.weight.dtype      # what a lookup returns
    embedding.weight = nn.Parameter(torch.empty(layout.num_bytes, dtype=torch.uint8, device=embedding.weight.device),
                                    requires_grad=False)
    embedding.gguf = layout
    return None


def gguf_embedding(input_ids: torch.Tensor, weight: torch.Tensor, layout: GgufLayout,
                   dtype: torch.dtype) -> torch.Tensor:
    """The embeddings of ``input_ids`` in ``dtype``, decoding only their rows (of an
    interleaved weight too: each row's blocks gathered from its group)."""
    (part,) = layout.parts
    ids = input_ids.reshape(-1)
    direct = dtype in (torch.float32, torch.bfloat16, torch.float16)
    decoded = dtype if direct else torch.float32
    if layout.interleaved:
        values = gguf_matmul_cpu.dequantize_interleaved(weight.view(part.rows, part.bytes_per_row), part.qtype,
                                                        decoded, rows=ids)
    else:
        rows = weight.view(part.rows, part.bytes_per_row).index_select(0, ids)
        values = gguf_matmul_cpu.dequantize(rows, part.qtype, decoded)
    return values.to(dtype).reshape(*input_ids.shape, layout.columns)


def _as_tensor(raw: np.ndarray | torch.Tensor) -> torch.Tensor:
    if isinstance(raw, torch.Tensor):
        return raw
    return torch.from_numpy(np.ascontiguousarray(raw))


def dequantize(raw: np.ndarray | torch.Tensor, qtype: int) -> torch.Tensor:
    """float32 ``[rows, columns]`` of GGUF rows ``[rows, bytes_per_row]`` of ``qtype``
    (the kernel's decoder where it has one, else the ``gguf`` package's)."""
    if qtype in FLOAT_TYPES:
        return _as_tensor(raw).to(torch.float32)
    tensor = _as_tensor(raw)
    if qtype in gguf_matmul_cpu.QTYPES and gguf_matmul_cpu.load() is not None:
        return gguf_matmul_cpu.dequantize(tensor.contiguous(), qtype)
    from gguf.quants import dequantize as gguf_dequantize

    return torch.from_numpy(np.ascontiguousarray(gguf_dequantize(tensor.numpy(), qtype), dtype=np.float32))


def load_gguf_weight(linear: nn.Module, raw: np.ndarray | torch.Tensor, qtype: int,
                     shard_id: int | None = None, row_order: torch.Tensor | None = None) -> None:
    """Fill part ``shard_id`` of ``linear``'s weight (the whole weight: None) from a GGUF
    tensor's data as ``GGUFReader`` gives it: uint8 ``[rows, bytes_per_row]`` blocks for a
    quantized type, ``[rows, columns]`` values for F32/F16/BF16. ``row_order``: the rows
    to take, in order (``raw[row_order]``), e.g. ``llama_qk_row_order``."""
    tensor = _as_tensor(raw)
    if row_order is not None:
        tensor = tensor[row_order]
    layout: GgufLayout | None = getattr(linear, "gguf", None)
    if layout is None:
        linear.load_weight("weight", dequantize(tensor, qtype), shard_id)
        return
    index = shard_id or 0
    part = layout.parts[index]
    shard = linear.parts[index] if hasattr(linear, "parts") else None
    full_rows = shard.full if shard is not None else part.rows
    if qtype != part.qtype or tuple(tensor.shape) != (full_rows, part.bytes_per_row):
        raise ValueError(f"GGUF tensor {qtype_name(qtype)} {tuple(tensor.shape)} does not fit part {index} "
                         f"of this layer: {qtype_name(part.qtype)} ({full_rows}, {part.bytes_per_row})")
    if shard is not None:
        tensor = tensor[shard.start:shard.start + part.rows]
    if layout.interleaved:
        tensor = gguf_matmul_cpu.interleave(tensor.contiguous(), qtype)
    dst = linear.weight.data[part.byte_offset:part.byte_offset + part.num_bytes]
    dst.view(part.rows, part.bytes_per_row).copy_(tensor)


def llama_qk_row_order(rows: int, num_heads: int) -> torch.Tensor:
    """The rows of a GGUF q or k weight, in HF order: llama.cpp's converter interleaves
    each head's two rotary halves (``reshape(heads, 2, d / 2).swapaxes(1, 2)``), so
    ``gguf_rows[order]`` are the checkpoint's rows."""
    head_dim = rows // num_heads
    if rows % num_heads or head_dim % 2:
        raise ValueError(f"{rows} rows do not form {num_heads} heads of an even size")
    return torch.arange(rows).reshape(num_heads, head_dim // 2, 2).transpose(1, 2).reshape(-1)


def gguf_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                layout: GgufLayout) -> torch.Tensor:
    """``x W^T + b`` for a GGUF ``W`` (see the module docstring for the two paths)."""
    flat = x.reshape(-1, layout.columns)
    if layout.interleaved and len(layout.segments) == 1 and q8_activations(flat.dtype, layout.float32_q8) \
            and flat.shape[0] <= gguf_matmul_cpu.Q8_INTERLEAVED_MAX_BATCH and not _FLOAT_ACTIVATIONS.get():
        # a decode step's call, straight to the kernel: this path runs ~120 times a step,
        # where the general one's Python cost (~12 us a call) came to a tenth of a step
        (seg,) = layout.segments
        y = gguf_matmul_cpu.matmul_q8_interleaved(flat, weight.view(seg.rows, seg.bytes_per_row), seg.qtype, bias)
        return y.reshape(*x.shape[:-1], seg.rows)
    outs = [_segment(flat, weight, seg, layout,
                     None if bias is None else bias[seg.row_offset:seg.row_offset + seg.rows])
            for seg in layout.segments]
    y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
    return y.to(x.dtype).reshape(*x.shape[:-1], layout.rows)


def uses_q8(dtype: torch.dtype, qtype: int, tokens: int, *, interleaved: bool = False,
            float32_q8: bool = False) -> bool:
    """Whether ``tokens`` activations of ``dtype`` take the q8 path through a ``qtype``
    weight (of any width), held ``interleaved`` or not, in a layer loaded with or without
    ``float32_q8``, here (module docstring)."""
    bound = gguf_matmul_cpu.Q8_INTERLEAVED_MAX_BATCH if interleaved else gguf_matmul_cpu.Q8_MAX_BATCH
    return (q8_activations(dtype, float32_q8) and not _FLOAT_ACTIVATIONS.get() and qtype in gguf_matmul_cpu.Q8_TYPES
            and gguf_matmul_cpu.q8_enabled()
            and tokens <= bound
            and gguf_matmul_cpu.q8_isa() is not None)


def _segment(flat: torch.Tensor, weight: torch.Tensor, seg: GgufPart, layout: GgufLayout,
             bias: torch.Tensor | None) -> torch.Tensor:
    """One segment's outputs (bias added before the one rounding to the activation
    dtype): the activation dtype from the q8 path and tiles, float32 from the float kernel."""
    columns = layout.columns
    rows = weight[seg.byte_offset:seg.byte_offset + seg.num_bytes].view(seg.rows, seg.bytes_per_row)
    if uses_q8(flat.dtype, seg.qtype, flat.shape[0], interleaved=layout.interleaved,
               float32_q8=layout.float32_q8):
        if layout.interleaved:
            return gguf_matmul_cpu.matmul_q8_interleaved(flat, rows, seg.qtype, bias)
        return gguf_matmul_cpu.matmul_q8(flat, rows, seg.qtype, bias)
    if flat.shape[0] <= gguf_matmul_cpu.MAX_VECTOR_BATCH and not layout.interleaved:
        out = gguf_matmul_cpu.matmul(flat, rows, seg.qtype)
        return out if bias is None else out + bias
    if (layout.interleaved and flat.dtype == torch.float32
            and flat.shape[0] <= gguf_matmul_cpu.INTERLEAVED_FLOAT_MAX_BATCH):
        # interleaved, a float32 model: its few float rows without decoding every tile
        return gguf_matmul_cpu.matmul_interleaved_float(flat, rows, seg.qtype, bias)
    tile = max(1, TILE_ELEMENTS // columns)
    decode = gguf_matmul_cpu.dequantize
    if layout.interleaved:   # whole groups of rows, decoded straight into rows
        step = gguf_matmul_cpu.INTERLEAVE_ROWS
        tile = max(step, tile // step * step)
        decode = gguf_matmul_cpu.dequantize_interleaved
    if tile >= seg.rows:     # one tile: F.linear's result is the segment's
        return F.linear(flat, decode(rows, seg.qtype, flat.dtype), bias)
    out = torch.empty(flat.shape[0], seg.rows, dtype=flat.dtype)
    for start in range(0, seg.rows, tile):
        block = decode(rows[start:start + tile], seg.qtype, flat.dtype)
        out[:, start:start + block.shape[0]] = F.linear(
            flat, block, None if bias is None else bias[start:start + block.shape[0]])
    return out


def resident_bytes(module: nn.Module) -> int:
    """Bytes of a layer's (or a model's) parameters as held: GGUF blocks count their file
    bytes, everything else its dtype's."""
    return sum(p.numel() * p.element_size() for p in module.parameters())
