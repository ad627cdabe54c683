"""How many bytes of weights a checkpoint puts on the GPUs.

In order of preference (the derivation says which was used):

1. ``model.safetensors.index.json`` -> ``metadata.total_size`` (exact, sharded checkpoints);
2. the safetensors headers (exact: elements x dtype size summed over every tensor,
   read with the ``safetensors`` library without loading any data);
3. a published parameter count (the built-in catalogue) x dtype bytes;
4. a parameter count estimated from the architecture (dense decoder: attention
   projections with optional q/k/v bias and q/k norms, a gated MLP of three
   matrices, the layer norms, embeddings and an untied LM head).

Checkpoints that store a tied LM head twice are counted as stored (slightly high).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from kvpilot.contract.arch_config import ArchConfig
from kvpilot.contract.constants import MODEL_DTYPE_BYTES

DTYPE_BYTES = MODEL_DTYPE_BYTES

# safetensors header dtype -> bits per element
_SAFETENSORS_BITS: dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "F4": 4, "F6_E2M3": 6,
    "F6_E3M2": 6, "U16": 16, "I16": 16, "F16": 16, "BF16": 16, "U32": 32, "I32": 32, "F32": 32,
    "U64": 64, "I64": 64, "F64": 64, "C64": 64,
}

# bytes per parameter of a weight-quantised checkpoint the engine serves (only FP8: the
# engine refuses other methods, so the planner neither plans nor suggests them). The
# embedding and the LM head stay in the model dtype (FP8 checkpoints quantise the linear
# layers only: Llama-3.3-70B-Instruct-FP8-dynamic loads 67.72 GiB, the split below gives
# 67.67 GiB, quantising everything 65.71 GiB).
WEIGHT_QUANT_BYTES: dict[str, float] = {"fp8": 1.0}


_GATED_NORMS = {"gemma2": 4, "gemma3": 4, "gemma3_text": 4}


def quantized_weight_bytes(num_params: int, embedding_params: int, dtype_bytes: int, quant: str) -> int:
    """Bytes of a ``quant`` checkpoint: linear layers quantised, embeddings in the model dtype."""
    quantised = max(0, num_params - embedding_params)
    return math.ceil(quantised * WEIGHT_QUANT_BYTES[quant]) + min(num_params, embedding_params) * dtype_bytes


def estimate_num_params(arch: ArchConfig) -> int:
    """Parameter count of a dense decoder from its config (tied embeddings counted once)."""
    model_type = arch.model_type
    hidden, head_dim = arch.hidden_size, arch.head_dim
    q_out, kv_out = arch.num_attention_heads * head_dim, arch.num_key_value_heads * head_dim
    attention = hidden * q_out + 2 * hidden * kv_out + q_out * hidden
    if arch.attention_bias or model_type == "qwen2":
        attention += q_out + 2 * kv_out
    if arch.attention_bias and model_type != "qwen2":
        attention += hidden                       # o_proj bias (Llama-style attention_bias)
    if model_type in ("qwen3", "gemma3", "gemma3_text"):
        attention += 2 * head_dim                 # per-head q and k RMSNorm
    inter = arch.intermediate_size
    mlp = 3 * hidden * inter + (2 * inter + hidden if arch.mlp_bias else 0)
    norms = _GATED_NORMS.get(model_type, 2) * hidden
    embeddings = arch.vocab_size * hidden * (1 if arch.tie_word_embeddings else 2)
    return arch.num_hidden_layers * (attention + mlp + norms) + embeddings + hidden


def weight_bytes_from_index(index_path: Path) -> int | None:
    """``metadata.total_size`` of a sharded checkpoint's index, or None if absent."""
    try:
        index = json.loads(index_path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{index_path} is not valid JSON: {exc}") from None
    total = (index.get("metadata") or {}).get("total_size")
    if total is None:
        return None
    if not isinstance(total, int) or total < 1:
        raise ValueError(f"{index_path}: metadata.total_size must be a positive integer, got {total!r}")
    return total


def weight_bytes_from_headers(files: list[Path]) -> int:
    """Sum of tensor sizes recorded in safetensors headers (no tensor data is read)."""
    from safetensors import SafetensorError, safe_open

    total_bits = 0
    for path in files:
        try:
            with safe_open(str(path), framework="numpy") as handle:
                for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    tensor = handle.get_slice(key)
                    dtype = tensor.get_dtype()
                    if dtype not in _SAFETENSORS_BITS:
                        raise ValueError(f"{path}: tensor {key!r} has unknown dtype {dtype}")
                    total_bits += math.prod(tensor.get_shape()) * _SAFETENSORS_BITS[dtype]
        except SafetensorError as exc:
            raise ValueError(f"{path} is not a readable safetensors file: {exc}") from None
    return -(-total_bits // 8)


def checkpoint_weight_bytes(model_dir: Path) -> tuple[int | None, str | None]:
    """(bytes, source description) for the safetensors checkpoint in ``model_dir``, if any."""
    index = model_dir / "model.safetensors.index.json"
    total = weight_bytes_from_index(index)
    if total is not None:
        return total, f"{index.name} metadata.total_size"
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return weight_bytes_from_headers(files), f"safetensors headers ({len(files)} file(s))"
    return None, None
