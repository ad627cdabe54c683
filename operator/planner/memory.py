"""GPU memory arithmetic: the budget, KV blocks, sequences, prefix tiers.

Per GPU (one tensor-parallel rank)::

    budget      = gpu_memory_utilization x GPU memory (as CUDA reports it)
    KV estimate = budget - weights / TP - reserve - LoRA slots   (reserve.py, lora.py)
    KV          = KV estimate x (1 - kv_safety_margin)

The margin keeps the pinned ``--kv-cache-memory-bytes`` under what the engine's own
profile will find even where the calibrated estimate runs high (see ``reserve.FIT``).

The reserve is sized from the default (or pinned) max_num_batched_tokens and the
target concurrency, not from the values finally chosen, so that tightening a latency
target never frees KV memory (the planner's monotonicity guarantees rely on it).

Prefix tiers: each distinct shared prefix occupies ``shared_prefix_tokens // block_size``
full blocks (only full blocks are cached). Prefixes stay on the GPU in whatever KV
is left after ``max_num_seqs`` sequences; the rest go to a CPU tier (host memory,
default cap 2 x the replica's GPU memory), then to disk. The engine does not offload
KV under tensor parallelism, so a replica of more than one GPU gets no tiers.

Host memory per replica (one pod): a base for the engine process, a share per GPU worker
process, and ``/dev/shm`` (the CPU KV tier, the engine's IPC, and per extra rank room for
NCCL's shared-memory transport between the GPU workers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpilot.contract.kv_layout import blocks_held
from kvpilot.operator.planner.model_spec import ModelSpec
from kvpilot.operator.planner.reserve import Reserve

GIB = 1 << 30
CPU_TIER_CAP_PER_GPU_MEMORY = 2.0
HOST_BASE_GIB = 4            # engine process, tokenizer, safetensors page cache churn
HOST_PER_RANK_GIB = 2        # per GPU worker process
SHM_BASE_GIB = 1             # inter-process buffers (NCCL, tokenizer workers)
SHM_PER_EXTRA_RANK_GIB = 1   # tensor parallelism: NCCL's shared-memory buffers per further rank


def gib(num_bytes: float) -> float:
    return num_bytes / GIB


def ceil_gib(num_bytes: float) -> int:
    return math.ceil(num_bytes / GIB) if num_bytes > 0 else 0


@dataclass(frozen=True, slots=True)
class Budget:
    """One GPU's split of memory; ``kv_bytes`` <= 0 means weights + reserve do not fit."""

    gpu_memory_bytes: int
    gpu_memory_utilization: float
    weight_bytes: int          # per GPU
    reserve: Reserve
    kv_safety_margin: float = 0.0
    kv_pinned_bytes: int | None = None  # the kv_cache_memory_bytes override
    lora_bytes: int = 0                 # the LoRA adapter slots (lora.py)

    @property
    def budget_bytes(self) -> int:
        return int(self.gpu_memory_bytes * self.gpu_memory_utilization)

    @property
    def kv_estimate_bytes(self) -> int:
        """The calibrated estimate of what the engine's profile leaves for the KV cache."""
        return self.budget_bytes - self.weight_bytes - self.reserve.total_bytes - self.lora_bytes

    @property
    def kv_available_bytes(self) -> int:
        """KV memory the GPU leaves for the plan: the estimate less the safety margin."""
        estimate = self.kv_estimate_bytes
        return int(estimate * (1 - self.kv_safety_margin)) if estimate > 0 else estimate

    @property
    def kv_bytes(self) -> int:
        """KV memory planned: the pinned size, else all that is available."""
        return self.kv_pinned_bytes if self.kv_pinned_bytes is not None else self.kv_available_bytes


def blocks_for(model: ModelSpec, num_tokens: int, block_size: int) -> int:
    """KV blocks one sequence of ``num_tokens`` holds: the engine's own count (capped at
    the window and one block when every layer slides)."""
    return blocks_held(num_tokens, block_size, model.kv_release_window)


def kv_seq_limit(num_blocks: int, max_context_blocks: int, seq_blocks: int) -> int:
    """Sequences that fit without preemption: one max-context sequence plus p95 ones.

    Room is kept for one sequence at ``max_model_len`` (a long request must never be
    unschedulable), and every other running sequence is budgeted at the p95 length.
    Returns 0 when not even the max-context sequence fits.
    """
    if num_blocks < max_context_blocks:
        return 0
    return (num_blocks - max_context_blocks) // seq_blocks + 1


@dataclass(frozen=True, slots=True)
class PrefixTiers:
    """Where the distinct shared prefixes live."""

    blocks_each: int              # full blocks per prefix (per GPU)
    bytes_each: int               # KV bytes of one prefix across the replica's GPUs
    distinct: int
    on_gpu: int
    on_cpu: int
    on_disk: int
    cpu_offload_gib: float
    disk_offload_gib: float

    @property
    def uncached(self) -> int:
        return self.distinct - self.on_gpu - self.on_cpu - self.on_disk

    @property
    def gpu_blocks(self) -> int:
        return self.on_gpu * self.blocks_each


def place_prefixes(*, blocks_each: int, bytes_each: int, distinct: int, free_blocks: int,
                   replica_gpu_memory_bytes: int, cpu_offload_gib: float | None,
                   disk_offload_gib: float | None) -> PrefixTiers:
    """Fill GPU leftovers first, then the CPU tier, then disk (pinned sizes win)."""
    if blocks_each == 0 or distinct == 0:
        return PrefixTiers(blocks_each, bytes_each, distinct if blocks_each else 0, 0, 0, 0,
                           cpu_offload_gib or 0, disk_offload_gib or 0)
    on_gpu = min(distinct, max(0, free_blocks) // blocks_each)
    rest = distinct - on_gpu
    cpu_cap = (cpu_offload_gib * GIB if cpu_offload_gib is not None
               else CPU_TIER_CAP_PER_GPU_MEMORY * replica_gpu_memory_bytes)
    on_cpu = min(rest, int(cpu_cap // bytes_each))
    rest -= on_cpu
    on_disk = rest if disk_offload_gib is None else min(rest, int(disk_offload_gib * GIB // bytes_each))
    cpu = cpu_offload_gib if cpu_offload_gib is not None else ceil_gib(on_cpu * bytes_each)
    disk = disk_offload_gib if disk_offload_gib is not None else ceil_gib(on_disk * bytes_each)
    return PrefixTiers(blocks_each, bytes_each, distinct, on_gpu, on_cpu, on_disk, cpu, disk)


def offload_allowed(tensor_parallel_size: int, releases_blocks: bool = False) -> bool:
    """Whether a replica of this many GPUs can have KV offload tiers: one GPU only, and not
    for a model whose blocks the engine releases outside a sliding window
    (``ModelSpec.releases_kv_blocks``; the engine refuses offload for it)."""
    return tensor_parallel_size == 1 and not releases_blocks


def offload_tiers_gib(prefixes: PrefixTiers | None, cpu_offload_gib: float | None,
                      disk_offload_gib: float | None, tensor_parallel_size: int = 1,
                      releases_blocks: bool = False) -> tuple[float, float]:
    """(CPU, disk) KV tier sizes per replica in GiB: where the shared prefixes were placed,
    else the pinned sizes (0 when not pinned, and always 0 where ``offload_allowed`` says no)."""
    if not offload_allowed(tensor_parallel_size, releases_blocks):
        return 0, 0
    if prefixes is not None:
        return prefixes.cpu_offload_gib, prefixes.disk_offload_gib
    return cpu_offload_gib or 0, disk_offload_gib or 0


def host_memory_gib(tp: int, cpu_offload_gib: float) -> tuple[float, float]:
    """(pod memory, /dev/shm size) in GiB: the CPU tier lives in shared memory, and
    tmpfs pages count against the pod's memory limit, so the pod needs both."""
    shm = cpu_offload_gib + SHM_BASE_GIB + SHM_PER_EXTRA_RANK_GIB * (tp - 1)
    return HOST_BASE_GIB + HOST_PER_RANK_GIB * tp + shm, shm
