"""Finding a GGUF file and reading its metadata (torch-free: the planner reads headers too)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

GGUF_SUFFIX = ".gguf"


def find_gguf(model: str | Path) -> Path | None:
    """The GGUF file ``model`` names: the file itself, or the one ``*.gguf`` in a directory
    without a ``config.json`` (a directory with one is an HF checkpoint). None: not GGUF.

    Raises:
        ValueError: a directory holding several GGUF files (name the one to serve).
    """
    path = Path(model)
    if path.is_file():
        return path if path.suffix.lower() == GGUF_SUFFIX else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(p for p in path.iterdir() if p.suffix.lower() == GGUF_SUFFIX and p.is_file())
    if len(files) > 1:
        names = ", ".join(p.name for p in files)
        raise ValueError(f"{path} holds several GGUF files ({names}): pass the one to serve as --model")
    return files[0] if files else None


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
