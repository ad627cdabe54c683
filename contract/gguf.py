"""What a GGUF file means to the engine, from its header's values alone (pure Python: the
planner shares it; reading the file is the caller's, with the ``gguf`` package).

- ``find_gguf``: which file ``--model`` names.
- ``gguf_config_dict``: the metadata as a ``config.json``-style dict. llama.cpp's keys
  (``{arch}.embedding_length``, ...) map to transformers' config fields as transformers'
  own GGUF loader maps them; what llama.cpp does not store takes llama.cpp's rule (Gemma 3:
  5 local layers to 1 global, local rope base 10,000, softmax scale ``head_dim ** -0.5``,
  or ``(hidden / heads) ** -0.5`` for the 27B model) so that a real file runs as llama.cpp
  runs it. A Llama-architecture file whose ``general.name`` says Mistral is a
  ``MistralForCausalLM`` (as transformers reads it), with full attention (llama.cpp
  applies no window to it).
- ``resident_tensor_bytes``: what one tensor costs in the engine's memory: its stored
  bytes where the engine keeps it quantized (``keeps_quantized``: the CPU kernel's types,
  served on CPU by one rank), else its elements x the model dtype's bytes (dequantized at
  load); tensors the engine does not hold (``IGNORED``) cost nothing.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

GGUF_SUFFIX = ".gguf"

def find_gguf(model: str | Path) -> Path | None:
    """The GGUF file ``model`` names: the file itself, or the one ``*.gguf`` in a directory
    without a ``config.json`` (a directory with one is an HF checkpoint). None: not GGUF.

    Raises:
        ValueError: a directory holding several GGUF files (name the one to serve).
    """
    path = Path(model)
    if path.is_file():
        return path if path.suffix.lower() == GGUF_SUFFIX else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(p for p in path.iterdir() if p.suffix.lower() == GGUF_SUFFIX and p.is_file())
    if len(files) > 1:
        names = ", ".join(p.name for p in files)
        raise ValueError(f"{path} holds several GGUF files ({names}): pass the one to serve as --model")
    return files[0] if files else None


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


# GGML type names the engine keeps in their stored blocks on CPU (the types the CPU GGUF
# matmul kernel decodes: ``kvpilot.kernels.gguf_matmul_cpu.QTYPES``, a test holds the two
# equal), for the decoder's linear weights, the token embedding and the LM head; every
# other tensor is dequantized at load to the model dtype. The planner counts by the same rule.
KEPT_QUANTIZED: frozenset[str] = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"})
# Whole-model tensors kept as blocks too (``layers.gguf_linear.use_gguf_embedding``).
KEPT_WHOLE = frozenset({"token_embd.weight", "output.weight"})
LINEAR_KINDS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# Tensors llama.cpp writes that the engine computes itself.
IGNORED = frozenset({"rope_freqs.weight"})
BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def keeps_quantized(gguf_name: str, qtype_name: str, blocks: bool = True) -> bool:
    """Whether the engine holds GGUF tensor ``gguf_name`` (of GGML type ``qtype_name``) in
    its stored blocks rather than dequantized (a decoder linear weight, the token
    embedding or the LM head, of a kept type). ``blocks`` False: an engine that keeps
    none (on a GPU, or under tensor parallelism, everything is dequantized at load)."""
    if not blocks or qtype_name not in KEPT_QUANTIZED:
        return False
    if gguf_name in KEPT_WHOLE:
        return True
    m = BLOCK_TENSOR.match(gguf_name)
    return m is not None and m.group(2) in LINEAR_KINDS and m.group(3) == "weight"


def resident_tensor_bytes(gguf_name: str, qtype_name: str, numel: int, stored: int, dtype_bytes: int,
                          blocks: bool = True) -> int:
    """Bytes the engine holds for one GGUF tensor served in a ``dtype_bytes`` model dtype
    (``blocks``: on CPU with one rank, where kept types stay in their blocks)."""
    if gguf_name in IGNORED:
        return 0
    return stored if keeps_quantized(gguf_name, qtype_name, blocks) else numel * dtype_bytes
