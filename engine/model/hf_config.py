"""The engine's gate on a model's ``config.json`` (torch-free): the architecture is read by
the reader the planner shares (``kvpilot.contract.arch_config``); this adds what only the
engine refuses or warns about before anything is built.

- an architecture it does not build (``SUPPORTED_ARCHITECTURES``), a rope type its rotary
  embedding does not compute (``ROPE_TYPES``);
- Gemma 3 with ``use_bidirectional_attention`` (an embedding model; the engine runs causal
  language models); a warning for ``attn_logit_softcapping``, which transformers' and vLLM's
  Gemma 3 ignore (Gemma 2 used it; no Gemma 3 checkpoint sets it), as the engine does;
- sizes beyond its bounds (``checkpoint_checks.check_arch_bounds``), and a ``config.json``
  too large to be one (``check_config_file``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from kvpilot.contract.arch_config import SUPPORTED_ARCHITECTURES, ArchConfig, read_arch_config
from kvpilot.contract.rope import ROPE_TYPES
from kvpilot.engine.model.checkpoint_checks import check_arch_bounds, check_config_file

logger = logging.getLogger(__name__)


def parse_arch_config(cfg: dict[str, Any], architecture: str | None = None) -> ArchConfig:
    """The ArchConfig of a config.json dict the engine can build; ``architecture``
    overrides the file's. ValueError for one it cannot."""
    archs = cfg.get("architectures") or []
    arch = architecture or (archs[0] if archs else None)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported model architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    parsed = read_arch_config(cfg, arch)
    for rope in (parsed.rope, parsed.sliding_rope):
        if rope is not None and rope.rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope scaling type {rope.rope_type!r}; supported: {ROPE_TYPES}")
    if parsed.is_gemma3:
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("Gemma 3 with use_bidirectional_attention (an embedding model) is not supported; "
                             "the engine runs causal language models")
        if cfg.get("attn_logit_softcapping") is not None:
            logger.warning("config.json sets attn_logit_softcapping=%s: Gemma 3 does not apply it "
                           "(as in transformers and vLLM)", cfg["attn_logit_softcapping"])
    check_arch_bounds(parsed)  # before anything is built for it
    return parsed


def load_arch_config(model_dir: str | Path, architecture: str | None = None) -> ArchConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model directory {model_dir} has no config.json")
    check_config_file(path)
    return parse_arch_config(json.loads(path.read_text()), architecture)
