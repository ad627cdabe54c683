"""vLLM's Prometheus metrics as its ``/metrics`` exposes them (vLLM 0.3x, V1 engine), with
their types and, where fixed, their label sets and bucket boundaries: the reference the
metric-name tests hold kvpilot's exporter to.

Gathered from vLLM's ``vllm/v1/metrics/loggers.py`` (``PrometheusStatLogger``) and its
KV-connector / MFU loggers. Counters carry ``_total`` as exposed. vLLM labels every series
``model_name`` and ``engine`` (the data-parallel engine index); kvpilot runs one engine per
process and exports ``model_name`` only, so label sets below leave ``engine`` out.
"""

from __future__ import annotations

TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
        10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
       20.0, 40.0, 80.0)
REQUEST = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
STEP_TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
RESIDENCY = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120,
             300, 600, 1200, 1800)
PREEMPTIONS = (1, 2, 3, 4, 5, 10, 20)
N = (1, 2, 5, 10, 20)
TOKENS = "1-2-5 up to max_model_len"   # build_1_2_5_buckets(max_model_len)

# name -> (type, extra labels besides model_name, buckets or None)
VLLM_METRICS: dict[str, tuple[str, tuple[str, ...], tuple | str | None]] = {
    "vllm:num_requests_running": ("gauge", (), None),
    "vllm:num_requests_waiting": ("gauge", (), None),
    "vllm:num_requests_waiting_by_reason": ("gauge", ("reason",), None),
    "vllm:engine_sleep_state": ("gauge", ("sleep_state",), None),
    "vllm:kv_cache_usage_perc": ("gauge", (), None),
    "vllm:cache_config_info": ("gauge", None, None),   # labels: the cache config's fields
    # no model_name: vLLM's labels are exactly these (tests/lora/test_server.py checks them)
    "vllm:lora_requests_info": ("gauge", None, None),
    "vllm:prefix_cache_queries_total": ("counter", (), None),
    "vllm:prefix_cache_hits_total": ("counter", (), None),
    "vllm:external_prefix_cache_queries_total": ("counter", (), None),
    "vllm:external_prefix_cache_hits_total": ("counter", (), None),
    "vllm:mm_cache_queries_total": ("counter", (), None),
    "vllm:mm_cache_hits_total": ("counter", (), None),
    "vllm:corrupted_requests_total": ("counter", (), None),
    "vllm:num_preemptions_total": ("counter", (), None),
    "vllm:prompt_tokens_total": ("counter", (), None),
    "vllm:prompt_tokens_by_source_total": ("counter", ("source",), None),
    "vllm:prompt_tokens_cached_total": ("counter", (), None),
    "vllm:prompt_tokens_recomputed_total": ("counter", (), None),
    "vllm:generation_tokens_total": ("counter", (), None),
    "vllm:request_success_total": ("counter", ("finished_reason",), None),
    "vllm:request_prompt_tokens": ("histogram", (), TOKENS),
    "vllm:request_generation_tokens": ("histogram", (), TOKENS),
    "vllm:iteration_tokens_total": ("histogram", (), STEP_TOKENS),
    "vllm:request_max_num_generation_tokens": ("histogram", (), TOKENS),
    "vllm:request_params_n": ("histogram", (), N),
    "vllm:request_params_max_tokens": ("histogram", (), TOKENS),
    "vllm:time_to_first_token_seconds": ("histogram", (), TTFT),
    "vllm:inter_token_latency_seconds": ("histogram", (), ITL),
    "vllm:request_time_per_output_token_seconds": ("histogram", (), ITL),
    "vllm:e2e_request_latency_seconds": ("histogram", (), REQUEST),
    "vllm:request_queue_time_seconds": ("histogram", (), REQUEST),
    "vllm:request_inference_time_seconds": ("histogram", (), REQUEST),
    "vllm:request_prefill_time_seconds": ("histogram", (), REQUEST),
    "vllm:request_decode_time_seconds": ("histogram", (), REQUEST),
    "vllm:request_prefill_kv_computed_tokens": ("histogram", (), TOKENS),
    "vllm:request_num_preemptions": ("histogram", (), PREEMPTIONS),
    "vllm:kv_block_lifetime_seconds": ("histogram", (), RESIDENCY),
    "vllm:kv_block_idle_before_evict_seconds": ("histogram", (), RESIDENCY),
    "vllm:kv_block_reuse_gap_seconds": ("histogram", (), RESIDENCY),
    "vllm:estimated_flops_per_gpu_total": ("counter", (), None),
    "vllm:estimated_read_bytes_per_gpu_total": ("counter", (), None),
    "vllm:estimated_write_bytes_per_gpu_total": ("counter", (), None),
    "vllm:kv_offload_total_bytes_total": ("counter", ("transfer_type",), None),
    # vLLM PR #56318 (vllm/v1/metrics/cache_hit_source.py: CacheHitSource): the cached
    # prompt tokens by tier, device / host / p2p / disk / external_unspecified, summing to
    # vllm:prompt_tokens_cached_total, counted at admission.
    "vllm:prompt_tokens_cached_by_source_total": ("counter", ("source",), None),
    # vLLM PR #55812: one per rejected frontend admission attempt (n > 1 counts once), by
    # the queue limit that refused it (vLLM's: max_num_queued_reqs / max_num_queued_tokens,
    # HTTP 503; kvpilot's: --max-waiting-requests, HTTP 429).
    "vllm:admission_rejections_total": ("counter", ("reason",), None),
    # Named by issue 47; no vLLM source or pull request read for it defines it (vLLM's KV
    # cache watermark, PR #44594, adds no metric; its text watermarking is a sampling
    # feature): its type and meaning are unknown, see NOT_EXPORTED.
    "vllm:watermark_requests": ("unknown", None, None),
    "vllm:spec_decode_num_drafts_total": ("counter", (), None),
    "vllm:spec_decode_num_draft_tokens_total": ("counter", (), None),
    "vllm:spec_decode_num_accepted_tokens_total": ("counter", (), None),
    "vllm:spec_decode_num_accepted_tokens_per_pos_total": ("counter", ("position",), None),
}

# vLLM's names that do not apply to kvpilot's engine (text-only, no sleep mode), and
# applicable names kvpilot does not export, with why.
NOT_APPLICABLE = {
    "vllm:engine_sleep_state": "sleep mode",
    "vllm:mm_cache_queries_total": "multimodal inputs",
    "vllm:mm_cache_hits_total": "multimodal inputs",
}
NOT_EXPORTED: dict[str, str] = {
    "vllm:watermark_requests": "not found in vLLM's source or pull requests (searched: the metric "
                               "loggers, the KV-cache watermark of PR #44594, the text "
                               "watermarking of vLLM 0.30); kvpilot does not invent a meaning for it",
}
