"""JSON merge-patch helpers (RFC 7386) for comparing and patching objects.

The operator patches children with ``application/merge-patch+json``: objects merge key by
key, lists and scalars are replaced whole, ``null`` deletes a key. A child is "as
desired" when every field the operator sets has that value on the server
(``contains``); fields the server or other controllers add (defaults, status,
annotations) are not the operator's business and do not count as drift.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
from decimal import Decimal, InvalidOperation
from typing import Any

_QUANTITY = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
_SUFFIX = {None: 1, "m": Decimal("0.001"), "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
           "P": 10**15, "E": 10**18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
           "Pi": 2**50, "Ei": 2**60}


def quantity(value: Any) -> Decimal | None:
    """The value of a Kubernetes quantity (``"1536Mi"``, ``"500m"``, ``2``), else None."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return None
    match = _QUANTITY.match(str(value))
    if match is None:
        return None
    try:
        return Decimal(match[1]) * _SUFFIX[match[2]]
    except InvalidOperation:
        return None


def contains(actual: Any, desired: Any) -> bool:
    """True if ``desired`` is a sub-document of ``actual``.

    Mappings: every desired key is in ``actual`` with a contained value. Lists: same
    length, items contained pairwise (the server may default fields inside items).
    Scalars: equal (``1 == 1.0``; ``True`` is not ``1``), or the same quantity when one
    side is a string (``"1536Mi" == "1.5Gi"``).
    """
    if isinstance(desired, Mapping):
        return isinstance(actual, Mapping) and all(
            k in actual and contains(actual[k], v) for k, v in desired.items())
    if isinstance(desired, Sequence) and not isinstance(desired, str):
        return (isinstance(actual, Sequence) and not isinstance(actual, str)
                and len(actual) == len(desired)
                and all(contains(a, d) for a, d in zip(actual, desired, strict=True)))
    if isinstance(desired, bool) or isinstance(actual, bool):
        return type(desired) is type(actual) and desired == actual
    if actual == desired:
        return True
    # The server prints quantities in canonical form ("0.5" -> "500m", 1 -> "1").
    a, d = quantity(actual), quantity(desired)
    return a is not None and a == d and (isinstance(actual, str) or isinstance(desired, str))


def removals(previous: Any, desired: Any) -> dict:
    """A merge patch that deletes the keys ``previous`` had and ``desired`` no longer has.

    Only mapping keys are tracked; lists are replaced whole by the desired value anyway.
    """
    if not isinstance(previous, Mapping) or not isinstance(desired, Mapping):
        return {}
    patch: dict = {}
    for key, old in previous.items():
        if key not in desired:
            patch[key] = None
        else:
            nested = removals(old, desired[key])
            if nested:
                patch[key] = nested
    return patch


def union(a: Mapping, b: Mapping) -> dict:
    """Deep union of two merge patches; ``b`` wins on conflicts (its None values included)."""
    out = dict(a)
    for key, value in b.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = union(out[key], value)
        else:
            out[key] = value
    return out


def still_present(actual: Any, removal: Mapping) -> bool:
    """Whether any key that the ``removals`` patch ``removal`` deletes still exists in ``actual``."""
    if not isinstance(actual, Mapping):
        return False
    for key, value in removal.items():
        if key in actual and (value is None or still_present(actual[key], value)):
            return True
    return False


def diff(current: Any, desired: Any) -> dict:
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


def drop_path(obj: dict, dotted: str) -> dict:
    """A deep copy of ``obj`` without the field at ``dotted`` (``"spec.replicas"``)."""
    result = copy.deepcopy(obj)
    *parents, leaf = dotted.split(".")
    node: Any = result
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            return result
    if isinstance(node, dict):
        node.pop(leaf, None)
    return result
