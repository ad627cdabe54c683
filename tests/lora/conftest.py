"""Fixtures of the LoRA tests: tiny base checkpoints with three random PEFT adapters each
(ranks 8, 16 and 8 with rsLoRA, every B non-zero), cached per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.gemma3_checkpoints import build_gemma3
from support.lora_adapters import build_adapter
from support.tiny_checkpoints import build_checkpoint, save_tokenizer

# name -> (rank, rsLoRA, target modules; None: all seven)
ADAPTERS = {"sql": (8, False, None), "chat": (16, False, None),
            "attn": (8, True, ["q_proj", "k_proj", "v_proj", "o_proj"])}


@pytest.fixture(scope="session")
def lora_case(tmp_path_factory):
    """``lora_case(kind) -> (base path, {adapter name: path})``; ``kind``: llama, qwen2,
    qwen3 or gemma3."""
    cache: dict[str, tuple[Path, dict[str, Path]]] = {}

    def make(kind: str = "qwen3") -> tuple[Path, dict[str, Path]]:
        if kind not in cache:
            path = tmp_path_factory.mktemp(f"lora-base-{kind}")
            if kind == "gemma3":   # sliding-window layers: a hybrid KV cache
                base = build_gemma3(path)
                save_tokenizer(base, 512)
            else:
                base = build_checkpoint(path, kind)
            adapters = {}
            for seed, (name, (rank, rslora, targets)) in enumerate(ADAPTERS.items()):
                adapters[name] = build_adapter(base, tmp_path_factory.mktemp(f"lora-{kind}-{name}"),
                                               rank, seed=100 + seed, use_rslora=rslora,
                                               target_modules=targets)
            cache[kind] = (base, adapters)
        return cache[kind]

    return make
