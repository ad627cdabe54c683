"""``--max-log-len`` applied to every field of a request's log line, not only the prompt:
a string is cut to that many characters, a list, tuple, set or dict to that many
entries (recursively), with the number of items left out said, so that a request with
thousands of stop strings or a megabyte schema cannot flood the log."""

from __future__ import annotations

import dataclasses
from typing import Any


def capped(value: Any, limit: int | None) -> Any:
    """``value`` with each string / collection in it cut to ``limit`` (None: as is)."""
    if limit is None:
        return value
    if isinstance(value, str):
        return value if len(value) <= limit else f"{value[:limit]}...({len(value) - limit} more chars)"
    if isinstance(value, dict):
        items = list(value.items())
        kept = {capped(k, limit): capped(v, limit) for k, v in items[:limit]}
        if len(items) > limit:
            kept["..."] = f"{len(items) - limit} more"
        return kept
    if isinstance(value, list | tuple | set | frozenset):
        items = list(value)
        kept = [capped(v, limit) for v in items[:limit]]
        return kept + [f"...({len(items) - limit} more)"] if len(items) > limit else kept
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return capped_repr(value, limit)
    return value


def capped_repr(obj: Any, limit: int | None) -> str:
    """``repr`` of a dataclass instance with every field ``capped`` (fields with
    ``repr=False`` left out, as ``repr`` does)."""
    fields = ", ".join(f"{f.name}={capped(getattr(obj, f.name), limit)!r}"
                       for f in dataclasses.fields(obj) if f.repr)
    return f"{type(obj).__name__}({fields})"
