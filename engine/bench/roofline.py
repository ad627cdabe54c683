"""The single-stream decode roofline that ``bench peer`` and ``bench offline`` print: the
machine's measured read bandwidth over the bytes one decode token must read is the most
tokens per second one stream can make on this machine, whatever the server.

- ``read_bandwidth``: a large float32 tensor summed with all threads (a reduction reads
  every byte once and writes nothing), best of N, in bytes/s.
- ``weight_bytes_per_token``: the weight bytes one decode token of one stream reads: every
  tensor once, except the token embedding, which is only gathered, one row per token; a
  tied embedding is also the LM head, which reads it whole, so then it counts whole (and
  once). A GGUF file counts its tensors as stored (quantized sizes: what llama.cpp reads),
  or as the engine holds them when given a dtype (``contract.gguf.resident_tensor_bytes``:
  kept types in their blocks, the rest dequantized); an HF checkpoint counts its
  floating-point tensors in the dtype it is served in, the others (FP8, integers) as stored.
- ``kv_bytes_per_token``: the KV cache one decode token reads at a given context: keys and
  values of every layer, ``2 x kv_heads x head_dim x dtype bytes`` per cached token, a
  sliding-window layer at most its window.
- ``Roofline``: bandwidth / (weights + KV) = the ceiling in tokens/s, and the share of it a
  measured rate reaches.

A ceiling, not a prediction: compute, per-layer overheads and sampling come on top, and a
batch of streams shares one read of the weights (so batched rates may exceed it).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvpilot.contract.arch_config import ArchConfig
from kvpilot.contract.constants import MODEL_DTYPE_BYTES
from kvpilot.contract.gguf import find_gguf, resident_tensor_bytes

DEFAULT_PROBE_BYTES = 256 << 20
DEFAULT_PROBE_REPEATS = 8
GGUF_EMBEDDING = "token_embd.weight"
GGUF_LM_HEAD = "output.weight"
HF_EMBEDDING = "embed_tokens.weight"     # model.embed_tokens.weight (any prefix)
HF_LM_HEAD = "lm_head.weight"
# safetensors dtypes served in the model dtype; others (FP8, integers) stay as stored
_FLOAT_TYPES = frozenset({"F16", "BF16", "F32", "F64"})
_STORED_BYTES = {"F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1, "I16": 2, "U16": 2,
                 "I32": 4, "U32": 4, "I64": 8, "U64": 8}


def read_bandwidth(num_bytes: int = DEFAULT_PROBE_BYTES, repeats: int = DEFAULT_PROBE_REPEATS,
                   threads: int | None = None) -> float:
    """This machine's read bandwidth in bytes/s: the best of ``repeats`` sums of a
    ``num_bytes`` float32 tensor (far larger than the caches by default) on ``threads``
    torch threads (None: torch's current number; restored afterwards)."""
    import torch

    if num_bytes < 4 or repeats < 1:
        raise ValueError("the probe needs num_bytes >= 4 and repeats >= 1")
    data = torch.ones(num_bytes // 4, dtype=torch.float32)   # written once: every page resident
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        data.sum()
        best = math.inf
        for _ in range(repeats):
            start = time.perf_counter()
            data.sum()
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return data.numel() * 4 / max(best, 1e-9)


def _named(name: str, key: str) -> bool:
    """``name`` is ``key`` or ends in ``.key`` (``blk.0.attn_output.weight`` is no ``output.weight``)."""
    return name == key or name.endswith("." + key)


def _count(tensors, embedding: str, lm_head: str, tied: bool) -> int:
    """Sum of ``(name, bytes, rows)`` under the embedding rule (module docstring)."""
    total = 0
    for name, size, rows in tensors:
        if _named(name, embedding) and not tied:
            total += size // rows           # one row gathered per token
        elif not (tied and _named(name, lm_head)):   # a stored copy of a tied head
            total += size
    return total


def gguf_weight_bytes(path: str | Path, dtype: str | None = None) -> int:
    """Weight bytes per decode token of GGUF file ``path``: its tensors as stored
    (``dtype`` None), or as the engine holds them serving in ``dtype``."""
    from kvpilot.engine.model.gguf.files import open_reader

    tensors = open_reader(path).tensors
    tied = not any(t.name == GGUF_LM_HEAD for t in tensors)

    def size(t) -> int:
        if dtype is None:
            return int(t.n_bytes)
        return resident_tensor_bytes(t.name, t.tensor_type.name, int(t.n_elements), int(t.n_bytes),
                                     MODEL_DTYPE_BYTES[dtype])

    # GGUF shapes run fastest dimension first: a row is shape[0] elements
    return _count(((t.name, size(t), int(t.n_elements) // int(t.shape[0])) for t in tensors),
                  GGUF_EMBEDDING, GGUF_LM_HEAD, tied)


def checkpoint_weight_bytes(model_dir: str | Path, dtype: str) -> int:
    """Weight bytes per decode token of the HF checkpoint in ``model_dir`` served in ``dtype``
    (tied embeddings as its ``config.json`` says)."""
    from kvpilot.engine.model.hf_config import load_arch_config
    from kvpilot.engine.model.loader import iter_checkpoint

    elem = MODEL_DTYPE_BYTES[dtype]
    tied = load_arch_config(model_dir).tie_word_embeddings

    def entry(name: str, tensor) -> tuple[str, int, int]:
        shape, kind = tensor.get_shape(), tensor.get_dtype()
        if kind not in _FLOAT_TYPES and kind not in _STORED_BYTES:
            raise ValueError(f"{model_dir}: tensor {name!r} has dtype {kind}, not one counted here")
        numel = math.prod(shape)
        return name, numel * (elem if kind in _FLOAT_TYPES else _STORED_BYTES[kind]), shape[0] if shape else 1

    return _count((entry(n, t) for n, t in iter_checkpoint(Path(model_dir))),
                  HF_EMBEDDING, HF_LM_HEAD, tied)


def weight_bytes_per_token(model: str | Path, dtype: str | None) -> int:
    """``gguf_weight_bytes`` or ``checkpoint_weight_bytes``, by what ``model`` is (a GGUF
    file, else a checkpoint, which needs a ``dtype``)."""
    gguf = find_gguf(model)
    if gguf is not None:
        return gguf_weight_bytes(gguf, dtype)
    if dtype is None:
        raise ValueError("an HF checkpoint's weight bytes need the dtype it is served in")
    return checkpoint_weight_bytes(model, dtype)


def kv_bytes_per_token(arch: ArchConfig, context: int, dtype_bytes: int) -> int:
    """KV bytes one decode token reads with ``context`` tokens cached: 2 (keys, values) x
    kv_heads x head_dim x ``dtype_bytes`` per cached token and layer, a sliding-window
    layer at most its window."""
    per_slot = 2 * arch.num_key_value_heads * arch.head_dim * dtype_bytes
    return sum(per_slot * min(context, arch.layer_sliding_window(i) or context)
               for i in range(arch.num_hidden_layers))


def mean_decode_context(prompt_lens: Sequence[int], output_lens: Sequence[int]) -> int:
    """The mean context over every output token of these requests (the i-th output token
    of a ``p``-token prompt is computed with ``p + i`` tokens cached), rounded."""
    tokens = sum(output_lens)
    if tokens < 1:
        raise ValueError("no output tokens")
    # sum over i < n of (p + i) = n * p + n * (n - 1) / 2
    total = sum(n * p + n * (n - 1) / 2 for p, n in zip(prompt_lens, output_lens, strict=True))
    return round(total / tokens)


@dataclass(frozen=True, slots=True)
class Roofline:
    """The single-stream decode ceiling of one model served one way on this machine.

    Args:
        bandwidth: measured read bandwidth, bytes/s.
        weight_bytes: weight bytes one decode token reads.
        kv_bytes: KV bytes it reads at ``context`` tokens (0: KV not counted).
        context: the context ``kv_bytes`` was counted at.
    """

    bandwidth: float
    weight_bytes: int
    kv_bytes: int = 0
    context: int = 0

    def __post_init__(self) -> None:
        if not (self.bandwidth > 0 and math.isfinite(self.bandwidth)):
            raise ValueError(f"bandwidth must be positive and finite, got {self.bandwidth}")
        if self.weight_bytes < 1 or self.kv_bytes < 0:
            raise ValueError("weight_bytes must be >= 1 and kv_bytes >= 0")

    @property
    def bytes_per_token(self) -> int:
        return self.weight_bytes + self.kv_bytes

    @property
    def ceiling(self) -> float:
        """The most tokens/s one stream can make: bandwidth / bytes per token."""
        return self.bandwidth / self.bytes_per_token

    def share(self, tokens_per_s: float | None) -> float | None:
        """The fraction of ``ceiling`` that ``tokens_per_s`` reaches (None stays None)."""
        return None if tokens_per_s is None else tokens_per_s / self.ceiling

    def describe(self, tokens_per_s: float | None = None) -> str:
        share = self.share(tokens_per_s)
        reached = "" if share is None else f", {100 * share:.0f}% reached"
        return f"{self.bytes_per_token / 1e6:.1f} MB/token -> {self.ceiling:.0f} tok/s{reached}"

    def as_dict(self, tokens_per_s: float | None = None, decode_tok_s: float | None = None) -> dict:
        """The figures; ``decode_tok_s``: the rate of decode alone (``bench peer``'s
        ``decode_tok/s@1``), if known."""
        return {"read_bandwidth_gb_s": self.bandwidth / 1e9, "weight_bytes": self.weight_bytes,
                "kv_bytes": self.kv_bytes, "context": self.context, "bytes_per_token": self.bytes_per_token,
                "ceiling_tok_s": self.ceiling, "tok_s": tokens_per_s, "share": self.share(tokens_per_s),
                "decode_tok_s": decode_tok_s, "decode_share": self.share(decode_tok_s)}
