"""vLLM's JSON-valued flags (``--speculative-config``, ``--kv-events-config``,
``--kv-transfer-config``) read into frozen dataclasses by one rule: a JSON object whose keys
are the dataclass's fields; an unknown key or a bad document is a ValueError naming it."""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any, TypeVar

T = TypeVar("T")


def parse_json(text: str, what: str = "") -> Any:
    """``text`` parsed; ValueError (prefixed by ``what``) when it is not JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what}not valid JSON ({exc.msg})") from None


def dataclass_from_object(cls: type[T], data: Any, what: str = "") -> T:
    """``cls(**data)`` for a JSON object ``data`` whose keys are fields of the dataclass
    ``cls``; ValueError (prefixed by ``what``) for anything else or an unknown key."""
    if not isinstance(data, dict):
        raise ValueError(f"{what}expected a JSON object")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{what}unknown key(s) {unknown}; the keys are {sorted(names)}")
    return cls(**data)
