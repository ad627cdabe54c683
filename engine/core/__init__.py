"""The engine's torch-free core: what each step decides.

- ``constants``: names and limits shared with the CLI and the operator (one source each).
- ``kv_layout``: the KV-cache memory formula (``KVLayout``; ``HybridKVLayout`` for mixed
  full / sliding-window layers), shared with the planner.
- ``weight_quant``: a checkpoint's FP8 weight format from config.json, shared with the planner.
- ``step_cost``: FLOPs and memory traffic of a step, for the MFU metrics and the planner's latency.
- ``block_hash``: hash-chained block hashes for prefix caching.
- ``block_pool``: blocks, ref counts, the LRU free queue and the hash -> block map.
- ``kv_cache_manager``: per-request block tables and prefix-cache lookups.
- ``hybrid_kv_cache_manager``: a table per group of layers (full attention / sliding window).
- ``request`` / ``request_queue``: a request's state; FCFS and priority queues.
- ``scheduler``: continuous batching, chunked prefill, preemption -> ``SchedulerOutput``.
- ``kv_transfer``: the offload saves and loads a step carries to the runner.
- ``kv_event_log``: what each step changed in each KV tier, for the KV-event publisher.

May import: the standard library, ``kvpilot.engine.config``, ``kvpilot.engine.sampling_params``
and ``kvpilot.engine.model.hf_config`` (all torch-free). Never torch, numpy or tokenizers:
``tests/test_layering.py`` imports every module here with torch blocked.
"""
