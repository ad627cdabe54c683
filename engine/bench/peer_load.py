"""The load ``kvpilot bench peer`` puts on every server: the same client for all of them.

Streamed ``/v1/completions`` over aiohttp (``bench serve``'s client), prompts as token-id
lists drawn from the model's ordinary vocabulary (every server here reads the same
vocabulary, so the lengths are exact everywhere), greedy, ``ignore_eos`` so every request
makes exactly ``output_len`` tokens:

- ``tok/s@N``: N concurrent streams, each sending ``requests_per_stream`` requests one
  after the other (``input_len`` prompt tokens, ``output_len`` output tokens); output
  tokens over the wall time, and the inter-token latency (``itl_p50@N``, the gaps between
  streamed chunks); at one stream also ``decode_tok/s@1``, decode alone: the median over
  the requests of the tokens after the first over the time after the first (prefill left
  out; robust to a server that streams several tokens per chunk);
- ``ttft_cached_prefix``: time to first token of a request whose ``prefix_len``-token
  prefix the server has just seen (``suffix_len`` new tokens after it), one at a time;
- ``ttft_cold``: time to first token of a fresh ``cold_len``-token prompt, one at a time.

Lower is better for every figure but the tokens/s ones.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

from kvpilot.engine.bench.serve import (
    RequestResult,
    client_session,
    first_model,
    percentile,
    stream_completion,
)


@dataclass(frozen=True, slots=True)
class Workload:
    streams: tuple[int, ...] = (1, 8, 32)
    input_len: int = 128
    output_len: int = 96
    requests_per_stream: int = 2
    prefix_len: int = 1500
    suffix_len: int = 16
    prefix_requests: int = 6
    cold_len: int = 1700
    cold_requests: int = 3

    def __post_init__(self) -> None:
        if not self.streams or min(self.streams) < 1:
            raise ValueError("streams must be positive")
        for name in ("input_len", "output_len", "requests_per_stream", "prefix_len",
                     "prefix_requests", "cold_len", "cold_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")

    @property
    def context_per_stream(self) -> int:
        """The context a server must give one sequence for every part of the load."""
        return max(self.input_len + self.output_len, self.prefix_len + self.suffix_len + 1,
                   self.cold_len + 1)

    def figure_names(self) -> list[str]:
        names = []
        for n in self.streams:
            names += [f"tok/s@{n}", f"itl_p50@{n}"] + (["decode_tok/s@1"] if n == 1 else [])
        return [*names, "ttft_cached_prefix", "ttft_cold"]


def higher_is_better(figure: str) -> bool:
    return figure.startswith(("tok/s", "decode_tok/s"))


def decode_rate(results: list[RequestResult]) -> float | None:
    """Median over ``results`` of tokens after the first / seconds after the first (None
    when no request made two tokens)."""
    rates = [(r.completion_tokens - 1) / (r.e2e - r.ttft) for r in results
             if r.completion_tokens > 1 and r.e2e > r.ttft]
    return percentile(rates, 50) if rates else None


async def _streams(http, model: str, rng: random.Random, pool: list[int], w: Workload,
                   num_streams: int) -> tuple[float, float | None, float | None]:
    """(output tokens/s, ITL p50 in ms, ``decode_rate``) of ``num_streams`` concurrent streams."""
    prompts = [[rng.choice(pool) for _ in range(w.input_len)]
               for _ in range(num_streams * w.requests_per_stream)]
    results = []

    async def stream(index: int) -> None:
        for prompt in prompts[index::num_streams]:
            results.append(await stream_completion(http, model, prompt, w.output_len))

    start = time.perf_counter()
    await asyncio.gather(*(stream(i) for i in range(num_streams)))
    duration = time.perf_counter() - start
    gaps = [g * 1000 for r in results for g in r.chunk_gaps]
    return (sum(r.completion_tokens for r in results) / duration,
            percentile(gaps, 50) if gaps else None, decode_rate(results))


async def _ttft(http, model: str, prompts: list[list[int]]) -> float:
    """TTFT p50 (ms) of ``prompts`` sent one at a time, one output token each."""
    ttfts = [(await stream_completion(http, model, p, 1)).ttft * 1000 for p in prompts]
    return percentile(ttfts, 50)


async def measure(base_url: str, pool: list[int], w: Workload, seed: int = 0) -> dict[str, float | None]:
    """Every figure of ``w`` against the server at ``base_url`` (same seed: same prompts)."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.choice(pool) for _ in range(n)]

    figures: dict[str, float | None] = {}
    # a connection per request for every server alike: llama-server closes idle keep-alive
    # connections, and reusing them would favour the others
    async with client_session(base_url, max(w.streams) + 4, reuse_connections=False) as http:
        model = await first_model(http)
        for _ in range(2):   # warm-up, not measured (first-request costs, lazy compiles)
            await stream_completion(http, model, tokens(w.input_len), 8)
        for n in w.streams:
            figures[f"tok/s@{n}"], figures[f"itl_p50@{n}"], decode = await _streams(http, model, rng, pool, w, n)
            if n == 1:
                figures["decode_tok/s@1"] = decode
        prefix = tokens(w.prefix_len)
        await stream_completion(http, model, prefix + tokens(w.suffix_len), 1)   # the prefix, seen once
        figures["ttft_cached_prefix"] = await _ttft(
            http, model, [prefix + tokens(w.suffix_len) for _ in range(w.prefix_requests)])
        figures["ttft_cold"] = await _ttft(http, model, [tokens(w.cold_len) for _ in range(w.cold_requests)])
    return figures
