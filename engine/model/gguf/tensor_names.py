"""llama.cpp's tensor names -> the HF checkpoint names the loader maps to the engine's
modules, and what to undo of llama.cpp's conversion (torch-free).

Two things ``convert_hf_to_gguf.py`` changes, undone here as transformers undoes them:

- Llama-family q/k projections (``general.architecture`` ``llama``: Llama, Mistral) have
  their rows permuted from HF's rotary layout (two halves) to GGML's (interleaved pairs).
  ``rotary_row_order`` gives the inverse permutation, a permutation of whole rows: GGUF
  quantization blocks run along the input dimension, so it applies to quantized rows as
  to dequantized ones.
- Gemma 3 stores its RMSNorm gains as ``1 + weight``; the engine (as HF) holds ``weight``:
  ``NORM_SHIFT`` is subtracted from every ``*norm.weight``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvpilot.contract.gguf import BLOCK_TENSOR

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3's four norms per layer.
_GEMMA3_LAYER = {
    **_LAYER,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
NORM_SHIFT = {"gemma3": 1.0}


@dataclass(frozen=True, slots=True)
class TensorMapping:
    hf_name: str
    rotary_heads: int | None = None   # undo llama.cpp's q/k row permutation over this many heads
    shift: float = 0.0                # subtract from the values (Gemma norms)


def map_tensor(name: str, architecture: str, num_heads: int, num_kv_heads: int) -> TensorMapping | None:
    """The HF name of GGUF tensor ``name`` and what to undo; None for an unknown name
    (``architecture`` is the file's ``general.architecture``)."""
    shift = NORM_SHIFT.get(architecture, 0.0) if name.endswith("norm.weight") else 0.0
    if name in _GLOBAL:
        return TensorMapping(_GLOBAL[name], shift=shift)
    m = BLOCK_TENSOR.match(name)
    if m is None:
        return None
    layer, kind, suffix = m.groups()
    table = _GEMMA3_LAYER if architecture == "gemma3" else _LAYER
    if kind not in table:
        return None
    heads = None
    if architecture == "llama" and kind in ("attn_q", "attn_k"):
        heads = num_heads if kind == "attn_q" else num_kv_heads
    return TensorMapping(f"model.layers.{layer}.{table[kind]}.{suffix}", rotary_heads=heads, shift=shift)


def rotary_row_order(rows: int, heads: int) -> np.ndarray:
    """Row ``i`` of the HF tensor is row ``order[i]`` of the GGUF tensor (the inverse of
    llama.cpp's ``permute``: per head, GGML's interleaved pairs back to two halves)."""
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(rows)

