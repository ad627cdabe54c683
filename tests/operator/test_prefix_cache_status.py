"""``status.prefixCache``: the engine pods' prefix-cache counters read from the engine's own
exposition over real HTTP, their increase per window, and the top miss reason when the
hit rate drops; the CRD keeps what the operator writes (the API server prunes the rest)."""

from __future__ import annotations

import asyncio
import dataclasses

import aiohttp.web
from prometheus_client import CollectorRegistry, generate_latest

from kvpilot.engine.config import KVCacheInfo
from kvpilot.engine.server.metrics import ServerMetrics
from kvpilot.engine.stats import EngineStats
from kvpilot.operator.engine_observer import DirectReader, EngineObserver, EnginePod
from kvpilot.operator.prefix_cache_window import PrefixCounters, parse_prefix_counters, window

from support import crd_schema

INFO = KVCacheInfo(num_gpu_blocks=64, block_size=16, kv_cache_dtype="bfloat16", bytes_per_block=65536,
                   kv_cache_memory_bytes=64 * 65536, enable_prefix_caching=True,
                   gpu_memory_utilization=0.9, profiled_available_bytes=None)


def exposition(queries: int, hits: int, **misses: int) -> str:
    """A /metrics page as kvpilot serve exports it, with these prefix-cache counters."""
    required = {f.name: 0 for f in dataclasses.fields(EngineStats)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    stats = EngineStats(**{**required, "kv_cache_usage": 0.0, "prefix_cache_queries": queries,
                           "prefix_cache_hits": hits,
                           **{f"prefix_miss_{r}": 0 for r in ("never_seen", "evicted_capacity", "divergence")},
                           **{f"prefix_miss_{r}": n for r, n in misses.items()}})
    registry = CollectorRegistry()
    ServerMetrics(registry, "chat", INFO, 256, lambda: stats)
    return generate_latest(registry).decode()


def test_the_counters_are_read_from_the_engines_own_exposition():
    counters = parse_prefix_counters(exposition(1000, 900, divergence=70, never_seen=30))
    assert (counters.queries, counters.hits) == (1000, 900)
    assert counters.misses == {"never_seen": 30, "evicted_capacity": 0, "divergence": 70}
    # a pod that restarted counts from zero; one that left counts nothing
    before = {"a": counters, "gone": counters}
    now = {"a": PrefixCounters(50, 10, {"divergence": 40}), "new": PrefixCounters(10, 5, {})}
    assert window(now, before) == PrefixCounters(60, 15, {"divergence": 40})


def test_a_drop_in_the_hit_rate_names_the_top_miss_reason():
    async def scenario():
        page = {"text": exposition(0, 0)}

        async def metrics(_):
            return aiohttp.web.Response(text=page["text"], content_type="text/plain")

        app = aiohttp.web.Application()
        app.router.add_get("/metrics", metrics)
        runner = aiohttp.web.AppRunner(app)
        await runner.setup()
        site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        observer = EngineObserver(DirectReader(), prefix_window=30)
        pods = [EnginePod("ns", "p0", "uid", "127.0.0.1", port, 0)]
        service = ("ns", "chat")
        try:
            assert await observer.observe_prefix_cache(service, pods, now=0) is None     # nothing read yet
            assert len(await observer.observe(service, pods)) == 1   # the KV figures' page ...
            assert await observer.observe_prefix_cache(service, pods, now=0) is None     # ... starts the window
            page["text"] = exposition(1000, 900, divergence=100)
            assert await observer.observe_prefix_cache(service, pods, now=10) is None    # window not over
            healthy = await observer.observe_prefix_cache(service, pods, now=30)
            assert healthy == {"hitRate": 0.9, "queriedTokens": 1000, "windowSeconds": 30.0}
            page["text"] = exposition(2000, 1300, divergence=150, evicted_capacity=450, never_seen=100)
            dropped = await observer.observe_prefix_cache(service, pods, now=60)
            assert dropped["hitRate"] == 0.4 and dropped["previousHitRate"] == 0.9
            assert dropped["topMissReason"] == "evicted_capacity"
            assert dropped["topMissReasonShare"] == 0.75 and "0.90 to 0.40" in dropped["message"]
            assert await observer.observe_prefix_cache(service, pods, now=70) == dropped  # kept meanwhile
            return dropped
        finally:
            await observer.close()
            await runner.cleanup()

    dropped = asyncio.run(scenario())
    schema = crd_schema.version_schema(crd_schema.load_crd())["properties"]["status"]
    status = {"prefixCache": dropped}
    assert crd_schema.schema_errors(schema, status) == []
    assert crd_schema.prune(schema, status, root=False) == status   # nothing pruned
