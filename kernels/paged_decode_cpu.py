"""Paged decode attention on CPU: a C++ kernel built on first use by torch's cpp_extension.

The pure-torch path (``engine/model/attention/torch_backend.py``, the reference) gathers
every decode sequence's K and V into a padded copy and hands it to SDPA; at batch 256
that copy and SDPA's per-head overhead are most of a micro model's decode step. This
kernel reads K and V in place through the block table, one (sequence, KV head) at a time
with the query heads that share the KV head, in two passes (scores and their maximum,
then the softmax-weighted sum of values), accumulating in float32 (double for double).

The source is ``csrc/paged_decode_cpu.cpp``; ``load()`` compiles it (about 30 s) once
per machine and version into the kernel cache (``kvpilot.kernels.kernel_cache``, under
``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``; ``scripts/bootstrap.sh``
builds it at install time, and a changed source is built anew on the next load; the engine
image ships it prebuilt, see ``kvpilot.kernels.prebuilt``) and returns None, with the reason logged,
where it cannot be built (no C++ compiler or Python headers): the engine then uses the
pure-torch path. fp8 caches are not handled here (the torch path dequantizes them).
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import torch

from kvpilot.kernels.cpu_extension import load_cpu_extension
from kvpilot.kernels.cpu_isa import isa_variant

SOURCE = Path(__file__).parent / "csrc" / "paged_decode_cpu.cpp"
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
# -ffast-math lets the exp loop vectorize through glibc's vector math (libmvec) and the
# sums reassociate (results stay within float32 rounding of the reference). -fopenmp:
# ATen's parallel_for is an inline OpenMP region in torch's CPU builds, serial without it.
CFLAGS = ["-O3", "-ffast-math", "-fopenmp"]
LDFLAGS = ("-lm", "-fopenmp")
def variant(isa: str | None) -> tuple[str, list[str]]:
    """The module name and compiler flags of the kernel for ``isa`` (None or unknown: baseline)."""
    return isa_variant("kvpilot_paged_decode_cpu", isa, CFLAGS)


@functools.cache
def load() -> ModuleType | None:
    """The compiled kernel module (prebuilt, or built on the first call), or None if it
    cannot be built (decode attention then runs on the pure-torch path)."""
    name, flags = variant(torch.backends.cpu.get_cpu_capability())
    return load_cpu_extension(name, SOURCE, flags, "CPU paged-decode kernel",
                              "decode attention runs on the pure-torch path", LDFLAGS)


def supports(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether this kernel can attend ``query`` over ``kv_cache`` (CPU, same dtype, no fp8)."""
    return (query.device.type == "cpu" and kv_cache.device.type == "cpu"
            and query.dtype == kv_cache.dtype and query.dtype in DTYPES)


def paged_decode(
    query: torch.Tensor,          # [num_seqs, num_heads, head_dim], one query per sequence
    kv_cache: torch.Tensor,       # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,   # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,       # [num_seqs] int32, the query being the last token
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention of each sequence's last token over its keys (the last ``sliding_window``
    of them when given); ``[num_seqs, num_heads, head_dim]`` in the query's dtype."""
    module = load()
    if module is None:
        raise RuntimeError("the CPU paged-decode kernel is not available on this machine")
    if query.dim() != 3 or kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"query must be [num_seqs, heads, head_dim] and kv_cache [2, blocks, "
                         f"block_size, kv_heads, head_dim]; got {tuple(query.shape)} and "
                         f"{tuple(kv_cache.shape)}")
    if not supports(query, kv_cache):
        raise ValueError(f"needs CPU tensors of one dtype among {DTYPES}; got query "
                         f"{query.dtype} on {query.device}, cache {kv_cache.dtype} on {kv_cache.device}")
    num_seqs, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads of size {head_dim} cannot attend over "
                         f"{num_kv_heads} KV heads of size {cache_head_dim}")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("block_tables and seq_lens must be int32")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or seq_lens.shape != (num_seqs,):
        raise ValueError(f"block_tables must be [{num_seqs}, max_blocks] and seq_lens [{num_seqs}]; "
                         f"got {tuple(block_tables.shape)} and {tuple(seq_lens.shape)}")
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive; got {sliding_window}")
    return module.paged_decode(query.contiguous(), kv_cache[0], kv_cache[1], block_tables.contiguous(),
                               seq_lens.contiguous(), sliding_window or 0, float(scale))
