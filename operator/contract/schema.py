"""Field types of a CRD schema that also validate in Python: one row, both sides.

Each field (``Str``, ``Int``, ``Num``, ``Bool``, ``Obj``, ``Arr``, ``Map``, ``Free``,
``IntOrStr``) renders to its OpenAPI v3 node (``openapi()``, what the CRD holds) and checks
a value as the API server would (``check()``): the type, bounds, enum, pattern, lengths,
required fields and the object's CEL rules (``rules.Rule``, evaluated in Python), with the
CRD's defaults filled in where fields are absent. A spec the operator reads has passed the
same checks whether or not the API server ran them (servers without CEL, objects written
before a rule existed).

Checks run in the API server's order: defaults, then every field, then the object's rules
(CEL runs only on schema-valid objects). Unknown fields are dropped, as the server prunes
them, except inside ``Free`` (``x-kubernetes-preserve-unknown-fields``).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpilot.operator.contract.rules import Rule


class SpecError(ValueError):
    """A spec the operator cannot act on; the message names the field."""


_ABSENT = object()


@dataclass(frozen=True, kw_only=True)
class Field:
    """What every field has: its description and its default (``_ABSENT``: none)."""

    description: str | None = None
    default: Any = _ABSENT

    json_type = ""

    def openapi(self) -> dict[str, Any]:
        node: dict[str, Any] = {"type": self.json_type} if self.json_type else {}
        if self.description:
            node["description"] = self.description
        if self.default is not _ABSENT:
            node["default"] = copy.deepcopy(self.default)
        return node

    def check(self, value: Any, path: str) -> Any:
        """``value`` checked (and defaulted inside); SpecError naming ``path`` if invalid."""
        raise NotImplementedError

    @property
    def has_default(self) -> bool:
        return self.default is not _ABSENT


def _bounds(node: dict, minimum: float | None, maximum: float | None, exclusive: bool) -> dict:
    if minimum is not None:
        node["minimum"] = minimum
        if exclusive:
            node["exclusiveMinimum"] = True
    if maximum is not None:
        node["maximum"] = maximum
    return node


def _check_bounds(value: float, path: str, minimum: float | None, maximum: float | None,
                  exclusive: bool) -> None:
    if minimum is not None and (value <= minimum if exclusive else value < minimum):
        raise SpecError(f"{path} must be {'>' if exclusive else '>='} {minimum:g}, got {value!r}")
    if maximum is not None and value > maximum:
        raise SpecError(f"{path} must be <= {maximum:g}, got {value!r}")


def _check_rules(rules: tuple[Rule, ...], value: Any) -> None:
    for rule in rules:
        if not rule.holds(value):
            raise SpecError(rule.message)


def _check_enum(value: Any, path: str, enum: tuple[Any, ...] | None) -> None:
    if enum is not None and value not in enum:
        raise SpecError(f"{path} must be one of {', '.join(map(str, enum))}; got {value!r}")


@dataclass(frozen=True, kw_only=True)
class Str(Field):
    enum: tuple[str, ...] | None = None
    pattern: str | None = None
    min_length: int | None = None
    max_length: int | None = None
    format: str | None = None
    expected: str | None = None   # what ``pattern`` means, for the operator's message
    json_type = "string"

    def openapi(self) -> dict[str, Any]:
        node = super().openapi()
        for key, value in (("format", self.format), ("enum", list(self.enum) if self.enum is not None else None),
                           ("minLength", self.min_length), ("maxLength", self.max_length),
                           ("pattern", self.pattern)):
            if value is not None:
                node[key] = value
        return node

    def check(self, value: Any, path: str) -> Any:
        if not isinstance(value, str):
            raise SpecError(f"{path} must be a string, got {value!r}")
        if self.min_length is not None and len(value) < self.min_length:
            raise SpecError(f"{path} must be at least {self.min_length} characters")
        if self.max_length is not None and len(value) > self.max_length:
            raise SpecError(f"{path} must be at most {self.max_length} characters, got {len(value)}")
        if self.pattern is not None and not re.search(self.pattern, value):
            raise SpecError(f"{path} {value!r} is not {self.expected}" if self.expected
                            else f"{path} {value!r} does not match {self.pattern}")
        _check_enum(value, path, self.enum)
        return value


@dataclass(frozen=True, kw_only=True)
class Int(Field):
    minimum: int | None = None
    maximum: int | None = None
    enum: tuple[int, ...] | None = None
    int64: bool = False
    json_type = "integer"

    def openapi(self) -> dict[str, Any]:
        node = super().openapi()
        if self.int64:
            node["format"] = "int64"
        if self.enum is not None:
            node["enum"] = list(self.enum)
        return _bounds(node, self.minimum, self.maximum, False)

    def check(self, value: Any, path: str) -> Any:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(f"{path} must be an integer, got {value!r}")
        _check_bounds(value, path, self.minimum, self.maximum, False)
        _check_enum(value, path, self.enum)
        return value


@dataclass(frozen=True, kw_only=True)
class Num(Field):
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    json_type = "number"

    def openapi(self) -> dict[str, Any]:
        return _bounds(super().openapi(), self.minimum, self.maximum, self.exclusive_minimum)

    def check(self, value: Any, path: str) -> Any:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(f"{path} must be a number, got {value!r}")
        _check_bounds(value, path, self.minimum, self.maximum, self.exclusive_minimum)
        return float(value)


@dataclass(frozen=True, kw_only=True)
class Bool(Field):
    json_type = "boolean"

    def check(self, value: Any, path: str) -> Any:
        if not isinstance(value, bool):
            raise SpecError(f"{path} must be true or false, got {value!r}")
        return value


@dataclass(frozen=True, kw_only=True)
class IntOrStr(Field):
    """A quantity or port: ``x-kubernetes-int-or-string``."""

    def openapi(self) -> dict[str, Any]:
        return {**super().openapi(), "anyOf": [{"type": "integer"}, {"type": "string"}],
                "x-kubernetes-int-or-string": True}

    def check(self, value: Any, path: str) -> Any:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise SpecError(f"{path} must be an integer or a string, got {value!r}")
        return value


@dataclass(frozen=True, kw_only=True)
class Free(Field):
    """An object kept as given (``x-kubernetes-preserve-unknown-fields``): a pod affinity."""

    json_type = "object"

    def openapi(self) -> dict[str, Any]:
        return {**super().openapi(), "x-kubernetes-preserve-unknown-fields": True}

    def check(self, value: Any, path: str) -> Any:
        if not isinstance(value, Mapping):
            raise SpecError(f"{path} must be an object, got {value!r}")
        return copy.deepcopy(dict(value))


@dataclass(frozen=True, kw_only=True)
class Obj(Field):
    """An object with declared fields (others are dropped), required ones and CEL rules."""

    properties: Mapping[str, Field] = field(default_factory=dict)
    required: tuple[str, ...] = ()
    rules: tuple[Rule, ...] = ()
    json_type = "object"

    def openapi(self) -> dict[str, Any]:
        node = super().openapi()
        if self.required:
            node["required"] = list(self.required)
        if self.rules:
            node["x-kubernetes-validations"] = [r.openapi() for r in self.rules]
        if self.properties:
            node["properties"] = {name: f.openapi() for name, f in self.properties.items()}
        return node

    def check(self, value: Any, path: str) -> dict[str, Any]:
        if not isinstance(value, Mapping):
            raise SpecError(f"{path} must be an object, got {value!r}")
        out: dict[str, Any] = {}
        for name, sub in self.properties.items():
            if name in value and value[name] is not None:
                out[name] = sub.check(value[name], f"{path}.{name}")
            elif name in self.required:
                raise SpecError(f"{path}.{name} is required")
            elif sub.has_default:
                out[name] = sub.check(copy.deepcopy(sub.default), f"{path}.{name}")
        _check_rules(self.rules, out)
        return out

    def sub(self, *names: str) -> Field:
        """The field at ``names`` below this object (``sub("slo", "maxContext")``)."""
        node: Field = self
        for name in names:
            node = node.properties[name]  # type: ignore[attr-defined]
        return node


@dataclass(frozen=True, kw_only=True)
class Arr(Field):
    items: Field
    max_items: int | None = None
    rules: tuple[Rule, ...] = ()
    map_keys: tuple[str, ...] = ()          # x-kubernetes-list-type: map, keyed by these
    json_type = "array"

    def openapi(self) -> dict[str, Any]:
        node = super().openapi()
        if self.max_items is not None:
            node["maxItems"] = self.max_items
        if self.map_keys:
            node["x-kubernetes-list-type"] = "map"
            node["x-kubernetes-list-map-keys"] = list(self.map_keys)
        node["items"] = self.items.openapi()
        if self.rules:
            node["x-kubernetes-validations"] = [r.openapi() for r in self.rules]
        return node

    def check(self, value: Any, path: str) -> list[Any]:
        if not isinstance(value, list):
            raise SpecError(f"{path} must be a list, got {value!r}")
        if self.max_items is not None and len(value) > self.max_items:
            raise SpecError(f"{path} must have at most {self.max_items} items, got {len(value)}")
        out = [self.items.check(item, f"{path}[{i}]") for i, item in enumerate(value)]
        if self.map_keys:   # the API server refuses two items with the same keys (a list-type map)
            seen: set[tuple] = set()
            for i, item in enumerate(out):
                key = tuple(item.get(k) for k in self.map_keys)
                if key in seen:
                    raise SpecError(f"{path}[{i}]: duplicate {', '.join(self.map_keys)} {key[0] if len(key) == 1 else key!r}")
                seen.add(key)
        _check_rules(self.rules, out)
        return out


@dataclass(frozen=True, kw_only=True)
class Map(Field):
    """An object of free keys whose values are all ``values`` (``additionalProperties``)."""

    values: Field
    max_properties: int | None = None
    json_type = "object"

    def openapi(self) -> dict[str, Any]:
        node = super().openapi()
        if self.max_properties is not None:
            node["maxProperties"] = self.max_properties
        node["additionalProperties"] = self.values.openapi()
        return node

    def check(self, value: Any, path: str) -> dict[str, Any]:
        if not isinstance(value, Mapping):
            raise SpecError(f"{path} must be an object, got {value!r}")
        if self.max_properties is not None and len(value) > self.max_properties:
            raise SpecError(f"{path} must have at most {self.max_properties} entries, got {len(value)}")
        out = {}
        for key, item in value.items():
            try:
                out[key] = self.values.check(item, f"{path}.{key}")
            except SpecError as exc:
                kind = {"string": "strings", "integer": "integers", "number": "numbers"}.get(
                    self.values.json_type)
                raise SpecError(f"{path} values must be {kind}: {exc}" if kind else str(exc)) from None
        return out
