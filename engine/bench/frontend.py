"""``kvpilot bench frontend``: what the HTTP server costs the engine, in one run.

The micro model of ``kvpilot bench overhead`` (Qwen3, 2 layers, hidden 64, vocabulary
1,024, float32, built on the fly) makes the model's forward almost free, so the engine's
host work and the server's own work decide the throughput. The same workload runs
twice or more, with the same engine settings:

- offline: ``--num-clients`` requests at once through the engine the way
  ``LLM.generate`` runs them (``--prompt-len`` prompt tokens, ``--output-len`` output
  tokens each, ``ignore_eos``);
- through ``kvpilot serve`` on loopback, once per ``--modes`` entry (and per
  ``--stream-intervals`` value, serve's ``--stream-interval``): ``core`` (the
  engine core in its own process, the default) and ``in-process`` (the engine on a
  thread of the server's process, ``--engine-in-process``): ``--num-clients``
  concurrent streaming ``/v1/completions`` clients, one request each, the same prompts.

It prints output tokens/s of each (the whole run: first request sent to last token
received, prefill included) and each server mode's share of the offline figure, and the
CPU seconds each process spent on the workload (offline engine; server process, engine
core process and the benchmark's own clients), which show what limits a server run
when the machine has fewer free cores than the three processes need, and each
process's CPU seconds per 1,000 streamed output tokens: the API (server) process's
figure is what the frontend costs per token, whatever the machine's free cores. The
engine runs on ``--threads`` torch threads everywhere (the server's through ``OMP_NUM_THREADS``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

MODES = {"core": [], "in-process": ["--engine-in-process"]}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("frontend", help="serve vs offline tokens/s on a near-zero model",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-clients", type=int, default=256,
                   help="concurrent streaming clients = offline batch (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    p.add_argument("--modes", default="core,in-process",
                   help=f"server modes to run, comma-separated from {sorted(MODES)} "
                        "(default: %(default)s)")
    p.add_argument("--stream-intervals", default="1",
                   help="serve's --stream-interval values to run each mode with, comma-separated "
                        "(tokens a stream gathers per chunk; default: %(default)s)")
    p.add_argument("--json-out", default=None, help="also write the results to this JSON file")
    p.set_defaults(func=run)


@dataclass(slots=True)
class FrontendResult:
    name: str
    output_tokens_per_s: float
    share_of_offline: float | None = None
    ttft_p50_ms: float | None = None
    itl_p50_ms: float | None = None
    cpu_s: dict[str, float] | None = None    # process -> CPU seconds spent on the workload
    # process -> CPU seconds per 1,000 streamed output tokens (server runs)
    cpu_s_per_1k_tokens: dict[str, float] | None = None


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of process ``pid`` (this one when None; Linux /proc)."""
    if pid is None:
        return time.process_time()
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def prompts(num: int, length: int) -> list[list[int]]:
    """The prompts ``overhead.measure`` gives its requests (ids valid for the micro model)."""
    return [[(7 * i + 13 * j) % 1000 + 10 for j in range(length)] for i in range(num)]


def serve_flags(model_dir: str, args: argparse.Namespace) -> list[str]:
    """``kvpilot serve`` flags giving the engine ``overhead.measure``'s settings."""
    max_len = args.prompt_len + args.output_len
    blocks = args.num_clients * -(-max_len // 16) + 16
    return ["--model", model_dir, "--dtype", "float32", "--max-model-len", str(max_len + 16),
            "--max-num-seqs", str(args.num_clients), "--num-gpu-blocks-override", str(blocks),
            "--max-waiting-requests", str(4 * args.num_clients), "--uvicorn-log-level", "warning",
            "--disable-uvicorn-access-log", "--disable-log-stats"]


async def _load(base_url: str, args: argparse.Namespace) -> FrontendResult:
    from kvpilot.engine.bench.serve import client_session, first_model, stream_completion, summarize

    async with client_session(base_url, args.num_clients + 4) as http:
        model = await first_model(http)
        await asyncio.gather(*(stream_completion(http, model, p, 4) for p in prompts(8, args.prompt_len)))  # warm-up
        start = time.perf_counter()
        results = await asyncio.gather(*(stream_completion(http, model, p, args.output_len)
                                         for p in prompts(args.num_clients, args.prompt_len)))
        duration = time.perf_counter() - start
    wrong = [r.completion_tokens for r in results if r.completion_tokens != args.output_len]
    if wrong:
        raise RuntimeError(f"{len(wrong)} requests got other than {args.output_len} tokens: {wrong[:5]}")
    summary = summarize("serve", list(results), duration)
    return FrontendResult("serve", summary.output_tokens_per_s, ttft_p50_ms=summary.ttft_p50_ms,
                          itl_p50_ms=summary.itl_p50_ms)


def measure_serve(model_dir: str, mode: str, args: argparse.Namespace, stream_interval: int = 1) -> FrontendResult:
    from kvpilot.engine.bench.server_process import launch_server

    env = {"OMP_NUM_THREADS": str(args.threads)}
    flags = [*serve_flags(model_dir, args), *MODES[mode], "--stream-interval", str(stream_interval)]
    with launch_server(flags, env=env) as server:
        found = re.search(r"engine core process started \(pid (\d+)\)", server.log_path.read_text())
        pids: dict[str, int | None] = {"server": server.process.pid}
        if found:
            pids["core"] = int(found.group(1))
        pids["clients"] = None   # this process
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        result = asyncio.run(_load(server.base_url, args))
        result.cpu_s = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    tokens = args.num_clients * args.output_len
    result.cpu_s_per_1k_tokens = {name: 1000 * seconds / tokens
                                  for name, seconds in result.cpu_s.items()}
    result.name = f"serve ({mode})" if stream_interval == 1 else f"serve ({mode}, interval {stream_interval})"
    return result


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def _cpu_line(cpu: dict[str, float]) -> str:
    return ", ".join(f"{name} {seconds:.2f}" for name, seconds in cpu.items())


def run(args: argparse.Namespace) -> int:
    import torch

    from kvpilot.engine.bench.overhead import MICRO_CONFIG, measure, write_micro_model

    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise SystemExit(f"kvpilot bench frontend: unknown mode(s) {unknown}; choose from {sorted(MODES)}")
    try:
        intervals = [int(v) for v in args.stream_intervals.split(",") if v]
    except ValueError:
        intervals = [0]
    if not intervals or min(intervals) < 1:
        raise SystemExit(f"kvpilot bench frontend: --stream-intervals must be positive integers; "
                         f"got {args.stream_intervals!r}")
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    results: list[FrontendResult] = []
    with tempfile.TemporaryDirectory(prefix="kvpilot-micro-") as tmp:
        model_dir = str(write_micro_model(Path(tmp)))
        print(f"micro model: Qwen3, {MICRO_CONFIG['num_hidden_layers']} layers, hidden "
              f"{MICRO_CONFIG['hidden_size']}, vocab {MICRO_CONFIG['vocab_size']}, float32; "
              f"{args.num_clients} requests at once, {args.prompt_len} prompt + {args.output_len} "
              f"output tokens each (ignore_eos); torch threads={args.threads}", flush=True)
        start = cpu_seconds()
        offline = measure(model_dir, args.num_clients, args.prompt_len, args.output_len, "final")
        results.append(FrontendResult("offline (LLM.generate)", offline.output_tokens_per_s,
                                      cpu_s={"engine": cpu_seconds() - start}))
        print(f"  {results[0].name:<30}{offline.output_tokens_per_s:>10.0f} output tok/s  "
              f"(CPU s: {_cpu_line(results[0].cpu_s)}, engine build included)", flush=True)
        for mode, interval in ((m, i) for m in modes for i in intervals):
            result = measure_serve(model_dir, mode, args, interval)
            result.share_of_offline = result.output_tokens_per_s / offline.output_tokens_per_s
            results.append(result)
            print(f"  {result.name:<30}{result.output_tokens_per_s:>10.0f} output tok/s  "
                  f"{result.share_of_offline:>6.1%} of offline  (TTFT p50 {_ms(result.ttft_p50_ms)}, "
                  f"ITL p50 {_ms(result.itl_p50_ms)}; CPU s: {_cpu_line(result.cpu_s)})",
                  flush=True)
            per_1k = result.cpu_s_per_1k_tokens
            print(f"  {'':<30}CPU s per 1,000 streamed tokens: API process "
                  f"{per_1k['server']:.4f}"
                  + "".join(f", {name} {per_1k[name]:.4f}" for name in per_1k if name != "server"),
                  flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0
