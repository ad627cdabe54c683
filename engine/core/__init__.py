"""The engine's torch-free core: what each step decides (the scheduler side).

- ``block_hash``: hash-chained block hashes for prefix caching.
- ``block_pool``: blocks, ref counts, the LRU free queue and the hash -> block map.
- ``kv_cache_manager``: per-request block tables and prefix-cache lookups.
- ``hybrid_kv_cache_manager``: a table per group of layers (full attention / sliding window).
- ``request`` / ``request_queue``: a request's state; FCFS and priority queues.
- ``scheduler``: continuous batching, chunked prefill, preemption -> ``SchedulerOutput``.
- ``kv_transfer``: the offload saves and loads a step carries to the runner.
- ``kv_event_log``: what each step changed in each KV tier, for the KV-event publisher.
- ``spec_stats``: speculative decoding's counters of verified drafts (``vllm:spec_decode_*``).

What the engine shares with the planner (the KV formula, the config.json reader, the
shared constants, ...) is ``kvpilot.contract``.

May import: the standard library, ``kvpilot.contract``, ``kvpilot.engine.config`` and
``kvpilot.engine.sampling_params`` (all torch-free). Never torch, numpy or tokenizers, the
model side, the server or the operator: ``tests/structure/test_layering.py`` imports
every module here with torch and numpy blocked, and checks the import graph.
"""
