"""Server-side apply of a child: what the operator applies, and whether it needs applying.

Every child is written with server-side apply as the field manager ``kvpilot``
(``constants.FIELD_MANAGER``): the body holds only the fields the operator sets, and the
API server merges it into the live object (maps key by key, associative lists item by
key), records which manager owns which field (``metadata.managedFields``) and removes the
fields the operator applied before and no longer does, unless another manager owns them.
Fields other controllers add (a mesh sidecar, a secrets agent's env and volumes,
``kubectl annotate``) are theirs and are never touched; the operator's own fields are
taken back with ``force`` when someone changed them.

To cost nothing on an unchanged service, a pass applies only when the live object does
not already hold the applied configuration (``holds``): every applied field has its value
in the live object, with the associative lists of ``LIST_KEYS`` matched item by key (so
items others add do not count) and other lists whole; and the operator owns no field
outside the configuration (else applying again removes it).

A create-only field (``Child.create_only``: an autoscaled Deployment's ``spec.replicas``,
a bound claim's ``spec``) is applied at creation and afterwards re-applied at its live
value for as long as the operator still owns it, so that omitting it never removes it;
once another manager changed it (an HPA scaling through ``/scale``), it is left out.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any

from kvpilot.operator.constants import FIELD_MANAGER
from kvpilot.operator.quantity import quantity
from kvpilot.operator.resources import Child

# The associative lists (x-kubernetes-list-type: map) of the fields the operator writes,
# keyed by their path ("*" = every item of a list), with their keys: the API server's own
# schema (tests/operator/test_server_side_apply.py checks this table against it).
_POD = ("spec", "template", "spec")
_CONTAINER_LISTS = {("env",): ("name",), ("ports",): ("containerPort", "protocol"),
                    ("volumeMounts",): ("mountPath",), ("volumeDevices",): ("devicePath",)}
_POD_LISTS = {("containers",): ("name",), ("initContainers",): ("name",), ("volumes",): ("name",),
              ("imagePullSecrets",): ("name",), ("hostAliases",): ("ip",),
              ("topologySpreadConstraints",): ("topologyKey", "whenUnsatisfiable"),
              **{(containers, "*", *sub): keys for containers in ("containers", "initContainers")
                 for sub, keys in _CONTAINER_LISTS.items()}}
_META_LISTS = {("metadata", "ownerReferences"): ("uid",)}
LIST_KEYS: dict[str, dict[tuple[str, ...], tuple[str, ...]]] = {
    "Deployment": {**_META_LISTS, **{(*_POD, *path): keys for path, keys in _POD_LISTS.items()}},
    "Service": {**_META_LISTS, ("spec", "ports"): ("port", "protocol")},
}
KEY_DEFAULTS = {"protocol": "TCP"}   # the one key field the API server defaults
# Maps the API server's schema makes atomic (x-kubernetes-map-type: atomic: one owner, set
# whole) in the built-in kinds, by field name: label selectors, node selectors and terms,
# references to a key of a Secret or ConfigMap. A map the operator owns is compared as its
# managedFields say anyway; this covers one another manager has taken over.
ATOMIC_MAPS = frozenset({"selector", "nodeSelector", "labelSelector", "namespaceSelector", "preference",
                         "requiredDuringSchedulingIgnoredDuringExecution", "secretKeyRef",
                         "configMapKeyRef", "fieldRef", "resourceFieldRef", "secretRef",
                         "nodePublishSecretRef", "dataSource", "dataSourceRef"})
# Lists whose items are such maps (owner references, image pull secrets).
ATOMIC_ITEMS = frozenset({"ownerReferences", "imagePullSecrets"})
# Keys the API server adds to such a map by defaulting: not someone else's edit.
SERVER_DEFAULTED = {"fieldRef": {"apiVersion"}}
BUILTIN_KINDS = frozenset({"Deployment", "Service", "PersistentVolumeClaim", "HorizontalPodAutoscaler",
                           "PodDisruptionBudget"})

Path = tuple[str, ...]   # fieldsV1 elements: "f:spec", 'k:{"name":"engine"}'


def _list_keys(kind: str, path: tuple[str, ...]) -> tuple[str, ...] | None:
    return LIST_KEYS.get(kind, _META_LISTS).get(path)


def atomic_map(kind: str, at: tuple[str, ...]) -> bool:
    """Whether the map at ``at`` (``"*"`` for a list's items) is atomic in a built-in kind."""
    return kind in BUILTIN_KINDS and bool(at) and (
        at[-1] in ATOMIC_MAPS or (at[-1] == "*" and len(at) > 1 and at[-2] in ATOMIC_ITEMS))


def _item_key(item: Mapping[str, Any], keys: tuple[str, ...]) -> str:
    values = {k: item.get(k, KEY_DEFAULTS.get(k)) for k in keys}
    return "k:" + json.dumps(values, separators=(",", ":"))


def field_paths(obj: Any, kind: str, at: tuple[str, ...] = (), prefix: Path = ()) -> set[Path]:
    """Every field of ``obj`` as a fieldsV1 path: intermediate maps included, associative
    list items as ``k:`` elements, other lists and scalars as leaves."""
    out = {prefix} if prefix else set()
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            out |= field_paths(value, kind, (*at, key), (*prefix, f"f:{key}"))
    elif isinstance(obj, list) and (keys := _list_keys(kind, at)) is not None:
        for item in obj:
            if isinstance(item, Mapping):
                out |= field_paths(item, kind, (*at, "*"), (*prefix, _item_key(item, keys)))
    return out


def _trie_paths(trie: Mapping[str, Any], prefix: Path = ()) -> dict[Path, bool]:
    """The paths of a fieldsV1 trie, each with whether it is a leaf (owned whole)."""
    out = {}
    for element, sub in trie.items():
        if element == ".":
            continue
        path = (*prefix, element)
        children = isinstance(sub, Mapping) and any(k != "." for k in sub)
        out[path] = not children
        if children:
            out.update(_trie_paths(sub, path))
    return out


def _apply_entry(live: Mapping[str, Any] | None) -> dict[Path, bool] | None:
    for entry in ((live or {}).get("metadata") or {}).get("managedFields") or ():
        if (isinstance(entry, Mapping) and entry.get("manager") == FIELD_MANAGER
                and entry.get("operation") == "Apply" and not entry.get("subresource")):
            return _trie_paths(entry.get("fieldsV1") or {})
    return None


def owned_paths(live: Mapping[str, Any] | None) -> set[Path] | None:
    """The fields the operator's Apply entry owns in ``live`` (None: it never applied it)."""
    entry = _apply_entry(live)
    return None if entry is None else set(entry)


def owns(live: Mapping[str, Any] | None, dotted: str) -> bool:
    """Whether the operator's Apply entry owns the field at ``dotted`` (``spec.replicas``)."""
    path = tuple(f"f:{part}" for part in dotted.split("."))
    return path in (owned_paths(live) or ())


def _project(value: Any, owned: set[Path], prefix: Path) -> Any:
    """The part of ``value`` (the field at ``prefix``) made of the fields in ``owned``."""
    below = [p for p in owned if len(p) > len(prefix) and p[:len(prefix)] == prefix]
    if not isinstance(value, Mapping) or not below:
        return copy.deepcopy(value)   # owned whole: a scalar, an atomic list or map
    return {key: _project(sub, owned, (*prefix, f"f:{key}")) for key, sub in value.items()
            if any(p[len(prefix)] == f"f:{key}" for p in below)}


def applied_config(child: Child, live: Mapping[str, Any] | None) -> dict:
    """The configuration to apply for ``child`` given the live object (None: absent)."""
    body = copy.deepcopy(child.body)
    if live is None:
        return body
    owned = owned_paths(live) or set()
    for dotted in child.create_only:
        *parents, leaf = dotted.split(".")
        node, actual = body, live
        for part in parents:
            node = node.setdefault(part, {})
            actual = actual.get(part) if isinstance(actual, Mapping) else None
        node.pop(leaf, None)
        path = tuple(f"f:{part}" for part in dotted.split("."))
        if isinstance(actual, Mapping) and leaf in actual and any(p[:len(path)] == path for p in owned):
            node[leaf] = _project(actual[leaf], owned, path)
    return body


def contains(actual: Any, desired: Any, kind: str, owned_leaves: frozenset[Path] = frozenset(),
             at: tuple[str, ...] = (), path: Path = (), whole: bool = False) -> bool:
    """True if every field of ``desired`` has its value in ``actual``.

    Mappings: key by key, except atomic ones (``ATOMIC_MAPS`` of a built-in kind, or a leaf
    of the operator's managed fields: ``owned_leaves``), which must be equal. Associative
    lists (``LIST_KEYS``): every desired item is matched by its keys and contained; items
    only ``actual`` has are someone else's. Other lists: same length, items contained
    pairwise (the server may default fields inside them). Scalars: equal (``True`` is not
    ``1``), or the same quantity when one side is a string (the server prints quantities
    in canonical form: ``"0.5"`` -> ``"500m"``). ``whole``: inside an atomic map or list,
    where maps must have exactly the desired keys.
    """
    if isinstance(desired, Mapping):
        if not isinstance(actual, Mapping):
            return False
        whole = whole or path in owned_leaves or atomic_map(kind, at)
        defaulted = SERVER_DEFAULTED.get(at[-1], set()) if at else set()
        if whole and set(actual) - defaulted != set(desired) - defaulted:
            return False
        return all(k in actual and contains(actual[k], v, kind, owned_leaves, (*at, k), (*path, f"f:{k}"), whole)
                   for k, v in desired.items())
    if isinstance(desired, list):
        if not isinstance(actual, list):
            return False
        keys = _list_keys(kind, at)
        if keys is not None:
            live = {_item_key(a, keys): a for a in actual if isinstance(a, Mapping)}
            return all(isinstance(d, Mapping) and (key := _item_key(d, keys)) in live
                       and contains(live[key], d, kind, owned_leaves, (*at, "*"), (*path, key), whole)
                       for d in desired)
        # an atomic list: its items may hold server defaults, but no item of someone else's
        return len(actual) == len(desired) and all(
            contains(a, d, kind, frozenset(), (*at, "*"), (), whole) for a, d in zip(actual, desired, strict=True))
    if isinstance(desired, bool) or isinstance(actual, bool):
        return type(desired) is type(actual) and desired == actual
    if actual == desired:
        return True
    a, d = quantity(actual), quantity(desired)
    return a is not None and a == d and (isinstance(actual, str) or isinstance(desired, str))


def holds(live: Mapping[str, Any], config: Mapping[str, Any], kind: str) -> bool:
    """Whether applying ``config`` to ``live`` would change nothing the operator cares about."""
    entry = _apply_entry(live)
    if entry is None:   # never applied by the operator (created some other way): take it over
        return False
    leaves = frozenset(p for p, leaf in entry.items() if leaf)
    return contains(live, config, kind, leaves) and set(entry) <= field_paths(config, kind)
