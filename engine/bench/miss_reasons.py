"""``kvpilot bench miss-reasons``: the planted-miss workload (``miss_workload``) through two
in-process engines of a model, and how much of each planted cause's uncached prompt tokens
the miss counter put under the cause's reason.

The first engine serves everything but the wrong-replica probe (with ``--lora-adapter`` it
serves that adapter too, and the adapter cause is planted), on a KV cache of
``--num-gpu-blocks`` blocks so that the fillers evict the evicted cause's seed; the second
is the other replica behind a round robin. Token-granular reuse stays off (it would serve
the last partial block from the seed).
"""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("miss-reasons", help="planted prefix-cache miss causes and their attribution",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory or GGUF (default: the built-in model)")
    p.add_argument("--lora-adapter", default=None, help="a PEFT adapter of the model (plants that cause)")
    # small enough that the fillers evict the evicted cause's seed (a larger cache holds
    # them all and that cause never misses: its share reads 0%)
    p.add_argument("--num-gpu-blocks", type=int, default=96)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvpilot.engine import LLM, SamplingParams
    from kvpilot.engine.bench.miss_workload import planted_workload, table
    from kvpilot.engine.bench.miss_workload import run as run_workload
    from kvpilot.engine.lora.config import LoRAModule
    from kvpilot.engine.model.cpu_info import cpu_info

    kwargs = dict(max_model_len=args.max_model_len, num_gpu_blocks=args.num_gpu_blocks)
    lora = (dict(enable_lora=True, max_loras=1, lora_modules=(LoRAModule("adapter", args.lora_adapter),))
            if args.lora_adapter else {})
    llms = [LLM(args.model, **kwargs, **lora), LLM(args.model, **kwargs)]
    planted = planted_workload(args.seed, adapter="adapter" if args.lora_adapter else None)
    results = run_workload(llms, planted, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    print(f"CPU: {cpu_info().describe()}; model {args.model or 'built-in'}")
    print(table(results))
    return 0 if all(r.share >= 0.95 for r in results) else 1
