"""The smallest JSON merge patch (RFC 7386) between two documents.

The operator writes an InferenceService's status with ``application/merge-patch+json``:
objects merge key by key, lists and scalars are replaced whole, ``null`` deletes a key.
(Children are written with server-side apply: ``server_side_apply``.)
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any


def diff(current: Any, desired: Mapping[str, Any]) -> dict:
    """The smallest merge patch taking mapping ``current`` to ``desired`` (RFC 7386 inverse)."""
    patch: dict = {}
    current = current if isinstance(current, Mapping) else {}
    for key in current:
        if key not in desired:
            patch[key] = None
    for key, value in desired.items():
        old = current.get(key)
        if isinstance(value, Mapping) and isinstance(old, Mapping):
            nested = diff(old, value)
            if nested:
                patch[key] = nested
        elif key not in current or not _equal(old, value):
            patch[key] = copy.deepcopy(value)
    return patch


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b
