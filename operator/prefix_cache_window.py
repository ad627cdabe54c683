"""A service's prefix-cache hit rate over the last window, and its top miss reason when the
rate drops: ``status.prefixCache`` (pure; the engine observer reads the pages).

Each engine pod exports cumulative counters (``vllm:prefix_cache_queries_total`` /
``_hits_total``, ``kvpilot:prefix_cache_miss_tokens_total{reason}``). A window is the
increase of the pods' counters between two reads, per pod (a pod that restarted counts
from zero; a pod that left counts nothing), summed over the service. When the window's
hit rate is ``DROP`` or more below the previous window's, the status names the reason
that counted the most uncached tokens in it: what a platform engineer should look at
first (``kvpilot explain-prefix`` then explains a request).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

QUERIES = "vllm:prefix_cache_queries_total"
HITS = "vllm:prefix_cache_hits_total"
MISSES = "kvpilot:prefix_cache_miss_tokens_total"
DROP = 0.1   # absolute fall of the hit rate from one window to the next that names a reason


@dataclass(frozen=True, slots=True)
class PrefixCounters:
    """One pod's cumulative prefix-cache counters (tokens)."""

    queries: float = 0.0
    hits: float = 0.0
    misses: Mapping[str, float] = field(default_factory=dict)   # by reason


def parse_prefix_counters(text: str) -> PrefixCounters:
    """The counters in a ``/metrics`` page (absent ones are 0)."""
    queries = hits = 0.0
    misses: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == QUERIES:
                queries += sample.value
            elif sample.name == HITS:
                hits += sample.value
            elif sample.name == MISSES:
                reason = sample.labels.get("reason", "")
                misses[reason] = misses.get(reason, 0.0) + sample.value
    return PrefixCounters(queries, hits, misses)


def _increase(now: float, before: float | None) -> float:
    """A counter's increase; a reset (a restarted pod) counts from zero."""
    return now if before is None or now < before else now - before


def window(now: Mapping[Any, PrefixCounters], before: Mapping[Any, PrefixCounters]) -> PrefixCounters:
    """The service's counters' increase over the window, from each pod's two readings (by pod key)."""
    queries = hits = 0.0
    misses: dict[str, float] = {}
    for key, counters in now.items():
        old = before.get(key)
        queries += _increase(counters.queries, old.queries if old else None)
        hits += _increase(counters.hits, old.hits if old else None)
        for reason, value in counters.misses.items():
            misses[reason] = misses.get(reason, 0.0) + _increase(value, old.misses.get(reason) if old else None)
    return PrefixCounters(queries, hits, misses)


def prefix_cache_status(current: PrefixCounters, previous_hit_rate: float | None,
                        seconds: float) -> dict[str, Any] | None:
    """``status.prefixCache`` for a window (None when it looked nothing up)."""
    if current.queries <= 0:
        return None
    rate = current.hits / current.queries
    status: dict[str, Any] = {"hitRate": round(rate, 4), "queriedTokens": int(current.queries),
                              "windowSeconds": round(seconds, 1)}
    if previous_hit_rate is not None:
        status["previousHitRate"] = round(previous_hit_rate, 4)
    missed = {r: v for r, v in current.misses.items() if v > 0}
    if previous_hit_rate is not None and rate <= previous_hit_rate - DROP and missed:
        reason, tokens = max(missed.items(), key=lambda item: item[1])
        share = tokens / sum(missed.values())
        status.update(topMissReason=reason, topMissReasonShare=round(share, 4),
                      message=f"hit rate fell from {previous_hit_rate:.2f} to {rate:.2f}; {share:.0%} of the "
                              f"uncached prompt tokens missed as {reason} (kvpilot explain-prefix explains one request)")
    return status
