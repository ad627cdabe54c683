"""Fixtures of the engine tests: tiny checkpoints (``support.tiny_checkpoints``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from support.tiny_checkpoints import build_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """``tiny_checkpoint(kind, **overrides) -> Path``, cached per (kind, overrides);
    ``dtype="bfloat16"`` saves the weights in that dtype (default float32)."""
    cache: dict[tuple, Path] = {}

    def make(kind: str = "qwen3", **overrides) -> Path:
        key = (kind, json.dumps(overrides, sort_keys=True))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"ckpt-{kind}")
            if "dtype" in overrides:        # by name, so that the cache key is JSON
                overrides = {**overrides, "dtype": getattr(torch, overrides["dtype"])}
            cache[key] = build_checkpoint(path, kind, **overrides)
        return cache[key]

    return make
