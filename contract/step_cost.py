"""The cost of an engine step from the model's shape: FLOPs and memory traffic (torch-free).

One model of a step, used by both sides that need one:

- the engine's MFU metrics (``--enable-mfu-metrics``: ``vllm:estimated_flops_per_gpu_total``,
  ``vllm:estimated_{read,write}_bytes_per_gpu_total``) add up ``step()`` of every step;
  ``rate(flops) / peak`` is the model FLOPs utilisation;
- the planner's roofline latency estimate (``operator/planner/latency.py``) times a step
  from ``flops_per_token``, ``weight_read_bytes`` and ``kv_read_bytes``.

Estimates, not hardware counters:

- FLOPs: 2 per weight per token for every linear layer (attention projections, the MLP with
  a gate), the LM head (2 x vocab x hidden) once per request scheduled (the one position
  that samples: logits are not computed for the rest of a prompt), and attention's two
  matrix products, 2 x 2 x heads x head_dim per (query, key) pair. A query at position
  ``i`` attends to the ``i + 1`` keys up to it, at most ``sliding_window`` of them on
  sliding-window layers. The embedding is a lookup: no FLOPs.
- Read: every weight once per step, and each scheduled request's KV context (on
  sliding-window layers at most the window). Write: the KV of the tokens computed.

Split evenly over tensor-parallel ranks ("per GPU"). The weight count is the architecture's
own (it equals the 2-D parameters HF transformers builds, tests/engine); a measured
checkpoint size (``total_weight_bytes``) replaces count x width where one is known.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepCost:
    flops: int
    read_bytes: int
    write_bytes: int


def _pairs(num_new: int, context_len: int, window: int | None) -> int:
    """(query, key) pairs of ``num_new`` queries ending at ``context_len``, each attending to
    the keys up to its own position, at most ``window`` of them."""
    start = context_len - num_new          # the queries are at positions start .. context_len - 1
    if window is None or context_len <= window:
        return num_new * start + num_new * (num_new + 1) // 2
    # a query at position p sees p + 1 keys while p + 1 <= window, else window keys
    short = max(0, min(context_len, window) - start)
    return short * start + short * (short + 1) // 2 + (num_new - short) * window


@dataclass(frozen=True, slots=True)
class StepCostModel:
    """The shape figures the estimate needs.

    Args:
        num_layers, hidden_size, intermediate_size, num_heads, num_kv_heads, head_dim,
            vocab_size: the architecture.
        weight_bytes: bytes per weight element (the compute dtype; 1 for FP8 weights).
        kv_bytes_per_token: KV cache bytes one token takes over all layers (all ranks).
        tensor_parallel_size: ranks the work is split over.
        num_sliding_layers / sliding_window: how many layers attend within a window, and
            its length (0 / None: every layer attends to the whole context).
        total_weight_bytes: the bytes of all weights a step reads, when measured (a
            checkpoint's size); None: the weight count x ``weight_bytes``.
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
    num_sliding_layers: int = 0
    sliding_window: int | None = None
    total_weight_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not 0 <= self.num_sliding_layers <= self.num_layers:
            raise ValueError(f"num_sliding_layers must be in [0, {self.num_layers}], got {self.num_sliding_layers}")
        if self.num_sliding_layers and not self.sliding_window:
            raise ValueError("sliding-window layers need a sliding_window")

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

    @property
    def weight_read_bytes(self) -> int:
        """Bytes of weights one GPU reads per step."""
        total = self.total_weight_bytes if self.total_weight_bytes is not None else \
            self.num_weights * self.weight_bytes
        return -(-total // self.tensor_parallel_size)

    def kv_tokens_read(self, context_len: int) -> int:
        """Whole-model token slots of KV one request at ``context_len`` reads (the average
        over layers, rounded up: sliding-window layers read at most the window)."""
        full = self.num_layers - self.num_sliding_layers
        kept = full * context_len + self.num_sliding_layers * min(context_len, self.sliding_window or context_len)
        return -(-kept // self.num_layers)

    def kv_read_bytes(self, context_len: int) -> int:
        """KV bytes one GPU reads for one request at ``context_len``."""
        return self.kv_tokens_read(context_len) * self.kv_bytes_per_token // self.tensor_parallel_size

    def _attention_pairs(self, num_new: int, context_len: int) -> int:
        """(query, key) pairs summed over layers."""
        full = self.num_layers - self.num_sliding_layers
        pairs = full * _pairs(num_new, context_len, None)
        if self.num_sliding_layers:
            pairs += self.num_sliding_layers * _pairs(num_new, context_len, self.sliding_window)
        return pairs

    def flops(self, num_new: int, context_len: int) -> int:
        """FLOPs (all ranks) of one request computing ``num_new`` tokens up to ``context_len``."""
        linear = 2 * num_new * self.num_layers * self.layer_linear_params
        lm_head = 2 * self.vocab_size * self.hidden_size
        attention = 4 * self.num_heads * self.head_dim * self._attention_pairs(num_new, context_len)
        return linear + lm_head + attention

    def flops_per_token(self, prompt_tokens: int) -> float:
        """FLOPs (all ranks) per token of prefilling a ``prompt_tokens`` prompt from empty."""
        return self.flops(prompt_tokens, prompt_tokens) / prompt_tokens

    def step(self, scheduled: Iterable[tuple[int, int]]) -> StepCost:
        """The cost of one step, per GPU.

        Args:
            scheduled: per scheduled request, (tokens computed this step, context length
                after the step).
        """
        flops = tokens = read = 0
        for num_new, context_len in scheduled:
            flops += self.flops(num_new, context_len)
            tokens += num_new
            read += self.kv_tokens_read(context_len) * self.kv_bytes_per_token
        tp = self.tensor_parallel_size
        return StepCost(flops=flops // tp, read_bytes=self.weight_read_bytes + read // tp,
                        write_bytes=tokens * self.kv_bytes_per_token // tp)
