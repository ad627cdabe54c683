"""``kvpilot bench gguf-matmul``: decode-shaped matmuls of GGUF weights kept as blocks
(``layers.gguf_linear`` on the CPU kernel) against float32 and bfloat16 ``F.linear``,
side by side, with each layer's resident bytes.

Each shape is a ``rows x columns`` weight (default: SmolLM2-135M's q/o, k/v, gate/up and
down projections); ``--copies`` copies of it (default 30, that model's layer count) are
cycled through, so that the weights stream from memory as a model's layers do rather
than sitting in cache. The quantized types multiply activations of ``--act-dtype``
(the engine's model dtype; bfloat16 on a CPU with AVX512-BF16). Weights are random
valid blocks; the fastest of ``--repeats`` rounds is reported, per call.

``--model-pass`` reports instead one decode step over all of SmolLM2-135M's matrices:
the float kernel vs the q8-activation kernel vs bfloat16 ``F.linear``
(``bench.gguf_model_pass``), at ``--batches`` (default there: 1,8,32).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kvpilot.engine.bench.cpu_attention import add_kernel_bench_args

DEFAULT_SHAPES = "576x576,192x576,1536x576,576x1536"
DEFAULT_TYPES = "Q8_0,Q4_0,Q4_1,Q4_K,Q5_K,Q6_K"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("gguf-matmul", help="GGUF block weights vs float32/bf16 F.linear (CPU)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated ROWSxCOLUMNS (default: %(default)s)")
    p.add_argument("--types", default=DEFAULT_TYPES, help="ggml types (default: %(default)s)")
    p.add_argument("--batches", default=None, help="tokens per call (default: 1,8; with --model-pass 1,8,32)")
    p.add_argument("--model-pass", action="store_true",
                   help="one decode step over SmolLM2-135M's matrices: float vs q8 vs bf16 F.linear")
    p.add_argument("--act-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="activations of the quantized layers (default: %(default)s)")
    p.add_argument("--copies", type=int, default=30, help="weights cycled through (default: %(default)s)")
    add_kernel_bench_args(p, run)


@dataclass(frozen=True, slots=True)
class MatmulResult:
    shape: str
    method: str          # float32, bfloat16, or a ggml type
    resident_bytes: int  # one layer's weight
    us_per_call: dict[int, float]   # batch -> microseconds (empty: the type cannot hold the shape)


def parse_shape(text: str) -> tuple[int, int]:
    try:
        rows, columns = (int(v) for v in text.split("x"))
    except ValueError:
        raise ValueError(f"shape {text!r} is not ROWSxCOLUMNS") from None
    return rows, columns


def _time(fn, inputs: list, repeats: int) -> float:
    """Fastest round of one pass over ``inputs`` (a call each), microseconds per call."""
    fn(*inputs[0])
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for args in inputs:
            fn(*args)
        best = min(best, (time.perf_counter() - start) / len(inputs) * 1e6)
    return best


def measure(rows: int, columns: int, methods: list[str], batches: list[int], act_dtype,
            copies: int, repeats: int) -> list[MatmulResult]:
    """Every method at one shape; a fresh set of ``copies`` weights per method."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from kvpilot.engine.model.layers.gguf_linear import build_layout, gguf_linear

    rng = np.random.default_rng(0)
    results = []
    for method in methods:
        if method in ("float32", "bfloat16"):
            dtype = getattr(torch, method)
            weights = [torch.randn(rows, columns).to(dtype) for _ in range(copies)]
            nbytes = weights[0].numel() * weights[0].element_size()
            fn, x_dtype = F.linear, dtype
        else:
            qtype = GGMLQuantizationType[method]
            block, type_size = GGML_QUANT_SIZES[qtype]
            if columns % block:     # llama.cpp stores such a tensor in another type
                results.append(MatmulResult(f"{rows}x{columns}", method, 0, {}))
                continue
            layout = build_layout(columns, [rows], [int(qtype)])
            weights = [torch.from_numpy(rng.integers(0, 256, rows * columns // block * type_size,
                                                     dtype=np.uint8)) for _ in range(copies)]
            for w in weights:   # finite fp16 scales in every block
                _small_scales(w.view(-1, type_size), qtype)
            nbytes = layout.num_bytes

            def fn(x, w, layout=layout):
                return gguf_linear(x, w, None, layout)
            x_dtype = act_dtype
        timings = {}
        for batch in batches:
            x = torch.randn(batch, columns).to(x_dtype)
            timings[batch] = _time(fn, [(x, w) for w in weights], repeats)
        results.append(MatmulResult(f"{rows}x{columns}", method, nbytes, timings))
    return results


def _small_scales(blocks, qtype) -> None:
    """Overwrite each block's fp16 fields with a small finite value (random bytes may be
    inf/NaN there; the timing does not depend on the value)."""
    import torch

    offsets = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
               "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}.get(qtype.name, ())
    half = torch.tensor([0x00, 0x10], dtype=torch.uint8)
    for offset in offsets:
        blocks[:, offset:offset + 2] = half


def run(args: argparse.Namespace) -> int:
    import torch

    from kvpilot.engine.model.cpu_info import cpu_info
    from kvpilot.kernels import gguf_matmul_cpu

    if gguf_matmul_cpu.load() is None:
        print("the CPU GGUF matmul kernel cannot be built on this machine (see the warning above)")
        return 1
    try:
        shapes = [parse_shape(s) for s in args.shapes.split(",")]
        batches = [int(b) for b in (args.batches or ("1,8,32" if args.model_pass else "1,8")).split(",")]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.model_pass:
        return _run_model_pass(args, batches)
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    unknown = [t for t in types if t not in {v[0] for v in gguf_matmul_cpu.QTYPES.values()}]
    if unknown:
        print(f"error: no kernel for {', '.join(unknown)}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_info().describe()}; torch threads={torch.get_num_threads()}; "
          f"{args.copies} weights cycled; GGUF types with {args.act_dtype} activations")
    header = f"{'shape':>10} {'weights':>22}{'KiB':>9}{'x f32':>7}" + "".join(f"{f'b={b} us':>11}" for b in batches)
    print(header)
    results = []
    for rows, columns in shapes:
        rs = measure(rows, columns, ["float32", "bfloat16", *types], batches,
                     getattr(torch, args.act_dtype), args.copies, args.repeats)
        f32 = rs[0].resident_bytes
        for r in rs:
            label = r.method if r.method in ("float32", "bfloat16") else f"{r.method} ({args.act_dtype} x)"
            if not r.us_per_call:
                print(f"{r.shape:>10} {label:>22}   n/a: {columns} columns are not whole blocks of this type")
                continue
            cells = "".join(f"{r.us_per_call[b]:>11.1f}" for b in batches)
            print(f"{r.shape:>10} {label:>22}{r.resident_bytes / 1024:>9.1f}{r.resident_bytes / f32:>7.3f}{cells}",
                  flush=True)
        results.extend(rs)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0


def _run_model_pass(args: argparse.Namespace, batches: list[int]) -> int:
    import torch

    from kvpilot.engine.bench import gguf_model_pass
    from kvpilot.engine.model.cpu_info import cpu_info
    from kvpilot.kernels import gguf_matmul_cpu

    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_info().describe()}; torch threads={torch.get_num_threads()}; "
          f"q8 path: {gguf_matmul_cpu.q8_isa() or 'none'}; SmolLM2-135M Q4_1 matrices x 30 layers + "
          f"Q8_0 LM head, ms per pass (median of {args.repeats} alternating rounds)")
    if gguf_matmul_cpu.q8_isa() is None:
        print("no q8 path on this machine")
        return 1
    results = gguf_model_pass.measure(batches, args.repeats)
    gguf_model_pass.report(results)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0
