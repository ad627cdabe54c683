"""The ``kvpilot serve`` command-line flags and their mapping onto ``EngineArgs``.

Torch-free on purpose: the operator parses the arguments it puts into a Deployment
with this very parser, and its image has no torch. Flag names follow vLLM's wherever
the concept is the same, so a vLLM command line mostly carries over.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from kvpilot.engine.config import (
    REASONING_PARSERS,
    STRUCTURED_OUTPUT_BACKENDS,
    StructuredOutputsConfig,
)
from kvpilot.engine.core.constants import (
    ATTENTION_BACKENDS,
    KV_CACHE_DTYPES,
    MAX_TENSOR_PARALLEL_SIZE,
    MODEL_DTYPES,
    OFFLOAD_BACKENDS,
)
from kvpilot.engine.core.request_queue import SCHEDULING_POLICIES
from kvpilot.engine.server.arg_types import (
    fraction,
    json_object,
    max_logprobs,
    non_negative_float,
    non_negative_int,
    parse_size,
    positive_int,
)

__all__ = ["add_serve_arguments", "engine_args_from_namespace", "make_serve_parser", "parse_size"]

# vLLM's spellings of the dtypes kvpilot names differently.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
LOAD_FORMATS = ("auto", "safetensors")
TOKENIZER_MODES = ("auto", "hf")


def _dtype(text: str) -> str:
    """vLLM's dtype aliases, mapped before argparse checks the choices."""
    return DTYPE_ALIASES.get(text, text)


def _structured_outputs_config(text: str) -> StructuredOutputsConfig:
    data = json_object(text)
    names = set(StructuredOutputsConfig.__dataclass_fields__)
    unknown = sorted(set(data) - names)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown key(s) {unknown}; kvpilot honours {sorted(names)}")
    try:
        return StructuredOutputsConfig(**data)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _kv_events_config(text: str):
    from kvpilot.engine.kv_events.config import KVEventsConfig

    try:
        return KVEventsConfig.from_json(text)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds every ``kvpilot serve`` flag to ``parser`` and returns it: the engine's flags
    here, the HTTP front end's (``args_frontend``), and the vLLM flags kvpilot refuses
    (``vllm_flags``: hidden from --help, each stops start-up with a one-line reason)."""
    from kvpilot.engine.server.args_frontend import add_frontend_arguments
    from kvpilot.engine.server.vllm_flags import add_refused_flags

    model = parser.add_argument_group("model")
    model.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="the model directory as a positional argument, as in `vllm serve MODEL` "
                            "(same as --model)")
    model.add_argument("--model", default=None, metavar="PATH",
                       help="local Hugging Face checkpoint directory (config.json, *.safetensors, "
                            "tokenizer.json); default: the built-in demo model")
    model.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="model name(s) accepted in requests; the first is reported in responses "
                            "and in the metrics' model_name label (default: derived from --model)")
    model.add_argument("--tokenizer", default=None, metavar="PATH",
                       help="directory with tokenizer.json / tokenizer_config.json (default: --model)")
    model.add_argument("--tokenizer-mode", choices=TOKENIZER_MODES, default="auto",
                       help="kvpilot reads the fast tokenizer (tokenizer.json) in either mode")
    model.add_argument("--trust-remote-code", action="store_true",
                       help="accepted for vLLM command lines; kvpilot never runs code from a "
                            "checkpoint (built-in architectures only)")
    model.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                       help="weight format; kvpilot loads safetensors only")
    model.add_argument("--dtype", type=_dtype, choices=MODEL_DTYPES, default="auto",
                       help="weight and activation dtype; auto = the checkpoint's dtype (float32 on "
                            "CPU); vLLM's half / float are accepted")
    model.add_argument("--max-model-len", type=positive_int, default=None, metavar="TOKENS",
                       help="context length (prompt + output); default: the model's")
    model.add_argument("--seed", type=int, default=0,
                       help="global random seed of the engine (requests without a seed of their "
                            "own sample from it)")
    model.add_argument("--generation-config", default="auto", metavar="{auto,vllm,DIR}",
                       help="sampling defaults for requests that omit them: auto = the checkpoint's "
                            "generation_config.json, vllm = none, or a directory holding one")
    model.add_argument("--override-generation-config", type=json_object, default=None,
                       metavar="JSON",
                       help="sampling defaults (temperature, top_p, top_k, min_p, "
                            "repetition_penalty, max_new_tokens) over --generation-config's")
    model.add_argument("--max-logprobs", type=max_logprobs, default=20, metavar="N",
                       help="most logprobs / top_logprobs a request may ask for (-1: the vocabulary)")
    model.add_argument("--enforce-eager", action="store_true",
                       help="CUDA: run every step eagerly, without CUDA graphs (by default decode "
                            "batches of 1, 2, 4, 8, 16, ... up to --max-num-seqs replay captured graphs)")

    cache = parser.add_argument_group("KV cache")
    cache.add_argument("--block-size", type=positive_int, default=16, metavar="TOKENS",
                       help="tokens per KV cache block")
    cache.add_argument("--gpu-memory-utilization", type=fraction, default=0.9, metavar="FRACTION",
                       help="CUDA only: fraction of GPU memory for weights + activations + KV cache; "
                            "the KV cache gets what is left after profiling")
    cache.add_argument("--kv-cache-memory-bytes", type=parse_size, default=None, metavar="SIZE",
                       help="KV cache size in bytes (suffixes K/M/G or Ki/Mi/Gi); on CUDA the engine "
                            "still profiles and refuses to start if this exceeds what profiling leaves "
                            "at --gpu-memory-utilization; on CPU the engine's default applies when omitted")
    cache.add_argument("--clamp-kv-cache-memory", action="store_true",
                       help="when --kv-cache-memory-bytes exceeds what profiling leaves, shrink the KV "
                            "cache to the profiled figure (with a warning) instead of failing")
    cache.add_argument("--num-gpu-blocks-override", type=positive_int, default=None, metavar="N",
                       help="exact number of KV cache blocks (overrides every sizing rule)")
    cache.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                       help="KV cache element type; auto = the model dtype, fp8 (= fp8_e4m3) and "
                            "fp8_e5m2 store one byte per element")
    cache.add_argument("--calculate-kv-scales", action="store_true",
                       help="fp8 KV cache: compute the scales from the first batch (else 1.0 or "
                            "the checkpoint's)")
    cache.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=True,
                       help="reuse KV blocks of identical prompt prefixes across requests")
    cache.add_argument("--prefix-caching-hash-seed", default=None, metavar="SEED",
                       help="seed of the prefix-cache hash chain (default: the engine's)")
    cache.add_argument("--kv-cache-metrics", action="store_true",
                       help="export sampled KV block residency histograms (vllm:kv_block_lifetime_"
                            "seconds, ..._idle_before_evict_seconds, ..._reuse_gap_seconds)")
    cache.add_argument("--kv-cache-metrics-sample", type=fraction, default=0.01, metavar="FRACTION",
                       help="share of allocated KV blocks --kv-cache-metrics follows (default 0.01)")
    cache.add_argument("--enable-mfu-metrics", action="store_true",
                       help="export model-shape estimates of FLOPs and bytes read / written per GPU "
                            "(vllm:estimated_flops_per_gpu_total, ...)")

    cache.add_argument("--kv-events-config", type=_kv_events_config, default=None, metavar="JSON",
                       help="vLLM's KV-cache events over ZeroMQ for prefix-aware routers: JSON with "
                            "enable_kv_cache_events, publisher (zmq | null), endpoint (tcp://*:5557), "
                            "replay_endpoint, buffer_steps, hwm, max_queue_size, topic")

    offload = parser.add_argument_group("KV offloading (only where this build supports it)")
    offload.add_argument("--kv-offloading-size", type=non_negative_float, default=None,
                         metavar="GiB", help="CPU memory for offloaded KV blocks, in GiB")
    offload.add_argument("--kv-offloading-backend", choices=OFFLOAD_BACKENDS, default=None,
                         help="offload implementation (the engine's default when omitted)")
    offload.add_argument("--kv-offloading-disk-path", default=None, metavar="DIR",
                         help="directory for a disk tier below the CPU tier")
    offload.add_argument("--kv-offloading-disk-size", type=non_negative_float, default=None,
                         metavar="GiB", help="size of the disk tier, in GiB")

    sched = parser.add_argument_group("scheduler")
    sched.add_argument("--max-num-seqs", type=positive_int, default=256, metavar="N",
                       help="most sequences in one batch")
    sched.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                       metavar="TOKENS",
                       help="token budget of one engine step (chunked prefill); default: the engine's")
    sched.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                       default=True,
                       help="split long prompts across steps; without it a prompt is admitted only "
                            "when it fits one step's token budget whole")
    sched.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs",
                       help="fcfs, or priority: requests' priority field (lower first) orders the "
                            "queue, and a waiting request preempts running ones of lower priority")
    sched.add_argument("--max-waiting-requests", type=non_negative_int, default=1024,
                       metavar="N",
                       help="requests allowed to wait for a batch slot; beyond that the server "
                            "answers 429 with Retry-After (0 = no waiting, only free slots)")

    device = parser.add_argument_group("device")
    device.add_argument("--device", default="auto", metavar="DEVICE",
                        help="auto (CUDA when present, else CPU), cpu, cuda or cuda:N")
    device.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                        help="attention implementation; auto = triton on CUDA, elsewhere cpu (decode rows "
                        "on a C++ kernel built on first use) where it builds, else torch (pure torch)")
    device.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1, metavar="N",
                        help=f"GPUs per model replica (1 to {MAX_TENSOR_PARALLEL_SIZE}, one node): "
                             "Megatron-style tensor parallelism, one process per GPU; N must split "
                             "the attention heads")

    structured = parser.add_argument_group("structured outputs and reasoning")
    structured.add_argument("--structured-outputs-config", type=_structured_outputs_config,
                            default=None, metavar="JSON",
                            help="JSON object: backend (auto | xgrammar), disable_any_whitespace "
                                 "(default true: compact JSON), reasoning_parser, enable_in_reasoning")
    structured.add_argument("--guided-decoding-backend", choices=STRUCTURED_OUTPUT_BACKENDS,
                            default=None, help="older vLLM name of the structured-outputs backend")
    structured.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                            help="return <think>...</think> as reasoning_content; structured outputs "
                                 "then constrain only the text after the reasoning")

    add_frontend_arguments(parser)
    add_refused_flags(parser)
    return parser


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends ``(default: X)`` to a flag's help unless X is None or the help names a default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, argparse.SUPPRESS) or "default" in text:
            return text
        return text + " (default: %(default)s)"


def make_serve_parser(prog: str = "kvpilot serve") -> argparse.ArgumentParser:
    """A standalone parser for the ``kvpilot serve`` flags (also used by the operator)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Serve a model through an OpenAI-compatible HTTP API with Prometheus metrics.",
        formatter_class=HelpFormatter,
    )
    return add_serve_arguments(parser)


def resolve_model(ns: argparse.Namespace) -> str | None:
    """The model directory from ``--model`` or the positional ``MODEL``; ValueError if they differ."""
    if ns.model_tag is not None and ns.model is not None and ns.model_tag != ns.model:
        raise ValueError(f"the positional model {ns.model_tag!r} and --model {ns.model!r} differ; "
                         "give one of them")
    return ns.model_tag if ns.model_tag is not None else ns.model


def structured_outputs_config(ns: argparse.Namespace) -> StructuredOutputsConfig:
    """``--structured-outputs-config`` with ``--reasoning-parser`` and the older
    ``--guided-decoding-backend`` folded in."""
    config = ns.structured_outputs_config or StructuredOutputsConfig()
    if ns.guided_decoding_backend is not None:
        config = dataclasses.replace(config, backend=ns.guided_decoding_backend)
    if ns.reasoning_parser is not None:
        if config.reasoning_parser not in (None, ns.reasoning_parser):
            raise ValueError(f"--reasoning-parser {ns.reasoning_parser} and "
                             f"--structured-outputs-config's {config.reasoning_parser} differ")
        config = dataclasses.replace(config, reasoning_parser=ns.reasoning_parser)
    return config


def engine_args_from_namespace(ns: argparse.Namespace):
    """Builds the engine's ``EngineArgs`` from parsed ``kvpilot serve`` flags.

    Raises ValueError for a combination this build cannot serve (tensor parallelism past
    one node, offload flags without offload support) and whatever ``EngineArgs`` rejects.
    """
    from kvpilot.engine.engine_args import EngineArgs  # lazy: keeps this module light

    if ns.tensor_parallel_size > MAX_TENSOR_PARALLEL_SIZE:
        raise ValueError(
            f"--tensor-parallel-size {ns.tensor_parallel_size} is not supported: one replica "
            f"spans at most {MAX_TENSOR_PARALLEL_SIZE} GPUs of one node (multi-node replicas are "
            "not implemented); scale further with replicas"
        )
    structured = structured_outputs_config(ns)
    kwargs = {
        "model": resolve_model(ns),
        "served_model_name": ns.served_model_name[0] if ns.served_model_name else None,
        "tensor_parallel_size": ns.tensor_parallel_size,
        "tokenizer": ns.tokenizer,
        "dtype": ns.dtype,
        "seed": ns.seed,
        "block_size": ns.block_size,
        "gpu_memory_utilization": ns.gpu_memory_utilization,
        "kv_cache_memory_bytes": ns.kv_cache_memory_bytes,
        "clamp_kv_cache_memory": ns.clamp_kv_cache_memory,
        "num_gpu_blocks": ns.num_gpu_blocks_override,
        "max_num_seqs": ns.max_num_seqs,
        "max_num_batched_tokens": ns.max_num_batched_tokens,
        "max_model_len": ns.max_model_len,
        "kv_cache_dtype": ns.kv_cache_dtype,
        "calculate_kv_scales": ns.calculate_kv_scales,
        "enable_prefix_caching": ns.enable_prefix_caching,
        "prefix_caching_hash_seed": ns.prefix_caching_hash_seed,
        "enable_chunked_prefill": ns.enable_chunked_prefill,
        "scheduling_policy": ns.scheduling_policy,
        "attention_backend": ns.attention_backend,
        "device": ns.device,
        "generation_config": ns.generation_config,
        "override_generation_config": ns.override_generation_config,
        "max_logprobs": ns.max_logprobs,
        "structured_outputs_config": structured,
        "kv_events_config": ns.kv_events_config,
        "enforce_eager": ns.enforce_eager,
        "kv_cache_metrics": ns.kv_cache_metrics,
        "kv_cache_metrics_sample": ns.kv_cache_metrics_sample,
        "enable_mfu_metrics": ns.enable_mfu_metrics,
        # vLLM's switch for the NaN check (an environment variable there too)
        "compute_nans_in_logits": os.environ.get("VLLM_COMPUTE_NANS_IN_LOGITS", "0").lower()
        not in ("", "0", "false"),
    }
    for name in ("kv_offloading_size", "kv_offloading_backend", "kv_offloading_disk_path",
                 "kv_offloading_disk_size"):
        value = getattr(ns, name)
        if value is not None:       # unset: EngineArgs' own default
            kwargs[name] = value
    return EngineArgs(**kwargs)
