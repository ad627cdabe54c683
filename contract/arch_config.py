"""A model's architecture, read from its HF ``config.json``: the one reader the engine and
the planner share (torch-free).

The engine builds its model from an ``ArchConfig`` (``engine/model/hf_config.py`` adds
what only the engine checks: the architectures it builds, the rope types it computes, the
sizes it accepts); the planner sizes a deployment from one (``operator/planner/
model_spec.py``). Reading both with this module is what keeps "the planner's model is the
engine's model" true: layers, heads, the KV heads and ``head_dim``, which layers slide and
over what window, tied embeddings, the dtype, the weight quantization.

Rules, as transformers applies them:

- Both layouts: 4.x (``torch_dtype``, top-level ``rope_theta`` / ``rope_scaling``) and 5.x
  (``dtype``, ``rope_parameters``); multimodal checkpoints' ``text_config`` is read over
  the top level.
- ``num_key_value_heads`` defaults to ``num_attention_heads`` and ``head_dim`` to
  ``hidden_size // num_attention_heads`` (Qwen3 and Gemma set it to something else); a
  missing dtype means float32; ``half`` / ``bf16`` / ``fp16`` / ``float`` are spelled out.
- Sliding-window layers: ``layer_types`` when present; else Gemma 3 slides all but every
  ``sliding_window_pattern``-th layer (default 6), Gemma 2 the even-indexed ones,
  Qwen2/Qwen3 those from ``max_window_layers`` on when ``use_sliding_window`` is true, and
  any other config with a ``sliding_window`` slides every layer (Mistral v0.1).
- Tied embeddings default to the family's (Gemma: tied, the rest: untied).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from kvpilot.contract.rope import RopeConfig, read_gemma3_ropes, read_rope
from kvpilot.contract.weight_quant import Fp8WeightConfig, parse_quantization_config

# The architectures the engine builds -> (q/k/v bias, per-head q/k RMSNorm).
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
    "Gemma3ForCausalLM": (False, True),
}
# Architectures built by the engine's ``models.gemma3`` (the rest by ``models.llama``);
# their configs are read further by ``_gemma3_fields``.
GEMMA3_ARCHITECTURES = ("Gemma3ForCausalLM",)
GEMMA3_MODEL_TYPES = ("gemma3", "gemma3_text")
TIED_BY_DEFAULT = ("gemma", "gemma2", *GEMMA3_MODEL_TYPES)
DTYPE_ALIASES = {"half": "float16", "bf16": "bfloat16", "fp16": "float16", "float": "float32"}


@dataclass(frozen=True, slots=True)
class ArchConfig:
    architecture: str                 # config.json's ``architectures[0]`` ("" when it names none)
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
    # Gemma 3 (``_gemma3_fields``); the defaults are the Llama family's behaviour.
    sliding_rope: RopeConfig | None = None           # rope of the sliding-window layers (None: ``rope``)
    query_pre_attn_scalar: float | None = None       # softmax scale = this ** -0.5 (None: head_dim)
    final_logit_softcapping: float | None = None     # logits = cap * tanh(logits / cap) (None: off)
    attention_bias: bool = False      # config.json's ``attention_bias`` as written (the planner's count)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def attention_scale(self) -> float:
        """The softmax scale of every layer's attention."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def is_gemma3(self) -> bool:
        return self.architecture in GEMMA3_ARCHITECTURES or self.model_type in GEMMA3_MODEL_TYPES

    @property
    def max_context(self) -> int:
        """The longest context the model supports: ``max_position_embeddings`` stretched by
        a rope that stretches it (Gemma 3's already counts its global layers' scaling)."""
        if self.is_gemma3:
            return self.max_position_embeddings
        return self.rope.stretched_positions(self.max_position_embeddings)

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
        block table (``kv_release_window``)."""
        return kv_release_window(self.num_hidden_layers, len(self.sliding_window_layers), self.sliding_window)


def kv_release_window(num_layers: int, num_sliding_layers: int, sliding_window: int | None) -> int | None:
    """The window outside which the engine releases a sequence's KV blocks from its one
    block table: set only when every layer slides (mixed layers get a table per kind of
    layer instead, ``hybrid_kv``)."""
    if sliding_window and num_sliding_layers and num_sliding_layers == num_layers:
        return sliding_window
    return None


def hybrid_kv(num_layers: int, num_sliding_layers: int, sliding_window: int | None, max_context: int) -> bool:
    """Whether the engine keeps the sliding-window layers' KV in block tables of their own:
    both kinds of layer, and a context that can outgrow the window (otherwise nothing would
    be released)."""
    return (0 < num_sliding_layers < num_layers and sliding_window is not None
            and max_context > sliding_window)


def kv_cache_groups(arch: ArchConfig, max_model_len: int) -> tuple[int, ...] | None:
    """Each layer's KV cache group when ``hybrid_kv``: full-attention layers 0, sliding-window
    layers 1; else None."""
    sliding = set(arch.sliding_window_layers)
    if not hybrid_kv(arch.num_hidden_layers, len(sliding), arch.sliding_window, max_model_len):
        return None
    return tuple(int(i in sliding) for i in range(arch.num_hidden_layers))


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def _sliding_window_layers(cfg: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """Layers with sliding-window attention outside Gemma 3 (the module's rules)."""
    if not cfg.get("sliding_window"):
        return ()
    types = cfg.get("layer_types")
    if types:
        return tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if cfg.get("model_type") == "gemma2":
        return tuple(range(0, num_layers, 2))
    if "use_sliding_window" in cfg:
        if not cfg["use_sliding_window"]:
            return ()
        return tuple(range(int(cfg.get("max_window_layers") or 0), num_layers))
    return tuple(range(num_layers))


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Multimodal checkpoints nest the language model's config under ``text_config``."""
    return {**cfg, **cfg["text_config"]} if isinstance(cfg.get("text_config"), dict) else cfg


def read_arch_config(cfg: dict[str, Any], architecture: str | None = None, *,
                     source: str = "config.json") -> ArchConfig:
    """The ``ArchConfig`` of a config.json dict; ``architecture`` overrides the file's.

    Any architecture is read (one the engine does not build gets no q/k/v bias or q/k norm
    beyond ``attention_bias``); ValueError, naming ``source``, for a missing or
    non-integer size and for heads that do not divide into the KV heads."""
    cfg = text_config(cfg)
    archs = cfg.get("architectures") or []
    arch = architecture or (archs[0] if archs else "")
    try:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        num_layers = int(cfg["num_hidden_layers"])
        intermediate, vocab = int(cfg["intermediate_size"]), int(cfg["vocab_size"])
    except KeyError as exc:
        raise ValueError(f"{source} is missing required field {exc.args[0]!r}") from None
    except (TypeError, ValueError):
        raise ValueError(f"{source} has a non-integer size field") from None
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
    qkv_bias, qk_norm = SUPPORTED_ARCHITECTURES.get(arch, (False, False))
    attention_bias = bool(cfg.get("attention_bias", False))
    model_type = cfg.get("model_type", "")
    is_gemma3 = arch in GEMMA3_ARCHITECTURES or model_type in GEMMA3_MODEL_TYPES
    sliding_layers = _sliding_window_layers(cfg, num_layers)
    dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
    parsed = ArchConfig(
        architecture=arch,
        model_type=model_type,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", model_type in TIED_BY_DEFAULT or is_gemma3)),
        qkv_bias=qkv_bias or attention_bias,
        o_bias=attention_bias and arch == "LlamaForCausalLM",
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=qk_norm,
        hidden_act=cfg.get("hidden_act", "silu"),
        rope=read_rope(cfg),
        dtype=DTYPE_ALIASES.get(dtype, dtype),
        sliding_window=int(cfg["sliding_window"]) if sliding_layers else None,
        sliding_window_layers=sliding_layers,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
        quantization=parse_quantization_config(cfg),
        attention_bias=attention_bias,
    )
    if is_gemma3:
        parsed = replace(parsed, **_gemma3_fields(cfg, num_layers))
    return parsed


def _gemma3_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """What a Gemma 3 text config (``model_type`` ``gemma3_text``) sets beyond the Llama
    fields, with transformers' ``Gemma3TextConfig`` defaults for what it leaves out.

    - Sliding-window layers: ``layer_types``, else every layer but each
      ``sliding_window_pattern``-th (default 6: 5 local layers to 1 global).
    - Rope: ``rope.read_gemma3_ropes`` (a global and a local one).
    - ``query_pre_attn_scalar`` (default 256) sets the softmax scale;
      ``final_logit_softcapping`` caps the logits; the MLP activation is
      ``hidden_activation`` (GELU-tanh); the attention bias, where present, is on o_proj too.
    """
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types:
        sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    else:
        pattern = int(cfg.get("sliding_window_pattern") or 6)
        sliding = tuple(i for i in range(num_layers) if (i + 1) % pattern)
    if not window:
        sliding = ()
    full_rope, local_rope = read_gemma3_ropes(cfg)
    softcap = cfg.get("final_logit_softcapping")
    return dict(
        sliding_window=int(window) if sliding else None,
        sliding_window_layers=sliding,
        rope=full_rope,
        sliding_rope=local_rope,
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 256),
        final_logit_softcapping=float(softcap) if softcap else None,
        hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
        o_bias=bool(cfg.get("attention_bias", False)),
    )
