"""The KV-cache memory formula, shared by the engine and the operator's planner.

Torch-free on purpose: the operator image has no torch, and the planner's promise
("an engine given these bytes gets exactly this many blocks") only holds if both
sides compute the block count with this one function.

    bytes/token = 2 (K and V) x layers x kv_heads x head_dim x dtype_bytes
                  (+ a speculative draft model's or EAGLE head's own, in the same blocks)
    bytes/block = bytes/token x block_size
    num_blocks  = floor(kv_cache_memory_bytes / bytes/block)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpilot.contract.constants import FP8_KV_DTYPES, MODEL_DTYPE_BYTES

# Bytes per element of each KV cache dtype name accepted by the engine and the CLI.
KV_DTYPE_BYTES: dict[str, int] = {**MODEL_DTYPE_BYTES, **dict.fromkeys(FP8_KV_DTYPES, 1)}


def kv_dtype_bytes(kv_cache_dtype: str, model_dtype: str) -> int:
    """Bytes per KV element: ``auto`` follows the model dtype, ``fp8*`` is one byte."""
    name = model_dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    try:
        return KV_DTYPE_BYTES[name]
    except KeyError:
        known = ", ".join(["auto", *KV_DTYPE_BYTES])
        raise ValueError(f"unknown KV cache dtype {name!r}; expected one of: {known}") from None


def kv_heads_per_rank(num_kv_heads: int, tensor_parallel_size: int) -> int:
    """KV heads held by one GPU under tensor parallelism.

    Heads are split across ranks; when there are fewer KV heads than ranks each
    rank keeps a replica of one head (as vLLM does), so the count never drops below 1.
    """
    if num_kv_heads < 1 or tensor_parallel_size < 1:
        raise ValueError("num_kv_heads and tensor_parallel_size must be >= 1")
    return max(1, math.ceil(num_kv_heads / tensor_parallel_size))


def tensor_parallel_split_error(num_attention_heads: int, num_kv_heads: int,
                                intermediate_size: int, tensor_parallel_size: int) -> str | None:
    """Why ``tensor_parallel_size`` ranks cannot split this model, or None when they can.

    Query heads and the MLP's intermediate size must split evenly; KV heads must split
    evenly too, or (fewer KV heads than ranks) the ranks must be a multiple of them,
    each KV head then replicated on ``tensor_parallel_size / num_kv_heads`` ranks
    (vLLM's rule). The engine and the planner both ask this one function.
    """
    tp = tensor_parallel_size
    if tp < 1:
        return f"tensor_parallel_size must be >= 1, got {tp}"
    if num_attention_heads % tp:
        return f"its {num_attention_heads} attention heads do not split evenly over {tp} GPUs"
    if num_kv_heads % tp and tp % num_kv_heads:
        return (f"its {num_kv_heads} KV heads neither split evenly over {tp} GPUs nor divide {tp} "
                f"(to be replicated)")
    if intermediate_size % tp:
        return f"its MLP intermediate size {intermediate_size} does not split evenly over {tp} GPUs"
    return None


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """2 x layers x kv_heads x head_dim x dtype_bytes (the 2 is one K and one V)."""
    for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim), ("dtype_bytes", dtype_bytes)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def num_released_blocks(num_computed_tokens: int, block_size: int, release_window: int | None) -> int:
    """Leading blocks of a sequence that no query from ``num_computed_tokens`` on can see.

    A query at position ``p`` of a sliding-window layer sees keys ``p - window + 1 .. p``
    (HF's mask: ``kv_idx > q_idx - window``), so once the first token still to compute
    is at ``num_computed_tokens``, every block wholly before
    ``num_computed_tokens - window + 1`` is dead. ``release_window`` None: none are.
    """
    if release_window is None:
        return 0
    return max(0, num_computed_tokens - release_window + 1) // block_size


def blocks_held(num_tokens: int, block_size: int, release_window: int | None = None) -> int:
    """The most KV blocks one sequence holds while it decodes up to ``num_tokens`` tokens.

    Without a release window: every block, ``ceil(num_tokens / block_size)``. With one
    (a model whose layers all slide): the blocks spanned by the last ``window`` tokens,
    at most ``ceil((window - 1) / block_size) + 1`` (``window / block_size + 1`` when the
    window is a multiple of the block size: window + one block of tokens). The engine's
    block tables and the planner both count with this.
    """
    full = -(-num_tokens // block_size)
    if release_window is None:
        return full
    return min(full, -(-(release_window - 1) // block_size) + 1)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of one rank's paged KV cache: what a block costs and how many fit."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    block_size: int = 16
    # Per-layer element sizes when layers differ (e.g. fp8 cache with sliding-window
    # layers kept 16-bit); empty means every layer uses ``dtype_bytes``.
    layer_dtype_bytes: tuple[int, ...] = ()
    # KV bytes per token of a speculative draft model or EAGLE head, kept in the same
    # blocks (the block ids index its cache too): every block costs both.
    extra_bytes_per_token: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype_bytes)
        if self.layer_dtype_bytes and (len(self.layer_dtype_bytes) != self.num_layers
                                       or min(self.layer_dtype_bytes) < 1):
            raise ValueError(f"layer_dtype_bytes needs {self.num_layers} positive entries, "
                             f"got {self.layer_dtype_bytes}")
        if self.extra_bytes_per_token < 0:
            raise ValueError(f"extra_bytes_per_token must be >= 0, got {self.extra_bytes_per_token}")

    @property
    def bytes_per_token(self) -> int:
        if self.layer_dtype_bytes:
            own = 2 * self.num_kv_heads * self.head_dim * sum(self.layer_dtype_bytes)
        else:
            own = kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype_bytes)
        return own + self.extra_bytes_per_token

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def num_blocks(self, kv_cache_memory_bytes: int) -> int:
        """Whole blocks that fit in ``kv_cache_memory_bytes`` (floor; never negative)."""
        if kv_cache_memory_bytes < 0:
            raise ValueError(f"kv_cache_memory_bytes must be >= 0, got {kv_cache_memory_bytes}")
        return kv_cache_memory_bytes // self.bytes_per_block

    def token_capacity(self, num_blocks: int) -> int:
        return num_blocks * self.block_size

    def memory_for_blocks(self, num_blocks: int) -> int:
        return num_blocks * self.bytes_per_block


def sliding_pool_blocks(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                        block_size: int, window: int) -> int:
    """Blocks the sliding-window layers' own pool needs so that it never limits admission
    (hybrid models: full-attention and sliding-window layers keep separate block tables).

    Between steps a sequence holds the blocks of its last ``window - 1`` tokens, at most
    ``ceil((window - 2) / block_size) + 1`` (the scheduler releases the rest after each
    step); a step adds the blocks of its new tokens, at most ``ceil(n / block_size)`` for
    ``n`` tokens, and the ``n`` of one step sum to ``max_num_batched_tokens``. Over
    ``max_num_seqs`` sequences:
    ``max_num_seqs x (ceil((window - 2) / block_size) + 2) + ceil(max_num_batched_tokens / block_size)``,
    and never more than every sequence at ``max_model_len``. The engine and the planner
    both size the pool with this.
    """
    for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                        ("max_model_len", max_model_len), ("block_size", block_size), ("window", window)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    per_seq = -(-(window - 2) // block_size) + 2
    working_set = max_num_seqs * per_seq + -(-max_num_batched_tokens // block_size)
    return min(working_set, max_num_seqs * -(-max_model_len // block_size))


@dataclass(frozen=True, slots=True)
class HybridKVLayout:
    """One rank's KV cache for a model with full-attention and sliding-window layers, each
    kind in its own pool of blocks with its own block tables (vLLM's hybrid KV cache
    manager, as two pools).

    The sliding pool has a fixed size (``sliding_pool_blocks``, capped at the full pool's,
    since a sequence never holds more blocks there than in the full pool); every other
    byte goes to the full pool. ``num_blocks`` and the engine's ``num_gpu_blocks`` count
    the *full* pool: the KV capacity in tokens is ``num_blocks x block_size`` tokens of
    context on every layer, whatever the sliding layers need. ``bytes_per_block`` is what
    one more block of that capacity costs (a full-pool block); ``memory_for_blocks`` is
    the memory of both pools.
    """

    full: KVLayout                 # the full-attention layers
    sliding: KVLayout              # the sliding-window layers
    sliding_window: int
    max_sliding_blocks: int        # the sliding pool's size (sliding_pool_blocks)

    def __post_init__(self) -> None:
        if self.full.block_size != self.sliding.block_size:
            raise ValueError("both pools must use one block size")
        if self.sliding_window < 1 or self.max_sliding_blocks < 1:
            raise ValueError("sliding_window and max_sliding_blocks must be >= 1")

    @property
    def block_size(self) -> int:
        return self.full.block_size

    @property
    def num_layers(self) -> int:
        return self.full.num_layers + self.sliding.num_layers

    @property
    def num_kv_heads(self) -> int:
        return self.full.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.full.head_dim

    @property
    def dtype_bytes(self) -> int:
        return self.full.dtype_bytes

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token writes (every layer of both pools)."""
        return self.full.bytes_per_token + self.sliding.bytes_per_token

    @property
    def bytes_per_block(self) -> int:
        return self.full.bytes_per_block

    def num_sliding_blocks(self, num_blocks: int) -> int:
        """The sliding pool's blocks when the full pool has ``num_blocks``."""
        return min(self.max_sliding_blocks, num_blocks)

    def num_blocks(self, kv_cache_memory_bytes: int) -> int:
        """Full-pool blocks that fit in ``kv_cache_memory_bytes`` next to the sliding pool."""
        if kv_cache_memory_bytes < 0:
            raise ValueError(f"kv_cache_memory_bytes must be >= 0, got {kv_cache_memory_bytes}")
        full, sliding = self.full.bytes_per_block, self.sliding.bytes_per_block
        reserve = self.max_sliding_blocks * sliding
        if kv_cache_memory_bytes >= reserve + self.max_sliding_blocks * full:
            return (kv_cache_memory_bytes - reserve) // full
        return kv_cache_memory_bytes // (full + sliding)   # both pools the same size

    def token_capacity(self, num_blocks: int) -> int:
        return num_blocks * self.block_size

    def memory_for_blocks(self, num_blocks: int) -> int:
        return (num_blocks * self.full.bytes_per_block
                + self.num_sliding_blocks(num_blocks) * self.sliding.bytes_per_block)
