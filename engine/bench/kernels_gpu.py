"""Compiled-kernel checks and timings on one CUDA device: ``python -m kvpilot.engine.bench.kernels_gpu``.

1. Checks every kernel compiled against its pure-torch reference: the KV store for
   16/32-bit caches and the in-kernel fp8 e4m3 / e5m2 quantization byte for byte against
   torch's cast (including exact ties, rounding carries, subnormals and saturation),
   then unified attention on mixed prefill / chunked-prefill / decode batches (GQA,
   non-power-of-two heads, fp8 caches) against its reference and the engine's torch path,
   split-KV attention, RMSNorm (+ residual) and rotary against theirs
   (``kvpilot.engine.bench.gpu_kernel_checks``).
2. Times decode and prefill attention against ``scaled_dot_product_attention`` on the
   same K/V laid out contiguously, with ``triton.testing.do_bench`` (median), sweeps a few
   tilings, and prints decode's achieved HBM bandwidth as a share of this device's
   measured device-to-device copy bandwidth.

Exits 0 with a message when no CUDA device is present; exits 1 when a check fails.
``--interpret-smoke`` runs the same code on CPU through the Triton interpreter at tiny
sizes (checks, plus each timed callable once, untimed) — a test of this script, not of
the compiled kernels.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
TOL = {torch.float32: 5e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _fp8_probe_values(dtype: torch.dtype, device) -> torch.Tensor:
    """Every finite fp8 value, the midpoints between neighbours (ties), just above/below them,
    and values beyond the range (saturation): all the places a cast can round wrongly."""
    grid = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    grid = grid[torch.isfinite(grid)].unique().sort().values
    mids = (grid[1:] + grid[:-1]) / 2
    limit = float(grid.max())
    x = torch.cat([grid, mids, mids * (1 + 2**-20), mids * (1 - 2**-20),
                   torch.tensor([limit * 1.01, -limit * 1.5, limit * 4])])
    return x.to(device)


def check_store(device, *, smoke: bool) -> list[dict]:
    """KV store against its reference and the engine's torch store; one record per case."""
    from kvpilot.engine.model.attention.torch_backend import store_kv
    from kvpilot.kernels.kv_store import store_kv_cache, store_kv_cache_ref
    from kvpilot.kernels.paged_batch import make_paged_batch

    records = []
    n = 40 if smoke else 2000
    specs = ((0, n), (5, 3))
    cases = [(torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
             (torch.float32, torch.float32), (torch.float32, torch.bfloat16),
             (torch.bfloat16, E4M3), (torch.float32, E4M3), (torch.float16, E5M2),
             (torch.float32, E5M2)]
    for dtype, cache_dtype in cases:
        fp8 = cache_dtype in (E4M3, E5M2)
        # Power-of-two scales for fp8 keep the probe's exact ties exact through x / scale.
        b = make_paged_batch(specs, num_heads=8, num_kv_heads=8, head_dim=128, block_size=16,
                             dtype=dtype, cache_dtype=cache_dtype, device=device,
                             scales=(0.25, 0.5) if fp8 else None)
        key, value = b.key, b.value
        if fp8:   # every rounding corner case, times the scale
            probe = (_fp8_probe_values(cache_dtype, device) * b.k_scale).to(dtype)
            flat = key.view(-1)
            flat[: min(probe.numel(), flat.numel())] = probe[: flat.numel()]
            value = -key.flip(0) * (b.v_scale / b.k_scale).to(dtype)
        slots = b.metadata.slot_mapping
        caches = [b.kv_cache.clone() for _ in range(3)]
        # Compiled: convert in the kernel. Interpreted: its casts are known wrong, so default.
        store_kv_cache(key, value, caches[0][0], caches[0][1], slots, b.k_scale, b.v_scale,
                       convert_in_kernel=None if smoke else True)
        store_kv_cache_ref(key, value, caches[1][0], caches[1][1], slots, b.k_scale, b.v_scale)
        store_kv(key, value, caches[2], slots, b.k_scale, b.v_scale)
        bad_ref = int((_bits(caches[0]) != _bits(caches[1])).sum())
        bad_engine = int((_bits(caches[0]) != _bits(caches[2])).sum())
        name = f"store {str(dtype)[6:]:>8} -> {str(cache_dtype)[6:]:<13}"
        ok = bad_ref == 0 and bad_engine == 0
        print(f"  {name} bytes differing: vs ref {bad_ref}, vs engine {bad_engine}  "
              f"{'ok' if ok else 'FAIL'}")
        records.append({"name": name.strip(), "ok": ok, "bytes_differing": bad_ref + bad_engine})
    return records


def check_attention(device, *, smoke: bool) -> list[dict]:
    """Unified attention against its reference and the engine's torch path; one record per case."""
    from kvpilot.engine.model.attention.torch_backend import paged_attention
    from kvpilot.kernels.kv_store import store_kv_cache_ref
    from kvpilot.kernels.paged_batch import MIXED_SPECS, make_paged_batch
    from kvpilot.kernels.unified_attention import (
        AttentionTiling,
        unified_attention,
        unified_attention_ref,
    )

    specs = MIXED_SPECS if smoke else (
        (500, 77), (0, 300), (1000, 1), (129, 0), (0, 1), (3000, 1), (257, 255), (31, 1))
    cases = [  # dtype, cache dtype, heads, kv heads, head dim, block size, tiling
        (torch.bfloat16, None, 32, 8, 128, 16, None),
        (torch.float16, None, 16, 16, 64, 32, None),
        (torch.float32, None, 12, 4, 96, 16, None),
        (torch.bfloat16, None, 14, 2, 64, 16, None),        # group of 7
        (torch.bfloat16, None, 8, 1, 80, 32, None),         # MQA, head 80
        (torch.bfloat16, None, 16, 4, 256, 16, None),
        (torch.bfloat16, E4M3, 32, 8, 128, 16, None),
        (torch.float16, E5M2, 16, 8, 128, 32, None),
        (torch.bfloat16, None, 32, 8, 128, 16, AttentionTiling(16, 16, 4, 2)),
        (torch.bfloat16, None, 32, 8, 128, 16, AttentionTiling(64, 128, 4, 2)),
    ]
    if smoke:
        cases = [(d, c, max(2, h // 8), max(1, kv // 8), hd, bs, t)
                 for d, c, h, kv, hd, bs, t in cases[::3]]
    records = []
    for dtype, cache_dtype, heads, kv_heads, head_dim, block_size, tiling in cases:
        b = make_paged_batch(specs, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                             block_size=block_size, dtype=dtype, cache_dtype=cache_dtype,
                             fill="zero", device=device)
        m = b.metadata
        store_kv_cache_ref(b.key, b.value, b.kv_cache[0], b.kv_cache[1], m.slot_mapping,
                           b.k_scale, b.v_scale)
        args = (b.query, b.kv_cache[0], b.kv_cache[1], m.block_tables, m.seq_lens,
                m.query_start_loc)
        out = unified_attention(*args, m.max_query_len, b.scale, b.k_scale, b.v_scale,
                                tiling=tiling)
        ref = unified_attention_ref(*args, b.scale, b.k_scale, b.v_scale)
        engine = paged_attention(b.query, b.kv_cache, m, b.scale, b.k_scale, b.v_scale)
        err_ref = (out.float() - ref.float()).abs().max().item()
        err_engine = (out.float() - engine.float()).abs().max().item()
        tol = TOL[dtype]
        ok = all(torch.allclose(out.float(), r.float(), atol=tol, rtol=tol) for r in (ref, engine))
        name = (f"attn {str(dtype)[6:]:>8} cache={str(cache_dtype or dtype)[6:]:<13} "
                f"heads={heads}/{kv_heads} d={head_dim} bs={block_size}"
                + (f" tiling={tiling.block_m}x{tiling.tile_n}" if tiling else ""))
        print(f"  {name:<78} max|err| vs ref {err_ref:.2e}, vs engine {err_engine:.2e}  "
              f"{'ok' if ok else 'FAIL'}")
        records.append({"name": name, "ok": ok, "max_err": max(err_ref, err_engine)})
    return records


def _sdpa(q, k, v, causal: bool):
    """A callable running SDPA on contiguous [B, heads, L, D] tensors, and the backend used."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run(backends):
        def fn():
            with sdpa_kernel(backends):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        return fn

    if q.is_cuda:
        try:
            fn = run([SDPBackend.FLASH_ATTENTION])
            fn()
            return fn, "flash"
        except RuntimeError:
            pass
    return run([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]), "efficient/math"


def _contiguous_kv(b, num_seqs: int, seq_len: int):
    """The paged K/V of ``num_seqs`` equal-length sequences as [B, kv_heads, L, D] tensors."""
    m = b.metadata
    block_size = b.kv_cache.shape[2]
    nb = -(-seq_len // block_size)
    out = []
    for half in (0, 1):
        x = b.kv_cache[half][m.block_tables[:, :nb].long()]   # [B, nb, bs, kv_heads, D]
        x = x.reshape(num_seqs, nb * block_size, *x.shape[3:])[:, :seq_len]
        if x.dtype in (E4M3, E5M2):
            x = x.to(b.query.dtype) * (b.k_scale if half == 0 else b.v_scale).to(b.query.dtype)
        out.append(x.transpose(1, 2).contiguous())
    return out


def _time(fn, smoke: bool) -> float:
    """Median milliseconds (0.0 in smoke mode, where ``fn`` just runs once)."""
    if smoke:
        fn()
        return 0.0
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_bandwidth(device, smoke: bool) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write of a 2 GiB buffer)."""
    n = 1 << (20 if smoke else 31)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _time(lambda: dst.copy_(src), smoke)
    return 2 * n / (ms * 1e-3) if ms else 0.0


DECODE_SWEEP = ((16, 32, 4, 3), (16, 64, 4, 3), (16, 128, 4, 3), (16, 64, 4, 4), (16, 64, 2, 3))
PREFILL_SWEEP = ((128, 64, 8, 2), (128, 64, 4, 2), (64, 64, 4, 3), (128, 128, 8, 2),
                 (128, 32, 4, 3), (64, 128, 4, 2))


def bench_case(device, kind: str, num_seqs: int, seq_len: int, dtype, cache_dtype, *,
               shape=(32, 8, 128, 16), smoke: bool = False) -> tuple[dict, list[str]]:
    """Time one decode (each sequence: ``seq_len - 1`` cached + 1 new) or causal prefill case.

    ``shape`` = (heads, kv_heads, head_dim, block_size). Returns (figures, failures):
    milliseconds of the default tiling, the best sweep tiling and SDPA on contiguous
    [B, heads, L, D] copies of the same K/V, and the largest difference to SDPA's output.
    """
    import triton

    from kvpilot.kernels.kv_store import store_kv_cache
    from kvpilot.kernels.paged_batch import make_paged_batch
    from kvpilot.kernels.unified_attention import AttentionTiling, default_tiling, unified_attention

    heads, kv_heads, head_dim, block_size = shape
    specs = [(seq_len - 1, 1) if kind == "decode" else (0, seq_len)] * num_seqs
    b = make_paged_batch(specs, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                         block_size=block_size, dtype=dtype, cache_dtype=cache_dtype,
                         num_padding_tokens=0, fill="zero", device=device)
    m = b.metadata
    store_kv_cache(b.key, b.value, b.kv_cache[0], b.kv_cache[1], m.slot_mapping,
                   b.k_scale, b.v_scale)
    k, v = _contiguous_kv(b, num_seqs, seq_len)
    q_len = 1 if kind == "decode" else seq_len
    q = b.query.view(num_seqs, q_len, heads, head_dim).transpose(1, 2)
    sdpa, backend = _sdpa(q, k, v, causal=kind == "prefill")
    sdpa_out = sdpa().transpose(1, 2).reshape(b.query.shape)
    out_buf = torch.empty_like(b.query)   # like SDPA's output: allocated once, outside the timing

    def triton_fn(tiling):
        return lambda: unified_attention(
            b.query, b.kv_cache[0], b.kv_cache[1], m.block_tables, m.seq_lens,
            m.query_start_loc, m.max_query_len, b.scale, b.k_scale, b.v_scale,
            out=out_buf, tiling=tiling, max_seq_len=seq_len)   # split-KV where the engine would

    tol = TOL[dtype]
    default = default_tiling(m.max_query_len, heads // kv_heads, head_dim, dtype)
    sweep = [] if smoke else [AttentionTiling(*t) for t in
                              (DECODE_SWEEP if kind == "decode" else PREFILL_SWEEP)]
    failures, times, err = [], {}, None
    for tiling in [default, *(t for t in sweep if t != default)]:
        try:
            got = triton_fn(tiling)().float()
        except triton.runtime.errors.OutOfResources as e:   # a sweep point too big for this GPU
            print(f"  tiling {tiling} skipped: {e}")
            continue
        diff = (got - sdpa_out.float()).abs().max().item()
        err = diff if err is None else max(err, diff)
        if not torch.allclose(got, sdpa_out.float(), atol=tol, rtol=tol):
            failures.append(f"{kind} B={num_seqs} L={seq_len} tiling {tiling}: "
                            f"max|diff| to SDPA {diff:.2e}")
        times[tiling] = _time(triton_fn(tiling), smoke)
    best = min(times, key=times.get)
    figures = {"kind": kind, "num_seqs": num_seqs, "seq_len": seq_len,
               "cache": str(cache_dtype or dtype).removeprefix("torch."),
               "triton_ms": times[default], "best_ms": times[best],
               "best": f"{best.block_m}x{best.tile_n} w{best.num_warps} s{best.num_stages}",
               "sdpa_ms": _time(sdpa, smoke), "sdpa_backend": backend, "max_diff": err}
    qo_bytes = 2 * b.query.numel() * b.query.element_size()
    if kind == "decode":   # bytes that must cross HBM: K and V once, Q in, O out
        figures["bytes"] = 2 * num_seqs * seq_len * kv_heads * head_dim * b.kv_cache.element_size() + qo_bytes
        figures["sdpa_bytes"] = 2 * k.numel() * k.element_size() + qo_bytes
    else:
        figures["flops"] = 4 * num_seqs * heads * head_dim * seq_len * (seq_len + 1) / 2
    return figures, failures


def _report(f: dict, copy_bw: float) -> str:
    """One line: triton (default tiling), the best sweep tiling and SDPA, with bandwidth or FLOP/s."""
    if f["kind"] == "decode":   # share of the measured copy bandwidth
        def rate(ms, key="bytes"):
            return f"{100 * f[key] / (ms * 1e-3) / copy_bw if ms and copy_bw else 0:3.0f}% of copy"
    else:
        def rate(ms, key=None):
            return f"{f['flops'] / (ms * 1e-3) / 1e12 if ms else 0:5.1f} TFLOP/s"
    ratio = f["sdpa_ms"] / f["triton_ms"] if f["triton_ms"] else 0.0
    extra = ""
    if f["kind"] == "decode" and f["triton_ms"]:
        extra = f", {f['bytes'] / (f['triton_ms'] * 1e-3) / 1e9:.0f} GB/s"
    return (f"{f['kind']:<7} B={f['num_seqs']:<4} L={f['seq_len']:<6} {f['cache']:<13} "
            f"triton {f['triton_ms']:8.3f} ms ({rate(f['triton_ms'])}{extra}) | "
            f"best [{f['best']}] {f['best_ms']:8.3f} ms ({rate(f['best_ms'])}) | "
            f"sdpa[{f['sdpa_backend']}] {f['sdpa_ms']:8.3f} ms "
            f"({rate(f['sdpa_ms'], 'sdpa_bytes')}) | sdpa/triton {ratio:4.2f}x | "
            f"max|diff| vs sdpa {f['max_diff']:.1e}")


def bench_attention(device, *, smoke: bool) -> tuple[dict, list[str]]:
    """Decode and prefill timings vs SDPA, with a tiling sweep.

    Returns ({copy bandwidth, per-case figures with decode's share of copy bandwidth},
    failure lines)."""
    copy_bw = copy_bandwidth(device, smoke)
    print(f"\ndevice-to-device copy bandwidth: {copy_bw / 1e9:.0f} GB/s (read + write)")
    shape = (4, 2, 64, 16) if smoke else (32, 8, 128, 16)
    bf16 = torch.bfloat16
    cases = [("decode", 2, 40, bf16, None), ("prefill", 2, 40, bf16, None)] if smoke else [
        ("decode", 64, 4096, bf16, None), ("decode", 64, 4096, bf16, E4M3),
        ("decode", 16, 16384, bf16, None), ("decode", 256, 1024, bf16, None),
        ("decode", 8, 8192, bf16, None), ("decode", 8, 8192, bf16, E5M2),
        ("prefill", 4, 4096, bf16, None), ("prefill", 16, 1024, bf16, None),
        ("prefill", 1, 16384, bf16, None)]
    print("heads={} kv_heads={} head_dim={} block_size={}; decode % = achieved HBM bytes/s "
          "over the copy bandwidth".format(*shape))
    failures, figures_list = [], []
    for kind, num_seqs, seq_len, dtype, cache_dtype in cases:
        try:
            figures, bad = bench_case(device, kind, num_seqs, seq_len, dtype, cache_dtype,
                                      shape=shape, smoke=smoke)
        except Exception as e:   # keep going: one broken case must not hide the others
            failures.append(f"{kind} B={num_seqs} L={seq_len}: {type(e).__name__}: {e}")
            print(f"{kind} B={num_seqs} L={seq_len}: FAILED ({type(e).__name__}: {e})")
            continue
        print(_report(figures, copy_bw), flush=True)
        if kind == "decode" and figures["triton_ms"] and copy_bw:
            figures["pct_of_copy_bandwidth"] = 100 * figures["bytes"] / (figures["triton_ms"] * 1e-3) / copy_bw
        figures_list.append(figures)
        failures += bad
    return {"copy_bandwidth_gbs": copy_bw / 1e9, "cases": figures_list}, failures


def run_checks(device, *, smoke: bool, bench: bool) -> tuple[dict, list[str]]:
    """Every kernel check (and the attention timings when ``bench``): (results, failures)."""
    from kvpilot.engine.bench.gpu_kernel_checks import check_rms_norm, check_rotary, check_split_kv

    results: dict = {"checks": []}
    failures: list[str] = []
    for check in (check_store, check_attention, check_split_kv, check_rms_norm, check_rotary):
        try:
            records = check(device, smoke=smoke)
        except Exception as e:   # report and go on to the next check
            failures.append(f"{check.__name__}: {type(e).__name__}: {e}")
            print(f"{check.__name__} FAILED: {type(e).__name__}: {e}")
            continue
        results["checks"] += records
        failures += [r["name"] for r in records if not r["ok"]]
    if bench:
        try:
            results["attention_bench"], bad = bench_attention(device, smoke=smoke)
            failures += bad
        except Exception as e:
            failures.append(f"bench_attention: {type(e).__name__}: {e}")
            print(f"bench_attention FAILED: {type(e).__name__}: {e}")
    return results, failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--interpret-smoke", action="store_true",
                        help="run on CPU through the Triton interpreter at tiny sizes (no timing)")
    parser.add_argument("--skip-bench", action="store_true", help="run the checks only")
    args = parser.parse_args(argv)
    smoke = args.interpret_smoke
    if smoke:
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            print("--interpret-smoke: triton was imported before TRITON_INTERPRET=1 could be set")
            return 2
        os.environ["TRITON_INTERPRET"] = "1"
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("kernels_gpu: no CUDA device found; nothing was checked or timed. Run it on a machine "
              "with a CUDA GPU (or pass --interpret-smoke to test this script on CPU).")
        return 0
    else:
        device = torch.device("cuda")
        torch.cuda.set_device(device)
    import triton

    name = "CPU (Triton interpreter)" if smoke else torch.cuda.get_device_name(device)
    print(f"device: {name} | torch {torch.__version__} | triton {triton.__version__}")
    start = time.perf_counter()
    torch.manual_seed(0)
    print("checks (compiled kernels vs pure-torch references):")
    _, failures = run_checks(device, smoke=smoke, bench=not args.skip_bench)
    print(f"\n{len(failures)} failure(s) in {time.perf_counter() - start:.0f} s")
    for line in failures:
        print(f"  FAIL {line}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
