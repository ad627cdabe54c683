"""``kvpilot bench serve``: load an OpenAI-compatible server and report latencies.

Client side only: streamed ``/v1/completions`` requests over HTTP, so time to first
token (TTFT) and the gaps between streamed chunks (inter-token latency, ITL) are
measured as a client sees them. The requests are sent with aiohttp rather than the
``openai`` SDK, whose own request preparation took ~15 ms for a 1,500-token id list
here (it would swamp a cached prefix's TTFT), or httpx, whose pure-Python HTTP/1.1
parser spent more CPU on 256 streams than the server it was measuring.

Workloads:

- ``random``: ``--num-prompts`` prompts of ``--input-len`` random tokens, each asking
  for exactly ``--output-len`` tokens (``ignore_eos``), ``--concurrency`` at a time.
  Prints TTFT and ITL p50/p95, requests/s and output tokens/s.
- ``shared-prefix``: TTFT of requests whose ``--prefix-len``-token prefix is in the
  server's prefix cache against requests whose prefix is new (each gets a fresh
  random prefix), one request at a time, the two kinds interleaved so that machine
  noise hits both alike. Prints both and their ratio (cached / uncached), and the
  cached prompt tokens the server reported for each kind.

Prompts are built from token ids the server's own ``/tokenize`` returns for random
words, so they are valid for any model, and are sent as token-id lists so their
lengths are exact.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import statistics
import string
import time
from dataclasses import asdict, dataclass, field


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="load an OpenAI-compatible server: TTFT, ITL, tokens/s",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_arguments(p)
    p.add_argument("--workload", choices=("random", "shared-prefix", "all"), default="all")
    p.add_argument("--num-prompts", type=int, default=32, help="random workload: requests")
    p.add_argument("--input-len", type=int, default=128, help="random workload: prompt tokens")
    p.add_argument("--output-len", type=int, default=32, help="random workload: output tokens")
    p.add_argument("--concurrency", type=int, default=8, help="random workload: requests in flight")
    p.add_argument("--prefix-len", type=int, default=1500, help="shared-prefix: prefix tokens")
    p.add_argument("--suffix-len", type=int, default=16, help="shared-prefix: distinct tail tokens")
    p.add_argument("--prefix-requests", type=int, default=8,
                   help="shared-prefix: measured requests of each kind")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None, help="also write the results to this JSON file")
    p.set_defaults(func=run)


def add_server_arguments(p: argparse.ArgumentParser, serve_args: str = "") -> None:
    """The flags saying which server a benchmark loads (``run_with_server`` reads them)."""
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="server to load (default: %(default)s)")
    p.add_argument("--launch", action="store_true",
                   help="start `kvpilot serve` on a free loopback port first (see --serve-args)")
    p.add_argument("--serve-args", default=serve_args,
                   help="flags for the launched server, one string, e.g. "
                        "\"--kv-cache-memory-bytes 256Mi --max-model-len 4096\" "
                        "(default: %(default)r)")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--api-key", default=os.environ.get("KVPILOT_API_KEY", "none"),
                   help="bearer key (default: $KVPILOT_API_KEY)")


@dataclass(slots=True)
class RequestResult:
    ttft: float
    e2e: float
    chunk_gaps: list[float]
    completion_tokens: int
    cached_tokens: int


@dataclass(slots=True)
class Summary:
    name: str
    num_requests: int
    duration_s: float
    ttft_p50_ms: float
    ttft_p95_ms: float
    itl_p50_ms: float | None
    itl_p95_ms: float | None
    output_tokens_per_s: float
    requests_per_s: float
    mean_cached_tokens: float
    extra: dict = field(default_factory=dict)


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation; values must be non-empty."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summarize(name: str, results: list[RequestResult], duration: float) -> Summary:
    ttfts = [r.ttft * 1000 for r in results]
    gaps = [g * 1000 for r in results for g in r.chunk_gaps]
    tokens = sum(r.completion_tokens for r in results)
    return Summary(
        name=name, num_requests=len(results), duration_s=duration,
        ttft_p50_ms=percentile(ttfts, 50), ttft_p95_ms=percentile(ttfts, 95),
        itl_p50_ms=percentile(gaps, 50) if gaps else None,
        itl_p95_ms=percentile(gaps, 95) if gaps else None,
        output_tokens_per_s=tokens / duration, requests_per_s=len(results) / duration,
        mean_cached_tokens=statistics.fmean(r.cached_tokens for r in results))


def client_session(base_url: str, max_connections: int, headers: dict[str, str] | None = None,
                   *, reuse_connections: bool = True):
    """The benchmarks' HTTP client: an aiohttp session on ``base_url`` (no timeout short of
    10 minutes, ``max_connections`` open at once). ``reuse_connections=False`` opens a
    connection per request, for servers that close idle keep-alive connections under the
    client's feet (llama.cpp's ``llama-server``)."""
    import aiohttp

    return aiohttp.ClientSession(base_url=base_url, headers=headers,
                                 timeout=aiohttp.ClientTimeout(total=600),
                                 connector=aiohttp.TCPConnector(limit=max_connections,
                                                                force_close=not reuse_connections))


async def first_model(http) -> str:
    """The name of the server's first model."""
    async with http.get("/v1/models") as resp:
        resp.raise_for_status()
        return (await resp.json())["data"][0]["id"]


async def _token_pool(http, rng: random.Random) -> list[int]:
    """Distinct token ids the server's tokenizer produces for random words."""
    words = [" " + "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9)))
             for _ in range(3000)]
    async with http.post("/tokenize", json={"prompt": "".join(words), "add_special_tokens": False}) as resp:
        resp.raise_for_status()
        pool = sorted(set((await resp.json())["tokens"]))
    if len(pool) < 50:
        raise RuntimeError(f"/tokenize gave only {len(pool)} distinct tokens")
    return pool


async def sse_frames(resp):
    """The JSON frames of an OpenAI event stream (an aiohttp response), each as
    ``(time.perf_counter() when it arrived, frame)``, up to ``data: [DONE]``. RuntimeError
    for an answer other than 200 or a frame carrying an error."""
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:500]}")
    async for line in resp.content:   # one SSE line at a time
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        now = time.perf_counter()
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise RuntimeError(f"error in stream: {chunk['error']}")
        yield now, chunk


@dataclass(frozen=True, slots=True)
class StreamedText:
    """A streamed completion as its client saw it."""

    ttft: float          # seconds from sending to the first frame with a choice
    gaps: list[float]    # seconds between consecutive frames with a choice
    text: str


async def stream_text(http, url: str, body: dict, headers: dict[str, str] | None = None) -> StreamedText:
    """POSTs ``body`` (a streamed ``/v1/completions`` request) to ``url`` (a path on the
    session's base URL, or a whole URL); RuntimeError when the stream carried no token."""
    times, parts = [], []
    start = time.perf_counter()
    async with http.post(url, json=body, headers=headers) as resp:
        async for now, chunk in sse_frames(resp):
            if chunk.get("choices"):
                times.append(now)
                parts.append(chunk["choices"][0].get("text") or "")
    if not times:
        raise RuntimeError("the stream carried no tokens")
    return StreamedText(times[0] - start, [b - a for a, b in zip(times, times[1:], strict=False)], "".join(parts))


async def stream_completion(http, model: str, prompt: list[int], max_tokens: int) -> RequestResult:
    """One streamed completion; times measured from just before the request is sent."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    first = None
    gaps: list[float] = []
    usage = None
    num_chunks = 0
    start = last = time.perf_counter()
    async with http.post("/v1/completions", json=body) as resp:
        async for now, chunk in sse_frames(resp):
            if chunk.get("usage"):
                usage = chunk["usage"]
            if not chunk["choices"]:
                continue
            num_chunks += 1
            if first is None:
                first = now
            else:
                gaps.append(now - last)
            last = now
    end = time.perf_counter()
    if first is None:
        raise RuntimeError("the stream carried no tokens")
    if usage is None:   # a server that sends no usage (some peers): a chunk per token
        return RequestResult(first - start, end - start, gaps, num_chunks, 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return RequestResult(first - start, end - start, gaps, usage["completion_tokens"], cached)


async def run_random(http, model: str, pool: list[int], args, rng: random.Random) -> Summary:
    from tqdm.auto import tqdm

    prompts = [[rng.choice(pool) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    limit = asyncio.Semaphore(args.concurrency)
    results: list[RequestResult] = []
    with tqdm(total=len(prompts), desc="random workload", unit="req") as bar:

        async def worker(prompt: list[int]) -> None:
            async with limit:
                results.append(await stream_completion(http, model, prompt, args.output_len))
                bar.update()

        start = time.perf_counter()
        await asyncio.gather(*(worker(p) for p in prompts))
        duration = time.perf_counter() - start
    return summarize("random", results, duration)


async def run_shared_prefix(http, model: str, pool: list[int], args,
                            rng: random.Random) -> tuple[Summary, Summary]:
    from tqdm.auto import tqdm

    def tokens(n: int) -> list[int]:
        return [rng.choice(pool) for _ in range(n)]

    shared = tokens(args.prefix_len)
    await stream_completion(http, model, shared + tokens(args.suffix_len), 1)  # warm the cache (not measured)
    cached: list[RequestResult] = []
    uncached: list[RequestResult] = []
    start = time.perf_counter()
    with tqdm(total=2 * args.prefix_requests, desc="shared-prefix TTFT", unit="req") as bar:
        for _ in range(args.prefix_requests):  # interleaved: noise hits both kinds alike
            uncached.append(await stream_completion(http, model, tokens(args.prefix_len + args.suffix_len), 1))
            bar.update()
            cached.append(await stream_completion(http, model, shared + tokens(args.suffix_len), 1))
            bar.update()
    duration = time.perf_counter() - start
    return summarize("uncached prefix", uncached, duration), summarize("cached prefix", cached, duration)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def print_random(s: Summary, args) -> None:
    print(f"\n== random workload: {s.num_requests} requests, {args.input_len} prompt + "
          f"{args.output_len} output tokens, concurrency {args.concurrency}")
    print(f"  TTFT p50 / p95:  {_fmt(s.ttft_p50_ms)} / {_fmt(s.ttft_p95_ms)} ms")
    print(f"  ITL  p50 / p95:  {_fmt(s.itl_p50_ms)} / {_fmt(s.itl_p95_ms)} ms")
    print(f"  throughput:      {s.output_tokens_per_s:.1f} output tokens/s, "
          f"{s.requests_per_s:.2f} requests/s")


def print_shared_prefix(uncached: Summary, cached: Summary, args) -> float:
    ratio = cached.ttft_p50_ms / uncached.ttft_p50_ms
    print(f"\n== shared prefix: {args.prefix_len}-token prefix + {args.suffix_len} distinct tokens, "
          f"{args.prefix_requests} requests of each kind, one at a time")
    print(f"  {'':18}{'TTFT p50':>10}{'TTFT p95':>10}{'cached prompt tokens':>24}")
    for s in (uncached, cached):
        print(f"  {s.name:18}{s.ttft_p50_ms:>8.1f}ms{s.ttft_p95_ms:>8.1f}ms"
              f"{s.mean_cached_tokens:>24.0f}")
    verdict = "meets" if ratio <= 0.1 else "misses"
    print(f"  cached / uncached TTFT (p50): {ratio:.3f} = 1/{1 / ratio:.1f} "
          f"({verdict} the 1/10 target)")
    return ratio


async def _bench(args, base_url: str) -> dict:
    rng = random.Random(args.seed)
    async with client_session(base_url, max(args.concurrency, 1) + 4,
                              {"Authorization": f"Bearer {args.api_key}"}) as http:
        model = args.model or await first_model(http)
        pool = await _token_pool(http, rng)
        results: dict = {"base_url": base_url, "model": model}
        if args.workload in ("random", "all"):
            summary = await run_random(http, model, pool, args, rng)
            print_random(summary, args)
            results["random"] = asdict(summary)
        if args.workload in ("shared-prefix", "all"):
            uncached, cached = await run_shared_prefix(http, model, pool, args, rng)
            ratio = print_shared_prefix(uncached, cached, args)
            results["shared_prefix"] = {"uncached": asdict(uncached), "cached": asdict(cached),
                                        "ttft_ratio_p50": ratio}
    return results


def run_with_server(args: argparse.Namespace, bench) -> dict:
    """``asyncio.run(bench(args, base_url))`` against ``--base-url``, or against a server
    started first with ``--launch`` (``--serve-args``) and stopped after; the results also
    go to ``--json-out`` when given. Shared by the benchmarks that load a server."""
    server = None
    base_url = args.base_url.rstrip("/")
    if args.launch:
        from kvpilot.engine.bench.server_process import launch_server

        print("launching kvpilot serve", args.serve_args, flush=True)
        server = launch_server(shlex.split(args.serve_args))
        base_url = server.base_url
        print(f"server ready at {base_url} (log: {server.log_path})", flush=True)
    try:
        results = asyncio.run(bench(args, base_url))
    finally:
        if server is not None:
            server.stop()
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=2)
    return results


def run(args: argparse.Namespace) -> int:
    run_with_server(args, _bench)
    return 0
