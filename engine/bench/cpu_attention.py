"""``kvpilot bench cpu-attention``: decode attention on CPU, the C++ kernel against the
pure-torch path, side by side on the same paged cache.

For each shape (sequences x query heads / KV heads x head size x context length) one
random paged cache with shuffled block tables; each path attends every sequence's last
token over its whole context (the torch path as one layer of an engine step: its decode
plan built once), alternating runs, and the fastest of ``--repeats`` rounds is reported with the ratio and the largest difference between the two outputs. The
default shapes are the micro model of ``bench overhead`` at batch 256 and Qwen3-0.6B- and
8B-shaped layers (16/8 and 32/8 heads of 128) at serving batch sizes and contexts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# sequences, query heads, KV heads, head size, context length
DEFAULT_SHAPES = "256x4/2x16x128,32x16/8x128x1024,8x16/8x128x4096,64x32/8x128x512,1x32/8x128x8192"
BLOCK_SIZE = 16


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("cpu-attention", help="CPU decode attention: C++ kernel vs pure torch",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=DEFAULT_SHAPES,
                   help="comma-separated SEQSxHEADS/KV_HEADSxHEAD_SIZExCONTEXT (default: %(default)s)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    add_kernel_bench_args(p, run)


def add_kernel_bench_args(p: argparse.ArgumentParser, run) -> None:
    """The options every CPU kernel benchmark shares (``run`` is its command)."""
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="rounds; the fastest is reported")
    p.add_argument("--json-out", default=None, help="also write the results to this JSON file")
    p.set_defaults(func=run)


@dataclass(frozen=True, slots=True)
class Shape:
    num_seqs: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    context: int

    @classmethod
    def parse(cls, text: str) -> Shape:
        try:
            seqs, heads, head_dim, context = text.split("x")
            num_heads, num_kv_heads = heads.split("/")
            return cls(int(seqs), int(num_heads), int(num_kv_heads), int(head_dim), int(context))
        except ValueError:
            raise ValueError(f"shape {text!r} is not SEQSxHEADS/KV_HEADSxHEAD_SIZExCONTEXT") from None


@dataclass(frozen=True, slots=True)
class CpuAttentionResult:
    shape: str
    torch_ms: float
    kernel_ms: float
    speedup: float
    max_abs_diff: float


def measure(shape: Shape, dtype, repeats: int = 3) -> CpuAttentionResult:
    """Both paths on one random paged cache of ``shape``; fastest round of each."""
    import torch

    from kvpilot.engine.model.attention.torch_backend import paged_attention
    from kvpilot.kernels import paged_decode_cpu
    from kvpilot.kernels.attention_metadata import AttentionMetadata

    gen = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-shape.context // BLOCK_SIZE)
    num_blocks = shape.num_seqs * blocks_per_seq
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim,
                           generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen).view(shape.num_seqs, blocks_per_seq).int()
    query = torch.randn(shape.num_seqs, shape.num_heads, shape.head_dim, generator=gen).to(dtype)
    n = shape.num_seqs
    seq_lens = torch.full((n,), shape.context, dtype=torch.int32)
    ones = torch.ones(n, dtype=torch.int32)
    scale = shape.head_dim ** -0.5
    unit = torch.ones((), dtype=torch.float32)

    # One step's metadata for every call: the torch path builds its decode plan on the first
    # call and reuses it, as the later layers of an engine step do (favouring torch a little).
    metadata = AttentionMetadata(n, torch.cat([torch.zeros(1, dtype=torch.int32), ones.cumsum(0)]).int(),
                                 seq_lens, tables, torch.zeros(n, dtype=torch.long), 1,
                                 (1,) * n, (shape.context,) * n, shape.context)

    def torch_path():
        return paged_attention(query, kv_cache, metadata, scale, unit, unit)

    def kernel():
        return paged_decode_cpu.paged_decode(query, kv_cache, tables, seq_lens, scale)

    start = time.perf_counter()
    diff = (torch_path().float() - kernel().float()).abs().max().item()
    calls = max(1, min(20, int(0.2 / (time.perf_counter() - start))))   # ~0.2 s a round
    best = {torch_path: float("inf"), kernel: float("inf")}
    for _ in range(repeats):
        for fn in (torch_path, kernel):   # alternating: a noisy moment hits both
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best[fn] = min(best[fn], (time.perf_counter() - start) / calls * 1000)
    label = f"{n}x{shape.num_heads}/{shape.num_kv_heads}x{shape.head_dim}x{shape.context}"
    return CpuAttentionResult(label, best[torch_path], best[kernel], best[torch_path] / best[kernel], diff)


def run(args: argparse.Namespace) -> int:
    import torch

    from kvpilot.kernels import paged_decode_cpu

    if paged_decode_cpu.load() is None:
        print("the CPU decode kernel cannot be built on this machine (see the warning above)")
        return 1
    try:
        shapes = [Shape.parse(s) for s in args.shapes.split(",")]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"decode attention on CPU, {args.dtype}, block size {BLOCK_SIZE}, threads="
          f"{torch.get_num_threads()}; shape = sequences x heads/KV heads x head size x context")
    print(f"{'shape':>24}{'torch ms':>11}{'kernel ms':>11}{'speedup':>9}{'max |diff|':>12}")
    results = []
    for shape in shapes:
        r = measure(shape, dtype, args.repeats)
        results.append(r)
        print(f"{r.shape:>24}{r.torch_ms:>11.2f}{r.kernel_ms:>11.2f}{r.speedup:>8.2f}x{r.max_abs_diff:>12.1e}",
              flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0
