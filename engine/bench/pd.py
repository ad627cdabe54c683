"""``kvpilot bench pd``: disaggregated prefill and decode against colocated replicas, one run.

Two set-ups of two ``kvpilot serve`` replicas each (one intra-op thread per replica, so the
two share the machine alike), each behind the real ``vllm-router`` on loopback:

- *colocated*: both replicas serve everything, ``--policy round_robin``;
- *P/D*: one prefill replica (``kv_producer``) and one decode replica (``kv_consumer``), both
  with a ``NixlConnector``, behind ``vllm-router --vllm-pd-disaggregation --kv-connector nixl``.

The same workload runs through each router: ``--streams`` streams decode ``--stream-output``
tokens each while ``--long-prompts`` prompts of ``--long-tokens`` tokens arrive one after
the other (the case P/D is for: on a colocated replica a long prompt's prefill stalls the
streams decoding there). Reported per set-up: the streams' inter-token latency p50/p99 (the
gaps between their tokens), TTFT p50/p95 of the streams and of the long prompts, output
tokens/s, and for P/D the KV bytes moved and the transfer time per read and the tokens the
decode replica recomputed, from its ``/metrics``.

``--identity-requests N`` (default 64) first sends N greedy requests (prompts of 200-3,000
tokens, a third of them sharing a prefix with an earlier one; streamed and not, alternately)
to the P/D router and the same requests straight to a fresh replica of the same model and
dtype, and counts the token-identical answers; the decode replica's prompt tokens by
source (computed there, its own prefix cache, read over NIXL) are reported.

Needs ``vllm-router`` on PATH (``pip install vllm-router``, or ``--router-bin``) and NIXL
(``pip install 'kvpilot[nixl]'``). Not part of ``make test``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Prompts are random token ids below this (every real vocabulary is larger), so the router
# and both replicas see exactly the same tokens, no tokenizer involved.
TOKEN_RANGE = 8000


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("pd", help="disaggregated prefill/decode vs colocated replicas behind vllm-router: "
                              "ITL of decoding streams while long prompts arrive, TTFT, identical outputs",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default="demo", help="the replicas' model (default: the built-in demo model)")
    p.add_argument("--streams", type=int, default=16, help="decoding streams (default: %(default)s)")
    p.add_argument("--stream-prompt", type=int, default=64, help="prompt tokens per stream")
    p.add_argument("--stream-output", type=int, default=192, help="output tokens per stream")
    p.add_argument("--long-prompts", type=int, default=4, help="long prompts arriving while they decode")
    p.add_argument("--long-tokens", type=int, default=4000, help="tokens per long prompt")
    p.add_argument("--identity-requests", type=int, default=64,
                   help="greedy requests checked token for token against one replica (0: skip)")
    p.add_argument("--serve-args", default="--max-model-len 4608 --max-num-seqs 32 --max-num-batched-tokens 1024",
                   help="flags for every replica (default: %(default)r)")
    p.add_argument("--router-bin", default=None, help="vllm-router executable (default: from PATH)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None)
    p.set_defaults(func=run)


# ---- processes ----------------------------------------------------------------------------
def nixl_config(role: str) -> str:
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role, "kv_load_failure_policy": "recompute"})


def start_router(router_bin: str, args: list[str], log_path: Path, timeout: float = 120.0) -> tuple[subprocess.Popen, str]:
    """``vllm-router ARGS`` on a free loopback port, once its /health answers; (process, URL)."""
    import httpx

    from kvpilot.engine.bench.server_process import free_port, stop_process

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [router_bin, *args, "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port()),
           "--worker-startup-check-interval", "1", "--log-level", "info"]
    with log_path.open("wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"vllm-router exited ({process.returncode}):\n"
                                   + log_path.read_text(errors="replace")[-3000:])
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return process, url
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("vllm-router was not ready in time:\n" + log_path.read_text(errors="replace")[-3000:])
            time.sleep(0.3)
    except BaseException:
        stop_process(process, 10)
        raise


@dataclass
class Setup:
    name: str
    url: str = ""
    replicas: list = field(default_factory=list)
    router: subprocess.Popen | None = None

    def stop(self) -> None:
        from kvpilot.engine.bench.server_process import stop_process

        if self.router is not None:
            stop_process(self.router, 10)
        for replica in self.replicas:
            replica.stop()


def start_setup(name: str, args, workdir: Path, router_bin: str) -> Setup:
    from kvpilot.engine.bench.server_process import free_port, launch_server

    base = ["--model", args.model_dir, "--served-model-name", "bench", "--log-stats-interval", "0",
            "--uvicorn-log-level", "warning", *shlex.split(args.serve_args)]
    setup = Setup(name)
    try:
        if name == "colocated":
            for i in range(2):
                setup.replicas.append(launch_server(base, log_path=workdir / f"colocated-{i}.log",
                                                    env={"OMP_NUM_THREADS": "1"}))
            router_args = ["--policy", "round_robin", "--worker-urls", *(r.base_url for r in setup.replicas)]
        else:
            for role in ("kv_producer", "kv_consumer"):
                env = {"OMP_NUM_THREADS": "1", "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                       "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
                setup.replicas.append(launch_server([*base, "--kv-transfer-config", nixl_config(role)],
                                                    log_path=workdir / f"pd-{role}.log", env=env))
            router_args = ["--vllm-pd-disaggregation", "--kv-connector", "nixl", "--policy", "round_robin",
                           "--prefill", setup.replicas[0].base_url, "--decode", setup.replicas[1].base_url]
        setup.router, setup.url = start_router(router_bin, router_args, workdir / f"{name}-router.log")
    except BaseException:
        setup.stop()
        raise
    return setup


def scrape(url: str) -> dict[str, float]:
    """Every sample of ``url``/metrics summed over its labels but ``source``."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in family.samples:
            key = s.name + (f"{{{s.labels['source']}}}" if "source" in s.labels else "")
            out[key] = out.get(key, 0.0) + s.value
    return out


# ---- requests ----------------------------------------------------------------------------
async def stream(http, url: str, prompt: list[int], max_tokens: int):
    """One streamed greedy completion (``serve.StreamedText``: TTFT, gaps between its token
    chunks, text)."""
    from kvpilot.engine.bench.serve import stream_text

    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    return await stream_text(http, f"{url}/v1/completions", body)


async def plain(http, url: str, prompt: list[int], max_tokens: int) -> str:
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        data = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {data}")
        return data["choices"][0]["text"]


def _pct(values: list[float], q: float) -> float:
    """``serve.percentile`` (linear interpolation), NaN where nothing was measured."""
    from kvpilot.engine.bench.serve import percentile

    return percentile(values, q) if values else float("nan")


@dataclass(slots=True)
class LoadResult:
    setup: str
    itl_p50_ms: float
    itl_p99_ms: float
    stream_ttft_p50_ms: float
    stream_ttft_p95_ms: float
    long_ttft_p50_ms: float
    long_ttft_p95_ms: float
    output_tok_s: float
    duration_s: float
    kv_bytes_per_read: float | None = None
    kv_read_ms: float | None = None
    kv_reads: int | None = None
    decode_recomputed_tokens: float | None = None


async def load(url: str, args, rng: random.Random, vocab: int) -> tuple[list, list, list, float, int]:
    import aiohttp

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    streams = [tokens(args.stream_prompt) for _ in range(args.streams)]
    longs = [tokens(args.long_tokens) for _ in range(args.long_prompts)]
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
        start = time.perf_counter()
        stream_tasks = [asyncio.create_task(stream(http, url, p, args.stream_output)) for p in streams]
        await asyncio.sleep(1.0)   # the streams are decoding
        long_ttfts = []
        for prompt in longs:        # one after the other, while the streams decode
            long_ttfts.append((await stream(http, url, prompt, 4)).ttft)
        results = await asyncio.gather(*stream_tasks)
        duration = time.perf_counter() - start
    gaps = [g for r in results for g in r.gaps]
    num_tokens = args.streams * args.stream_output + args.long_prompts * 4
    return [r.ttft for r in results], gaps, long_ttfts, duration, num_tokens


def identity_prompts(n: int, rng: random.Random, vocab: int) -> list[list[int]]:
    prompts: list[list[int]] = []
    for i in range(n):
        length = rng.randint(200, 3000)
        if i % 3 == 2 and prompts:   # shares a prefix with an earlier prompt
            base = rng.choice(prompts)
            keep = rng.randint(len(base) // 3, len(base) - 1)
            prompts.append(base[:keep] + [rng.randrange(100, vocab) for _ in range(max(1, length - keep))])
        else:
            prompts.append([rng.randrange(100, vocab) for _ in range(length)])
    return prompts


async def answers(url: str, prompts: list[list[int]], max_tokens: int) -> list[str]:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as http:
        out = []
        for i, prompt in enumerate(prompts):   # one at a time: each decode-side admission is accounted alone
            out.append((await stream(http, url, prompt, max_tokens)).text if i % 2 else
                       await plain(http, url, prompt, max_tokens))
        return out


def run(args) -> int:
    router_bin = args.router_bin or shutil.which("vllm-router")
    if router_bin is None:
        raise SystemExit("vllm-router not found: pip install vllm-router, or pass --router-bin")
    rng = random.Random(args.seed)
    vocab = TOKEN_RANGE
    workdir = Path(tempfile.mkdtemp(prefix="kvpilot-bench-pd-"))
    report: dict = {"workdir": str(workdir)}
    results = []
    for name in ("colocated", "pd"):
        setup = start_setup(name, args, workdir, router_bin)
        try:
            if name == "pd" and args.identity_requests:
                report["identity"] = identity(setup, args, rng, vocab, workdir)
            before = scrape(setup.replicas[1].base_url)
            ttfts, gaps, long_ttfts, duration, num_tokens = asyncio.run(load(setup.url, args, random.Random(args.seed),
                                                                             vocab))
            after = scrape(setup.replicas[1].base_url)
        finally:
            setup.stop()
        result = LoadResult(name, _pct(gaps, 50) * 1e3, _pct(gaps, 99) * 1e3, _pct(ttfts, 50) * 1e3,
                            _pct(ttfts, 95) * 1e3, _pct(long_ttfts, 50) * 1e3, _pct(long_ttfts, 95) * 1e3,
                            num_tokens / duration, duration)
        if name == "pd":
            reads = after.get("kvpilot:nixl_xfer_time_seconds_count", 0) - before.get("kvpilot:nixl_xfer_time_seconds_count", 0)
            result.kv_reads = int(reads)
            if reads:
                result.kv_bytes_per_read = (after["kvpilot:nixl_bytes_transferred_sum"]
                                            - before["kvpilot:nixl_bytes_transferred_sum"]) / reads
                result.kv_read_ms = (after["kvpilot:nixl_xfer_time_seconds_sum"]
                                     - before["kvpilot:nixl_xfer_time_seconds_sum"]) / reads * 1e3
            result.decode_recomputed_tokens = (after.get("kvpilot:kv_transfer_recomputed_tokens_total", 0)
                                               - before.get("kvpilot:kv_transfer_recomputed_tokens_total", 0))
        results.append(result)
        print(json.dumps(asdict(result)), flush=True)
    colocated, pd = results
    report["load"] = [asdict(r) for r in results]
    report["itl_p99_ratio_pd_over_colocated"] = pd.itl_p99_ms / colocated.itl_p99_ms
    report["itl_p50_ratio_pd_over_colocated"] = pd.itl_p50_ms / colocated.itl_p50_ms
    print(f"ITL p99: P/D {pd.itl_p99_ms:.1f} ms vs colocated {colocated.itl_p99_ms:.1f} ms "
          f"({report['itl_p99_ratio_pd_over_colocated']:.2f}x); p50 {pd.itl_p50_ms:.1f} vs "
          f"{colocated.itl_p50_ms:.1f} ms; long-prompt TTFT p50 {pd.long_ttft_p50_ms:.0f} vs "
          f"{colocated.long_ttft_p50_ms:.0f} ms")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    return 0


def identity(setup: Setup, args, rng: random.Random, vocab: int, workdir: Path) -> dict:
    """The identity check (see the module docstring) through ``setup``'s P/D router."""
    from kvpilot.engine.bench.server_process import launch_server

    prompts = identity_prompts(args.identity_requests, rng, vocab)
    reference = launch_server(["--model", args.model_dir, "--served-model-name", "bench", "--log-stats-interval", "0",
                               "--uvicorn-log-level", "warning", *shlex.split(args.serve_args)],
                              log_path=workdir / "reference.log", env={"OMP_NUM_THREADS": "1"})
    try:
        expected = asyncio.run(answers(reference.base_url, prompts, 16))
    finally:
        reference.stop()
    decode = setup.replicas[1].base_url
    before = scrape(decode)
    got = asyncio.run(answers(setup.url, prompts, 16))
    after = scrape(decode)
    sources = {s: after.get(f"vllm:prompt_tokens_by_source_total{{{s}}}", 0)
               - before.get(f"vllm:prompt_tokens_by_source_total{{{s}}}", 0)
               for s in ("local_compute", "local_cache_hit", "external_kv_transfer")}
    result = {"requests": len(prompts), "identical": sum(a == b for a, b in zip(got, expected, strict=True)),
              "prompt_tokens": sum(map(len, prompts)), "decode_prompt_tokens_by_source": sources,
              "decode_local_compute_per_request": sources["local_compute"] / len(prompts)}
    print(json.dumps({"identity": result}), flush=True)
    return result
