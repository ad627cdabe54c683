"""A GGUF file as a planner model, from its header (torch-free; the ``gguf`` package reads
it, imported only when a GGUF file is planned for).

The config is the engine's reading of the metadata (``contract.gguf``), in
bfloat16 as the engine serves it on a GPU (``--dtype auto``); the weight bytes are what
the engine holds, tensor by tensor, by the engine's rule (``resident_tensor_bytes``). The
planner plans GPUs, where the engine dequantizes every GGUF tensor at load (its block
kernel is CPU-only): so by default the weights count at the model dtype, never at the
file's smaller size; ``blocks=True`` counts what a one-rank CPU engine holds.
"""

from __future__ import annotations

from pathlib import Path

from kvpilot.contract.gguf import (
    TOKENIZER_ARRAYS,
    gguf_config_dict,
    resident_tensor_bytes,
)
from kvpilot.operator.planner.model_spec import ModelSpec, model_from_config
from kvpilot.operator.planner.weights import DTYPE_BYTES


def gguf_model(path: Path, blocks: bool = False) -> ModelSpec:
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ValueError(f"{path}: reading a GGUF file needs the `gguf` package (pip install gguf)") from None
    reader = GGUFReader(str(path))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.") and k not in TOKENIZER_ARRAYS}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    cfg = gguf_config_dict(meta, {t.name for t in reader.tensors}, len(tokens.data) if tokens else None)
    dtype_bytes = DTYPE_BYTES[cfg["torch_dtype"]]
    resident = sum(resident_tensor_bytes(t.name, t.tensor_type.name, int(t.n_elements), int(t.n_bytes), dtype_bytes,
                                         blocks) for t in reader.tensors)
    stored = sum(int(t.n_bytes) for t in reader.tensors)
    return model_from_config(cfg, path.stem, weight_bytes=resident,
                             weight_source=f"GGUF header: {stored:,} B stored, counted as the engine holds them "
                                           f"({'in blocks on one CPU rank' if blocks else 'dequantized to ' + cfg['torch_dtype'] + ' on a GPU'})")
