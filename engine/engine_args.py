"""User-facing engine arguments (vLLM names) and their resolution into configs."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpilot.contract.arch_config import ArchConfig, kv_cache_groups
from kvpilot.contract.gguf import find_gguf
from kvpilot.contract.speculative import SpeculativeConfig
from kvpilot.engine.config import (
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    Rendezvous,
    SchedulerConfig,
    StructuredOutputsConfig,
)
from kvpilot.engine.generation_defaults import load_generation_defaults
from kvpilot.engine.kv_events.config import KVEventsConfig
from kvpilot.engine.kv_transfer.config import KVTransferConfig, check_connector
from kvpilot.engine.lora.config import LoRAConfig, LoRAModule
from kvpilot.engine.model.auto_dtype import resolve_auto_dtype
from kvpilot.engine.model.builtin_model import BUILTIN_MODEL_NAME, DEMO_MODEL, packaged_smollm2
from kvpilot.engine.model.device_memory import FAKE_DEVICE_MEMORY_ENV

logger = logging.getLogger(__name__)

GIB = 1 << 30
# CPU has no memory profiler to size the cache from: this is the default KV budget there
# (vLLM's CPU backend takes a fixed KV space too).
DEFAULT_CPU_KV_CACHE_BYTES = 1 * GIB


def _default(config: type, name: str) -> Any:
    """The default of ``config``'s field ``name``: a default of the configs EngineArgs
    builds is stated there once (and ``kvpilot serve``'s flags read EngineArgs')."""
    return config.__dataclass_fields__[name].default


DEFAULT_MAX_NUM_BATCHED_TOKENS = _default(SchedulerConfig, "max_num_batched_tokens")


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """What an engine is built from: vLLM's names, the defaults of ``kvpilot serve`` (its
    flags take theirs from here) and of ``LLM(...)``."""

    model: str | None = None                  # None => the built-in model; "demo" => the demo model
    served_model_name: str | None = None
    tokenizer: str | None = None              # tokenizer directory; None => the model's
    hf_config_path: str | None = None         # a GGUF model's config.json directory; None => its metadata
    architecture: str | None = None           # override config.json's architectures[0]
    dtype: str = "auto"
    seed: int = _default(ModelConfig, "seed")
    block_size: int = _default(CacheConfig, "block_size")
    gpu_memory_utilization: float = _default(CacheConfig, "gpu_memory_utilization")
    kv_cache_memory_bytes: int | None = None
    clamp_kv_cache_memory: bool = _default(CacheConfig, "clamp_kv_cache_memory")
    num_gpu_blocks: int | None = None
    max_num_seqs: int = _default(SchedulerConfig, "max_num_seqs")
    max_num_batched_tokens: int | None = None   # None => DEFAULT_MAX_NUM_BATCHED_TOKENS or more
    stream_interval: int = _default(SchedulerConfig, "stream_interval")
    max_model_len: int | None = None
    kv_cache_dtype: str = _default(CacheConfig, "kv_cache_dtype")
    calculate_kv_scales: bool = _default(CacheConfig, "calculate_kv_scales")
    kv_cache_dtype_skip_sliding_window: bool = _default(CacheConfig, "kv_cache_dtype_skip_sliding_window")
    enable_prefix_caching: bool = _default(CacheConfig, "enable_prefix_caching")
    prefix_caching_hash_seed: str | None = None
    # Token-granular reuse (kvpilot's own): the block after a prefix hit copies the KV of
    # the tokens a released block shares with it instead of computing them. Off by default:
    # it makes cached_tokens and the hit counters differ from vLLM's block-granular figures,
    # which KV-event routers predict. Ignored (with a warning) where it cannot hold.
    token_granular_reuse: bool = False
    # Classify each request's uncached prompt tokens by why they missed (core.prefix_miss).
    explain_prefix_misses: bool = True
    enable_chunked_prefill: bool = _default(SchedulerConfig, "enable_chunked_prefill")
    attention_backend: str = "auto"          # auto | cpu | torch | triton (model/attention/backend.py)
    device: str = "auto"
    enforce_eager: bool = _default(ModelConfig, "enforce_eager")   # CUDA: no CUDA graphs for decode
    # Ranks (processes, GPUs) one replica of the model is split over: Megatron-style
    # tensor parallelism; ranks use consecutive devices from ``device`` (cuda:N..N+tp-1).
    tensor_parallel_size: int = _default(ParallelConfig, "tensor_parallel_size")
    # Pipeline parallelism: the decoder layers split into this many stages (vLLM's split,
    # ``contract.pipeline_stages``), TP ranks each; all on this host unless ``rendezvous``
    # (a LeaderWorkerSet group: one pod per stage, ``engine.deploy.lws``).
    pipeline_parallel_size: int = _default(ParallelConfig, "pipeline_parallel_size")
    rendezvous: Rendezvous | None = None
    # microbatches in flight through the stages per step (None: one per stage; 1: none)
    pipeline_microbatches: int | None = None
    scheduling_policy: str = _default(SchedulerConfig, "policy")
    # KV offload (vLLM's names): CPU tier GiB (None = off), backend, optional disk tier.
    kv_offloading_size: float | None = None
    kv_offloading_backend: str = "native"
    kv_offloading_disk_path: str | None = None
    kv_offloading_disk_size: float | None = None
    # Sampling defaults: "auto" (the checkpoint's generation_config.json), "vllm" (none)
    # or a directory holding a generation_config.json; the overrides win.
    generation_config: str = "auto"
    override_generation_config: dict | None = None
    max_logprobs: int = _default(ModelConfig, "max_logprobs")
    # Observability: sampled KV block residency histograms (vLLM's --kv-cache-metrics,
    # --kv-cache-metrics-sample) and model-shape FLOPs / bytes counters (--enable-mfu-metrics).
    kv_cache_metrics: bool = False
    kv_cache_metrics_sample: float = 0.01
    enable_mfu_metrics: bool = False
    # Check each step's logits for NaNs and count the requests hit (vllm:corrupted_requests;
    # vLLM's VLLM_COMPUTE_NANS_IN_LOGITS): a device sync per step.
    compute_nans_in_logits: bool = False
    structured_outputs_config: StructuredOutputsConfig = StructuredOutputsConfig()
    # vLLM's --kv-events-config: publish KV-cache events over ZeroMQ (None = off).
    kv_events_config: KVEventsConfig | None = None
    # vLLM's --kv-transfer-config: KV blocks exchanged with other engines (disaggregated
    # prefill / decode); None = off. create_kv_transfer_config refuses a connector this
    # engine does not run.
    kv_transfer_config: KVTransferConfig | None = None
    # LoRA adapters (vLLM's names): off unless enable_lora; see kvpilot.engine.lora.
    enable_lora: bool = False
    max_loras: int = _default(LoRAConfig, "max_loras")
    max_lora_rank: int = _default(LoRAConfig, "max_lora_rank")
    max_cpu_loras: int | None = None          # None: max_loras
    lora_dtype: str = _default(LoRAConfig, "lora_dtype")
    lora_modules: tuple[LoRAModule, ...] | None = None
    # /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING)
    allow_runtime_lora_updating: bool = False
    # Speculative decoding (vLLM's --speculative-config: a SpeculativeConfig or its JSON
    # fields as a dict); None: off.
    speculative_config: SpeculativeConfig | dict | None = None

    def resolve_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def create_configs(self) -> tuple[ModelConfig, CacheConfig, SchedulerConfig]:
        """Validate and resolve everything that does not need the model loaded."""
        model_dir = self.model_path()
        gguf_file = find_gguf(model_dir)
        if gguf_file is not None:
            model_dir = str(gguf_file)
        elif not Path(model_dir).is_dir():
            raise FileNotFoundError(f"model directory {model_dir} does not exist")
        elif self.hf_config_path is not None:
            raise ValueError("--hf-config-path applies to a GGUF model; an HF checkpoint has its own config.json")
        arch = self._arch(model_dir)
        device = self.resolve_device()
        dtype = self.dtype
        float32_q8 = False
        if dtype == "auto":
            dtype, why = resolve_auto_dtype(arch.dtype, device)
            # a GGUF file's decode tokens take 8-bit activations in float32 as they do in 16 bits
            float32_q8 = gguf_file is not None and device == "cpu" and dtype == "float32"
            if float32_q8:
                why += "; GGUF decode tokens take 8-bit activations (--dtype float32: exact)"
            logger.info("--dtype auto: computing in %s (%s)", dtype, why)
        max_model_len = self.max_model_len or arch.max_position_embeddings
        name = self.served_model_name or self._default_name(model_dir, gguf_file is not None)
        tokenizer = self.tokenizer
        if tokenizer is not None and not Path(tokenizer).is_dir() and find_gguf(tokenizer) is None:
            raise FileNotFoundError(f"tokenizer directory {tokenizer} does not exist")
        defaults = load_generation_defaults(self.generation_config, model_dir,
                                            self.override_generation_config)
        model_config = ModelConfig(model=model_dir, served_model_name=name, arch=arch, dtype=dtype,
                                   max_model_len=max_model_len, seed=self.seed,
                                   tokenizer=tokenizer, max_logprobs=self.max_logprobs,
                                   default_sampling=defaults,
                                   enforce_eager=self.enforce_eager, gguf_float32_q8=float32_q8)
        kv_bytes = self.kv_cache_memory_bytes
        if (kv_bytes is None and self.num_gpu_blocks is None and device == "cpu"
                and not os.environ.get(FAKE_DEVICE_MEMORY_ENV)):   # the test hook profiles instead
            kv_bytes = DEFAULT_CPU_KV_CACHE_BYTES
        cache_config = CacheConfig(
            block_size=self.block_size, kv_cache_dtype=self.kv_cache_dtype,
            gpu_memory_utilization=self.gpu_memory_utilization, kv_cache_memory_bytes=kv_bytes,
            num_gpu_blocks=self.num_gpu_blocks, enable_prefix_caching=self.enable_prefix_caching,
            prefix_caching_hash_seed=self.prefix_caching_hash_seed,
            calculate_kv_scales=self.calculate_kv_scales,
            kv_cache_dtype_skip_sliding_window=self.kv_cache_dtype_skip_sliding_window,
            clamp_kv_cache_memory=self.clamp_kv_cache_memory,
        )
        batched = self.max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS,
                                                    0 if self.enable_chunked_prefill else max_model_len)
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=batched,
            max_model_len=max_model_len, policy=self.scheduling_policy,
            enable_chunked_prefill=self.enable_chunked_prefill,
            max_loras=self.max_loras if self.enable_lora else None,
            stream_interval=self.stream_interval,
        )
        return model_config, cache_config, scheduler_config

    def model_path(self) -> str:
        """Where the model lies: ``model``, the built-in model's GGUF file for None, the
        demo checkpoint (built on first use) for ``"demo"``."""
        if self.model is None:
            return str(packaged_smollm2())
        if self.model == DEMO_MODEL:
            from kvpilot.engine.model.models.demo import ensure_demo_model

            return str(ensure_demo_model())
        return self.model

    def _default_name(self, model_dir: str, gguf: bool) -> str:
        if self.model is None:
            return BUILTIN_MODEL_NAME
        if self.model == DEMO_MODEL:
            return "kvpilot-demo"
        return Path(model_dir).stem if gguf else Path(model_dir).name

    def _arch(self, model: str) -> ArchConfig:
        """The architecture of ``model``: a GGUF file's metadata (or ``hf_config_path``'s
        config.json), else the checkpoint's config.json."""
        from kvpilot.engine.model.gguf.arch import load_model_arch

        return load_model_arch(model, self.architecture, self.hf_config_path)

    def create_lora_config(self) -> LoRAConfig | None:
        """The ``LoRAConfig``, or None when LoRA is off; ValueError for what cannot be served."""
        if not self.enable_lora:
            if self.lora_modules:
                raise ValueError("--lora-modules needs --enable-lora")
            return None
        if self.tensor_parallel_size > 1:
            raise ValueError("LoRA adapters are not implemented with tensor parallelism; use "
                             "--tensor-parallel-size 1 or turn --enable-lora off")
        if self.pipeline_parallel_size > 1:
            raise ValueError("LoRA adapters are not implemented with pipeline parallelism; use "
                             "--pipeline-parallel-size 1 or turn --enable-lora off")
        if self.kv_offloading_size is not None and self.kv_offloading_backend == "lmcache":
            raise ValueError("LoRA adapters with the lmcache offload backend would share KV across "
                             "adapters (LMCache keys by tokens); use --kv-offloading-backend native")
        return LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                          max_cpu_loras=self.max_cpu_loras, lora_dtype=self.lora_dtype,
                          modules=tuple(self.lora_modules or ()),
                          allow_runtime_updates=self.allow_runtime_lora_updating)

    def create_parallel_config(self, arch: ArchConfig) -> ParallelConfig:
        """The ranks' devices; ValueError when the model cannot be split over
        ``tensor_parallel_size`` ranks (or its layers over ``pipeline_parallel_size``
        stages) or there are fewer GPUs than this host's ranks."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        device = self.resolve_device()
        if tp == 1 and pp == 1:
            return ParallelConfig(1, (device,))
        micro = self.pipeline_microbatches
        local = tp if self.rendezvous is not None else tp * pp
        kind, _, index = device.partition(":")
        if kind == "cpu":
            devices = ("cpu",) * local
        elif kind == "cuda":
            import torch

            first = int(index or 0)
            visible = torch.cuda.device_count()
            if first + local > visible:
                what = f"tensor_parallel_size {tp}" if pp == 1 else \
                    f"tensor_parallel_size {tp} x pipeline_parallel_size {pp}"
                raise ValueError(f"{what} needs {local} GPUs (cuda:{first}..cuda:"
                                 f"{first + local - 1}) but {visible} are visible; lower "
                                 f"--tensor-parallel-size or make more GPUs visible")
            devices = tuple(f"cuda:{first + r}" for r in range(local))
        else:
            raise ValueError(f"tensor and pipeline parallelism run on cuda or cpu devices, not {device!r}")
        config = ParallelConfig(tp, devices, pp, self.rendezvous, micro)
        config.check_model(arch)
        if pp > 1 and find_gguf(Path(self.model_path())) is not None:
            raise ValueError("pipeline parallelism is not implemented for GGUF checkpoints; use a "
                             "safetensors checkpoint or --pipeline-parallel-size 1")
        return config

    def create_kv_transfer_config(self) -> KVTransferConfig | None:
        """``kv_transfer_config`` once its connector is known to be one this engine runs
        (ValueError naming those it does, before anything loads); None when off."""
        config = self.kv_transfer_config
        check_connector(config)
        if config is None or not config.is_kv_transfer_instance:
            return config
        if self.create_offload_config() is not None:
            raise ValueError(f"--kv-transfer-config ({config.kv_connector}) with KV offloading is not "
                             "implemented: an engine runs one KV connector; drop --kv-offloading-size / "
                             "--kv-offloading-backend")
        # Combinations not verified: refused before anything loads rather than risk wrong KV.
        if self.token_granular_reuse:
            raise ValueError(f"--kv-transfer-config ({config.kv_connector}) with --token-granular-reuse is "
                             "not implemented: a partial-block copy and a remote engine's block reads are "
                             "not verified together; drop one of them")
        if self.speculative_config is not None:
            raise ValueError(f"--kv-transfer-config ({config.kv_connector}) with --speculative-config is "
                             "not implemented: a remote engine's KV carries no draft model's or EAGLE "
                             "head's KV, and speculation over transferred prompts is not verified; drop "
                             "one of them")
        if self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1:
            raise ValueError(f"{config.kv_connector} is implemented for one rank per engine "
                             "(--tensor-parallel-size 1, --pipeline-parallel-size 1)")
        from kvpilot.engine.kv_transfer.nixl.settings import NixlSettings

        NixlSettings.from_config(config)   # its extra config and environment, checked now
        return config

    def create_speculative_config(self) -> SpeculativeConfig | None:
        """The ``SpeculativeConfig`` (None: off); ValueError for what cannot be served."""
        if self.speculative_config is None:
            return None
        config = SpeculativeConfig.from_dict(self.speculative_config)
        if self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1:
            raise ValueError("speculative decoding is not implemented with tensor or pipeline "
                             "parallelism; use one rank or drop --speculative-config")
        if config.uses_model and self.kv_offloading_size is not None:
            raise ValueError(f"speculative method {config.method!r} keeps its own KV in the blocks, "
                             "which KV offloading does not save; use the ngram method or turn "
                             "offloading off")
        return config

    def create_offload_config(self):
        """The ``OffloadConfig``, or None when KV offloading is off; ValueError for bad values."""
        from kvpilot.engine.offload.config import OffloadConfig

        config = OffloadConfig.from_engine_args(self.kv_offloading_size, self.kv_offloading_backend,
                                                self.kv_offloading_disk_path,
                                                self.kv_offloading_disk_size)
        if config is None:
            return None
        if not self.enable_prefix_caching:
            raise ValueError("KV offloading extends the prefix cache: it needs "
                             "enable_prefix_caching=True")
        if self.model is not None:
            arch = self._arch(self.model_path())
            max_len = self.max_model_len or arch.max_position_embeddings
            window = arch.kv_release_window
            if window is None and kv_cache_groups(arch, max_len) is not None:
                window = arch.sliding_window     # a hybrid model: its sliding layers release
            if window is not None and max_len > window:
                raise ValueError(
                    f"KV offloading is not implemented for sliding-window models whose blocks are "
                    f"released outside the window ({arch.architecture}, window "
                    f"{window}); turn offloading off or set max_model_len <= {window}")
        if self.pipeline_parallel_size > 1:
            raise ValueError("KV offloading is not implemented with pipeline parallelism (each stage "
                             "holds its own layers' blocks): use pipeline_parallel_size 1 or turn "
                             "offloading off")
        if self.tensor_parallel_size > 1:
            raise ValueError("KV offloading is not implemented with tensor parallelism (each rank "
                             "holds its own heads' blocks): use tensor_parallel_size 1 or turn "
                             "offloading off")
        if self.calculate_kv_scales and (config.disk_path is not None or config.backend == "lmcache"):
            raise ValueError("calculate_kv_scales calibrates fp8 scales per engine start, so KV "
                             "blocks kept on disk or in LMCache would be read back with other "
                             "scales; use the CPU tier of the native backend only, or fixed scales")
        return config


def model_fingerprint(model_dir: str) -> str:
    """Identity of a checkpoint for prefix-cache hashing, cheap to compute.

    config.json plus, per weight file, its size and a digest of its first and last MiB
    (the header and real tensor bytes): two fine-tunes of one base model differ there,
    so their KV blocks never match on a shared offload tier.
    """
    h = hashlib.sha256()
    if Path(model_dir).is_file():   # a GGUF file: its metadata lies in its first MiB
        _hash_ends(h, Path(model_dir))
        return h.hexdigest()
    config = Path(model_dir) / "config.json"
    h.update(json.dumps(json.loads(config.read_text()), sort_keys=True).encode())
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        _hash_ends(h, path)
    return h.hexdigest()


def _hash_ends(h: Any, path: Path) -> None:
    """A file's name, size and first and last MiB into digest ``h``."""
    size = path.stat().st_size
    h.update(f"{path.name}:{size}".encode())
    with path.open("rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
