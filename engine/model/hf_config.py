"""Reading an HF ``config.json`` into the architecture the engine runs (torch-free).

Handles both layouts seen in the wild: transformers 4.x (``torch_dtype``, top-level
``rope_theta`` / ``rope_scaling``) and 5.x (``dtype``, ``rope_parameters``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvpilot.engine.core.weight_quant import Fp8WeightConfig, parse_quantization_config
from kvpilot.engine.model.checkpoint_checks import check_arch_bounds, check_config_file

logger = logging.getLogger(__name__)

# architecture name -> (q/k/v bias, per-head q/k RMSNorm)
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
    "Gemma3ForCausalLM": (False, True),
}
# Architectures built by ``models.gemma3`` (the rest by ``models.llama``); their configs
# are read further by ``gemma3_arch_fields``.
GEMMA3_ARCHITECTURES = ("Gemma3ForCausalLM",)

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0     # llama3
    high_freq_factor: float = 4.0    # llama3
    beta_fast: float = 32.0          # yarn
    beta_slow: float = 1.0           # yarn
    attention_factor: float | None = None   # yarn (mscale); None = derived from factor
    partial_rotary_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope scaling type {self.rope_type!r}; supported: {ROPE_TYPES}")


@dataclass(frozen=True, slots=True)
class ArchConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    hidden_act: str
    rope: RopeConfig
    dtype: str                        # checkpoint dtype name, e.g. "bfloat16"
    sliding_window: int | None = None            # window of the sliding-window layers
    sliding_window_layers: tuple[int, ...] = ()  # layer indices that use it
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    quantization: Fp8WeightConfig | None = None   # FP8 weights (None: unquantized)
    # Gemma 3 (``gemma3_arch_fields``); the defaults are the Llama family's behaviour.
    sliding_rope: RopeConfig | None = None           # rope of the sliding-window layers (None: ``rope``)
    query_pre_attn_scalar: float | None = None       # softmax scale = this ** -0.5 (None: head_dim)
    final_logit_softcapping: float | None = None     # logits = cap * tanh(logits / cap) (None: off)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def attention_scale(self) -> float:
        """The softmax scale of every layer's attention."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_rope(self, layer_idx: int) -> RopeConfig:
        """The rope of layer ``layer_idx``: Gemma 3's local layers have their own base."""
        if self.sliding_rope is not None and layer_idx in self.sliding_window_layers:
            return self.sliding_rope
        return self.rope

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """The window of layer ``layer_idx`` (None: full attention)."""
        return self.sliding_window if layer_idx in self.sliding_window_layers else None

    @property
    def kv_release_window(self) -> int | None:
        """The window outside which a sequence's KV blocks can be released from its one
        block table: set only when every layer slides (mixed layers get a table per kind
        of layer instead, see ``kv_cache_groups``)."""
        if self.sliding_window and len(self.sliding_window_layers) == self.num_hidden_layers:
            return self.sliding_window
        return None


def kv_cache_groups(arch: ArchConfig, max_model_len: int) -> tuple[int, ...] | None:
    """Each layer's KV cache group when the engine keeps separate block tables for the
    full-attention layers (group 0) and the sliding-window layers (group 1), else None.

    Only when both kinds are present and a sequence can outgrow the window (otherwise
    nothing would be released). The planner applies the same rule (``ModelSpec.hybrid_kv``).
    """
    sliding = set(arch.sliding_window_layers)
    if (not sliding or len(sliding) == arch.num_hidden_layers
            or arch.sliding_window is None or max_model_len <= arch.sliding_window):
        return None
    return tuple(int(i in sliding) for i in range(arch.num_hidden_layers))


def _rope_config(cfg: dict[str, Any]) -> RopeConfig:
    params = dict(cfg.get("rope_parameters") or {})       # 5.x
    scaling = cfg.get("rope_scaling") or {}                # 4.x
    params = {**scaling, **params}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    kwargs = {k: params[k] for k in ("factor", "original_max_position_embeddings", "low_freq_factor",
                                     "high_freq_factor", "beta_fast", "beta_slow", "attention_factor",
                                     "partial_rotary_factor") if params.get(k) is not None}
    if "partial_rotary_factor" not in kwargs and cfg.get("partial_rotary_factor") is not None:
        kwargs["partial_rotary_factor"] = cfg["partial_rotary_factor"]
    return RopeConfig(theta=float(theta), rope_type=rope_type, **kwargs)


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def _sliding_window_layers(cfg: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """Layers with sliding-window attention: ``layer_types`` (transformers 5), else the
    Qwen2 convention (``use_sliding_window``: layers from ``max_window_layers`` on), else
    every layer (Mistral: a ``sliding_window`` and no per-layer switch). The planner's
    ``model_spec`` reads configs by the same rules."""
    if not cfg.get("sliding_window"):
        return ()
    types = cfg.get("layer_types")
    if types:
        return tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if "use_sliding_window" in cfg:
        if not cfg["use_sliding_window"]:
            return ()
        return tuple(range(int(cfg.get("max_window_layers") or 0), num_layers))
    return tuple(range(num_layers))


def parse_arch_config(cfg: dict[str, Any], architecture: str | None = None) -> ArchConfig:
    """Build an ArchConfig from a config.json dict; ``architecture`` overrides the file's."""
    archs = cfg.get("architectures") or []
    arch = architecture or (archs[0] if archs else None)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported model architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    qkv_bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]
    try:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        num_layers = int(cfg["num_hidden_layers"])
        intermediate, vocab = int(cfg["intermediate_size"]), int(cfg["vocab_size"])
    except KeyError as exc:
        raise ValueError(f"config.json is missing required field {exc.args[0]!r}") from None
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
    attention_bias = bool(cfg.get("attention_bias", False))
    sliding_layers = _sliding_window_layers(cfg, num_layers)
    parsed = ArchConfig(
        architecture=arch,
        model_type=cfg.get("model_type", ""),
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias or attention_bias,
        o_bias=attention_bias and arch == "LlamaForCausalLM",
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=qk_norm,
        hidden_act=cfg.get("hidden_act", "silu"),
        rope=_rope_config(cfg),
        dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
        sliding_window=int(cfg["sliding_window"]) if sliding_layers else None,
        sliding_window_layers=sliding_layers,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
        quantization=parse_quantization_config(cfg),
    )
    if arch in GEMMA3_ARCHITECTURES:
        parsed = replace(parsed, **gemma3_arch_fields(cfg, num_layers))
    check_arch_bounds(parsed)  # before anything is built for it
    return parsed


def gemma3_arch_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """What a Gemma 3 text config (``model_type`` ``gemma3_text``) sets beyond the Llama
    fields, with transformers' ``Gemma3TextConfig`` defaults for what it leaves out.

    - Sliding-window layers: ``layer_types``, else every layer but each
      ``sliding_window_pattern``-th (default 6: 5 local layers to 1 global).
    - Rope: global layers use ``rope_theta`` (default 1e6) with ``rope_scaling``, local
      layers ``rope_local_base_freq`` (default 1e4) unscaled (4.x layout); transformers
      5 nests both under ``rope_parameters`` by layer type.
    - ``query_pre_attn_scalar`` (default 256) sets the softmax scale;
      ``final_logit_softcapping`` caps the logits; embeddings are tied by default; the
      MLP activation is ``hidden_activation`` (GELU-tanh); the attention bias, where
      present, is on o_proj too.

    ``attn_logit_softcapping`` is not applied: transformers' and vLLM's Gemma 3 ignore it
    (Gemma 2 used it; no Gemma 3 checkpoint sets it), and the engine follows them.
    Bidirectional attention (``use_bidirectional_attention``, an embedding variant) is
    refused.
    """
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("Gemma 3 with use_bidirectional_attention (an embedding model) is not supported; "
                         "the engine runs causal language models")
    if cfg.get("attn_logit_softcapping") is not None:
        logger.warning("config.json sets attn_logit_softcapping=%s: Gemma 3 does not apply it "
                       "(as in transformers and vLLM)", cfg["attn_logit_softcapping"])
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types:
        sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    else:
        pattern = int(cfg.get("sliding_window_pattern") or 6)
        sliding = tuple(i for i in range(num_layers) if (i + 1) % pattern)
    if not window:
        sliding = ()
    full_rope, local_rope = _gemma3_ropes(cfg)
    attention_bias = bool(cfg.get("attention_bias", False))
    softcap = cfg.get("final_logit_softcapping")
    return dict(
        sliding_window=int(window) if sliding else None,
        sliding_window_layers=sliding,
        rope=full_rope,
        sliding_rope=local_rope,
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 256),
        final_logit_softcapping=float(softcap) if softcap else None,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
        o_bias=attention_bias,
    )


def _gemma3_ropes(cfg: dict[str, Any]) -> tuple[RopeConfig, RopeConfig]:
    """(global, local) rope of a Gemma 3 config, in either layout."""
    nested = cfg.get("rope_parameters")
    if isinstance(nested, dict) and ("full_attention" in nested or "sliding_attention" in nested):
        full = {"rope_theta": 1_000_000.0, **(nested.get("full_attention") or {})}
        local = {"rope_theta": 10_000.0, **(nested.get("sliding_attention") or {})}
        return _rope_config({"rope_parameters": full}), _rope_config({"rope_parameters": local})
    full = {"rope_theta": cfg.get("rope_theta") or 1_000_000.0, "rope_scaling": cfg.get("rope_scaling"),
            "rope_parameters": nested}
    local = {"rope_theta": cfg.get("rope_local_base_freq") or 10_000.0}
    return _rope_config(full), _rope_config(local)


def load_arch_config(model_dir: str | Path, architecture: str | None = None) -> ArchConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model directory {model_dir} has no config.json")
    check_config_file(path)
    return parse_arch_config(json.loads(path.read_text()), architecture)
