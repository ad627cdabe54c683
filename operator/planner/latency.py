"""Roofline latency model of one replica.

A step of the engine processes up to ``max_num_batched_tokens`` tokens: one per
decoding sequence plus a chunk of a prompt being prefilled. Its time is the larger
of reading memory and computing::

    memory  = (weights / TP + batch x KV bytes of one sequence / TP) / (HBM_EFFICIENCY x bandwidth)
    compute = tokens x FLOPs/token / (FLOPS_EFFICIENCY x TP x dense BF16 FLOP/s)

The bytes and FLOPs are the engine's own model of a step (``kvpilot.contract.step_cost``,
the one behind its MFU metrics): FLOPs/token of a prompt of P tokens is 2 x the linear
weights of the layers, the LM head once per prompt (2 x vocab x hidden / P) and
attention's 4 x heads x head_dim x (P + 1) / 2 keys per query summed over layers (at
most the window on sliding layers), which makes the prefill total about
``2 x linear x P + 2 x layers x heads x head_dim x P^2`` for full attention.

- ITL p95: a step with a full batch of p95-length sequences *and* a full prefill
  chunk, so ``max(memory(batch), compute(max_num_batched_tokens))``; that bounds both
  ``max_num_seqs`` (memory) and ``max_num_batched_tokens`` (compute).
- TTFT p95: the uncached part of a p95 prompt goes through in chunks of
  ``max_num_batched_tokens - max_num_seqs`` tokens (decodes take their slots), each
  step timed as above; at least one step. Queueing behind other prefills is not
  modelled (replicas are sized to REPLICA_UTILIZATION for that).
- Throughput: Little's law on p50 lengths, capped by compute.

Efficiencies are the fractions of peak a well-tuned engine reaches in practice
(decode kernels read HBM at ~80 % of peak; large prefill GEMMs reach ~50 % MFU
once attention and small-batch effects are included). TP all-reduce time is not
modelled.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from kvpilot.contract.step_cost import StepCostModel
from kvpilot.operator.planner.model_spec import ModelSpec

HBM_EFFICIENCY = 0.80
FLOPS_EFFICIENCY = 0.50
REPLICA_UTILIZATION = 0.80


def step_cost_model(model: ModelSpec, kv_bytes_per_token: int, tensor_parallel_size: int,
                    weight_bytes_total: int) -> StepCostModel:
    """The engine's step cost model of ``model`` on ``tensor_parallel_size`` GPUs.

    Args:
        kv_bytes_per_token: KV bytes of one token on one GPU (the plan's KV layout).
        weight_bytes_total: the weights' bytes over all GPUs (measured where known).
    """
    return StepCostModel(
        num_layers=model.num_layers, hidden_size=model.hidden_size, intermediate_size=model.intermediate_size,
        num_heads=model.num_attention_heads, num_kv_heads=model.num_kv_heads, head_dim=model.head_dim,
        vocab_size=model.vocab_size, weight_bytes=model.dtype_bytes,
        kv_bytes_per_token=kv_bytes_per_token * tensor_parallel_size, tensor_parallel_size=tensor_parallel_size,
        num_sliding_layers=model.num_sliding_layers, sliding_window=model.sliding_window,
        total_weight_bytes=weight_bytes_total)


@dataclass(frozen=True, slots=True)
class Roofline:
    """Step-time model of one replica.

    Args:
        weight_bytes: weights per GPU.
        seq_kv_bytes: KV bytes per GPU of one sequence at the length being modelled.
        bandwidth: peak memory bandwidth of one GPU, bytes/s.
        replica_flops: peak dense BF16 FLOP/s of all GPUs of the replica.
        flops_per_token: FLOPs per processed token (``StepCostModel.flops_per_token``).
    """

    weight_bytes: int
    seq_kv_bytes: int
    bandwidth: float
    replica_flops: float
    flops_per_token: float

    @classmethod
    def of(cls, cost: StepCostModel, bandwidth: float, replica_flops: float, seq_tokens: int,
           prompt_tokens: int) -> Roofline:
        """The roofline of sequences of ``seq_tokens`` tokens and prompts of ``prompt_tokens``."""
        return cls(cost.weight_read_bytes, cost.kv_read_bytes(seq_tokens), bandwidth, replica_flops,
                   cost.flops_per_token(prompt_tokens))

    @property
    def effective_bandwidth(self) -> float:
        return HBM_EFFICIENCY * self.bandwidth

    @property
    def effective_flops(self) -> float:
        return FLOPS_EFFICIENCY * self.replica_flops

    def memory_s(self, batch: int) -> float:
        return (self.weight_bytes + batch * self.seq_kv_bytes) / self.effective_bandwidth

    def compute_s(self, tokens: float) -> float:
        return tokens * self.flops_per_token / self.effective_flops

    def step_s(self, batch: int, tokens: float) -> float:
        return max(self.memory_s(batch), self.compute_s(tokens))

    def batch_limit(self, itl_s: float) -> int:
        """Largest batch whose memory time fits in ``itl_s`` (0 if the weights alone do not)."""
        room = itl_s * self.effective_bandwidth - self.weight_bytes
        return max(0, math.floor(room / self.seq_kv_bytes)) if room >= 0 else 0

    def token_limit(self, itl_s: float) -> int:
        """Most tokens one step may compute within ``itl_s``."""
        return math.floor(itl_s * self.effective_flops / self.flops_per_token)

    def ttft_s(self, batch: int, max_num_batched_tokens: int, prompt_tokens: int) -> float:
        """Time to prefill ``prompt_tokens`` while ``batch`` sequences decode alongside."""
        share = max_num_batched_tokens - batch
        if share <= 0:
            return math.inf
        steps = max(1.0, prompt_tokens / share)
        return steps * self.step_s(batch, min(max_num_batched_tokens, prompt_tokens + batch))


def largest_int(lo: int, hi: int, fits: Callable[[int], bool]) -> int | None:
    """Largest v in [lo, hi] with fits(v), for fits monotone (true then false); None if none."""
    if hi < lo or not fits(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo
