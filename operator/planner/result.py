"""``Plan``: the planner's answer, and ``Suggestion``: a machine-applicable fix.

A plan is complete even when infeasible: every number is filled in from the
evaluated candidate, ``feasible`` is false, ``binding_constraint`` names the first
check that failed and ``suggestions`` lists request patches that were verified to
make the plan feasible.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

from kvpilot.contract.constants import DEFAULT_OFFLOAD_DISK_PATH
from kvpilot.contract.kv_layout import HybridKVLayout, KVLayout
from kvpilot.operator.planner.checks import Check

DEFAULT_DISK_PATH = DEFAULT_OFFLOAD_DISK_PATH


@dataclass(frozen=True, slots=True)
class Suggestion:
    """A change that makes an infeasible request feasible.

    Args:
        kind: ``tensor_parallel``, ``fp8_kv``, ``max_context``, ``fewer_sequences``,
            ``replicas``, ``gpu``, ``weight_quantization``, ``gpu_memory_utilization``,
            ``ttft_target``, ``itl_target``, ``drop_override`` or ``combined``.
        description: one sentence with the numbers of the resulting plan.
        apply: a patch for ``PlanRequest.apply`` (same shape as ``PlanRequest.from_dict``).
    """

    kind: str
    description: str
    apply: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "description": self.description, "apply": copy.deepcopy(self.apply)}


def _num(value: float) -> str:
    """Plain decimal for flags: 16 -> '16', 0.9 -> '0.9'."""
    return f"{value:g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True, slots=True)
class Plan:
    """Engine parameters for one replica plus the deployment around it (see module doc).

    ``kv_bytes_per_token`` is per GPU (KV heads are split across tensor-parallel ranks);
    ``kv_cache_memory_bytes`` / ``num_gpu_blocks`` / ``kv_token_capacity`` are per GPU
    too (every rank holds the same number of blocks, each for its share of the heads).
    ``cpu_offload_gib``, ``disk_offload_gib``, ``pod_memory_gib`` and ``shm_gib`` are per
    replica (one pod; per pod of a replica of several pipeline stages, one pod a node). ``limits`` maps each bound on ``max_num_seqs`` to its value;
    ``memory`` and ``estimates`` hold the intermediate numbers of the derivation.
    ``derivation`` and ``warnings`` are tuples of sentences (JSON lists in ``to_dict``).
    """

    feasible: bool
    binding_constraint: str
    binding_detail: str
    model: str
    gpu: str
    tensor_parallel_size: int
    replicas: int
    kv_cache_dtype: str
    kv_dtype_name: str
    kv_dtype_bytes: int
    kv_bytes_per_token: int
    gpu_memory_utilization: float
    kv_cache_memory_bytes: int
    num_gpu_blocks: int
    block_size: int
    kv_token_capacity: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool
    resident_prefix_tokens: int
    cpu_offload_gib: float
    disk_offload_gib: float
    offload_backend: str | None
    offload_disk_path: str | None
    pod_memory_gib: float
    shm_gib: float
    num_layers: int
    num_kv_heads_per_gpu: int
    head_dim: int
    memory: dict[str, int]
    estimates: dict[str, float | None]
    limits: dict[str, int]
    checks: tuple[Check, ...]
    derivation: tuple[str, ...]
    warnings: tuple[str, ...]
    suggestions: tuple[Suggestion, ...] = field(default_factory=tuple)
    # A hybrid model (sliding-window layers in their own KV pool, ``HybridKVLayout``): how
    # many layers that pool serves, their window and the pool's blocks; 0 / None otherwise.
    # ``num_gpu_blocks`` / ``kv_token_capacity`` then count the full-attention pool.
    num_sliding_pool_layers: int = 0
    sliding_window: int | None = None
    sliding_pool_blocks: int = 0
    # Pipeline parallelism: nodes (stages) per replica, each of ``tensor_parallel_size`` GPUs;
    # ``stages`` says per stage its layers, what it holds besides them (embedding, LM head)
    # and its GPUs' weight / reserve / KV bytes (empty with one stage). Per-GPU figures above
    # are then the stage with the most layers' (every GPU gets ``kv_cache_memory_bytes``).
    pipeline_parallel_size: int = 1
    gpus_per_node: int = 8
    stages: tuple[dict[str, Any], ...] = ()
    # Speculative decoding: vLLM's --speculative-config (None: off) and its drafter's KV bytes
    # per token, kept in the same blocks (0 for n-gram lookup).
    speculative_config: dict[str, Any] | None = None
    draft_kv_bytes_per_token: int = 0

    @property
    def kv_layout(self) -> KVLayout | HybridKVLayout:
        """The engine's KV layout for this plan: ``kv_layout.num_blocks(kv_cache_memory_bytes)``
        is ``num_gpu_blocks`` (the round trip the engine must reproduce)."""
        if not self.num_sliding_pool_layers:
            return KVLayout(self.num_layers, self.num_kv_heads_per_gpu, self.head_dim, self.kv_dtype_bytes,
                            self.block_size, extra_bytes_per_token=self.draft_kv_bytes_per_token)
        pool = (self.num_kv_heads_per_gpu, self.head_dim, self.kv_dtype_bytes, self.block_size)
        return HybridKVLayout(KVLayout(self.num_layers - self.num_sliding_pool_layers, *pool),
                              KVLayout(self.num_sliding_pool_layers, *pool), self.sliding_window,
                              self.sliding_pool_blocks)

    @property
    def wants_offload(self) -> bool:
        return self.cpu_offload_gib > 0 or self.disk_offload_gib > 0

    def serve_args(self) -> list[str]:
        """The ``kvpilot serve`` flags that realise this plan (model path not included)."""
        args = ["--max-model-len", str(self.max_model_len),
                "--max-num-seqs", str(self.max_num_seqs),
                "--max-num-batched-tokens", str(self.max_num_batched_tokens),
                "--block-size", str(self.block_size),
                "--kv-cache-dtype", self.kv_cache_dtype,
                "--gpu-memory-utilization", _num(self.gpu_memory_utilization),
                "--kv-cache-memory-bytes", str(self.kv_cache_memory_bytes),
                "--enable-prefix-caching" if self.enable_prefix_caching else "--no-enable-prefix-caching"]
        if self.tensor_parallel_size > 1:
            args += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.pipeline_parallel_size > 1:
            args += ["--pipeline-parallel-size", str(self.pipeline_parallel_size)]
        if self.wants_offload:
            if self.cpu_offload_gib > 0:
                args += ["--kv-offloading-size", _num(self.cpu_offload_gib)]
            args += ["--kv-offloading-backend", self.offload_backend or "native"]
            if self.disk_offload_gib > 0:
                args += ["--kv-offloading-disk-path", self.offload_disk_path or DEFAULT_DISK_PATH,
                         "--kv-offloading-disk-size", _num(self.disk_offload_gib)]
        if self.speculative_config is not None:
            args += ["--speculative-config", json.dumps(self.speculative_config, sort_keys=True)]
        return args

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form with snake_case keys (fresh containers; safe to mutate)."""
        out: dict[str, Any] = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if name == "checks":
                value = [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in value]
            elif name == "suggestions":
                value = [s.to_dict() for s in value]
            elif isinstance(value, (tuple, dict)):
                value = copy.deepcopy(list(value) if isinstance(value, tuple) else value)
            out[name] = value
        out["serve_args"] = self.serve_args()
        return out
