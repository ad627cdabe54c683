"""One short GPU run that measures the whole GPU path and writes one JSON (``scripts/gpu-check.sh``).

Sections (each also printed as it runs):

1. ``kernels``: every Triton kernel compiled vs its pure-torch reference (KV store, unified
   attention, split-KV, RMSNorm, rotary), then decode / prefill attention timings against
   SDPA, with decode's achieved bandwidth as a share of the measured copy bandwidth
   (``kvpilot.engine.bench.kernels_gpu``).
2. ``engine_vs_hf``: output tokens/s of the engine against HF transformers ``generate`` on
   a random-weight model shaped like Qwen3-0.6B (bf16), batch 64, 512 prompt / 128
   output tokens each (``ignore_eos``), in the same process one after the other.
3. ``cuda_graphs``: decode milliseconds per step with CUDA graphs on and off
   (``enforce_eager``), batch 1 and 64, same model.
4. ``quantized_matmul``: FP8-weight projections (per-channel and block scales, 1 and 64
   tokens) against ``F.linear`` over their dequantized weights: the path taken
   (``torch._scaled_mm`` on compute capability 9.0+), its error and, on the GPU, its time
   against the bfloat16 ``F.linear`` of the same shape.
5. ``overhead``: ``kvpilot bench overhead``'s micro model at batch 256 on the GPU: ms per
   decode step (the host work around a near-free forward).

``--smoke`` runs every section at toy sizes on whatever device there is (CPU: kernels
through the Triton interpreter, which the caller must have set with TRITON_INTERPRET=1
before triton was imported); it tests this script, not the GPU. The exit status is 1
when a check failed, else 0.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

QWEN3_06B = {   # Qwen3-0.6B's shape (random weights)
    "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "max_position_embeddings": 40960, "max_window_layers": 28,
}
TOY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1024,
       "max_window_layers": 2}


def write_random_model(directory: Path, shape: dict, dtype: str) -> Path:
    """A Qwen3 checkpoint of ``shape`` with random weights and the demo tokenizer."""
    import shutil

    from safetensors.torch import save_file

    from kvpilot.engine.model.models import demo

    source = demo.ensure_demo_model()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, directory / name)
    config = {**demo.demo_config(), **shape, "torch_dtype": dtype, "dtype": dtype}
    torch_dtype = getattr(torch, dtype)
    weights = {k: v.to(torch_dtype).contiguous() for k, v in demo.demo_weights(config=config).items()}
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def _prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(100, min(vocab, 100_000), (batch, length), generator=gen).tolist()


def run_engine(model_dir: str, prompts: list[list[int]], output_len: int, *, device: str,
               dtype: str, enforce_eager: bool, kv_bytes: int | None = None) -> dict:
    """Engine tokens/s over the whole batch, and its mean decode step (every request decoding)."""
    from kvpilot.engine import LLMEngine, SamplingParams
    from kvpilot.engine.engine_args import EngineArgs
    from kvpilot.engine.sampling_params import RequestOutputKind

    engine = LLMEngine(EngineArgs(
        model=model_dir, max_model_len=len(prompts[0]) + output_len + 16,
        max_num_seqs=len(prompts), dtype=dtype, device=device, enforce_eager=enforce_eager,
        enable_prefix_caching=False, gpu_memory_utilization=0.5, kv_cache_memory_bytes=kv_bytes))
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    engine.add_request("warm", prompts[0][:16], SamplingParams(temperature=0, max_tokens=4))
    while engine.has_unfinished_requests():
        engine.step()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    schedule = engine.scheduler.schedule
    decode = []

    def probe():
        out = schedule()
        decode.append(bool(out.scheduled) and out.num_scheduled_tokens == len(out.scheduled))
        return out

    engine.scheduler.schedule = probe
    step_ms = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        if decode[-1]:
            step_ms.append((time.perf_counter() - t0) * 1000)
    seconds = time.perf_counter() - start
    captured = engine.runner.graphs is not None
    engine.close()
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"output_tokens_per_s": len(prompts) * output_len / seconds, "seconds": seconds,
            "decode_ms_per_step": statistics.fmean(step_ms) if step_ms else None,
            "cuda_graphs_captured": captured}


def run_hf(model_dir: str, prompts: list[list[int]], output_len: int, *, device: str,
           dtype: str) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    ids = torch.tensor(prompts, device=device)
    with torch.no_grad():
        model.generate(ids[:1, :16], max_new_tokens=2, do_sample=False, pad_token_id=0)   # warm-up
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                       min_new_tokens=output_len, do_sample=False, pad_token_id=0)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"output_tokens_per_s": len(prompts) * output_len / seconds, "seconds": seconds}


def section_engine(model_dir: str, device: str, dtype: str, smoke: bool) -> dict:
    batch, in_len, out_len = (4, 16, 8) if smoke else (64, 512, 128)
    vocab = (TOY if smoke else QWEN3_06B)["vocab_size"]
    prompts = _prompts(batch, in_len, vocab)
    kv = 64 << 20 if device == "cpu" else None
    graphs_on = run_engine(model_dir, prompts, out_len, device=device, dtype=dtype,
                           enforce_eager=False, kv_bytes=kv)
    print(f"engine (CUDA graphs on) : {graphs_on['output_tokens_per_s']:9.1f} output tok/s", flush=True)
    hf = run_hf(model_dir, prompts, out_len, device=device, dtype=dtype)
    print(f"HF transformers generate: {hf['output_tokens_per_s']:9.1f} output tok/s", flush=True)
    engine_vs_hf = {"batch": batch, "prompt_len": in_len, "output_len": out_len, "engine": graphs_on,
                    "hf": hf, "ratio": graphs_on["output_tokens_per_s"] / hf["output_tokens_per_s"]}
    print(f"engine / HF             : {engine_vs_hf['ratio']:.2f}x", flush=True)
    graphs = {}
    for b in (1, batch):
        on = graphs_on if b == batch else run_engine(
            model_dir, prompts[:b], out_len, device=device, dtype=dtype, enforce_eager=False, kv_bytes=kv)
        off = run_engine(model_dir, prompts[:b], out_len, device=device, dtype=dtype,
                         enforce_eager=True, kv_bytes=kv)
        graphs[f"batch_{b}"] = {"on_ms_per_step": on["decode_ms_per_step"],
                                "off_ms_per_step": off["decode_ms_per_step"],
                                "captured": on["cuda_graphs_captured"]}
        print(f"decode step, batch {b:3d}: graphs on {on['decode_ms_per_step'] or 0:7.2f} ms, "
              f"off {off['decode_ms_per_step'] or 0:7.2f} ms", flush=True)
    return {"engine_vs_hf": engine_vs_hf, "cuda_graphs": graphs}


def section_overhead(device: str, smoke: bool) -> dict:
    from kvpilot.engine.bench.overhead import measure, write_micro_model

    batch = 4 if smoke else 256
    with tempfile.TemporaryDirectory(prefix="kvpilot-micro-") as tmp:
        r = measure(str(write_micro_model(Path(tmp))), batch, 8 if smoke else 64,
                    4 if smoke else 128, device=device)
    print(f"per-step overhead, micro model, batch {batch}: {r.ms_per_step:.2f} ms/step", flush=True)
    return {"batch": batch, "ms_per_step": r.ms_per_step, "decode_steps": r.decode_steps}


def _time_ms(fn, repeats: int) -> float:
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def section_quantized_matmul(device: str, smoke: bool) -> dict:
    """FP8-weight projections (``layers.fp8_linear``) on the device against ``F.linear``
    over their dequantized weights, per-channel and 128x128-block scales: which path ran
    (``torch._scaled_mm`` with per-token FP8 activations on a GPU of compute capability
    9.0+ with per-channel scales, else dequantize-and-multiply), the error, and (not
    smoke) the time against the bfloat16 ``F.linear`` of the same shape."""
    import torch.nn.functional as F

    from kvpilot.contract.weight_quant import Fp8WeightConfig
    from kvpilot.engine.model.layers import fp8_linear as q

    rows, columns = (256, 128) if smoke else (6144, 1024)   # Qwen3-0.6B's gate/up
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(rows, columns, generator=gen) * 0.05).to(device)
    cases = []
    for strategy, block in (("channel", None), ("block", (128, 128))):
        config = Fp8WeightConfig("fp8", strategy, block)
        sr, sc = q.scale_shape(rows, columns, config)
        tiles = weight.reshape(sr, rows // sr, sc, columns // sc) if block else weight.reshape(rows, 1, 1, columns)
        scale = (tiles.abs().amax(dim=(1, 3)) / q.FP8_MAX).clamp(min=1e-12).float()
        spread = scale.repeat_interleave(rows // sr, 0).repeat_interleave(columns // sc, 1)
        w8 = (weight / spread).clamp(-q.FP8_MAX, q.FP8_MAX).to(q.FP8)
        dense = (w8.float() * spread).to(dtype)   # the oracle: dequantized here, not by the layer
        for batch in (1, 64):
            x = torch.randn(batch, columns, generator=gen).to(device, dtype)
            got = q.fp8_linear(x, w8, scale, None, config)
            want = F.linear(x, dense)
            path = "scaled_mm" if q._scaled_mm_supported(x, w8, config) else "dequantize"
            err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
            # per-token FP8 activations cost a few percent; the dequantize path only rounding
            ok = err <= (0.08 if path == "scaled_mm" else 1e-2)
            case = {"strategy": strategy, "batch": batch, "path": path, "max_rel_error": err, "ok": ok}
            if not smoke:
                case["fp8_ms"] = _time_ms(functools.partial(q.fp8_linear, x, w8, scale, None, config), 50)
                case["bf16_ms"] = _time_ms(functools.partial(F.linear, x, dense), 50)
            cases.append(case)
            print(f"fp8 {strategy:7s} batch {batch:3d}: {path:10s} max rel error {err:.4f} "
                  f"{'ok' if ok else 'FAILED'}"
                  + (f"; {case['fp8_ms']:.3f} ms vs bf16 {case['bf16_ms']:.3f} ms" if not smoke else ""),
                  flush=True)
    return {"rows": rows, "columns": columns, "cases": cases}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--json-out", default="gpu-check.json")
    parser.add_argument("--smoke", action="store_true",
                        help="toy sizes on any device (tests this script; CPU needs TRITON_INTERPRET=1)")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("gpu-check: no CUDA device found; nothing was run (needs an NVIDIA GPU).")
        return 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    import triton

    start = time.perf_counter()
    report: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                    "torch": torch.__version__, "triton": triton.__version__, "smoke": args.smoke}
    failures: list[str] = []
    from kvpilot.engine.bench.kernels_gpu import run_checks

    print("== kernels: compiled vs reference, attention timings", flush=True)
    report["kernels"], bad = run_checks(torch.device(device), smoke=args.smoke or device == "cpu",
                                        bench=True)
    failures += bad
    dtype = "float32" if device == "cpu" else "bfloat16"
    with tempfile.TemporaryDirectory(prefix="kvpilot-gpu-check-") as tmp:
        print("== engine vs HF transformers, CUDA graphs on/off", flush=True)
        model_dir = str(write_random_model(Path(tmp), TOY if args.smoke else QWEN3_06B, dtype))
        try:
            report.update(section_engine(model_dir, device, dtype, args.smoke))
        except Exception as e:   # keep the other sections' figures
            failures.append(f"engine: {type(e).__name__}: {e}")
            print(f"engine section FAILED: {type(e).__name__}: {e}")
    print("== quantized matmul (FP8 weights)", flush=True)
    try:
        report["quantized_matmul"] = section_quantized_matmul(device, args.smoke)
        failures += [f"quantized matmul {c['strategy']} batch {c['batch']}: error {c['max_rel_error']:.4f}"
                     for c in report["quantized_matmul"]["cases"] if not c["ok"]]
    except Exception as e:
        failures.append(f"quantized matmul: {type(e).__name__}: {e}")
        print(f"quantized matmul section FAILED: {type(e).__name__}: {e}")
    print("== per-step overhead", flush=True)
    try:
        report["overhead"] = section_overhead(device, args.smoke)
    except Exception as e:
        failures.append(f"overhead: {type(e).__name__}: {e}")
        print(f"overhead section FAILED: {type(e).__name__}: {e}")
    report["failures"] = failures
    report["seconds"] = time.perf_counter() - start
    Path(args.json_out).write_text(json.dumps(report, indent=2, default=str))
    print(f"\n{len(failures)} failure(s) in {report['seconds']:.0f} s; wrote {args.json_out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
