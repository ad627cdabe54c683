"""Kubernetes quantities read as numbers, so that ``"1536Mi"`` and ``"1.5Gi"`` compare equal.

The API server stores a quantity in canonical form (``"0.5"`` comes back as ``"500m"``),
so comparing what the operator applied with what it reads back goes by value.
"""

from __future__ import annotations

import re
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
