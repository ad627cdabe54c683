"""``kvpilot bench offline``: engine throughput vs HF transformers, and KV waste.

Both run in the same process on the same checkpoint, dtype and prompts, one after the
other, so the ratio is robust to a noisy machine. HF runs ``generate`` on padded
batches (left padding), each batch until its longest request is done; only the tokens
each request asked for count as useful. The engine runs all requests with continuous
batching. The default workload has chat-like long-tailed lengths (``--workload
uniform`` for uniform ranges). KV waste is measured every engine step as (allocated slots - slots holding
a token) / allocated slots over the running requests, and compared with reserving
``max_model_len`` slots per running sequence, as a non-paged server would.

``--tensor-parallel-size N`` (N > 1) also runs the engine split over N ranks (gloo
worker processes on CPU) on the same workload, right after the one-rank engine, and
prints both throughputs, the time per engine step of each and the share of requests
whose tokens agree (greedy float32: the ranks' all-reduces sum in another order, which
can flip a near-tie late in a long random-weight generation).

``--dtypes bfloat16,float32`` runs the engine once per dtype (``auto`` included: the
engine's own choice for this CPU) on the same workload and prints their throughputs and
ratio side by side; the first dtype is the one compared with HF and used for the rest.

On a CPU it also prints the single-stream decode roofline (``roofline``): the machine's read
bandwidth (measured on the engine's threads before it starts), the bytes one decode token
reads per engine dtype (weights as served, KV at the workload's mean context) and the
ceiling in tokens/s; with ``--max-num-seqs 1`` (one stream) also the share of that ceiling
each dtype's output tokens/s reaches (prefill included, as in every figure here).
"""

from __future__ import annotations

import argparse
import math
import random
import time
from dataclasses import dataclass


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("offline", help="engine vs HF transformers throughput, and KV waste",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF checkpoint directory or GGUF file (default: built-in demo model)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--workload", choices=("longtail", "uniform"), default="longtail",
                   help="longtail: log-normal prompt and output lengths (median 150 / 48 tokens, "
                        "chat-like, as in ShareGPT traces); uniform: --min/--max ranges")
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=128)
    p.add_argument("--hf-batch-sizes", default="8,16,32",
                   help="comma-separated; the best one is compared ('' skips HF)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtypes", default="float32",
                   help="comma-separated engine dtypes run side by side, e.g. bfloat16,float32 "
                        "(default: %(default)s); HF runs float32")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="also run the engine over N tensor-parallel ranks and compare with one rank")
    p.set_defaults(func=run)


@dataclass(frozen=True, slots=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def total_output(self) -> int:
        return sum(self.output_lens)


def _lengths(rng: random.Random, args) -> tuple[int, int]:
    if args.workload == "uniform":
        return (int(rng.uniform(args.min_prompt, args.max_prompt)),
                int(rng.uniform(args.min_output, args.max_output)))
    # Chat traces have long-tailed lengths: most replies are short, a few are long.
    prompt = min(1024, max(8, int(rng.lognormvariate(math.log(150), 0.8))))
    output = min(512, max(4, int(rng.lognormvariate(math.log(48), 0.9))))
    return prompt, output


def make_workload(args, vocab: int) -> Workload:
    rng = random.Random(args.seed)
    low = min(1000, vocab // 2)    # past the special tokens of a real vocabulary, within a tiny one
    prompts, outs = [], []
    for _ in range(args.num_prompts):
        n, out = _lengths(rng, args)
        prompts.append([rng.randrange(low, min(vocab, 100000)) for _ in range(n)])
        outs.append(out)
    return Workload(prompts, outs)


@dataclass(frozen=True, slots=True)
class EngineRun:
    seconds: float
    num_steps: int
    paged_waste: float            # % of allocated slots
    reserve_waste: float          # % of max_model_len reservations
    token_ids: dict[str, list[int]]


def run_engine(model_dir: str, wl: Workload, args, tensor_parallel_size: int = 1,
               dtype: str = "float32") -> EngineRun:
    """Every request of ``wl`` through one engine, timed from the first step to the last."""
    from kvpilot.engine import LLMEngine, SamplingParams
    from kvpilot.engine.engine_args import EngineArgs
    from kvpilot.engine.sampling_params import RequestOutputKind

    engine = LLMEngine(EngineArgs(model=model_dir, max_model_len=args.max_model_len,
                                  max_num_seqs=args.max_num_seqs, enable_prefix_caching=False,
                                  dtype=dtype, tensor_parallel_size=tensor_parallel_size))
    try:
        block = engine.cache_info.block_size
        for i, (p, n) in enumerate(zip(wl.prompts, wl.output_lens, strict=True)):
            engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                                                         output_kind=RequestOutputKind.FINAL_ONLY))
        allocated = used = reserved = steps = 0
        token_ids = {}
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            for out in engine.step():
                token_ids[out.request_id] = out.outputs[0].token_ids
            steps += 1
            for r in engine.scheduler.running:
                slots = len(engine.kv_cache_manager.block_ids(r.request_id)) * block
                allocated += slots
                used += min(r.num_computed_tokens, slots)
                reserved += args.max_model_len
        seconds = time.perf_counter() - start
    finally:
        engine.close()
    return EngineRun(seconds, steps, 100 * (allocated - used) / allocated,
                     100 * (reserved - used) / reserved, token_ids)


def run_hf(model_dir: str, wl: Workload, batch_size: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    from kvpilot.contract.gguf import find_gguf

    gguf = find_gguf(model_dir)   # transformers dequantizes a GGUF file to float32
    model = (AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32) if gguf is None else
             AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)).eval()
    pad = 0
    start = time.perf_counter()
    with torch.no_grad():
        for b in range(0, len(wl.prompts), batch_size):
            prompts = wl.prompts[b:b + batch_size]
            width = max(map(len, prompts))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            new = max(wl.output_lens[b:b + batch_size])
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=pad)
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> int:
    import torch

    from kvpilot.engine.bench.roofline import read_bandwidth
    from kvpilot.engine.model.gguf.arch import load_model_arch

    model_dir = args.model
    if model_dir is None:
        from kvpilot.engine.model.models.demo import ensure_demo_model

        model_dir = str(ensure_demo_model())
    torch.manual_seed(0)
    arch = load_model_arch(model_dir)
    wl = make_workload(args, arch.vocab_size)
    plens = sorted(map(len, wl.prompts))
    olens = sorted(wl.output_lens)
    print(f"workload ({args.workload}): {len(wl.prompts)} prompts of {plens[0]}-{plens[-1]} tokens "
          f"(median {plens[len(plens) // 2]}), outputs of {olens[0]}-{olens[-1]} tokens "
          f"(median {olens[len(olens) // 2]}, {wl.total_output} in total); threads={torch.get_num_threads()}")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()] or ["float32"]
    on_cpu = not torch.cuda.is_available()    # the engine's device (auto); the probe reads CPU memory
    bandwidth = read_bandwidth() if on_cpu else None
    runs = {d: run_engine(model_dir, wl, args, dtype=d) for d in dtypes}
    for d, r in runs.items():
        print(f"kvpilot engine {d:>9}: {r.seconds:7.2f} s  {wl.total_output / r.seconds:8.1f} output tok/s  "
              f"({1000 * r.seconds / r.num_steps:.1f} ms/step)")
    if bandwidth is not None:
        _print_roofline(model_dir, arch, wl, args, {d: wl.total_output / r.seconds for d, r in runs.items()},
                        bandwidth)
    one = runs[dtypes[0]]
    eng_tps = wl.total_output / one.seconds
    for d in dtypes[1:]:
        same = sum(runs[d].token_ids.get(rid) == ids for rid, ids in one.token_ids.items())
        print(f"throughput ratio ({dtypes[0]} / {d}): {runs[d].seconds / one.seconds:.2f}x; identical "
              f"outputs: {same}/{len(one.token_ids)} requests")
    if args.tensor_parallel_size > 1:
        _compare_tensor_parallel(model_dir, wl, args, one, dtypes[0])
    best = None
    for bs in [int(x) for x in args.hf_batch_sizes.split(",") if x.strip()]:
        hf_s = run_hf(model_dir, wl, bs)
        tps = wl.total_output / hf_s
        print(f"HF generate (bs={bs:3d}): {hf_s:7.2f} s  {tps:8.1f} output tok/s")
        best = max(best or 0.0, tps)
    if best:
        print(f"throughput ratio (engine / best HF): {eng_tps / best:.2f}x")
    print(f"KV waste, paged blocks            : {one.paged_waste:5.2f}% of allocated slots")
    print(f"KV waste, reserve max_model_len   : {one.reserve_waste:5.2f}% (max_model_len={args.max_model_len})")
    return 0


def _compare_tensor_parallel(model_dir: str, wl: Workload, args, one: EngineRun, dtype: str) -> None:
    tp = args.tensor_parallel_size
    split = run_engine(model_dir, wl, args, tp, dtype)
    tps, one_tps = wl.total_output / split.seconds, wl.total_output / one.seconds
    same = sum(split.token_ids.get(rid) == ids for rid, ids in one.token_ids.items())
    print(f"kvpilot engine TP={tp} : {split.seconds:7.2f} s  {tps:8.1f} output tok/s  "
          f"({1000 * split.seconds / split.num_steps:.1f} ms/step)")
    print(f"throughput ratio (TP={tp} / TP=1)   : {tps / one_tps:.2f}x; steps {split.num_steps} vs "
          f"{one.num_steps}; identical outputs: {same}/{len(one.token_ids)} requests")


def _print_roofline(model_dir: str, arch, wl: Workload, args, tokens_per_s: dict[str, float],
                    bandwidth: float) -> None:
    """One line: bandwidth, bytes per decode token and ceiling per engine dtype, and the share
    of it each dtype's output tokens/s reaches when the run was one stream."""
    import torch

    from kvpilot.contract.constants import MODEL_DTYPE_BYTES
    from kvpilot.engine.bench import roofline as rl
    from kvpilot.engine.model.auto_dtype import resolve_auto_dtype

    context = rl.mean_decode_context([len(p) for p in wl.prompts], wl.output_lens)
    one_stream = args.max_num_seqs == 1
    cells = []
    for d, tps in tokens_per_s.items():
        dtype = resolve_auto_dtype(arch.dtype, "cpu")[0] if d == "auto" else d
        roof = rl.Roofline(bandwidth, rl.weight_bytes_per_token(model_dir, dtype),
                           rl.kv_bytes_per_token(arch, context, MODEL_DTYPE_BYTES[dtype]), context)
        label = f"auto ({dtype})" if d == "auto" else d
        cells.append(f"{label} {roof.describe(tps if one_stream else None)}")
    print(f"roofline (1 stream; weights + KV at {context} tokens of context): read {bandwidth / 1e9:.1f} GB/s "
          f"({torch.get_num_threads()} threads); " + "; ".join(cells)
          + ("" if one_stream else " (the share of it: run with --max-num-seqs 1)"))
