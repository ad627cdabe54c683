"""Finding a GGUF file (``gguf_contract.find_gguf``) and reading its metadata (torch-free)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def open_reader(path: str | Path):
    """A ``gguf.GGUFReader`` on ``path`` (memory-mapped: tensors are read when touched);
    ValueError for a file that is not GGUF."""
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except (ValueError, OSError) as exc:
        raise ValueError(f"{path} is not a readable GGUF file: {exc}") from None


def metadata(reader, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The file's key/value metadata as Python values (``skip``: keys not to decode)."""
    return {key: field.contents() for key, field in reader.fields.items()
            if not key.startswith("GGUF.") and key not in skip}
