"""What the service must do (``ServiceLevel``) and the engine settings a user pins (``Overrides``).

Token lengths are per request. ``p95_prompt_tokens`` includes any shared prefix
(system prompt / few-shot examples) that ``shared_prefix_tokens`` describes.
``concurrency`` is the number of sequences in flight across all replicas;
``requests_per_second`` the arrival rate across all replicas. Latency targets are
p95 milliseconds. p50 lengths default to the p95 ones (conservative for throughput).

Every override, when set, is used as given and then checked: a value that breaks a
constraint makes the plan infeasible instead of being silently replaced.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from kvpilot.contract.constants import KV_CACHE_DTYPES, OFFLOAD_BACKENDS
from kvpilot.operator.planner.weights import WEIGHT_QUANT_BYTES


def _positive(name: str, value: float | None, *, allow_none: bool = True, integer: bool = True) -> None:
    if value is None:
        if not allow_none:
            raise ValueError(f"{name} is required")
        return
    if isinstance(value, bool) or (integer and not isinstance(value, int)) or \
            not isinstance(value, (int, float)):
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")


@dataclass(frozen=True, slots=True)
class ServiceLevel:
    """Workload shape and latency targets (see module docstring for units)."""

    max_context: int
    p95_prompt_tokens: int
    p95_output_tokens: int
    p50_prompt_tokens: int | None = None
    p50_output_tokens: int | None = None
    concurrency: int | None = None
    requests_per_second: float | None = None
    ttft_p95_ms: float | None = None
    itl_p95_ms: float | None = None
    shared_prefix_tokens: int = 0
    distinct_prefixes: int = 1
    allow_fp8_kv: bool = False

    def __post_init__(self) -> None:
        for name in ("max_context", "p95_prompt_tokens", "p95_output_tokens"):
            _positive(name, getattr(self, name), allow_none=False)
        for name in ("p50_prompt_tokens", "p50_output_tokens", "concurrency", "distinct_prefixes"):
            _positive(name, getattr(self, name))
        for name in ("requests_per_second", "ttft_p95_ms", "itl_p95_ms"):
            _positive(name, getattr(self, name), integer=False)
        if not isinstance(self.shared_prefix_tokens, int) or self.shared_prefix_tokens < 0:
            raise ValueError(f"shared_prefix_tokens must be an integer >= 0, got {self.shared_prefix_tokens!r}")
        if not isinstance(self.allow_fp8_kv, bool):
            raise ValueError(f"allow_fp8_kv must be true or false, got {self.allow_fp8_kv!r}")
        if self.seq_tokens_p95 > self.max_context:
            raise ValueError(
                f"p95 prompt + output tokens ({self.p95_prompt_tokens:,} + {self.p95_output_tokens:,} = "
                f"{self.seq_tokens_p95:,}) exceed max_context ({self.max_context:,}); more than 5% of "
                "requests would be rejected: raise max_context or lower the p95 lengths")
        for p50, p95 in (("p50_prompt_tokens", "p95_prompt_tokens"), ("p50_output_tokens", "p95_output_tokens")):
            if getattr(self, p50) is not None and getattr(self, p50) > getattr(self, p95):
                raise ValueError(f"{p50} ({getattr(self, p50)}) must not exceed {p95} ({getattr(self, p95)})")
        if self.shared_prefix_tokens > self.p95_prompt_tokens:
            raise ValueError(f"shared_prefix_tokens ({self.shared_prefix_tokens}) is part of the prompt and "
                             f"cannot exceed p95_prompt_tokens ({self.p95_prompt_tokens})")

    @property
    def seq_tokens_p95(self) -> int:
        return self.p95_prompt_tokens + self.p95_output_tokens

    @property
    def prompt_tokens_p50(self) -> int:
        return self.p50_prompt_tokens or self.p95_prompt_tokens

    @property
    def output_tokens_p50(self) -> int:
        return self.p50_output_tokens or self.p95_output_tokens

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Overrides:
    """Engine / deployment settings pinned by the user; None = let the planner choose.

    Args:
        tensor_parallel_size: GPUs per replica (None = smallest of 1, 2, 4, 8 that works).
        replicas: number of replicas (None = from concurrency / request rate).
        gpu_memory_utilization: fraction of GPU memory the engine may use (default 0.90).
        block_size: tokens per KV block (default 16).
        kv_cache_dtype: ``auto`` (model dtype), ``fp8``, ``fp8_e4m3`` or ``fp8_e5m2``.
        max_num_seqs / max_num_batched_tokens: scheduler limits.
        enable_prefix_caching: default on.
        cpu_offload_gib / disk_offload_gib: KV offload tier sizes per replica.
        offload_backend: ``native`` or ``lmcache`` (default: native, which has CPU and disk tiers).
        weight_quantization: serve a pre-quantised checkpoint: ``fp8`` (the only weight
            quantization the engine serves).
        kv_safety_margin: fraction of the calibrated KV estimate kept back (default
            ``reserve.DEFAULT_KV_SAFETY_MARGIN``), in [0, 0.5).
        cuda_graphs: reserve a CUDA-graph pool (default: whether kvpilot serve captures graphs).
        kv_cache_memory_bytes: pin the KV cache per GPU (bytes) instead of what the GPU leaves
            for it (a GPU shared with other processes, a small cache); it must fit in that.
        gpus_per_node: GPUs in one node (default: the GPU catalogue's ``gpus_per_node``); tensor
            parallelism stays within a node.
        pipeline_parallel_size: nodes (pipeline stages) per replica (None = one node, more only
            when one node cannot hold the weights and the SLO's KV; see ``plan``).
        max_loras: LoRA adapter slots on the GPU (``--max-loras``; None = LoRA off); their
            memory comes out of the KV budget (``lora.py``).
        max_lora_rank: the slots' rank (``--max-lora-rank``; default 16).
        speculative: vLLM's ``--speculative-config`` fields (None: off); one GPU, the drafter's
            weights and KV counted (``speculative.py``).
    """

    tensor_parallel_size: int | None = None
    replicas: int | None = None
    gpu_memory_utilization: float | None = None
    block_size: int | None = None
    kv_cache_dtype: str | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool | None = None
    cpu_offload_gib: float | None = None
    disk_offload_gib: float | None = None
    offload_backend: str | None = None
    weight_quantization: str | None = None
    kv_safety_margin: float | None = None
    cuda_graphs: bool | None = None
    kv_cache_memory_bytes: int | None = None
    gpus_per_node: int | None = None
    pipeline_parallel_size: int | None = None
    max_loras: int | None = None
    max_lora_rank: int | None = None
    speculative: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "replicas", "max_num_seqs", "max_num_batched_tokens",
                     "kv_cache_memory_bytes", "gpus_per_node", "pipeline_parallel_size", "max_loras",
                     "max_lora_rank"):
            _positive(name, getattr(self, name))
        util = self.gpu_memory_utilization
        _positive("gpu_memory_utilization", util, integer=False)
        if util is not None and util > 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util}")
        if self.block_size is not None and (not isinstance(self.block_size, int) or
                                            self.block_size not in (8, 16, 32, 64, 128, 256)):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, 256, got {self.block_size!r}")
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        for name in ("cpu_offload_gib", "disk_offload_gib"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or value < 0):
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if self.offload_backend is not None and self.offload_backend not in OFFLOAD_BACKENDS:
            raise ValueError(f"offload_backend must be one of {', '.join(OFFLOAD_BACKENDS)}, "
                             f"got {self.offload_backend!r}")
        if self.weight_quantization is not None and self.weight_quantization not in WEIGHT_QUANT_BYTES:
            raise ValueError(f"weight_quantization must be one of {', '.join(WEIGHT_QUANT_BYTES)}, "
                             f"got {self.weight_quantization!r}")
        for name in ("enable_prefix_caching", "cuda_graphs"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be true or false, got {value!r}")
        if self.speculative is not None:
            from kvpilot.contract.speculative import SpeculativeConfig

            SpeculativeConfig.from_dict(self.speculative)   # ValueError names the bad field
            if (self.tensor_parallel_size or 1) > 1 or (self.pipeline_parallel_size or 1) > 1:
                raise ValueError("speculative decoding runs on one GPU: it cannot be combined with "
                                 "tensor_parallel_size or pipeline_parallel_size > 1")
        margin = self.kv_safety_margin
        if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float))
                                   or not 0 <= margin < 0.5):
            raise ValueError(f"kv_safety_margin must be a fraction in [0, 0.5), got {margin!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def build(cls: type, data: dict[str, Any], section: str) -> Any:
    """Construct ``cls`` from a dict, naming unknown keys and wrong types clearly."""
    if not isinstance(data, dict):
        raise ValueError(f"{section} must be a mapping, got {type(data).__name__}")
    known = [f.name for f in fields(cls)]
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"unknown {section} field(s): {', '.join(unknown)}; known: {', '.join(known)}")
    try:
        return cls(**data)
    except TypeError as exc:
        raise ValueError(f"{section}: {exc}") from None
