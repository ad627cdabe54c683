"""Fixtures of the LoRA tests: tiny base checkpoints with three random PEFT adapters each
(ranks 8, 16 and 8 with rsLoRA, every B non-zero), cached per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.lora_adapters import build_adapter
from support.tiny_checkpoints import build_checkpoint

# name -> (rank, rsLoRA, target modules; None: all seven)
ADAPTERS = {"sql": (8, False, None), "chat": (16, False, None),
            "attn": (8, True, ["q_proj", "k_proj", "v_proj", "o_proj"])}


@pytest.fixture(scope="session")
def lora_case(tmp_path_factory):
    """``lora_case(kind) -> (base path, {adapter name: path})``."""
    cache: dict[str, tuple[Path, dict[str, Path]]] = {}

    def make(kind: str = "qwen3") -> tuple[Path, dict[str, Path]]:
        if kind not in cache:
            base = build_checkpoint(tmp_path_factory.mktemp(f"lora-base-{kind}"), kind)
            adapters = {}
            for seed, (name, (rank, rslora, targets)) in enumerate(ADAPTERS.items()):
                adapters[name] = build_adapter(base, tmp_path_factory.mktemp(f"lora-{kind}-{name}"),
                                               rank, seed=100 + seed, use_rslora=rslora,
                                               target_modules=targets)
            cache[kind] = (base, adapters)
        return cache[kind]

    return make
