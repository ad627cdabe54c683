"""The ``kvpilot serve`` command-line flags and their mapping onto ``EngineArgs``.

Torch-free on purpose: the operator parses the arguments it puts into a Deployment
with this very parser, and its image has no torch. Flag names follow vLLM's wherever
the concept is the same, so a vLLM command line mostly carries over.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import TypeVar

from kvpilot.engine.core.constants import (
    ATTENTION_BACKENDS,
    KV_CACHE_DTYPES,
    MAX_TENSOR_PARALLEL_SIZE,
    MODEL_DTYPES,
    OFFLOAD_BACKENDS,
)

DEFAULT_HOST = "0.0.0.0"  # inside a pod the server must listen on the pod IP
DEFAULT_PORT = 8000
API_KEY_ENV = "KVPILOT_API_KEY"

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)
_SIZE_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}

T = TypeVar("T")


def parse_size(text: str) -> int:
    """Parses a byte count: ``1073741824``, ``4G`` / ``4GB`` (10^9) or ``4Gi`` / ``4GiB`` (2^30)."""
    match = _SIZE_RE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: expected a number of bytes, optionally with a suffix "
            "K/M/G/T (powers of 1000) or Ki/Mi/Gi/Ti (powers of 1024)"
        )
    number, unit, binary = match.groups()
    base = 1024 if binary else 1000
    if binary and not unit:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: 'i' needs a unit (Ki, Mi, Gi, Ti)")
    return int(float(number) * base ** _SIZE_POWERS[unit.lower()])


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None


def _bounded(parse: Callable[[str], T], ok: Callable[[T], bool], requirement: str) -> Callable[[str], T]:
    """An argparse ``type``: ``parse(text)``, rejected with ``requirement`` unless ``ok``."""

    def convert(text: str) -> T:
        value = parse(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{requirement}, got {text!r}")
        return value

    return convert


_positive_int = _bounded(_int, lambda v: v >= 1, "must be a positive integer")
_non_negative_int = _bounded(_int, lambda v: v >= 0, "must be >= 0")
_port = _bounded(_int, lambda v: 0 <= v <= 65535, "port must be in 0..65535")
_fraction = _bounded(_float, lambda v: 0.0 < v <= 1.0, "must be in (0, 1]")
_non_negative_float = _bounded(_float, lambda v: v >= 0.0, "must be >= 0")  # also rejects nan


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds every ``kvpilot serve`` flag to ``parser`` and returns it."""
    model = parser.add_argument_group("model")
    model.add_argument("--model", default=None, metavar="PATH",
                       help="local Hugging Face checkpoint directory (config.json, *.safetensors, "
                            "tokenizer.json); default: the built-in demo model")
    model.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="model name(s) accepted in requests; the first is reported in responses "
                            "and in the metrics' model_name label (default: derived from --model)")
    model.add_argument("--dtype", choices=MODEL_DTYPES, default="auto",
                       help="weight and activation dtype; auto = the checkpoint's dtype")
    model.add_argument("--max-model-len", type=_positive_int, default=None, metavar="TOKENS",
                       help="context length (prompt + output); default: the model's")
    model.add_argument("--seed", type=int, default=0,
                       help="global random seed of the engine (requests without a seed of their "
                            "own sample from it)")

    cache = parser.add_argument_group("KV cache")
    cache.add_argument("--block-size", type=_positive_int, default=16, metavar="TOKENS",
                       help="tokens per KV cache block")
    cache.add_argument("--gpu-memory-utilization", type=_fraction, default=0.9, metavar="FRACTION",
                       help="CUDA only: fraction of GPU memory for weights + activations + KV cache; "
                            "the KV cache gets what is left after profiling")
    cache.add_argument("--kv-cache-memory-bytes", type=parse_size, default=None, metavar="SIZE",
                       help="KV cache size in bytes (suffixes K/M/G or Ki/Mi/Gi); on CUDA the engine "
                            "still profiles and refuses to start if this exceeds what profiling leaves "
                            "at --gpu-memory-utilization; on CPU the engine's default applies when omitted")
    cache.add_argument("--clamp-kv-cache-memory", action="store_true",
                       help="when --kv-cache-memory-bytes exceeds what profiling leaves, shrink the KV "
                            "cache to the profiled figure (with a warning) instead of failing")
    cache.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                       help="KV cache element type; auto = the model dtype, fp8 (= fp8_e4m3) and "
                            "fp8_e5m2 store one byte per element")
    cache.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=True,
                       help="reuse KV blocks of identical prompt prefixes across requests")
    cache.add_argument("--prefix-caching-hash-seed", default=None, metavar="SEED",
                       help="seed of the prefix-cache hash chain (default: the engine's)")

    offload = parser.add_argument_group("KV offloading (only where this build supports it)")
    offload.add_argument("--kv-offloading-size", type=_non_negative_float, default=None,
                         metavar="GiB", help="CPU memory for offloaded KV blocks, in GiB")
    offload.add_argument("--kv-offloading-backend", choices=OFFLOAD_BACKENDS, default=None,
                         help="offload implementation (the engine's default when omitted)")
    offload.add_argument("--kv-offloading-disk-path", default=None, metavar="DIR",
                         help="directory for a disk tier below the CPU tier")
    offload.add_argument("--kv-offloading-disk-size", type=_non_negative_float, default=None,
                         metavar="GiB", help="size of the disk tier, in GiB")

    sched = parser.add_argument_group("scheduler")
    sched.add_argument("--max-num-seqs", type=_positive_int, default=256, metavar="N",
                       help="most sequences in one batch")
    sched.add_argument("--max-num-batched-tokens", type=_positive_int, default=None,
                       metavar="TOKENS",
                       help="token budget of one engine step (chunked prefill); default: the engine's")
    sched.add_argument("--max-waiting-requests", type=_non_negative_int, default=1024,
                       metavar="N",
                       help="requests allowed to wait for a batch slot; beyond that the server "
                            "answers 429 with Retry-After (0 = no waiting, only free slots)")

    device = parser.add_argument_group("device")
    device.add_argument("--device", default="auto", metavar="DEVICE",
                        help="auto (CUDA when present, else CPU), cpu, cuda or cuda:N")
    device.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                        help="attention implementation; auto = triton on CUDA, torch elsewhere")
    device.add_argument("--tensor-parallel-size", "-tp", type=_positive_int, default=1, metavar="N",
                        help="GPUs per model replica; this build supports only 1")

    server = parser.add_argument_group("server")
    server.add_argument("--host", default=DEFAULT_HOST,
                        help="address to listen on (0.0.0.0 = all interfaces, as a pod needs)")
    server.add_argument("--port", type=_port, default=DEFAULT_PORT, help="TCP port to listen on")
    server.add_argument("--api-key", default=None, metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on /v1/* "
                             f"(default: ${API_KEY_ENV}, else no key)")
    server.add_argument("--log-stats-interval", type=_non_negative_float, default=10.0,
                        metavar="SECONDS",
                        help="period of the INFO throughput / KV usage line (0 = off); "
                             "nothing is logged while idle")
    server.add_argument("--uvicorn-log-level", choices=UVICORN_LOG_LEVELS, default="info",
                        help="log level of uvicorn (access log at info)")
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


def engine_args_from_namespace(ns: argparse.Namespace):
    """Builds the engine's ``EngineArgs`` from parsed ``kvpilot serve`` flags.

    Raises ValueError for a combination this build cannot serve (tensor parallelism,
    offload flags without offload support) and whatever ``EngineArgs`` rejects.
    """
    from kvpilot.engine.engine_args import EngineArgs  # lazy: keeps this module light

    if ns.tensor_parallel_size > MAX_TENSOR_PARALLEL_SIZE:
        raise ValueError(
            f"--tensor-parallel-size {ns.tensor_parallel_size} is not supported: this engine "
            "runs one replica per GPU (use --tensor-parallel-size 1 and scale with replicas)"
        )
    kwargs = {
        "model": ns.model,
        "served_model_name": ns.served_model_name[0] if ns.served_model_name else None,
        "dtype": ns.dtype,
        "seed": ns.seed,
        "block_size": ns.block_size,
        "gpu_memory_utilization": ns.gpu_memory_utilization,
        "kv_cache_memory_bytes": ns.kv_cache_memory_bytes,
        "clamp_kv_cache_memory": ns.clamp_kv_cache_memory,
        "max_num_seqs": ns.max_num_seqs,
        "max_num_batched_tokens": ns.max_num_batched_tokens,
        "max_model_len": ns.max_model_len,
        "kv_cache_dtype": ns.kv_cache_dtype,
        "enable_prefix_caching": ns.enable_prefix_caching,
        "prefix_caching_hash_seed": ns.prefix_caching_hash_seed,
        "attention_backend": ns.attention_backend,
        "device": ns.device,
    }
    for name in ("kv_offloading_size", "kv_offloading_backend", "kv_offloading_disk_path",
                 "kv_offloading_disk_size"):
        value = getattr(ns, name)
        if value is not None:       # unset: EngineArgs' own default
            kwargs[name] = value
    return EngineArgs(**kwargs)
