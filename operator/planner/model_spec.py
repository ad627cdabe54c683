"""A model's architecture as the planner needs it (``ModelSpec``).

From an HF ``config.json`` dict it is read by the engine's own reader
(``kvpilot.contract.arch_config.read_arch_config``: both transformers layouts, the
defaults of ``num_key_value_heads``, ``head_dim`` and the dtype, which layers slide), so
the planner sizes the model the engine builds; ``max_position_embeddings`` here is the
longest context (``ArchConfig.max_context``: stretched by a yarn / dynamic / linear rope).
Mixture-of-experts configs are refused: the planner sizes dense decoders.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any

from kvpilot.contract.arch_config import hybrid_kv, kv_release_window, read_arch_config, text_config
from kvpilot.contract.kv_layout import tensor_parallel_split_error
from kvpilot.operator.planner.weights import (
    DTYPE_BYTES,
    WEIGHT_QUANT_BYTES,
    estimate_num_params,
    quantized_weight_bytes,
)

_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Architecture numbers of a dense decoder-only model.

    Args:
        name: display name (preset key, hub id or directory name).
        num_layers / num_attention_heads / num_kv_heads / head_dim / hidden_size /
            intermediate_size / vocab_size: as in config.json.
        max_position_embeddings: longest context the model supports (after rope stretching).
        dtype: checkpoint dtype name (``bfloat16``, ``float16``, ``float32``).
        num_params: parameter count held on the GPUs (tied embeddings counted once).
        weight_bytes: bytes of weights to load; None = num_params x dtype bytes.
        weight_source: where weight_bytes / num_params came from, for the derivation.
        sliding_window: window of the sliding-window layers (None = none).
        num_sliding_layers: how many layers use that window.
        rope_theta: rotary base (informational).
        tied_embeddings: the LM head shares the input embedding matrix.
        weight_quantization: the checkpoint's own weight quantization (``fp8``, from
            config.json's ``quantization_config``; None = unquantized).
    """

    name: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    dtype: str
    num_params: int
    weight_bytes: int | None = None
    weight_source: str = "parameter-count estimate"
    sliding_window: int | None = None
    num_sliding_layers: int = 0
    rope_theta: float | None = None
    tied_embeddings: bool = False
    weight_quantization: str | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim", "hidden_size",
                     "intermediate_size", "vocab_size", "max_position_embeddings", "num_params"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model {name} must be a positive integer, got {value!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"model dtype must be one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple "
                             f"of num_key_value_heads ({self.num_kv_heads})")
        if self.weight_bytes is not None and self.weight_bytes < 1:
            raise ValueError(f"weight_bytes must be positive, got {self.weight_bytes}")
        if not 0 <= self.num_sliding_layers <= self.num_layers:
            raise ValueError(f"num_sliding_layers must be in [0, {self.num_layers}]")
        if self.num_sliding_layers and (self.sliding_window is None or self.sliding_window < 1):
            raise ValueError("sliding-window layers need a positive sliding_window")
        if self.weight_quantization is not None and self.weight_quantization not in WEIGHT_QUANT_BYTES:
            raise ValueError(f"model weight_quantization must be one of {', '.join(WEIGHT_QUANT_BYTES)}, "
                             f"got {self.weight_quantization!r}")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def total_weight_bytes(self) -> int:
        """Weight bytes to load: measured if known, else parameters x dtype bytes (the
        linear layers' parameters at the checkpoint's quantized width when it has one)."""
        if self.weight_bytes is not None:
            return self.weight_bytes
        if self.weight_quantization is not None:
            return quantized_weight_bytes(self.num_params, self.embedding_params, self.dtype_bytes,
                                          self.weight_quantization)
        return self.num_params * self.dtype_bytes

    @property
    def embedding_params(self) -> int:
        """Parameters of the input embedding and the LM head (one matrix when tied)."""
        return self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)

    @property
    def num_full_layers(self) -> int:
        return self.num_layers - self.num_sliding_layers

    @property
    def kv_release_window(self) -> int | None:
        """The window outside which the engine releases a sequence's KV blocks from its one
        block table: only when every layer slides (mixed layers: ``hybrid_kv``, where the
        full-attention pool holds every block); ``kv_layout.blocks_held`` counts what a
        sequence holds."""
        return kv_release_window(self.num_layers, self.num_sliding_layers, self.sliding_window)

    def hybrid_kv(self, max_context: int) -> bool:
        """Whether the engine keeps the sliding-window layers' KV in a pool of their own
        (``contract.arch_config.hybrid_kv``, the engine's rule): both kinds of layer and a
        context that can outgrow the window. The full-attention layers then hold every
        block; the sliding pool is sized by ``kv_layout.sliding_pool_blocks``."""
        return hybrid_kv(self.num_layers, self.num_sliding_layers, self.sliding_window, max_context)

    def releases_kv_blocks(self, max_context: int) -> bool:
        """Whether the engine releases a sequence's blocks outside a sliding window at this
        context (every layer slides, or a hybrid KV cache): it then refuses KV offload."""
        window = self.kv_release_window
        return (window is not None and max_context > window) or self.hybrid_kv(max_context)

    def kv_tokens(self, num_tokens: int) -> int:
        """Token slots the KV of one ``num_tokens`` sequence occupies: all of them, or at
        most the window when every layer slides (the engine releases older blocks)."""
        window = self.kv_release_window
        return num_tokens if window is None else min(num_tokens, window)

    def kv_tokens_attended(self, num_tokens: int) -> int:
        """Whole-model token slots one decode step of a ``num_tokens`` sequence reads:
        full-attention layers read all tokens, sliding-window layers at most the window."""
        if not self.num_sliding_layers:
            return num_tokens
        kept = self.num_full_layers * num_tokens + self.num_sliding_layers * min(num_tokens, self.sliding_window)
        return -(-kept // self.num_layers)

    def tensor_parallel_error(self, tensor_parallel_size: int) -> str | None:
        """Why the engine cannot split this model over ``tensor_parallel_size`` GPUs, or None
        (the engine's own rule: ``kv_layout.tensor_parallel_split_error``)."""
        return tensor_parallel_split_error(self.num_attention_heads, self.num_kv_heads,
                                           self.intermediate_size, tensor_parallel_size)

    def valid_tensor_parallel_sizes(self, choices: tuple[int, ...] = (1, 2, 4, 8)) -> list[int]:
        """TP sizes that split the query heads and the MLP evenly and the KV heads evenly
        (or replicate them)."""
        return [tp for tp in choices if tp >= 1 and self.tensor_parallel_error(tp) is None]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown model field(s) {unknown}; known: {sorted(known)}")
        missing = sorted(f.name for f in fields(cls) if f.name not in data
                         and f.default is MISSING)
        if missing:
            raise ValueError(f"model is missing field(s) {', '.join(missing)} (or give a preset, path or config)")
        return cls(**data)


def model_from_config(cfg: dict[str, Any], name: str, *, num_params: int | None = None,
                      weight_bytes: int | None = None, weight_source: str | None = None) -> ModelSpec:
    """Build a ModelSpec from a config.json dict, read as the engine reads it
    (``kvpilot.contract.arch_config``).

    Args:
        cfg: the parsed config.json.
        name: display name for reports.
        num_params: published parameter count; None = estimate from the architecture.
        weight_bytes: measured checkpoint bytes (safetensors); None = num_params x dtype.
        weight_source: how weight_bytes / num_params were obtained (for the derivation).
    """
    cfg = text_config(cfg)
    moe = [k for k in _MOE_KEYS if cfg.get(k)]
    if moe:
        raise ValueError(f"{name}: mixture-of-experts configs ({moe[0]}={cfg[moe[0]]}) are not "
                         "supported by the planner; it sizes dense decoder models")
    arch = read_arch_config(cfg, source=f"{name}: config.json")
    source = weight_source or ("safetensors" if weight_bytes else "parameter-count estimate")
    return ModelSpec(name=name, num_layers=arch.num_hidden_layers, num_attention_heads=arch.num_attention_heads,
                     num_kv_heads=arch.num_key_value_heads, head_dim=arch.head_dim, hidden_size=arch.hidden_size,
                     intermediate_size=arch.intermediate_size, vocab_size=arch.vocab_size,
                     max_position_embeddings=arch.max_context, dtype=arch.dtype,
                     num_params=estimate_num_params(arch) if num_params is None else num_params,
                     weight_bytes=weight_bytes, weight_source=source, sliding_window=arch.sliding_window,
                     num_sliding_layers=len(arch.sliding_window_layers), rope_theta=arch.rope.theta,
                     tied_embeddings=arch.tie_word_embeddings,
                     weight_quantization="fp8" if arch.quantization is not None else None)
