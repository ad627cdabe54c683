"""Frozen engine configuration, grouped by concern (torch-free).

Values computed at start-up (the number of KV blocks) live in ``KVCacheInfo``, not here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpilot.contract.arch_config import GEMMA3_ARCHITECTURES, ArchConfig
from kvpilot.contract.constants import KV_CACHE_DTYPES, MAX_TENSOR_PARALLEL_SIZE, MODEL_DTYPES
from kvpilot.contract.kv_layout import KV_DTYPE_BYTES, tensor_parallel_split_error
from kvpilot.contract.pipeline_stages import layer_split
from kvpilot.engine.core.request_queue import SCHEDULING_POLICIES


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model: str                   # local checkpoint directory
    served_model_name: str
    arch: ArchConfig
    dtype: str                   # resolved compute dtype name ("float32", "bfloat16", ...)
    max_model_len: int
    seed: int = 0
    tokenizer: str | None = None  # tokenizer directory; None = the model directory
    max_logprobs: int = 20        # -1 = no limit (the vocabulary)
    # Sampling defaults for requests that leave a field unset (generation_config.json):
    # SamplingParams field names -> values (see generation_defaults.py).
    default_sampling: dict[str, Any] = field(default_factory=dict)
    enforce_eager: bool = False   # no CUDA graphs for decode steps
    # GGUF layers' float32 decode tokens take the q8 path (8-bit activations, llama.cpp's
    # numerics) as 16-bit ones do: ``--dtype auto`` on a CPU without native bfloat16
    # (layers/gguf_linear.py). An explicit float32 keeps the exact float path.
    gguf_float32_q8: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in MODEL_DTYPES[1:]:
            raise ValueError(f"dtype must be one of {MODEL_DTYPES}, got {self.dtype!r}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (no limit) or >= 0, got {self.max_logprobs}")

    @property
    def tokenizer_dir(self) -> str:
        return self.tokenizer or self.model


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks: int | None = None      # explicit override (tests, planner round trips)
    enable_prefix_caching: bool = True
    prefix_caching_hash_seed: str | None = None
    calculate_kv_scales: bool = False
    kv_cache_dtype_skip_sliding_window: bool = False   # keep sliding-window layers 16-bit
    # a pinned kv_cache_memory_bytes above what profiling leaves: shrink to it (else fail)
    clamp_kv_cache_memory: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.block_size <= 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1, got {self.num_gpu_blocks}")

    def kv_dtype_name(self, model_dtype: str) -> str:
        """The cache's dtype name: ``auto`` follows the model, ``fp8`` means e4m3."""
        if self.kv_cache_dtype == "auto":
            return model_dtype
        return "fp8_e4m3" if self.kv_cache_dtype == "fp8" else self.kv_cache_dtype

    def kv_dtype_bytes(self, model_dtype: str) -> int:
        return KV_DTYPE_BYTES[self.kv_dtype_name(model_dtype)]


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    policy: str = "fcfs"
    enable_chunked_prefill: bool = True
    # Distinct LoRA adapters in one batch (--max-loras); None: LoRA is off.
    max_loras: int | None = None
    # Tokens a streamed request's outputs gather before one is sent (vLLM's
    # --stream-interval): its first token and its end always go at once.
    stream_interval: int = 1

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {SCHEDULING_POLICIES}, got {self.policy!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len})")


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """Where the ranks of a pipeline spread over pods (a LeaderWorkerSet group) meet: the
    leader's ``torch.distributed`` store at ``leader_address:port``. From the environment
    the LeaderWorkerSet controller gives each pod (``kvpilot.engine.deploy.lws``).

    ``worker_index``: this pod's place in the group (0: the leader, which runs the API
    server, the scheduler and stage 0; ``i``: stage ``i``); ``timeout_s``: how long the
    leader waits for every pod's ranks to join (and a worker for the leader's store)."""

    leader_address: str
    port: int
    group_size: int
    worker_index: int
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not 0 <= self.worker_index < self.group_size:
            raise ValueError(f"LWS_WORKER_INDEX {self.worker_index} must be in [0, {self.group_size}) "
                             f"(LWS_GROUP_SIZE)")
        if not 0 < self.port < 65536:
            raise ValueError(f"rendezvous port {self.port} must be in [1, 65535]")
        if not self.timeout_s > 0:
            raise ValueError(f"rendezvous timeout must be > 0 seconds, got {self.timeout_s}")


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """Tensor x pipeline parallelism: ``tensor_parallel_size x pipeline_parallel_size``
    ranks, one process and one device each, ``rank = stage * TP + tp_rank``
    (``contract.pipeline_stages``; rank 0 is the engine's own process).

    ``devices``: one per rank on this host: every rank's when ``rendezvous`` is None (one
    host runs them all), else the ``TP`` ranks of this pod's stage (one pod per stage)."""

    tensor_parallel_size: int = 1
    devices: tuple[str, ...] = ("cpu",)
    pipeline_parallel_size: int = 1
    rendezvous: Rendezvous | None = None
    # Microbatches a step's batch is cut into through the stages (None: one per stage;
    # 1: each step runs through the stages whole, one stage at a time).
    pipeline_microbatches: int | None = None

    def __post_init__(self) -> None:
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        if self.pipeline_microbatches is not None and self.pipeline_microbatches < 1:
            raise ValueError(f"pipeline_microbatches must be >= 1, got {self.pipeline_microbatches}")
        if not 1 <= tp <= MAX_TENSOR_PARALLEL_SIZE:
            raise ValueError(f"tensor_parallel_size must be in [1, {MAX_TENSOR_PARALLEL_SIZE}] "
                             f"(GPUs of one node), got {tp}")
        if pp < 1:
            raise ValueError(f"pipeline_parallel_size must be >= 1, got {pp}")
        if self.rendezvous is not None and self.rendezvous.group_size != pp:
            raise ValueError(f"LWS_GROUP_SIZE {self.rendezvous.group_size} must equal "
                             f"--pipeline-parallel-size {pp} (one pod per pipeline stage)")
        local = tp if self.rendezvous is not None else tp * pp
        if len(self.devices) != local:
            raise ValueError(f"tensor_parallel_size {tp} x pipeline_parallel_size {pp} needs one device "
                             f"per rank on this host ({local}), got {self.devices}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def num_microbatches(self) -> int:
        return self.pipeline_microbatches or self.pipeline_parallel_size

    def device_of(self, rank: int) -> str:
        """The device of global rank ``rank`` (a rank of this host)."""
        return self.devices[rank % self.tensor_parallel_size if self.rendezvous is not None else rank]

    def check_model(self, arch: ArchConfig) -> None:
        """ValueError when the model's heads or MLP cannot be split over the ranks, or its
        layers over the stages."""
        why = tensor_parallel_split_error(arch.num_attention_heads, arch.num_key_value_heads,
                                          arch.intermediate_size, self.tensor_parallel_size)
        if why is not None:
            valid = [n for n in range(1, MAX_TENSOR_PARALLEL_SIZE + 1)
                     if tensor_parallel_split_error(arch.num_attention_heads, arch.num_key_value_heads,
                                                    arch.intermediate_size, n) is None]
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} cannot split "
                             f"{arch.architecture}: {why}; sizes that work: "
                             f"{', '.join(map(str, valid))}")
        if self.pipeline_parallel_size > 1:
            layer_split(arch.num_hidden_layers, self.pipeline_parallel_size)   # ValueError past the layers
            if arch.sliding_window_layers or arch.architecture in GEMMA3_ARCHITECTURES:
                raise ValueError(f"pipeline parallelism is not implemented for {arch.architecture} with "
                                 f"sliding-window layers (a hybrid KV cache); use "
                                 f"--pipeline-parallel-size 1")


STRUCTURED_OUTPUT_BACKENDS = ("auto", "xgrammar")
REASONING_PARSERS = ("qwen3",)


@dataclass(frozen=True, slots=True)
class StructuredOutputsConfig:
    """Structured outputs (vLLM's ``--structured-outputs-config`` keys that kvpilot honours).

    ``disable_any_whitespace`` defaults to True here (vLLM: False): JSON is generated
    compact, without optional whitespace between tokens, because small models left to
    choose whitespace tend to produce it without end. ``compile_timeout`` (kvpilot's
    own, also ``--structured-output-compile-timeout``): seconds a request may wait for
    its grammar to compile before it fails with a 400.
    """

    backend: str = "auto"
    disable_any_whitespace: bool = True
    reasoning_parser: str | None = None
    enable_in_reasoning: bool = False
    compile_timeout: float = 10.0

    def __post_init__(self) -> None:
        if not self.compile_timeout > 0:
            raise ValueError(f"the structured-output compile timeout must be > 0 seconds, "
                             f"got {self.compile_timeout}")
        if self.backend not in STRUCTURED_OUTPUT_BACKENDS:
            raise ValueError(f"structured outputs backend {self.backend!r} is not supported by "
                             f"kvpilot: it uses xgrammar ({', '.join(STRUCTURED_OUTPUT_BACKENDS)})")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser {self.reasoning_parser!r} is not supported; "
                             f"choose from {', '.join(REASONING_PARSERS)}")



@dataclass(frozen=True, slots=True)
class KVCacheInfo:
    """What the engine allocated at start-up (computed, hence not config).

    A hybrid model (full-attention and sliding-window layers in separate pools, see
    ``core.hybrid_kv_cache_manager``): ``num_gpu_blocks`` and ``token_capacity`` count the
    full-attention pool, i.e. tokens of context held on every layer; ``bytes_per_block``
    is one such block; ``kv_cache_memory_bytes`` adds the sliding-window pool.
    """

    num_gpu_blocks: int
    block_size: int
    kv_cache_dtype: str          # resolved name: "bfloat16", "fp8_e4m3", ...
    bytes_per_block: int
    kv_cache_memory_bytes: int   # num_gpu_blocks * bytes_per_block (+ a hybrid model's sliding pool)
    enable_prefix_caching: bool
    gpu_memory_utilization: float
    # what start-up profiling left for the KV cache at gpu_memory_utilization (None: not profiled)
    profiled_available_bytes: int | None = None

    @property
    def token_capacity(self) -> int:
        return self.num_gpu_blocks * self.block_size
