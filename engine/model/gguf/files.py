"""Finding a GGUF file (``contract.gguf.find_gguf``) and reading its metadata (torch-free)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any


def open_reader(path: str | Path):
    """A ``gguf.GGUFReader`` on ``path`` (memory-mapped, read-only: tensors are read when
    touched); ValueError for a file that is not GGUF.

    Remembered per process for the same unchanged file: parsing the header decodes every
    vocabulary entry (about 5 s for SmolLM2's 49,152 tokens and 48,900 merges), and the
    config, the tokenizer and the loader each read it.
    """
    stat = Path(path).stat()
    return _open_reader(str(Path(path).resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _open_reader(path: str, mtime_ns: int, size: int):
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise ValueError(f"{path} is not a readable GGUF file: {exc}") from None


def metadata(reader, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The file's key/value metadata as Python values (``skip``: keys not to decode)."""
    return {key: field.contents() for key, field in reader.fields.items()
            if not key.startswith("GGUF.") and key not in skip}
