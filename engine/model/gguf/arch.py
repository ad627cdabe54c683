"""A GGUF file's metadata as a ``config.json``-style dict, and so an ``ArchConfig``
(torch-free).

llama.cpp's keys (``{arch}.embedding_length``, ...) map to transformers' config fields as
transformers' own GGUF loader maps them; what llama.cpp does not store takes llama.cpp's
rule (Gemma 3: 5 local layers to 1 global, local rope base 10,000, softmax scale
``head_dim ** -0.5``, or ``(hidden / heads) ** -0.5`` for the 27B model) so that a real
file runs as llama.cpp runs it. A Llama-architecture file whose ``general.name`` says
Mistral is a ``MistralForCausalLM`` (as transformers reads it), with full attention
(llama.cpp applies no window to it). ``--hf-config-path`` replaces all of this with a
``config.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvpilot.engine.model.checkpoint_checks import check_config_file
from kvpilot.engine.model.gguf.files import metadata, open_reader
from kvpilot.engine.model.hf_config import ArchConfig, parse_arch_config

# general.architecture -> (HF architecture, model_type)
GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}
# {arch}.<key> -> config.json field
_FIELDS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "attention.sliding_window": "sliding_window",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
    "final_logit_softcapping": "final_logit_softcapping",
}
# Big arrays nobody here needs decoded (the tokenizer reads them itself).
TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                    "tokenizer.ggml.merges", "tokenizer.ggml.precompiled_charsmap")


def gguf_architecture(meta: dict[str, Any]) -> str:
    """The file's llama.cpp architecture, with Mistral told apart from Llama by its name."""
    arch = meta.get("general.architecture")
    if arch == "llama" and "mistral" in str(meta.get("general.name", "")).lower():
        return "mistral"
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: "
                         f"{', '.join(sorted(set(GGUF_ARCHITECTURES) - {'mistral'}))}")
    return arch


def gguf_config_dict(meta: dict[str, Any], tensor_names: set[str], vocab_len: int | None) -> dict[str, Any]:
    """``config.json`` fields for the model a GGUF file holds (``vocab_len``: the number of
    tokens in its vocabulary, the vocabulary size when ``{arch}.vocab_size`` is absent)."""
    arch = gguf_architecture(meta)
    prefix = meta["general.architecture"]
    hf_arch, model_type = GGUF_ARCHITECTURES[arch]
    cfg: dict[str, Any] = {"architectures": [hf_arch], "model_type": model_type}
    for key, field in _FIELDS.items():
        if f"{prefix}.{key}" in meta:
            cfg[field] = meta[f"{prefix}.{key}"]
    if "head_dim" not in cfg and arch in ("llama", "mistral") and f"{prefix}.rope.dimension_count" in meta:
        cfg["head_dim"] = meta[f"{prefix}.rope.dimension_count"]
    if "vocab_size" not in cfg and vocab_len is not None:
        cfg["vocab_size"] = vocab_len
    cfg["tie_word_embeddings"] = "output.weight" not in tensor_names
    cfg["attention_bias"] = False   # Qwen2's q/k/v bias comes with the architecture
    scaling = meta.get(f"{prefix}.rope.scaling.type")
    if scaling and scaling != "none":
        cfg["rope_scaling"] = {"rope_type": scaling, "factor": meta.get(f"{prefix}.rope.scaling.factor", 1.0)}
        original = meta.get(f"{prefix}.rope.scaling.original_context_length")
        if original:
            cfg["rope_scaling"]["original_max_position_embeddings"] = original
    for name, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        if f"tokenizer.ggml.{key}" in meta:
            cfg[name] = meta[f"tokenizer.ggml.{key}"]
    if arch == "gemma3":
        heads, hidden = cfg.get("num_attention_heads"), cfg.get("hidden_size")
        head_dim = cfg.get("head_dim") or hidden // heads
        # llama.cpp (llama-model.cpp, LLM_ARCH_GEMMA3): the 27B model scales by hidden / heads.
        cfg["query_pre_attn_scalar"] = hidden // heads if cfg.get("num_hidden_layers") == 62 else head_dim
        cfg["sliding_window_pattern"] = 6
        cfg["rope_local_base_freq"] = 10_000.0
    cfg["torch_dtype"] = "bfloat16"
    return cfg


def load_gguf_arch_config(path: str | Path, architecture: str | None = None,
                          hf_config_path: str | Path | None = None) -> ArchConfig:
    """The ``ArchConfig`` of GGUF file ``path``: from its metadata, or from the
    ``config.json`` in directory ``hf_config_path`` when one is given."""
    if hf_config_path is not None:
        config_file = Path(hf_config_path) / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"--hf-config-path {hf_config_path} has no config.json")
        check_config_file(config_file)
        return parse_arch_config(json.loads(config_file.read_text()), architecture)
    reader = open_reader(path)
    meta = metadata(reader, skip=TOKENIZER_ARRAYS)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    cfg = gguf_config_dict(meta, {t.name for t in reader.tensors},
                           len(tokens.data) if tokens is not None else None)
    return parse_arch_config(cfg, architecture)
