"""Managed fields, server-side apply and strategic merge patch, as the API server does them.

The emulator's version of structured-merge-diff (the library behind the API server's
apply; Kubernetes docs "Server-Side Apply"). What it implements:

- **Schemas.** A built-in kind's comes from the real API server's OpenAPI (the Kubernetes
  1.33 JSON schemas that ``kubernetes-validate`` ships, with ``x-kubernetes-list-type`` /
  ``-list-map-keys`` / ``-map-type`` and the strategic-merge ``x-kubernetes-patch-merge-key``);
  a custom resource's from its CRD. Where a schema says nothing (a field it lacks, a
  schemaless CRD), objects are granular maps and lists atomic, as for ``preserve-unknown-fields``.
- **Field sets** (``fieldsV1``): the leaves (scalars, atomic lists, atomic maps, empty maps),
  the items of associative lists (``k:{"name":"engine"}``, their own entry ``.``) and of
  sets (``v:"x"``). Server-set metadata (name, namespace, uid, resourceVersion, ...) and,
  on the main resource of a kind with a status subresource, ``status`` are in none.
- **Apply** (``PATCH`` ``application/apply-patch+yaml``, ``fieldManager`` required): the
  configuration is merged into the live object (maps key by key, associative lists item
  by key, sets by value, atomic lists and scalars replaced). A field another manager owns
  whose value the configuration would change is a conflict (409) unless ``force=true``,
  which takes it over; equal values are co-owned. A field the manager applied before and
  no longer does is removed unless another manager owns it (or something beneath it); a
  default (a Deployment's ``spec.replicas``) then comes back. The manager's Apply entry
  becomes exactly the configuration's field set. Applying to a missing object creates it.
- **Update** (every other write, per manager and subresource): the fields whose value the
  write changed become the writer's and leave every other manager; fields it removed
  leave every set. The manager is the ``fieldManager`` parameter, else the User-Agent up
  to its first ``/`` (the API server's rule). Writes to ``/scale`` own ``spec.replicas``.
- **Strategic merge patch** (built-in kinds): lists with a patch merge key merge item by
  key (``$patch: delete`` on an item removes it), merge-strategy scalar lists by value,
  null deletes a map key; other lists are replaced.

Approximations: no ``$retainKeys`` / ``$setElementOrder`` / ``$deleteFromPrimitiveList``
directives; one API version per kind (no conversion of managed fields); of the key
fields an item may omit, only ``protocol`` is defaulted (to TCP, as the API server does
since 1.21: other omissions are a 422); managedFields a client sends are ignored (the
server's are kept); maps left empty by a removal are removed too; entry times are
seconds.
"""

from __future__ import annotations

import copy
import datetime
import functools
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import kubernetes_validate

Path_ = tuple[str, ...]   # fieldsV1 elements: "f:spec", 'k:{"name":"engine"}', 'v:"x"'
APPLY = "Apply"
UPDATE = "Update"
# metadata the server sets or that names the object: never in a field set
SERVER_META = ("name", "namespace", "uid", "resourceVersion", "generation", "creationTimestamp",
               "deletionTimestamp", "deletionGracePeriodSeconds", "selfLink", "managedFields")
KEY_DEFAULTS = {"protocol": "TCP"}


class Conflict(Exception):
    """An apply that would change fields other managers own: ``(path, manager)`` pairs."""

    def __init__(self, conflicts: list[tuple[Path_, str]], api_version: str) -> None:
        self.conflicts = conflicts
        lines = "\n".join(f'conflict with "{m}" using {api_version}: {dotted(p)}' for p, m in conflicts)
        super().__init__(f"Apply failed with {len(conflicts)} conflict{'s' * (len(conflicts) > 1)}: {lines}")


class InvalidConfig(ValueError):
    """An applied configuration the schema cannot merge (an item without its key fields)."""


def dotted(path: Path_) -> str:
    """``.spec.template.spec.containers[name="engine"].image``, as the API server prints paths."""
    out = ""
    for el in path:
        kind, _, rest = el.partition(":")
        if kind == "f":
            out += "." + rest
        elif kind == "k":
            out += "[" + ",".join(f"{k}={json.dumps(v)}" for k, v in json.loads(rest).items()) + "]"
        else:
            out += f"[={rest}]"
    return out


# ----------------------------------------------------------------------------- schemas

@functools.lru_cache(maxsize=1)
def _openapi() -> tuple[dict, dict]:
    """The 1.33 definitions and an index (group, version, kind) -> definition name."""
    root = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / "v1.33.0-local"
    defs = json.loads((root / "_definitions.json").read_text())["$defs"]
    index = {}
    for name, schema in defs.items():
        for gvk in schema.get("x-kubernetes-group-version-kind") or ():
            index[(gvk.get("group", ""), gvk["version"], gvk["kind"])] = name
    return defs, index


class Shape:
    """A node of a schema: what kind of map or list lives here, and the nodes below."""

    def __init__(self, schema: Mapping[str, Any] | None, defs: Mapping[str, Any] | None = None) -> None:
        self._defs = defs or {}
        schema = dict(schema or {})
        while "$ref" in schema:
            ref = schema.pop("$ref").rsplit("/", 1)[-1]
            schema = {**self._defs.get(ref, {}), **schema}
        self.schema = schema

    @classmethod
    def builtin(cls, group: str, version: str, kind: str) -> Shape | None:
        defs, index = _openapi()
        name = index.get((group, version, kind))
        return cls(defs[name], defs) if name else None

    def field(self, name: str) -> Shape:
        props = self.schema.get("properties") or {}
        if name in props:
            return Shape(props[name], self._defs)
        extra = self.schema.get("additionalProperties")
        return Shape(extra if isinstance(extra, Mapping) else None, self._defs)

    def item(self) -> Shape:
        return Shape(self.schema.get("items"), self._defs)

    @property
    def atomic_map(self) -> bool:
        return self.schema.get("x-kubernetes-map-type") == "atomic"

    @property
    def list_type(self) -> str:
        return self.schema.get("x-kubernetes-list-type") or "atomic"

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(self.schema.get("x-kubernetes-list-map-keys") or ())

    @property
    def patch_merge_key(self) -> str | None:
        return self.schema.get("x-kubernetes-patch-merge-key")

    @property
    def patch_merges(self) -> bool:
        return "merge" in (self.schema.get("x-kubernetes-patch-strategy") or "").split(",")


def item_key(item: Any, keys: tuple[str, ...]) -> str:
    """The ``k:`` element of an associative-list item (key fields in schema order)."""
    if not isinstance(item, Mapping):
        raise InvalidConfig(f"an associative list (keys {list(keys)}) holds a non-object item {item!r}")
    values = {}
    for k in keys:
        if k in item:
            values[k] = item[k]
        elif k in KEY_DEFAULTS:
            values[k] = KEY_DEFAULTS[k]
        else:
            raise InvalidConfig(f"associative list with keys has an element that omits key field {k!r} "
                                "(and doesn't have default value)")
    return "k:" + json.dumps(values, separators=(",", ":"))


def _is_item(item: Any, element: str) -> bool:
    """Whether list item ``item`` is the one ``k:`` element ``element`` names."""
    keys = tuple(json.loads(element[2:]))
    try:
        return isinstance(item, Mapping) and item_key(item, keys) == element
    except InvalidConfig:
        return False


def set_key(value: Any) -> str:
    return "v:" + json.dumps(value, separators=(",", ":"))


# ----------------------------------------------------------------------------- field sets

def strip(obj: Mapping[str, Any] | None, status_subresource: bool, subresource: str | None = None) -> dict:
    """The part of ``obj`` whose fields are managed by writes to ``subresource``."""
    obj = copy.deepcopy(dict(obj or {}))
    obj.pop("apiVersion", None)
    obj.pop("kind", None)
    meta = obj.get("metadata")
    if isinstance(meta, dict):
        for key in SERVER_META:
            meta.pop(key, None)
        if not meta:
            obj.pop("metadata")
    if subresource == "status":
        return {"status": obj["status"]} if "status" in obj else {}
    if status_subresource:
        obj.pop("status", None)
    return obj


def field_set(value: Any, shape: Shape, prefix: Path_ = ()) -> set[Path_]:
    """Every managed path of ``value`` (see the module docstring)."""
    if isinstance(value, Mapping) and value and not shape.atomic_map:
        out: set[Path_] = set()
        for k, v in value.items():
            out |= field_set(v, shape.field(k), (*prefix, f"f:{k}"))
        return out
    if isinstance(value, list) and value and shape.list_type in ("map", "set"):
        out = set()
        for item in value:
            if shape.list_type == "set":
                out.add((*prefix, set_key(item)))
                continue
            path = (*prefix, item_key(item, shape.keys))
            out.add(path)
            out |= field_set(item, shape.item(), path)
        return out
    return {prefix} if prefix else set()


def value_at(obj: Any, path: Path_, shape: Shape) -> tuple[bool, Any]:
    """(present, value) of the field at ``path``."""
    node: Any = obj
    for el in path:
        kind, _, rest = el.partition(":")
        if kind == "f":
            if not isinstance(node, Mapping) or rest not in node:
                return False, None
            node, shape = node[rest], shape.field(rest)
        elif kind == "k":
            match = [i for i in node if _is_item(i, el)] if isinstance(node, list) else []
            if not match:
                return False, None
            node, shape = match[0], shape.item()
        else:
            wanted = json.loads(rest)
            if not isinstance(node, list) or wanted not in node:
                return False, None
            node = wanted
    return True, node


def _remove_at(obj: dict, path: Path_) -> None:
    """Delete the field at ``path``; maps left empty on the way up go too."""
    parents: list[tuple[Any, str]] = []
    node: Any = obj
    for el in path[:-1]:
        kind, _, rest = el.partition(":")
        if kind == "f":
            if not isinstance(node, dict) or rest not in node:
                return
            parents.append((node, el))
            node = node[rest]
        elif kind == "k":
            match = [i for i in node if _is_item(i, el)] if isinstance(node, list) else []
            if not match:
                return
            parents.append((node, el))
            node = match[0]
        else:
            return
    kind, _, rest = path[-1].partition(":")
    if kind == "f" and isinstance(node, dict):
        node.pop(rest, None)
    elif kind == "k" and isinstance(node, list):
        node[:] = [i for i in node if not _is_item(i, path[-1])]
    elif kind == "v" and isinstance(node, list):
        value = json.loads(rest)
        node[:] = [i for i in node if i != value]
    for parent, el in reversed(parents):   # prune maps the removal emptied
        kind, _, rest = el.partition(":")
        if kind == "f" and parent.get(rest) == {}:
            parent.pop(rest)
        else:
            break


def to_fields_v1(paths: Iterable[Path_]) -> dict:
    """A field set as the ``fieldsV1`` trie (``{}`` leaves, ``.`` for a list item itself)."""
    trie: dict = {}
    for path in paths:
        node = trie
        for el in path:
            node = node.setdefault(el, {})
        if path and path[-1].startswith("k:"):
            node.setdefault(".", {})
    return _sorted(trie)


def _sorted(trie: dict) -> dict:
    return {k: _sorted(v) for k, v in sorted(trie.items())}


def from_fields_v1(trie: Mapping[str, Any], prefix: Path_ = ()) -> set[Path_]:
    out: set[Path_] = set()
    for el, sub in trie.items():
        if el == ".":
            out.add(prefix)
            continue
        path = (*prefix, el)
        if sub:
            out |= from_fields_v1(sub, path)
        else:
            out.add(path)
    return out


# ----------------------------------------------------------------------------- merging

def merge(live: Any, config: Any, shape: Shape) -> Any:
    """``config`` merged into ``live`` as apply does (see the module docstring)."""
    if isinstance(config, Mapping) and isinstance(live, Mapping) and not shape.atomic_map:
        out = copy.deepcopy(dict(live))
        for k, v in config.items():
            out[k] = merge(live[k], v, shape.field(k)) if k in live else copy.deepcopy(v)
        return out
    if isinstance(config, list) and isinstance(live, list) and shape.list_type == "map":
        out = copy.deepcopy(live)
        position = {item_key(i, shape.keys): n for n, i in enumerate(out)}
        for item in config:
            key = item_key(item, shape.keys)
            if key in position:
                out[position[key]] = merge(out[position[key]], item, shape.item())
            else:
                position[key] = len(out)
                out.append(copy.deepcopy(item))
        return out
    if isinstance(config, list) and isinstance(live, list) and shape.list_type == "set":
        return copy.deepcopy(live) + [copy.deepcopy(v) for v in config if v not in live]
    return copy.deepcopy(config)


def strategic_merge(target: Any, patch: Any, shape: Shape) -> Any:
    """A strategic merge patch applied to ``target`` (see the module docstring)."""
    if isinstance(patch, Mapping):
        if patch.get("$patch") == "replace":
            return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
        out = copy.deepcopy(dict(target)) if isinstance(target, Mapping) else {}
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = strategic_merge(out.get(k), v, shape.field(k))
        return out
    if isinstance(patch, list) and isinstance(target, list) and shape.patch_merge_key:
        key = shape.patch_merge_key
        out = copy.deepcopy(target)
        for item in patch:
            if not isinstance(item, Mapping) or key not in item:
                raise InvalidConfig(f"a strategic merge patch item lacks its merge key {key!r}: {item!r}")
            at = next((n for n, i in enumerate(out) if isinstance(i, Mapping) and i.get(key) == item[key]), None)
            if item.get("$patch") == "delete":
                out = [i for i in out if not (isinstance(i, Mapping) and i.get(key) == item[key])]
            elif at is None:
                out.append(copy.deepcopy(dict(item)))
            else:
                out[at] = strategic_merge(out[at], item, shape.item())
        return out
    if isinstance(patch, list) and isinstance(target, list) and shape.patch_merges:
        return copy.deepcopy(target) + [copy.deepcopy(v) for v in patch if v not in target]
    return copy.deepcopy(patch)


# ----------------------------------------------------------------------------- managers

def owners(obj: Mapping[str, Any], *path: str) -> set[str]:
    """The managers whose managedFields hold the fieldsV1 ``path`` (or something beneath it)."""
    return {e["manager"] for e in _entries(obj) if _owned_below(e["paths"], tuple(path))}


def manager_name(field_manager: str | None, user_agent: str) -> str:
    return field_manager or user_agent.split("/", 1)[0] or "unknown"


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _entries(obj: Mapping[str, Any] | None) -> list[dict]:
    """The managedFields entries with their sets parsed (``paths``)."""
    out = []
    for e in ((obj or {}).get("metadata") or {}).get("managedFields") or ():
        entry = {k: v for k, v in e.items() if k != "fieldsV1"}
        entry["paths"] = from_fields_v1(e.get("fieldsV1") or {})
        out.append(entry)
    return out


def _write_entries(obj: dict, entries: list[dict]) -> None:
    rendered = [{**{k: v for k, v in e.items() if k != "paths"}, "fieldsType": "FieldsV1",
                 "fieldsV1": to_fields_v1(e["paths"])} for e in entries if e["paths"]]
    meta = obj.setdefault("metadata", {})
    if rendered:
        meta["managedFields"] = rendered
    else:
        meta.pop("managedFields", None)


def _is_key_field(path: Path_) -> bool:
    """A key field of a list item (kept as long as the item is)."""
    return len(path) >= 2 and path[-2].startswith("k:") and path[-1][2:] in json.loads(path[-2][2:])


def _owned_below(paths: set[Path_], path: Path_) -> bool:
    return any(p[:len(path)] == path for p in paths)


def _differs(a: Any, b: Any, path: Path_, shape: Shape) -> bool:
    """Whether the field at ``path`` has another value in ``b`` than in ``a``; a list item
    itself never differs (only its fields do: its existence is shared, not contested)."""
    if path and not path[-1].startswith("f:"):
        return False
    return value_at(a, path, shape) != value_at(b, path, shape)


def _entry(entries: list[dict], manager: str, operation: str, subresource: str | None,
           api_version: str) -> dict:
    for e in entries:
        if (e["manager"], e["operation"], e.get("subresource")) == (manager, operation, subresource):
            return e
    entry = {"manager": manager, "operation": operation, "apiVersion": api_version, "time": _now(),
             "paths": set()}
    if subresource:
        entry["subresource"] = subresource
    entries.append(entry)
    return entry


def record_update(old: Mapping[str, Any] | None, new: dict, shape: Shape, manager: str,
                  api_version: str, status_subresource: bool, subresource: str | None = None) -> None:
    """Set ``new``'s managedFields after a non-apply write by ``manager`` (``old``: None on create)."""
    entries = _entries(old)
    before, after = strip(old, status_subresource, subresource), strip(new, status_subresource, subresource)
    old_set, new_set = field_set(before, shape), field_set(after, shape)
    changed = {p for p in new_set if p not in old_set or _differs(before, after, p, shape)}
    removed = old_set - new_set
    if changed or removed:
        for e in entries:
            e["paths"] = {p for p in e["paths"] if p not in changed and not _owned_below(removed, p)}
        if changed:
            mine = _entry(entries, manager, UPDATE, subresource, api_version)
            mine["paths"] |= changed
            mine["time"] = _now()
    _write_entries(new, entries)


def apply(live: Mapping[str, Any] | None, config: Mapping[str, Any], shape: Shape, manager: str,
          force: bool, api_version: str, status_subresource: bool,
          subresource: str | None = None) -> dict:
    """The object after ``manager`` applies ``config`` to ``live`` (None: created).

    Raises ``Conflict`` (409) and ``InvalidConfig`` (422); server fields are the caller's.
    """
    entries = _entries(live)
    wanted = strip(config, status_subresource, subresource)
    before = strip(live, status_subresource, subresource)
    applied = field_set(wanted, shape)
    mine = _entry(entries, manager, APPLY, subresource, api_version)
    others = [e for e in entries if e is not mine]
    conflicts = sorted({(p, e["manager"]) for e in others for p in e["paths"] & applied
                        if _differs(before, wanted, p, shape)})
    if conflicts and not force:
        raise Conflict(conflicts, api_version)
    taken = {p for p, _ in conflicts}
    for e in others:
        e["paths"] -= taken
    merged = merge(copy.deepcopy(dict(live or {})), wanted, shape)
    kept = set().union(*(e["paths"] for e in others)) if others else set()
    for path in sorted(mine["paths"] - applied, key=len):   # an item before its fields
        if not _owned_below(kept, path) and not _is_key_field(path):
            _remove_at(merged, path)
    if mine["paths"] != applied:
        mine["time"] = _now()
    mine["paths"] = applied
    _write_entries(merged, entries)
    return merged
