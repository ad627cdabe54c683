"""vLLM's ``vllm serve`` flags and what ``kvpilot serve`` does with each: one table.

A vLLM command line should carry over by changing only the binary name. Every flag in
``VLLM_FLAGS`` is either honoured (``kvpilot serve`` parses it and does what vLLM does,
see the meaning) or refused: kvpilot has no such feature, so the flag stops start-up
with one line naming it and saying why, instead of argparse's "unrecognized arguments"
or, worse, being silently ignored. The README's vLLM flag table is rendered from this
one (``render_markdown``), and ``tests/server/test_vllm_flags.py`` exercises every row.

Torch-free: the operator parses engine arguments with the same parser.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

HONOURED = "honoured"
REFUSED = "refused"


@dataclass(frozen=True, slots=True)
class VLLMFlag:
    """One ``vllm serve`` flag.

    Args:
        name: the long option (``--enable-lora``), or ``MODEL`` for vLLM's positional
            model argument.
        status: ``HONOURED`` or ``REFUSED``.
        meaning: what it does in kvpilot, or (refused) why kvpilot cannot honour it.
        aliases: vLLM's short forms (``-tp``).
    """

    name: str
    status: str
    meaning: str
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.status not in (HONOURED, REFUSED):
            raise ValueError(f"{self.name}: status must be {HONOURED!r} or {REFUSED!r}")

    @property
    def option_strings(self) -> tuple[str, ...]:
        return (self.name, *self.aliases) if self.name.startswith("-") else self.aliases


def _h(name: str, meaning: str, *aliases: str) -> VLLMFlag:
    return VLLMFlag(name, HONOURED, meaning, aliases)


def _r(name: str, meaning: str, *aliases: str) -> VLLMFlag:
    return VLLMFlag(name, REFUSED, meaning, aliases)


_LORA = "LoRA adapters are not implemented"
_SPEC = "speculative decoding is not implemented"
_PARALLEL = "a replica is one node's tensor-parallel GPUs (no pipeline, data or expert parallelism); scale with replicas"
_MM = "kvpilot serves text-only models (no multimodal inputs)"
_HUB = "kvpilot loads local checkpoint directories only (no Hugging Face Hub downloads)"
_RUNTIME = "kvpilot has no such runtime mode"

VLLM_FLAGS: tuple[VLLMFlag, ...] = (
    # ---- model and weights
    _h("MODEL", "positional model argument (`vllm serve MODEL`): a local checkpoint directory, same as --model"),
    _h("--model", "local HF checkpoint directory (safetensors + tokenizer.json); default: the demo model"),
    _h("--served-model-name", "names accepted in `model`; the first is reported and labels the metrics"),
    _h("--tokenizer", "directory holding tokenizer.json / tokenizer_config.json when it is not --model"),
    _h("--tokenizer-mode", "`auto` and `hf` (the fast tokenizer.json, the only kind kvpilot reads)"),
    _h("--trust-remote-code", "accepted: kvpilot never runs checkpoint code (built-in architectures only), so there is nothing to trust"),
    _h("--load-format", "`auto` and `safetensors` (kvpilot loads safetensors only; pickled weights are refused)"),
    _h("--dtype", "`auto`, `float32`/`float`, `float16`/`half`, `bfloat16`"),
    _h("--max-model-len", "context length (prompt + output)"),
    _h("--seed", "the engine's global seed"),
    _h("--generation-config", "`auto`: the checkpoint's generation_config.json sampling defaults apply to requests that omit them; `vllm`: none; or a directory holding generation_config.json"),
    _h("--override-generation-config", "JSON object of sampling defaults, merged over --generation-config's"),
    _h("--max-logprobs", "most logprobs / top_logprobs a request may ask for (`-1`: the vocabulary)"),
    _h("--enforce-eager", "CUDA: no CUDA graphs (decode batches otherwise replay graphs captured for 1, 2, 4, 8, 16, ... up to --max-num-seqs)"),
    _h("--device", "`auto`, `cpu`, `cuda`, `cuda:N`"),
    _r("--quantization", "the checkpoint's own quantization_config is served (FP8: compressed-tensors or fp8); kvpilot does not quantize 16-bit weights itself (the fp8 KV cache is --kv-cache-dtype)", "-q"),
    _r("--revision", _HUB),
    _r("--code-revision", _HUB),
    _r("--tokenizer-revision", _HUB),
    _r("--download-dir", _HUB),
    _r("--hf-token", _HUB),
    _r("--hf-config-path", _HUB),
    _r("--hf-overrides", "config.json overrides are not implemented; edit the checkpoint's config.json"),
    _r("--rope-scaling", "config.json overrides are not implemented; set rope_scaling in config.json"),
    _r("--rope-theta", "config.json overrides are not implemented; set rope_theta in config.json"),
    _r("--skip-tokenizer-init", "the engine always needs the tokenizer (stop strings, detokenization)"),
    _r("--model-impl", "kvpilot has one model implementation per architecture"),
    _r("--task", "kvpilot only generates text (no pooling / embedding tasks)"),
    _r("--runner", "kvpilot only generates text (no pooling / embedding tasks)"),
    _r("--convert", "kvpilot only generates text (no pooling / embedding tasks)"),
    _r("--override-pooler-config", "kvpilot only generates text (no pooling / embedding tasks)"),
    _r("--enable-prompt-embeds", "prompts are text or token ids (no embedding inputs)"),
    _r("--logits-processors", "custom logits processor plugins are not supported"),
    _r("--disable-sliding-window", "sliding-window layers always attend over their window, as the checkpoint was trained"),
    # ---- KV cache
    _h("--block-size", "tokens per KV block"),
    _h("--gpu-memory-utilization", "CUDA: share of GPU memory for weights + activations + KV cache"),
    _h("--kv-cache-memory-bytes", "KV cache size in bytes (`4Gi`, `512M`)"),
    _h("--num-gpu-blocks-override", "exact number of KV blocks, overriding profiling"),
    _h("--kv-cache-dtype", "`auto`, `fp8` / `fp8_e4m3`, `fp8_e5m2`"),
    _h("--calculate-kv-scales", "compute fp8 KV scales from the first batch"),
    _h("--enable-prefix-caching", "prefix caching on (the default) / off with --no-enable-prefix-caching"),
    _h("--kv-offloading-size", "GiB of host memory for offloaded KV blocks"),
    _h("--kv-offloading-backend", "`native` or `lmcache`"),
    _r("--swap-space", "preempted requests are recomputed, never swapped to host memory"),
    _r("--cpu-offload-gb", "weights always live on the device (KV offloading is --kv-offloading-size)"),
    _r("--prefix-caching-hash-algo", "the prefix hash is always sha256 (seed it with --prefix-caching-hash-seed)"),
    _r("--kv-transfer-config", "KV transfer between instances (disaggregated prefill) is not implemented; share prefixes with --kv-offloading-backend lmcache"),
    _h("--kv-events-config", "vLLM's KV-cache events (BlockStored / BlockRemoved / AllBlocksCleared, map form) on a ZeroMQ PUB socket with a replay socket, for llm-d and vllm-router's kv_aware policy"),
    # ---- scheduler
    _h("--max-num-seqs", "sequences per batch"),
    _h("--max-num-batched-tokens", "token budget of one step"),
    _h("--enable-chunked-prefill", "on by default; --no-enable-chunked-prefill admits a prompt only when it fits one step whole"),
    _h("--scheduling-policy", "`fcfs` or `priority` (requests' `priority` field; lower runs first and preempts running lower-priority requests)"),
    _r("--async-scheduling", "the engine steps synchronously"),
    _r("--max-num-partial-prefills", "partial-prefill limits are not implemented"),
    _r("--long-prefill-token-threshold", "partial-prefill limits are not implemented"),
    _r("--num-lookahead-slots", _SPEC),
    _r("--scheduler-cls", "the scheduler is not pluggable"),
    # ---- parallelism and runtime
    _h("--tensor-parallel-size", "GPUs per replica, 1 to 8 (one node): Megatron-style tensor parallelism, one worker process per GPU", "-tp"),
    _r("--pipeline-parallel-size", _PARALLEL, "-pp"),
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
    # ---- LoRA, speculative decoding, multimodal
    _r("--enable-lora", _LORA),
    _r("--lora-modules", _LORA),
    _r("--max-loras", _LORA),
    _r("--max-lora-rank", _LORA),
    _r("--max-cpu-loras", _LORA),
    _r("--lora-dtype", _LORA),
    _r("--fully-sharded-loras", _LORA),
    _r("--speculative-config", _SPEC),
    _r("--limit-mm-per-prompt", _MM),
    _r("--mm-processor-kwargs", _MM),
    _r("--mm-processor-cache-gb", _MM),
    _r("--disable-mm-preprocessor-cache", _MM),
    _r("--allowed-local-media-path", _MM),
    # ---- structured outputs, tools, reasoning
    _h("--structured-outputs-config", "JSON: `backend` (`auto` / `xgrammar`), `disable_any_whitespace`, `reasoning_parser`, `enable_in_reasoning`"),
    _h("--guided-decoding-backend", "older name of the structured-outputs backend: `auto` / `xgrammar`"),
    _h("--enable-auto-tool-choice", "`tool_choice: auto`: the model's text is parsed for tool calls (needs --tool-call-parser)"),
    _h("--tool-call-parser", "`hermes` (Qwen2.5/Qwen3 `<tool_call>` JSON) or `llama3_json`"),
    _h("--exclude-tools-when-tool-choice-none", "leave `tools` out of the chat template when `tool_choice` is `none`"),
    _h("--reasoning-parser", "`qwen3`: `<think>…</think>` text is returned as `reasoning_content`; structured outputs constrain only what follows"),
    _r("--tool-parser-plugin", "tool parsers are built in (hermes, llama3_json)"),
    _r("--reasoning-parser-plugin", "reasoning parsers are built in (qwen3)"),
    # ---- chat
    _h("--chat-template", "a Jinja chat template (file path or inline) replacing the checkpoint's"),
    _h("--default-chat-template-kwargs", "JSON object of chat template variables; a request's chat_template_kwargs win"),
    _r("--chat-template-content-format", "message content is rendered as a string"),
    _r("--response-role", "responses always carry the assistant role"),
    _r("--return-tokens-as-token-ids", "logprob tokens are returned as text"),
    # ---- HTTP server
    _h("--host", "address to listen on"),
    _h("--port", "TCP port"),
    _h("--api-key", "require `Authorization: Bearer KEY` on /v1/*"),
    _h("--root-path", "URL prefix of the app behind a path-routing proxy (FastAPI's root_path)"),
    _h("--allowed-origins", "CORS: JSON list of allowed origins (default `[\"*\"]`)"),
    _h("--allowed-methods", "CORS: JSON list of allowed methods (default `[\"*\"]`)"),
    _h("--allowed-headers", "CORS: JSON list of allowed headers (default `[\"*\"]`)"),
    _h("--allow-credentials", "CORS: allow credentials"),
    _h("--ssl-keyfile", "TLS private key file (serve HTTPS)"),
    _h("--ssl-certfile", "TLS certificate file"),
    _h("--ssl-ca-certs", "CA certificates for verifying client certificates"),
    _h("--ssl-cert-reqs", "whether a client certificate is required (Python's ssl.CERT_* number)"),
    _h("--uvicorn-log-level", "uvicorn's log level"),
    _h("--disable-uvicorn-access-log", "no uvicorn access log lines"),
    _h("--disable-fastapi-docs", "no /docs, /redoc or /openapi.json"),
    _h("--enable-request-id-headers", "responses carry an `X-Request-Id` header"),
    _h("--enable-prompt-tokens-details", "accepted: usage always carries prompt_tokens_details.cached_tokens"),
    _r("--uds", "the server listens on TCP (--host, --port)"),
    _r("--middleware", "custom ASGI middleware is not supported"),
    _r("--enable-ssl-refresh", "TLS files are read once at start-up"),
    # ---- logging and observability
    _h("--enable-log-requests", "an INFO line per request (id, prompt size, sampling parameters)"),
    _h("--disable-log-requests", "no per-request log lines (the default; vLLM's older flag)"),
    _h("--max-log-len", "most prompt characters / token ids printed per logged request"),
    _h("--disable-log-stats", "no periodic stats line (/metrics still serves)"),
    _h("--kv-cache-metrics", "sampled KV block residency histograms: lifetime, idle before eviction, reuse gaps"),
    _h("--kv-cache-metrics-sample", "share of allocated KV blocks --kv-cache-metrics follows (default 0.01)"),
    _h("--enable-mfu-metrics", "FLOPs and bytes read / written per GPU, estimated from the model's shape, as counters"),
    _r("--enable-log-outputs", "generated text is not logged"),
    _r("--otlp-traces-endpoint", "OpenTelemetry tracing is not implemented (metrics: /metrics)"),
    _r("--collect-detailed-traces", "OpenTelemetry tracing is not implemented (metrics: /metrics)"),
    _r("--show-hidden-metrics-for-version", "every metric is always shown"),
)


def honoured() -> list[VLLMFlag]:
    return [f for f in VLLM_FLAGS if f.status == HONOURED]


def refused() -> list[VLLMFlag]:
    return [f for f in VLLM_FLAGS if f.status == REFUSED]


def refusal_message(flag: VLLMFlag) -> str:
    """The one line a refused flag stops start-up with."""
    return f"{flag.name} is not supported by kvpilot: {flag.meaning}"


class _Refuse(argparse.Action):
    """Exits with ``refusal_message`` as soon as the flag is seen (whatever follows it)."""

    def __init__(self, option_strings: Sequence[str], dest: str, flag: VLLMFlag, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs="*", default=argparse.SUPPRESS,
                         help=argparse.SUPPRESS, **kwargs)
        self.flag = flag

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.exit(2, f"{parser.prog}: error: {refusal_message(self.flag)}\n")


def add_refused_flags(parser: argparse.ArgumentParser) -> None:
    """Registers every refused vLLM flag on ``parser`` (hidden from --help)."""
    for flag in refused():
        parser.add_argument(*flag.option_strings, action=_Refuse, flag=flag,
                            dest=f"_refused_{flag.name.lstrip('-').replace('-', '_')}")


def render_markdown() -> str:
    """The README's table of vLLM flags (the text between its vllm-flags markers)."""
    lines = [f"{len(honoured())} honoured, {len(refused())} refused.", "",
             "| vLLM flag | kvpilot | Meaning |", "|---|---|---|"]
    for flag in VLLM_FLAGS:
        names = ", ".join(f"`{n}`" for n in (flag.name, *flag.aliases))
        lines.append(f"| {names} | {flag.status} | {flag.meaning} |")
    return "\n".join(lines) + "\n"
