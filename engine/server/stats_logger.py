"""The periodic INFO line an operator on call reads, silent while the server idles."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpilot.engine.stats import EngineStats

logger = logging.getLogger("kvpilot.engine.server.stats")


@dataclass(slots=True)
class StatsLogger:
    """Turns successive ``EngineStats`` snapshots into throughput lines.

    ``update`` returns (and logs) a line only when something happened since the
    previous call: tokens were processed, or requests are running or waiting.
    The hit rate is over the interval's prefix-cache lookups (cumulative when the
    interval had none); with KV offloading on, the line adds the offload tiers' hit
    rate ("External prefix cache hit rate", vLLM's wording) the same way; with speculative
    decoding, the interval's draft acceptance rate and mean acceptance length (vLLM's
    "SpecDecoding metrics" figures).
    """

    log: Callable[[str], None] = field(default=logger.info)
    _last: EngineStats | None = None
    _last_time: float = 0.0

    def update(self, stats: EngineStats, now: float) -> str | None:
        last, last_time = self._last, self._last_time
        self._last, self._last_time = stats, now
        if last is None:
            return None
        elapsed = max(now - last_time, 1e-9)
        prompt = stats.prompt_tokens - last.prompt_tokens
        generation = stats.generation_tokens - last.generation_tokens
        if not prompt and not generation and not stats.num_running_reqs and not stats.num_waiting_reqs:
            return None
        queries = stats.prefix_cache_queries - last.prefix_cache_queries
        hits = stats.prefix_cache_hits - last.prefix_cache_hits
        hit_rate = hits / queries if queries else stats.prefix_cache_hit_rate
        line = (
            f"Avg prompt throughput: {prompt / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {generation / elapsed:.1f} tokens/s, "
            f"Running: {stats.num_running_reqs} reqs, Waiting: {stats.num_waiting_reqs} reqs, "
            f"KV cache usage: {stats.kv_cache_usage * 100:.1f}%, "
            f"Prefix cache hit rate: {hit_rate * 100:.1f}%"
        )
        if stats.external_prefix_cache_queries is not None:   # KV offloading is on
            ext_queries = stats.external_prefix_cache_queries - (last.external_prefix_cache_queries or 0)
            ext_hits = stats.external_prefix_cache_hits - (last.external_prefix_cache_hits or 0)
            ext_rate = ext_hits / ext_queries if ext_queries else stats.external_prefix_cache_hit_rate
            line += f", External prefix cache hit rate: {ext_rate * 100:.1f}%"
        if stats.spec_decoding is not None:
            line += _spec_decoding(stats.spec_decoding, last.spec_decoding)
        preempted = stats.num_preemptions - last.num_preemptions
        if preempted:
            line += f", Preemptions: {preempted}"
        self.log(line)
        return line


def _spec_decoding(spec, last) -> str:
    """The interval's acceptance figures (none when nothing was drafted in it)."""
    drafts = spec.num_drafts - (last.num_drafts if last is not None else 0)
    draft_tokens = spec.num_draft_tokens - (last.num_draft_tokens if last is not None else 0)
    accepted = spec.num_accepted_tokens - (last.num_accepted_tokens if last is not None else 0)
    if not draft_tokens:
        return ""
    return (f", Draft acceptance rate: {accepted / draft_tokens * 100:.1f}%, "
            f"Mean acceptance length: {1 + accepted / drafts:.2f}")


async def run_stats_logger(source: Callable[[], EngineStats | None], interval: float,
                           stats_logger: StatsLogger | None = None) -> None:
    """Calls ``stats_logger.update`` every ``interval`` seconds until cancelled."""
    stats_logger = stats_logger or StatsLogger()
    while True:
        stats = source()
        if stats is not None:
            stats_logger.update(stats, time.monotonic())
        await asyncio.sleep(interval)
