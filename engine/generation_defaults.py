"""Sampling defaults from a checkpoint's ``generation_config.json``, as vLLM applies them.

vLLM's ``--generation-config auto`` (its default) reads the sampling fields of the
model's ``generation_config.json`` and uses them for every request that leaves the field
unset; ``vllm`` ignores the file; a directory reads that directory's file instead.
``--override-generation-config`` (a JSON object) is merged over the result. Only
sampling fields count: ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty`` and ``max_new_tokens`` (which becomes ``max_tokens``); the rest
of the file (``do_sample``, token ids) is not a sampling default. Torch-free.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvpilot.engine.text.tokenizer import read_json_object

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json key -> SamplingParams field
SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def _read(directory: Path, required: bool) -> dict[str, Any]:
    path = directory / GENERATION_CONFIG_FILE
    if required and not path.is_file():
        raise FileNotFoundError(f"--generation-config {directory}: no {GENERATION_CONFIG_FILE} there")
    return read_json_object(path)


def load_generation_defaults(setting: str, model_dir: str,
                             overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The sampling defaults requests get: ``{SamplingParams field: value}``.

    Args:
        setting: ``"auto"`` (the model directory's file, if any), ``"vllm"`` (no file) or
            a directory holding a ``generation_config.json``.
        model_dir: the checkpoint directory.
        overrides: ``generation_config.json``-style keys that win over the file's.

    Raises:
        FileNotFoundError: ``setting`` names a directory without the file.
        ValueError: an unreadable file, or an override that is not a sampling key.
    """
    if setting == "vllm":
        base: dict[str, Any] = {}
    elif setting == "auto":
        base = _read(Path(model_dir), required=False)
    else:
        if not Path(setting).is_dir():
            raise FileNotFoundError(f"--generation-config {setting}: not 'auto', 'vllm' or a directory")
        base = _read(Path(setting), required=True)
    unknown = sorted(set(overrides or {}) - set(SAMPLING_KEYS))
    if unknown:
        raise ValueError(f"override_generation_config: unknown key(s) {unknown}; "
                         f"expected some of {sorted(SAMPLING_KEYS)}")
    merged = {**base, **(overrides or {})}
    defaults = {field: merged[key] for key, field in SAMPLING_KEYS.items()
                if merged.get(key) is not None}
    for field, value in defaults.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"generation config: {field} must be a number, got {value!r}")
    if defaults:
        logger.info("Sampling defaults from the generation config (requests may override): %s",
                    defaults)
    return defaults
