"""A GGUF file's ``ArchConfig`` (torch-free): its metadata read into a ``config.json``-style
dict by ``contract.gguf.gguf_config_dict``, or ``--hf-config-path``'s
``config.json`` instead."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvpilot.contract.arch_config import ArchConfig
from kvpilot.contract.gguf import TOKENIZER_ARRAYS, find_gguf, gguf_config_dict
from kvpilot.engine.model.checkpoint_checks import check_config_file
from kvpilot.engine.model.gguf.files import metadata, open_reader
from kvpilot.engine.model.hf_config import load_arch_config, parse_arch_config


def load_model_arch(model: str | Path, architecture: str | None = None,
                    hf_config_path: str | Path | None = None) -> ArchConfig:
    """The ``ArchConfig`` of ``model``: a GGUF file's (or a directory holding one:
    ``load_gguf_arch_config``), else the checkpoint directory's ``config.json``."""
    gguf = find_gguf(model)
    if gguf is not None:
        return load_gguf_arch_config(gguf, architecture, hf_config_path)
    return load_arch_config(model, architecture)


def load_gguf_arch_config(path: str | Path, architecture: str | None = None,
                          hf_config_path: str | Path | None = None) -> ArchConfig:
    """The ``ArchConfig`` of GGUF file ``path``: from its metadata, or from the
    ``config.json`` in directory ``hf_config_path`` when one is given."""
    if hf_config_path is not None:
        config_file = Path(hf_config_path) / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"--hf-config-path {hf_config_path} has no config.json")
        check_config_file(config_file)
        return parse_arch_config(json.loads(config_file.read_text()), architecture)
    return parse_arch_config(read_gguf_config(path), architecture)


def read_gguf_config(path: str | Path) -> dict[str, Any]:
    """The ``config.json``-style dict of GGUF file ``path`` (``gguf_config_dict``)."""
    reader = open_reader(path)
    meta = metadata(reader, skip=TOKENIZER_ARRAYS)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    return gguf_config_dict(meta, {t.name for t in reader.tensors},
                            len(tokens.data) if tokens is not None else None)
