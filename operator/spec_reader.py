"""Typed, path-aware reading of one object of an InferenceService spec.

``spec.py`` says what the fields are; this module only checks types and bounds and names
the offending field (``spec.slo.maxContext must be >= 16, got 8``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


class SpecError(ValueError):
    """A spec the operator cannot act on; the message names the field."""


class Reader:
    """Access to the mapping ``data`` found at ``path`` (``spec.slo``)."""

    def __init__(self, data: Any, path: str) -> None:
        if not isinstance(data, Mapping):
            raise SpecError(f"{path} must be an object, got {type(data).__name__}")
        self.data, self.path = data, path

    def sub(self, key: str, required: bool = False) -> Reader | None:
        """A reader of the object at ``key``; None when absent (SpecError if ``required``)."""
        if key not in self.data or self.data[key] is None:
            if required:
                raise SpecError(f"{self.path}.{key} is required")
            return None
        return Reader(self.data[key], f"{self.path}.{key}")

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = None, *, required: bool = False,
            minimum: float | None = None, maximum: float | None = None, exclusive_min: bool = False,
            choices: tuple[Any, ...] | None = None) -> Any:
        """The value at ``key`` checked as the CRD schema declares it, or ``default`` when absent.

        Args:
            kind: the accepted type(s); an integer is accepted (as a float) where float is.
            required / minimum / maximum / exclusive_min / choices: the schema's
                ``required``, ``minimum``, ``maximum``, ``exclusiveMinimum`` and ``enum``.
        """
        where = f"{self.path}.{key}"
        if key not in self.data or self.data[key] is None:
            if required:
                raise SpecError(f"{where} is required")
            return default
        value = self.data[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, bool) and bool not in kinds:
            raise SpecError(f"{where} must be {kinds[0].__name__}, got a boolean")
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kinds):
            raise SpecError(f"{where} must be {kinds[0].__name__}, got {value!r}")
        if minimum is not None and (value <= minimum if exclusive_min else value < minimum):
            raise SpecError(f"{where} must be {'>' if exclusive_min else '>='} {minimum:g}, got {value!r}")
        if maximum is not None and value > maximum:
            raise SpecError(f"{where} must be <= {maximum:g}, got {value!r}")
        if choices is not None and value not in choices:
            raise SpecError(f"{where} must be one of {', '.join(map(str, choices))}; got {value!r}")
        return value

    def items(self, key: str, ok: Callable[[Any], bool], what: str) -> tuple[Any, ...]:
        """The list at ``key`` (empty when absent); SpecError unless every item passes ``ok``.

        ``what`` names the items in the message: ``spec.env must be a list of {what}``.
        """
        value = self.data.get(key) or []
        if not isinstance(value, list) or not all(ok(item) for item in value):
            raise SpecError(f"{self.path}.{key} must be a list of {what}")
        return tuple(value)
