"""Which of two versions of one object is newer, by ``metadata.resourceVersion``.

Newer is decided by ``resourceVersion`` read as an integer, as client-go's
``NewIntegerResourceVersionMutationCache`` does: Kubernetes documents resource versions as
opaque, but every API server in use (etcd's revision) and the test emulator issue
increasing integers. Callers treat a version that is not an integer as not comparable.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def resource_version(obj: Mapping[str, Any] | None) -> int | None:
    """``metadata.resourceVersion`` as an integer (None when absent or not an integer)."""
    rv = ((obj or {}).get("metadata") or {}).get("resourceVersion")
    return int(rv) if isinstance(rv, str) and rv.isdigit() else None


def newest(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """Of two versions of one object, the one with the higher resourceVersion (``a`` on a tie
    or when either is not comparable and ``a`` is not None)."""
    if a is None or b is None:
        return a if a is not None else b
    ra, rb = resource_version(a), resource_version(b)
    return b if ra is not None and rb is not None and rb > ra else a
