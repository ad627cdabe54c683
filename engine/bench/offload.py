"""``kvpilot bench offload``: TTFT of a request whose shared prefix was evicted from the
device KV pool: recompute vs a CPU-tier hit vs a disk-tier hit, and the bytes each moved.

Each scenario runs on its own engine with the same settings and a device pool just big
enough for one ``max_model_len`` sequence, so a long unrelated request evicts the
prefix. Per repeat (each with a fresh random prefix): request A (prefix + suffix)
computes and saves the prefix, a filler request evicts it from the device pool, then
request B (prefix + another suffix) is timed: arrival to first token, and the prompt
tokens it ran through the model. Scenarios:

- recompute: offloading off; B computes the whole prompt.
- CPU tier: ``--kv-offloading-size`` large enough; B loads the prefix from host memory.
- disk tier: CPU tier 0 and a disk tier in a temporary directory (written to disk
  before B arrives); B reads the prefix from files (page cache permitting), verifies
  and loads it.

Medians over the repeats; one warm-up request per engine is not counted. On CPU the
copies are synchronous, so their time is inside B's TTFT ("fetch" = disk reads at
admission, "transfer" = copies into the KV cache before the forward pass).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import tempfile
from dataclasses import dataclass, field


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("offload", help="TTFT of an evicted prefix: recompute vs CPU vs disk tier",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF checkpoint directory (default: built-in demo model)")
    p.add_argument("--prefix-len", type=int, default=1500, help="shared prefix, in tokens")
    p.add_argument("--suffix-len", type=int, default=32, help="per-request suffix, in tokens")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--backend", choices=("native", "lmcache"), default="native")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


@dataclass(slots=True)
class Result:
    name: str
    ttfts: list[float] = field(default_factory=list)
    computed: list[int] = field(default_factory=list)
    moved: dict[str, int] = field(default_factory=dict)     # bytes per transfer type, all requests
    fetch_seconds: float = 0.0
    transfer_seconds: float = 0.0

    @property
    def ttft(self) -> float:
        return statistics.median(self.ttfts)


TRANSFERS = (("GPU_to_CPU", "kv_offload_gpu_to_cpu_bytes"), ("CPU_to_GPU", "kv_offload_cpu_to_gpu_bytes"),
             ("CPU_to_disk", "kv_offload_cpu_to_disk_bytes"), ("disk_to_CPU", "kv_offload_disk_to_cpu_bytes"))


def run_scenario(name: str, model_dir: str, args, offload: dict) -> Result:
    from kvpilot.engine import LLM, SamplingParams
    from kvpilot.engine.model.hf_config import load_arch_config

    vocab = load_arch_config(model_dir).vocab_size
    rng = random.Random(args.seed)
    max_len = args.prefix_len + args.suffix_len + 16
    blocks = -(-max_len // args.block_size) + 2
    llm = LLM(model_dir, dtype="float32", block_size=args.block_size, num_gpu_blocks=blocks,
              max_model_len=max_len, max_num_batched_tokens=max(2048, max_len), **offload)
    first_token = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(min(1000, vocab // 2), vocab) for _ in range(n)]

    llm.generate([tokens(args.suffix_len)], first_token)    # warm-up
    result = Result(name)
    engine = llm.llm_engine
    for _ in range(args.repeats):
        prefix = tokens(args.prefix_len)
        llm.generate([prefix + tokens(args.suffix_len)], first_token)
        llm.generate([tokens(args.prefix_len + args.suffix_len)], first_token)     # evicts the prefix
        if engine.kv_offload is not None:
            engine.kv_offload.flush()      # the blocks are in their tier before B arrives
        before = llm.get_stats()
        out = llm.generate([prefix + tokens(args.suffix_len)], first_token)[0]
        after = llm.get_stats()
        result.ttfts.append(out.metrics.first_token_time - out.metrics.arrival_time)
        result.computed.append(after.computed_prompt_tokens - before.computed_prompt_tokens)
    stats = llm.get_stats()
    result.moved = {kind: getattr(stats, f) for kind, f in TRANSFERS if getattr(stats, f) is not None}
    if engine.kv_offload is not None:
        result.fetch_seconds = engine.kv_offload.counters.fetch_seconds
        result.transfer_seconds = engine.kv_offload.counters.transfer_seconds
    engine.close()
    return result


@contextlib.contextmanager
def _environ(values: dict[str, str]):
    """Sets environment variables for the block (LMCache reads its config from them)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run(args: argparse.Namespace) -> int:
    import torch

    model_dir = args.model
    if model_dir is None:
        from kvpilot.engine.model.models.demo import ensure_demo_model

        model_dir = str(ensure_demo_model())
    print(f"model: {model_dir}; prefix {args.prefix_len} + suffix {args.suffix_len} tokens; "
          f"{args.repeats} repeats; backend {args.backend}; threads={torch.get_num_threads()}")
    lmcache = args.backend == "lmcache"
    # Native tiers allocate only what they hold; LMCache allocates its CPU buffer up front.
    cpu_gib = 0.5 if lmcache else 4.0
    env = {"LMCACHE_CHUNK_SIZE": os.environ.get("LMCACHE_CHUNK_SIZE", str(args.block_size))} if lmcache else {}
    results = []
    with tempfile.TemporaryDirectory(prefix="kvpilot-bench-offload-") as disk:
        backend = {"kv_offloading_backend": args.backend}
        scenarios = [
            ("recompute", {}, {}),
            ("CPU tier", dict(backend, kv_offloading_size=cpu_gib), env),
            # LMCache always stages through its CPU buffer; LMCACHE_LOCAL_CPU=false keeps
            # it from serving hits, so they come from its disk tier.
            ("disk tier", dict(backend, kv_offloading_size=cpu_gib if lmcache else 0.0,
                               kv_offloading_disk_path=disk, kv_offloading_disk_size=4.0),
             dict(env, LMCACHE_LOCAL_CPU="false") if lmcache else {}),
        ]
        for name, offload, variables in scenarios:
            with _environ(variables):
                results.append(run_scenario(name, model_dir, args, offload))
    base = results[0].ttft
    print(f"{'scenario':<10} {'TTFT ms':>9} {'vs recompute':>13} {'computed tok':>13} "
          f"{'fetch s':>8} {'transfer s':>10}  bytes moved (all requests)")
    for r in results:
        moved = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in r.moved.items()) or "-"
        print(f"{r.name:<10} {r.ttft * 1e3:9.1f} {base / r.ttft:12.2f}x {statistics.median(r.computed):13.0f} "
              f"{r.fetch_seconds:8.3f} {r.transfer_seconds:10.3f}  {moved}")
    return 0
