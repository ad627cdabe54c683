"""Every ``kvpilot serve`` flag in one table: vLLM's ``vllm serve`` flags, honoured or
refused, and kvpilot's own.

A vLLM command line should carry over by changing only the binary name. Every vLLM flag
here is either honoured (``kvpilot serve`` parses it and does what vLLM does, as its help
says) or refused: kvpilot has no such feature, so the flag stops start-up with one line
naming it and saying why, instead of argparse's "unrecognized arguments" or, worse,
being silently ignored. kvpilot's own flags (``_k``) sit beside the vLLM flags of their
concern.

The parser (``args.make_serve_parser``), its ``--help`` text and the two flag tables of
``docs/serving.md`` (``render_serve_flags``, ``render_markdown``) are built from this table, and
``tests/server/test_vllm_flags.py`` exercises every row; a row's fields are described in
``flag_table.Flag``. An engine flag names its ``EngineArgs`` field (``engine=``) and takes
its default from there.

Torch-free: the operator parses engine arguments with the same parser.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from kvpilot.contract.constants import (
    ATTENTION_BACKENDS,
    KV_CACHE_DTYPES,
    MAX_TENSOR_PARALLEL_SIZE,
    MODEL_DTYPES,
    OFFLOAD_BACKENDS,
)
from kvpilot.engine.config import REASONING_PARSERS, STRUCTURED_OUTPUT_BACKENDS
from kvpilot.engine.core.request_queue import SCHEDULING_POLICIES
from kvpilot.engine.engine_args import DEFAULT_CPU_KV_CACHE_BYTES, DEFAULT_MAX_NUM_BATCHED_TOKENS
from kvpilot.engine.lora.config import LORA_DTYPES, RUNTIME_LORA_UPDATING_ENV
from kvpilot.engine.server.arg_types import (
    dtype,
    fraction,
    json_object,
    json_string_list,
    kv_events_config,
    kv_transfer_config,
    lora_module,
    max_logprobs,
    non_negative_float,
    non_negative_int,
    parse_size,
    port,
    positive_float,
    positive_int,
    speculative_config,
    structured_outputs_config,
)
from kvpilot.engine.server.config import (
    API_KEY_ENV,
    DEFAULT_BODY_READ_TIMEOUT,
    DEFAULT_ENGINE_HANG_TIMEOUT,
    DEFAULT_HEADER_READ_TIMEOUT,
    DEFAULT_LIMIT_CONCURRENCY,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    DEFAULT_SHUTDOWN_TIMEOUT,
    DEFAULT_TIMEOUT_KEEP_ALIVE,
    DEFAULT_TOKENIZER_THREADS,
    ServerConfig,
)
from kvpilot.engine.server.flag_table import (
    HONOURED,
    POSITIONAL_MODEL,
    REFUSED,
    Flag,
    OnOff,
    refusal_message,
    render_flags_table,
    render_refused_table,
    section,
)
from kvpilot.engine.server.parsing.tool_parsers import TOOL_CALL_EXTRACTORS

__all__ = ["HONOURED", "REFUSED", "SERVE_FLAGS", "VLLM_FLAGS", "Flag", "honoured", "refusal_message",
           "refused", "render_markdown", "render_serve_flags"]

_SERVER = ServerConfig()     # the server's defaults, stated once there
LOAD_FORMATS = ("auto", "safetensors", "gguf")
TOKENIZER_MODES = ("auto", "hf")
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def _h(name: str, help: str, **spec: Any) -> Flag:
    """A vLLM flag kvpilot honours."""
    return Flag(name=name, help=help, **spec)


def _k(name: str, help: str, **spec: Any) -> Flag:
    """A flag of kvpilot's own (not one of vLLM's)."""
    return Flag(name=name, help=help, vllm=False, **spec)


def _r(name: str, why: str, *aliases: str) -> Flag:
    """A vLLM flag kvpilot refuses, and why."""
    return Flag(name=name, help=why, status=REFUSED, aliases=aliases)


_on = {"action": "store_true"}
_PARALLEL = "a replica is tensor x pipeline parallel ranks (no data or expert parallelism; several nodes start as a LeaderWorkerSet group); scale with replicas"
_MM = "kvpilot serves text-only models (no multimodal inputs)"
_HUB = "kvpilot loads local checkpoint directories only (no Hugging Face Hub downloads)"
_RUNTIME = "kvpilot has no such runtime mode"
_POOLING = "kvpilot only generates text (no pooling / embedding tasks)"
_TRACES = "OpenTelemetry tracing is not implemented (metrics: /metrics)"

SERVE_FLAGS: tuple[Flag, ...] = (
    *section(
        "model",
        _h(POSITIONAL_MODEL, "the model directory as a positional argument, as in `vllm serve MODEL` (same as --model)"),
        _h("--model", "local Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json), or a GGUF file (or a directory holding one); `demo`: the random-weight demo model",
           metavar="PATH", default_text="the built-in SmolLM2-135M-Instruct (Q4_1 GGUF)"),
        _h("--served-model-name", "model names accepted in requests; the first is reported in responses and in the metrics' model_name label",
           nargs="+", metavar="NAME", default_text="from --model"),
        _h("--tokenizer", "directory holding tokenizer.json / tokenizer_config.json (or a GGUF file whose vocabulary to use), when it is not --model",
           engine="tokenizer", metavar="PATH", default_text="--model"),
        _h("--hf-config-path", "directory whose config.json describes a GGUF model instead of the file's metadata",
           engine="hf_config_path", metavar="PATH", default_text="the GGUF metadata"),
        _h("--tokenizer-mode", "`auto` and `hf` both read the fast tokenizer (tokenizer.json), the only kind kvpilot reads",
           choices=TOKENIZER_MODES, default="auto"),
        _h("--trust-remote-code", "accepted: kvpilot never runs code from a checkpoint (built-in architectures only), so there is nothing to trust", **_on),
        _h("--load-format", "weight format: safetensors checkpoints and GGUF files are told apart by --model (pickled weights are refused)",
           choices=LOAD_FORMATS, default="auto"),
        _h("--dtype", "weight and activation dtype: `auto` is the checkpoint's dtype on a GPU; on CPU bfloat16 where the CPU has AVX512-BF16 or AMX, else float32 (a GGUF file's decode tokens then still take 8-bit activations; `float32` keeps them exact); vLLM's `half` / `float` are accepted",
           engine="dtype", type=dtype, choices=MODEL_DTYPES),
        _h("--max-model-len", "context length (prompt + output)", engine="max_model_len", type=positive_int,
           metavar="TOKENS", default_text="the model's"),
        _h("--seed", "the engine's global random seed (requests without a seed of their own sample from it)",
           engine="seed", type=int),
        _h("--generation-config", "sampling defaults for requests that omit them: `auto` = the checkpoint's generation_config.json, `vllm` = none, or a directory holding one",
           engine="generation_config", metavar="{auto,vllm,DIR}"),
        _h("--override-generation-config", "JSON object of sampling defaults (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) merged over --generation-config's",
           engine="override_generation_config", type=json_object, metavar="JSON"),
        _h("--max-logprobs", "most logprobs / top_logprobs a request may ask for (`-1`: the vocabulary)",
           engine="max_logprobs", type=max_logprobs, metavar="N"),
        _r("--quantization", "the checkpoint's own quantization_config is served (FP8: compressed-tensors or fp8); kvpilot does not quantize 16-bit weights itself (the fp8 KV cache is --kv-cache-dtype)", "-q"),
        _r("--revision", _HUB),
        _r("--code-revision", _HUB),
        _r("--tokenizer-revision", _HUB),
        _r("--download-dir", _HUB),
        _r("--hf-token", _HUB),
        _r("--hf-overrides", "config.json overrides are not implemented; edit the checkpoint's config.json"),
        _r("--rope-scaling", "config.json overrides are not implemented; set rope_scaling in config.json"),
        _r("--rope-theta", "config.json overrides are not implemented; set rope_theta in config.json"),
        _r("--skip-tokenizer-init", "the engine always needs the tokenizer (stop strings, detokenization)"),
        _r("--model-impl", "kvpilot has one model implementation per architecture"),
        _r("--task", _POOLING),
        _r("--runner", _POOLING),
        _r("--convert", _POOLING),
        _r("--override-pooler-config", _POOLING),
        _r("--enable-prompt-embeds", "prompts are text or token ids (no embedding inputs)"),
        _r("--logits-processors", "custom logits processor plugins are not supported"),
        _r("--disable-sliding-window", "sliding-window layers always attend over their window, as the checkpoint was trained"),
    ),
    *section(
        "KV cache",
        _h("--block-size", "tokens per KV cache block", engine="block_size", type=positive_int, metavar="TOKENS"),
        _h("--gpu-memory-utilization", "CUDA only: share of GPU memory for weights + activations + KV cache; the KV cache gets what profiling leaves",
           engine="gpu_memory_utilization", type=fraction, metavar="FRACTION"),
        _h("--kv-cache-memory-bytes", "KV cache size in bytes (`4Gi`, `512M`: suffixes K/M/G or Ki/Mi/Gi); on CUDA the engine still profiles and refuses to start if this exceeds what profiling leaves at --gpu-memory-utilization",
           engine="kv_cache_memory_bytes", type=parse_size, metavar="SIZE",
           default_text=f"CPU: {DEFAULT_CPU_KV_CACHE_BYTES >> 30} GiB; CUDA: what profiling leaves"),
        _k("--clamp-kv-cache-memory", "when --kv-cache-memory-bytes exceeds what profiling leaves, shrink the KV cache to the profiled figure (with a warning) instead of failing",
           engine="clamp_kv_cache_memory", **_on),
        _h("--num-gpu-blocks-override", "exact number of KV cache blocks (overrides every sizing rule)",
           engine="num_gpu_blocks", type=positive_int, metavar="N"),
        _h("--kv-cache-dtype", "KV cache element type: `auto` = the model dtype; `fp8` (= `fp8_e4m3`) and `fp8_e5m2` store one byte per element",
           engine="kv_cache_dtype", choices=KV_CACHE_DTYPES),
        _h("--calculate-kv-scales", "fp8 KV cache: compute the scales from the first batch (else 1.0 or the checkpoint's)",
           engine="calculate_kv_scales", **_on),
        _h("--enable-prefix-caching", "reuse the KV blocks of identical prompt prefixes across requests",
           engine="enable_prefix_caching", action=OnOff),
        _k("--prefix-caching-hash-seed", "seed of the prefix-cache hash chain", engine="prefix_caching_hash_seed",
           metavar="SEED", default_text="the engine's"),
        _k("--token-granular-reuse", "the block after a prefix hit copies the KV of the tokens it shares with a block a finished request left (its last partial block, or a block that diverges mid-way) instead of computing them; cached_tokens then counts them (off by default: vLLM and KV-event routers count whole blocks). Off on its own where a copy cannot hold: tensor / pipeline parallel, hybrid or all-sliding-window models",
           engine="token_granular_reuse", action=OnOff),
        _k("--explain-prefix-misses", "classify each request's uncached prompt tokens by why they missed the prefix cache (kvpilot:prefix_cache_miss_tokens_total, the request log line, the explain endpoint); a bounded side index that never changes a hit",
           engine="explain_prefix_misses", action=OnOff),
        _r("--swap-space", "preempted requests are recomputed, never swapped to host memory"),
        _r("--cpu-offload-gb", "weights always live on the device (KV offloading is --kv-offloading-size)"),
        _r("--prefix-caching-hash-algo", "the prefix hash is always sha256 (seed it with --prefix-caching-hash-seed)"),
        _h("--kv-transfer-config", "KV blocks exchanged with other engines (disaggregated prefill and decode): vLLM's JSON with `kv_connector`, `kv_role` (`kv_producer` / `kv_consumer` / `kv_both`), `kv_rank`, `kv_parallel_size`, `kv_ip`, `kv_port`, `kv_buffer_size`, `kv_buffer_device`, `kv_connector_extra_config`, `engine_id`, `kv_load_failure_policy` (`recompute` / `fail`); a connector this engine does not run stops start-up with the list of those it does (KV offloading and LMCache are --kv-offloading-backend)",
           engine="kv_transfer_config", type=kv_transfer_config, metavar="JSON"),
        _h("--kv-events-config", "vLLM's KV-cache events (BlockStored / BlockRemoved / AllBlocksCleared, map form) on a ZeroMQ PUB socket with a replay socket, for llm-d and vllm-router's kv_aware policy: JSON with `enable_kv_cache_events`, `publisher` (`zmq` / `null`), `endpoint` (`tcp://*:5557`), `replay_endpoint`, `buffer_steps`, `hwm`, `max_queue_size`, `topic`",
           engine="kv_events_config", type=kv_events_config, metavar="JSON"),
    ),
    *section(
        "KV offloading",
        _h("--kv-offloading-size", "host memory for offloaded KV blocks, in GiB (`0`: the disk tier only)",
           engine="kv_offloading_size", type=non_negative_float, metavar="GiB", default_text="off"),
        _h("--kv-offloading-backend", "`native` (host + disk tiers) or `lmcache` (LMCache's tiers; `pip install 'kvpilot[lmcache]'`)",
           engine="kv_offloading_backend", choices=OFFLOAD_BACKENDS),
        _k("--kv-offloading-disk-path", "directory of a disk tier below the host tier (give its size too)",
           engine="kv_offloading_disk_path", metavar="DIR"),
        _k("--kv-offloading-disk-size", "size of the disk tier, in GiB", engine="kv_offloading_disk_size",
           type=non_negative_float, metavar="GiB"),
    ),
    *section(
        "scheduler",
        _h("--max-num-seqs", "most sequences in one batch", engine="max_num_seqs", type=positive_int, metavar="N"),
        _h("--max-num-batched-tokens", "token budget of one engine step (chunked prefill)",
           engine="max_num_batched_tokens", type=positive_int, metavar="TOKENS",
           default_text=f"{DEFAULT_MAX_NUM_BATCHED_TOKENS}, or --max-model-len if larger without chunked prefill"),
        _h("--stream-interval", "output tokens a stream gathers before a chunk is sent (its first token and its end go at once): fewer SSE frames and less API-process work per token, at the cost of burstier streams",
           engine="stream_interval", type=positive_int, metavar="TOKENS"),
        _h("--enable-chunked-prefill", "split long prompts across steps; without it a prompt is admitted only when it fits one step's token budget whole",
           engine="enable_chunked_prefill", action=OnOff),
        _h("--scheduling-policy", "`fcfs`, or `priority`: requests' `priority` field (lower first) orders the queue, and a waiting request preempts running ones of lower priority",
           engine="scheduling_policy", choices=SCHEDULING_POLICIES),
        _k("--max-waiting-requests", "sequences (a request's prompts × n) allowed to wait for a batch slot; a request that would pass it gets 429 with Retry-After (`0`: no waiting, only free slots)",
           type=non_negative_int, metavar="N", default=_SERVER.max_waiting_requests),
        _r("--async-scheduling", "the engine steps synchronously"),
        _r("--max-num-partial-prefills", "partial-prefill limits are not implemented"),
        _r("--long-prefill-token-threshold", "partial-prefill limits are not implemented"),
        _r("--num-lookahead-slots", "a speculative proposer's KV slots are allocated from --speculative-config"),
        _r("--scheduler-cls", "the scheduler is not pluggable"),
    ),
    *section(
        "device and parallelism",
        _h("--device", "`auto` (CUDA when present, else CPU), `cpu`, `cuda` or `cuda:N`", engine="device", metavar="DEVICE"),
        _k("--attention-backend", "attention implementation: `auto` = triton on CUDA, elsewhere cpu (decode rows on a C++ kernel built on first use) where it builds, else torch (pure torch)",
           engine="attention_backend", choices=ATTENTION_BACKENDS),
        _h("--enforce-eager", "CUDA: run every step eagerly, without CUDA graphs (by default decode batches of 1, 2, 4, 8, 16, ... up to --max-num-seqs replay captured graphs)",
           engine="enforce_eager", **_on),
        _h("--tensor-parallel-size", f"GPUs per model replica (1 to {MAX_TENSOR_PARALLEL_SIZE}, one node): Megatron-style tensor parallelism, one process per GPU; N must split the attention heads",
           engine="tensor_parallel_size", aliases=("-tp",), type=positive_int, metavar="N"),
        _h("--pipeline-parallel-size", "pipeline stages per model replica: the decoder layers split as vLLM splits them, --tensor-parallel-size ranks each, one process per GPU; each step's batch crosses the stages as microbatches in flight (one per stage, cut at request boundaries); on one host, or one LeaderWorkerSet pod per stage (LWS_LEADER_ADDRESS, LWS_GROUP_SIZE, LWS_WORKER_INDEX, KVPILOT_RENDEZVOUS_PORT; the leader serves, the workers run their stages)",
           engine="pipeline_parallel_size", aliases=("-pp",), type=positive_int, metavar="N"),
        _r("--data-parallel-size", _PARALLEL, "-dp"),
        _r("--data-parallel-size-local", _PARALLEL),
        _r("--data-parallel-address", _PARALLEL),
        _r("--data-parallel-rpc-port", _PARALLEL),
        _r("--data-parallel-backend", _PARALLEL),
        _r("--enable-expert-parallel", _PARALLEL),
        _r("--distributed-executor-backend", _PARALLEL),
        _r("--headless", _PARALLEL),
        _r("--api-server-count", "one API server process serves each replica"),
        _r("--worker-cls", "the worker is not pluggable"),
        _r("--compilation-config", "the model runs eagerly (no torch.compile / CUDA graph settings)", "-O"),
        _r("--enable-sleep-mode", _RUNTIME),
        _r("--config", "read flags from the command line (or the InferenceService resource) instead of a YAML file"),
        _h("--speculative-config", "speculative decoding, vLLM's JSON: `method` (`ngram`, `draft_model`, `eagle`, `eagle3`), `num_speculative_tokens`, `prompt_lookup_min` / `prompt_lookup_max` (n-gram; default 5), `model` (the draft model's or EAGLE head's checkpoint), `draft_tensor_parallel_size` (1), `disable_by_batch_size` (no drafts while this many requests run); greedy outputs stay token-identical, sampled ones keep the target distribution",
           engine="speculative_config", type=speculative_config, metavar="JSON", default_text="off"),
        _r("--limit-mm-per-prompt", _MM),
        _r("--mm-processor-kwargs", _MM),
        _r("--mm-processor-cache-gb", _MM),
        _r("--disable-mm-preprocessor-cache", _MM),
        _r("--allowed-local-media-path", _MM),
    ),
    *section(
        "LoRA adapters",
        _h("--enable-lora", "serve PEFT LoRA adapters (on q/k/v/o and the MLP projections) beside the base model: a request's `model` names its adapter, and requests of different adapters and of the base model share a batch",
           engine="enable_lora", **_on),
        _h("--lora-modules", "adapters loaded at start-up, each `name=path` or `{\"name\": ..., \"path\": ..., \"base_model_name\": ...}` (a PEFT directory: adapter_config.json + adapter_model.safetensors); a bad one stops start-up",
           engine="lora_modules", type=lora_module, nargs="+", metavar="NAME=PATH"),
        _h("--max-loras", "most distinct adapters in one batch (device slots; others wait)", engine="max_loras",
           type=positive_int, metavar="N"),
        _h("--max-lora-rank", "the largest adapter rank served (every slot is this wide; a larger adapter is refused)",
           engine="max_lora_rank", type=positive_int, metavar="RANK"),
        _h("--max-cpu-loras", "adapters whose weights stay in host memory (least recently used out first; read from disk again when needed); at least --max-loras",
           engine="max_cpu_loras", type=positive_int, metavar="N", default_text="--max-loras"),
        _h("--lora-dtype", "dtype of the adapter slots (`auto`: the model's)", engine="lora_dtype",
           choices=LORA_DTYPES),
        _k("--allow-runtime-lora-updating", f"serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind --api-key), as ${RUNTIME_LORA_UPDATING_ENV}=true does",
           engine="allow_runtime_lora_updating", **_on),
        _r("--fully-sharded-loras", "LoRA adapters are not implemented under tensor parallelism"),
    ),
    *section(
        "structured outputs, tools and reasoning",
        _h("--structured-outputs-config", "JSON object: `backend` (`auto` / `xgrammar`), `disable_any_whitespace` (default true: compact JSON), `reasoning_parser`, `enable_in_reasoning`",
           type=structured_outputs_config, metavar="JSON"),
        _h("--guided-decoding-backend", "older vLLM name of the structured-outputs backend", choices=STRUCTURED_OUTPUT_BACKENDS),
        _k("--structured-output-compile-timeout", "seconds a request may wait for its grammar to compile (off the step loop, on the engine's grammar thread) before it fails with a 400; the same as `compile_timeout` in --structured-outputs-config",
           type=positive_float, metavar="SECONDS", default_text="10"),
        _h("--enable-auto-tool-choice", "allow `tool_choice: auto` (the default when tools are sent): the model's text is parsed for tool calls by --tool-call-parser", **_on),
        _h("--tool-call-parser", "how tool calls are found in the model's text: `hermes` (Qwen2.5 / Qwen3 `<tool_call>` JSON) or `llama3_json`",
           choices=tuple(TOOL_CALL_EXTRACTORS)),
        _h("--exclude-tools-when-tool-choice-none", "leave `tools` out of the chat template when `tool_choice` is `none`", **_on),
        _h("--reasoning-parser", "`qwen3`: `<think>…</think>` text is returned as `reasoning_content`; structured outputs then constrain only the text after it",
           choices=REASONING_PARSERS),
        _r("--tool-parser-plugin", "tool parsers are built in (hermes, llama3_json)"),
        _r("--reasoning-parser-plugin", "reasoning parsers are built in (qwen3)"),
    ),
    *section(
        "chat",
        _h("--chat-template", "a Jinja chat template (a file, or the template itself) used instead of the checkpoint's",
           metavar="FILE_OR_TEMPLATE"),
        _h("--default-chat-template-kwargs", "JSON object of chat template variables for every request (e.g. `{\"enable_thinking\": false}`); a request's chat_template_kwargs win",
           type=json_object, metavar="JSON"),
        _r("--chat-template-content-format", "message content is rendered as a string"),
        _r("--response-role", "responses always carry the assistant role"),
        _r("--return-tokens-as-token-ids", "logprob tokens are returned as text"),
    ),
    *section(
        "HTTP server",
        # 0.0.0.0: inside a pod the server must listen on the pod IP
        _h("--host", "address to listen on (0.0.0.0 = all interfaces, as a pod needs)", default="0.0.0.0"),
        _h("--port", "TCP port to listen on", type=port, default=8000),
        _h("--api-key", "require `Authorization: Bearer KEY` on every path but the probes (/health, /livez) and /metrics; checked before the body is read (401 without reading it)", metavar="KEY",
           default_text=f"${API_KEY_ENV}, else no key"),
        _k("--metrics-require-api-key", "/metrics needs the API key too (for clusters that scrape with credentials)", **_on),
        _h("--root-path", "URL prefix under which a path-routing proxy exposes the server (FastAPI's root_path)",
           metavar="PREFIX"),
        _h("--disable-fastapi-docs", "serve no /docs, /redoc or /openapi.json", **_on),
        _h("--enable-request-id-headers", "add an `X-Request-Id` header to every response", **_on),
        _h("--enable-prompt-tokens-details", "accepted: usage always carries prompt_tokens_details.cached_tokens", **_on),
        _h("--uvicorn-log-level", "uvicorn's log level (access log at info)", choices=UVICORN_LOG_LEVELS, default="info"),
        _h("--disable-uvicorn-access-log", "no access log line per HTTP request", **_on),
        _k("--engine-in-process", "run the engine on a thread of the HTTP server's process (for debugging) instead of in its own engine core process, where HTTP, JSON and streaming never take the interpreter from the step loop", **_on),
        _k("--limit-concurrency", "most connections and requests in flight at once; beyond that uvicorn answers 503 (`0`: no limit)",
           type=non_negative_int, metavar="N", default=DEFAULT_LIMIT_CONCURRENCY),
        _k("--header-read-timeout", "seconds a client has to send a request's line and headers (on a new connection, or after the first byte of the next request on a kept-alive one); late heads get 408 and the connection is closed (`0`: no limit)",
           type=non_negative_float, metavar="SECONDS", default=DEFAULT_HEADER_READ_TIMEOUT),
        _k("--body-read-timeout", "seconds a request body may take to arrive, from the start of the request; late bodies get 408 (`0`: no limit)",
           type=non_negative_float, metavar="SECONDS", default=DEFAULT_BODY_READ_TIMEOUT),
        _k("--timeout-keep-alive", "seconds an idle kept-alive connection stays open (uvicorn's timeout_keep_alive)",
           type=positive_int, metavar="SECONDS", default=DEFAULT_TIMEOUT_KEEP_ALIVE),
        _k("--h11-max-incomplete-event-size", "most bytes of a request head the h11 parser buffers (uvicorn's setting; the httptools parser has its own bound)",
           type=positive_int, metavar="BYTES", default_text="uvicorn's (16 KiB)"),
        _r("--uds", "the server listens on TCP (--host, --port)"),
        _r("--middleware", "custom ASGI middleware is not supported"),
        _r("--enable-ssl-refresh", "TLS files are read once at start-up"),
    ),
    *section(
        "limits, probes and shutdown",
        _k("--max-request-body-bytes", "larger request bodies get 413 (a Content-Length over it before the body is read; a chunked body once it passes it; `0`: no limit)",
           type=parse_size, metavar="SIZE", default=DEFAULT_MAX_REQUEST_BODY_BYTES,
           default_text=f"{DEFAULT_MAX_REQUEST_BODY_BYTES >> 20}Mi"),
        _k("--max-stop-strings", "most stop strings one request may give (400 beyond)",
           type=positive_int, metavar="N", default=_SERVER.limits.max_stop_strings),
        _k("--max-stop-string-chars", "most characters of one stop string (400 beyond)",
           type=positive_int, metavar="N", default=_SERVER.limits.max_stop_string_chars),
        _k("--max-structured-choices", "most entries of a `choice` constraint (400 beyond)",
           type=positive_int, metavar="N", default=_SERVER.limits.max_choices),
        _k("--max-structured-output-bytes", "most bytes of one output constraint: a JSON schema (as compact JSON), regex, grammar or choice list (400 beyond)",
           type=parse_size, metavar="SIZE", default=_SERVER.limits.max_constraint_bytes,
           default_text=f"{_SERVER.limits.max_constraint_bytes >> 10}Ki"),
        _k("--max-tools", "most `tools` one chat request may give (400 beyond)",
           type=positive_int, metavar="N", default=_SERVER.limits.max_tools),
        _k("--max-tools-bytes", "most bytes of a chat request's `tools` as JSON (400 beyond)",
           type=parse_size, metavar="SIZE", default=_SERVER.limits.max_tools_bytes,
           default_text=f"{_SERVER.limits.max_tools_bytes >> 10}Ki"),
        _k("--max-sequences-per-request", "most sequences (prompts × n) one request may ask for (400 beyond); --max-waiting-requests counts sequences too",
           type=positive_int, metavar="N", default=_SERVER.limits.max_sequences_per_request),
        _k("--tokenizer-threads", "threads that tokenize prompts, render chat templates and detokenize, off the event loop",
           type=positive_int, metavar="N", default=DEFAULT_TOKENIZER_THREADS),
        _k("--engine-hang-timeout", "an engine step running longer than this with requests waiting fails readiness (/health 503) and those requests (500) until it returns (`0`: never)",
           type=non_negative_float, metavar="SECONDS", default=DEFAULT_ENGINE_HANG_TIMEOUT),
        _k("--shutdown-timeout", "on SIGTERM: /health and new requests 503 at once, requests in flight finish for up to this long, then the process exits 0",
           type=non_negative_float, metavar="SECONDS", default=DEFAULT_SHUTDOWN_TIMEOUT),
    ),
    *section(
        "CORS (browser clients)",
        _h("--allowed-origins", "JSON list of origins allowed to call the API", type=json_string_list,
           metavar="JSON", default=_SERVER.cors.allowed_origins),
        _h("--allowed-methods", "JSON list of HTTP methods allowed cross-origin", type=json_string_list,
           metavar="JSON", default=_SERVER.cors.allowed_methods),
        _h("--allowed-headers", "JSON list of request headers allowed cross-origin", type=json_string_list,
           metavar="JSON", default=_SERVER.cors.allowed_headers),
        _h("--allow-credentials", "allow cross-origin requests with credentials (cookies, auth headers)", **_on),
    ),
    *section(
        "TLS (serve HTTPS)",
        _h("--ssl-keyfile", "the server's private key (serve HTTPS)", metavar="FILE"),
        _h("--ssl-certfile", "the server's certificate (chain)", metavar="FILE"),
        _h("--ssl-ca-certs", "CA certificates that client certificates are checked against", metavar="FILE"),
        _h("--ssl-cert-reqs", "client certificates: 0 = not asked, 1 = optional, 2 = required (Python's ssl.CERT_NONE / CERT_OPTIONAL / CERT_REQUIRED)",
           type=int, choices=(0, 1, 2), metavar="{0,1,2}", default=0),
    ),
    *section(
        "logging and metrics",
        _h("--enable-log-requests", "an INFO line per request: id, prompt size and text, sampling parameters",
           default=_SERVER.enable_log_requests, **_on),
        _h("--disable-log-requests", "no line per request (the default; vLLM's older flag)", action="store_false",
           dest="enable_log_requests"),
        _h("--max-log-len", "most prompt characters or token ids a request's log line shows; every other field of the line (stop strings, token-id lists, constraints) is cut to it too", type=positive_int, metavar="N",
           default=_SERVER.max_log_len, default_text=f"{_SERVER.max_log_len}"),
        _k("--log-stats-interval", "seconds between the INFO throughput / KV usage lines (`0`: off); nothing is logged while idle",
           type=non_negative_float, metavar="SECONDS", default=_SERVER.log_stats_interval),
        _h("--disable-log-stats", "no periodic stats line (same as --log-stats-interval 0); /metrics still serves", **_on),
        _h("--kv-cache-metrics", "export sampled KV block residency histograms (vllm:kv_block_lifetime_seconds, ..._idle_before_evict_seconds, ..._reuse_gap_seconds)",
           engine="kv_cache_metrics", **_on),
        _h("--kv-cache-metrics-sample", "share of allocated KV blocks --kv-cache-metrics follows",
           engine="kv_cache_metrics_sample", type=fraction, metavar="FRACTION"),
        _h("--enable-mfu-metrics", "export model-shape estimates of FLOPs and bytes read / written per GPU (vllm:estimated_flops_per_gpu_total, ...)",
           engine="enable_mfu_metrics", **_on),
        _r("--enable-log-outputs", "generated text is not logged"),
        _r("--otlp-traces-endpoint", _TRACES),
        _r("--collect-detailed-traces", _TRACES),
        _r("--show-hidden-metrics-for-version", "every metric is always shown"),
    ),
)

VLLM_FLAGS: tuple[Flag, ...] = tuple(f for f in SERVE_FLAGS if f.vllm)


def honoured() -> list[Flag]:
    """The vLLM flags kvpilot honours."""
    return [f for f in VLLM_FLAGS if f.status == HONOURED]


def refused() -> list[Flag]:
    """The vLLM flags kvpilot refuses."""
    return [f for f in VLLM_FLAGS if f.status == REFUSED]


def render_serve_flags() -> str:
    """The table of every flag ``kvpilot serve`` honours (docs/serving.md's serve-flags block)."""
    return (render_flags_table(SERVE_FLAGS)
            + "\n† kvpilot's own flag (not a `vllm serve` flag).\n")


def render_markdown() -> str:
    """The table of the vLLM flags kvpilot refuses (docs/serving.md's vllm-flags block)."""
    return (f"{len(honoured())} of vLLM's flags are honoured (the table above), "
            f"{len(refused())} refused:\n\n" + render_refused_table(VLLM_FLAGS))


def flag_table_blocks() -> dict[str, str]:
    """The rendered flag tables by marker name (``<!-- NAME:begin -->``)."""
    return {"serve-flags": render_serve_flags(), "vllm-flags": render_markdown()}


def update_flag_tables(text: str) -> str:
    """``text`` (a page: ``docs/serving.md``) with its rendered flag tables replaced by the
    current ones; ValueError when a pair of markers is missing."""
    for name, body in flag_table_blocks().items():
        pattern = re.compile(rf"(<!-- {name}:begin -->\n).*?(<!-- {name}:end -->)", re.DOTALL)
        if not pattern.search(text):
            raise ValueError(f"the page lacks the <!-- {name}:begin/end --> markers")
        text = pattern.sub(lambda m, body=body: m.group(1) + body + m.group(2), text)
    return text


if __name__ == "__main__":   # python -m kvpilot.engine.server.vllm_flags docs/serving.md
    page = Path(sys.argv[1])
    page.write_text(update_flag_tables(page.read_text()))
