"""GPU memory arithmetic: the budget, the reserve, KV blocks, sequences, prefix tiers.

Per GPU (one tensor-parallel rank)::

    budget  = gpu_memory_utilization x GPU memory
    KV      = budget - weights / TP - reserve
    reserve = fixed + activations + logits

The reserve model (what the engine needs besides weights and KV):

- fixed 1.00 GiB: CUDA context (~0.5 GiB), cuBLAS / attention workspaces and the
  CUDA-graph pool; plus 0.50 GiB of NCCL buffers when TP > 1;
- activations of the largest forward pass: ``tokens x (4 x hidden + 3 x intermediate / TP)``
  elements of the model dtype, with ``tokens`` = max_num_batched_tokens (the residual
  stream, the normed input and attention output, and the MLP's gate, up and
  activated tensors live at once at the peak);
- logits: ``seqs x vocab x 8 bytes`` (fp32 logits plus probabilities for each
  sequence sampled in a step).

The reserve is sized from the default (or pinned) max_num_batched_tokens and the
target concurrency, not from the values finally chosen, so that tightening a latency
target never frees KV memory (the planner's monotonicity guarantees rely on it).

Prefix tiers: each distinct shared prefix occupies ``shared_prefix_tokens // block_size``
full blocks (only full blocks are cached). Prefixes stay on the GPU in whatever KV
is left after ``max_num_seqs`` sequences; the rest go to a CPU tier (host memory,
default cap 2 x the replica's GPU memory), then to disk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpilot.operator.planner.model_spec import ModelSpec

GIB = 1 << 30
FIXED_RESERVE_BYTES = GIB
TP_RESERVE_BYTES = GIB // 2
LOGIT_BYTES_PER_VOCAB_ENTRY = 8
CPU_TIER_CAP_PER_GPU_MEMORY = 2.0
HOST_BASE_GIB = 4            # engine process, tokenizer, safetensors page cache churn
HOST_PER_RANK_GIB = 2        # per GPU worker process
SHM_BASE_GIB = 1             # inter-process buffers (NCCL, tokenizer workers)


def gib(num_bytes: float) -> float:
    return num_bytes / GIB


def ceil_gib(num_bytes: float) -> int:
    return math.ceil(num_bytes / GIB) if num_bytes > 0 else 0


@dataclass(frozen=True, slots=True)
class Reserve:
    """Per-GPU memory kept outside weights and KV (see module docstring)."""

    fixed_bytes: int
    activation_tokens: int
    activation_bytes_per_token: int
    logit_seqs: int
    logit_bytes_per_seq: int

    @property
    def activation_bytes(self) -> int:
        return self.activation_tokens * self.activation_bytes_per_token

    @property
    def logit_bytes(self) -> int:
        return self.logit_seqs * self.logit_bytes_per_seq

    @property
    def total_bytes(self) -> int:
        return self.fixed_bytes + self.activation_bytes + self.logit_bytes


def reserve(model: ModelSpec, tp: int, activation_tokens: int, logit_seqs: int) -> Reserve:
    """The reserve for ``activation_tokens`` per forward pass and ``logit_seqs`` sampled sequences."""
    fixed = FIXED_RESERVE_BYTES + (TP_RESERVE_BYTES if tp > 1 else 0)
    per_token = (4 * model.hidden_size + 3 * math.ceil(model.intermediate_size / tp)) * model.dtype_bytes
    return Reserve(fixed, activation_tokens, per_token, logit_seqs,
                   model.vocab_size * LOGIT_BYTES_PER_VOCAB_ENTRY)


@dataclass(frozen=True, slots=True)
class Budget:
    """One GPU's split of memory; ``kv_bytes`` <= 0 means weights + reserve do not fit."""

    gpu_memory_bytes: int
    gpu_memory_utilization: float
    weight_bytes: int          # per GPU
    reserve: Reserve

    @property
    def budget_bytes(self) -> int:
        return int(self.gpu_memory_bytes * self.gpu_memory_utilization)

    @property
    def kv_bytes(self) -> int:
        return self.budget_bytes - self.weight_bytes - self.reserve.total_bytes


def blocks_for(model: ModelSpec, num_tokens: int, block_size: int) -> int:
    """KV blocks one sequence of ``num_tokens`` holds (sliding-window layers capped)."""
    return -(-model.kv_tokens(num_tokens) // block_size)


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


def offload_tiers_gib(prefixes: PrefixTiers | None, cpu_offload_gib: float | None,
                      disk_offload_gib: float | None) -> tuple[float, float]:
    """(CPU, disk) KV tier sizes per replica in GiB: where the shared prefixes were placed,
    else the pinned sizes (0 when not pinned)."""
    if prefixes is not None:
        return prefixes.cpu_offload_gib, prefixes.disk_offload_gib
    return cpu_offload_gib or 0, disk_offload_gib or 0


def host_memory_gib(tp: int, cpu_offload_gib: float) -> tuple[float, float]:
    """(pod memory, /dev/shm size) in GiB: the CPU tier lives in shared memory, and
    tmpfs pages count against the pod's memory limit, so the pod needs both."""
    shm = cpu_offload_gib + SHM_BASE_GIB
    return HOST_BASE_GIB + HOST_PER_RANK_GIB * tp + shm, shm
