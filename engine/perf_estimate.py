"""Analytic FLOPs and memory traffic of engine steps, from the model's shape (torch-free).

The figures behind vLLM's MFU metrics (``--enable-mfu-metrics``):
``vllm:estimated_flops_per_gpu_total`` and ``vllm:estimated_{read,write}_bytes_per_gpu_total``.
``rate(flops) / peak`` is the model FLOPs utilisation, ``rate(read + write)`` the memory
bandwidth a step needs. Estimates, not hardware counters:

- FLOPs: 2 per weight per token for every linear layer (attention projections, MLP with
  a gate, the LM head on the one position per request that samples) plus attention's
  two matrix products, 2 x 2 x heads x head_dim per query token per context token.
- Read: every weight once per step, and each scheduled request's KV context.
- Write: the KV of the tokens computed.

Split evenly over tensor-parallel ranks ("per GPU").
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepCost:
    flops: int
    read_bytes: int
    write_bytes: int


@dataclass(frozen=True, slots=True)
class ModelCostModel:
    """The shape figures the estimate needs.

    Args:
        num_layers, hidden_size, intermediate_size, num_heads, num_kv_heads, head_dim,
            vocab_size: the architecture.
        weight_bytes: bytes per weight element (the compute dtype).
        kv_bytes_per_token: KV cache bytes one token takes over all layers (all ranks).
        tensor_parallel_size: ranks the work is split over.
    """

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    weight_bytes: int
    kv_bytes_per_token: int
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")

    @property
    def layer_linear_params(self) -> int:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = self.hidden_size * (q + 2 * kv) + q * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size     # gate, up, down
        return attention + mlp

    @property
    def num_weights(self) -> int:
        """Weights a step reads: the layers, the embedding and the LM head (counted twice
        even when tied: both are read)."""
        return self.num_layers * self.layer_linear_params + 2 * self.vocab_size * self.hidden_size

    def step(self, scheduled: Iterable[tuple[int, int]]) -> StepCost:
        """The cost of one step, per GPU.

        Args:
            scheduled: per scheduled request, (tokens computed this step, context length
                after the step).
        """
        tokens = attention_pairs = context = num_requests = 0
        for num_new, context_len in scheduled:
            tokens += num_new
            context += context_len
            # query i of the num_new attends to context_len - num_new + i + 1 keys
            attention_pairs += num_new * (context_len - num_new) + num_new * (num_new + 1) // 2
            num_requests += 1
        linear = 2 * tokens * self.num_layers * self.layer_linear_params
        lm_head = 2 * num_requests * self.vocab_size * self.hidden_size
        attention = 4 * self.num_layers * self.num_heads * self.head_dim * attention_pairs
        tp = self.tensor_parallel_size
        return StepCost(
            flops=(linear + lm_head + attention) // tp,
            read_bytes=(self.num_weights * self.weight_bytes + context * self.kv_bytes_per_token) // tp,
            write_bytes=(tokens * self.kv_bytes_per_token) // tp,
        )
