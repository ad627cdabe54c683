"""Pieces of Kubernetes API behaviour for the emulator: resource types, label selectors,
JSONPath printer columns, patch content types and Table rendering.

Pure functions and plain data; the stateful server is in ``emulator.py``.
"""

from __future__ import annotations

import copy
import datetime
import functools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import jsonpatch

from support import kube_field_manager as fm

VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]


@dataclass
class ResourceType:
    """One served resource (what discovery reports and what the store keys on)."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True
    short_names: list[str] = field(default_factory=list)
    categories: list[str] = field(default_factory=list)
    status: bool = False                      # has a status subresource
    scale: dict | None = None                 # {specReplicasPath, statusReplicasPath, labelSelectorPath}
    printer_columns: list[dict] = field(default_factory=list)
    schema: dict | None = None                # openAPIV3Schema of custom resources

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def singular(self) -> str:
        return self.kind.lower()

    @functools.cached_property
    def shape(self) -> fm.Shape:
        """How its maps and lists merge: the CRD's schema, else the API server's own."""
        if self.schema is not None:
            return fm.Shape(self.schema)
        return fm.Shape.builtin(self.group, self.version, self.kind) or fm.Shape(None)

    def discovery(self) -> list[dict]:
        """APIResource entries (the resource and its subresources)."""
        entries = [{"name": self.plural, "singularName": self.singular, "namespaced": self.namespaced,
                    "kind": self.kind, "verbs": VERBS, "shortNames": self.short_names,
                    "categories": self.categories}]
        if self.status:
            entries.append({"name": f"{self.plural}/status", "singularName": "", "namespaced": self.namespaced,
                            "kind": self.kind, "verbs": ["get", "patch", "update"]})
        if self.scale is not None:
            entries.append({"name": f"{self.plural}/scale", "singularName": "", "namespaced": self.namespaced,
                            "group": "autoscaling", "version": "v1", "kind": "Scale",
                            "verbs": ["get", "patch", "update"]})
        return entries


def _core(plural: str, kind: str, namespaced: bool = True, **kw: Any) -> ResourceType:
    return ResourceType("", "v1", plural, kind, namespaced, **kw)


DEPLOYMENT_SCALE = {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                    "labelSelectorPath": ".status.selector"}

BUILTIN_TYPES = [
    _core("namespaces", "Namespace", namespaced=False, short_names=["ns"], status=True),
    _core("events", "Event", short_names=["ev"]),
    _core("pods", "Pod", short_names=["po"], status=True),
    _core("nodes", "Node", namespaced=False, short_names=["no"], status=True),   # kube_scheduler's
    _core("services", "Service", short_names=["svc"], status=True),
    _core("secrets", "Secret"),
    _core("configmaps", "ConfigMap", short_names=["cm"]),
    _core("persistentvolumeclaims", "PersistentVolumeClaim", short_names=["pvc"], status=True),
    _core("serviceaccounts", "ServiceAccount", short_names=["sa"]),
    ResourceType("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", short_names=["netpol"]),
    ResourceType("apps", "v1", "deployments", "Deployment", short_names=["deploy"], status=True,
                 scale=DEPLOYMENT_SCALE),
    ResourceType("autoscaling", "v2", "horizontalpodautoscalers", "HorizontalPodAutoscaler",
                 short_names=["hpa"], status=True),
    ResourceType("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", short_names=["pdb"],
                 status=True),
    ResourceType("events.k8s.io", "v1", "events", "Event", short_names=["ev"]),
    # the router's identity and discovery Role (spec.routing.router: vllm-router)
    _core("serviceaccounts", "ServiceAccount", short_names=["sa"]),
    ResourceType("rbac.authorization.k8s.io", "v1", "roles", "Role"),
    ResourceType("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding"),
    ResourceType("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition",
                 namespaced=False, short_names=["crd", "crds"], status=True),
]


def apply_builtin_defaults(rtype: ResourceType, obj: dict) -> dict:
    """The API server's defaulting of built-in kinds, where tests depend on it: a Deployment
    without ``spec.replicas`` (never given, or removed by a patch) gets 1."""
    if (rtype.group, rtype.plural) == ("apps", "deployments") and isinstance(obj.get("spec"), dict):
        obj["spec"].setdefault("replicas", 1)
    return obj


def types_from_crd(crd: Mapping[str, Any]) -> list[ResourceType]:
    """The served versions of a CustomResourceDefinition as resource types."""
    spec = crd["spec"]
    names = spec["names"]
    out = []
    for version in spec["versions"]:
        if not version.get("served", True):
            continue
        sub = version.get("subresources") or {}
        out.append(ResourceType(
            group=spec["group"], version=version["name"], plural=names["plural"], kind=names["kind"],
            namespaced=spec.get("scope", "Namespaced") == "Namespaced",
            short_names=list(names.get("shortNames") or []), categories=list(names.get("categories") or []),
            status="status" in sub, scale=sub.get("scale"),
            printer_columns=list(version.get("additionalPrinterColumns") or []),
            schema=(version.get("schema") or {}).get("openAPIV3Schema"),
        ))
    return out


# ----------------------------------------------------------------------------- paths

@dataclass(frozen=True)
class ApiPath:
    group: str
    version: str
    plural: str | None = None
    namespace: str | None = None
    name: str | None = None
    subresource: str | None = None


def parse_path(path: str) -> ApiPath | None:
    """Split an API path; ``/api/v1/namespaces`` and ``/api/v1/namespaces/x`` included."""
    parts = [p for p in path.split("/") if p]
    if len(parts) >= 2 and parts[0] == "api":
        group, version, rest = "", parts[1], parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    if not rest:
        return ApiPath(group, version)
    namespace = None
    if rest[0] == "namespaces" and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    plural, name, sub = rest[0], rest[1] if len(rest) > 1 else None, "/".join(rest[2:]) or None
    return ApiPath(group, version, plural, namespace, name, sub)



# ----------------------------------------------------------------------------- selectors

_SET_RE = re.compile(r"^\s*([^\s!=]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def _split_selector(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def label_selector_matches(selector: str | None, labels: Mapping[str, str] | None) -> bool:
    """Equality (=, ==, !=), set (in, notin) and existence (key, !key) requirements."""
    labels = labels or {}
    for req in _split_selector(selector or ""):
        if m := _SET_RE.match(req):
            key, op, values = m[1], m[2], {v.strip() for v in m[3].split(",")}
            if op == "in" and (key not in labels or labels[key] not in values):
                return False
            if op == "notin" and key in labels and labels[key] in values:
                return False
        elif "!=" in req:
            key, value = (s.strip() for s in req.split("!=", 1))
            if labels.get(key) == value:
                return False
        elif "=" in req:
            key, value = (s.strip() for s in req.replace("==", "=").split("=", 1))
            if labels.get(key) != value:
                return False
        elif req.startswith("!"):
            if req[1:] in labels:
                return False
        elif req not in labels:
            return False
    return True


def field_selector_matches(selector: str | None, obj: Mapping[str, Any]) -> bool:
    """``metadata.name`` / ``metadata.namespace`` equality and inequality."""
    for req in _split_selector(selector or ""):
        negate = "!=" in req
        key, value = (s.strip() for s in req.replace("!=", "=").replace("==", "=").split("=", 1))
        actual = jsonpath_values(obj, "." + key)
        actual_value = str(actual[0]) if actual else ""
        if (actual_value == value) == negate:
            return False
    return True


# ----------------------------------------------------------------------------- JSONPath

_TOKEN = re.compile(r'\.([A-Za-z0-9_\-]+)|\[(\d+)\]|\[\?\(@\.([A-Za-z0-9_.\-]+)\s*==\s*["\']([^"\']*)["\']\)\]|\[\*\]')


def jsonpath_values(obj: Any, path: str) -> list[Any]:
    """Evaluate the JSONPath subset used in printer columns and scale paths.

    Supports ``.field``, ``[index]``, ``[*]`` and ``[?(@.a.b=="v")]``.
    """
    path = path.strip()
    if path.startswith("{") and path.endswith("}"):
        path = path[1:-1]
    if path.startswith("$"):
        path = path[1:]
    nodes = [obj]
    pos = 0
    while pos < len(path):
        m = _TOKEN.match(path, pos)
        if m is None:
            raise ValueError(f"unsupported JSONPath {path!r} at {path[pos:]!r}")
        pos = m.end()
        nxt = []
        for node in nodes:
            if m[1] is not None:
                if isinstance(node, Mapping) and m[1] in node:
                    nxt.append(node[m[1]])
            elif m[2] is not None:
                if isinstance(node, list) and int(m[2]) < len(node):
                    nxt.append(node[int(m[2])])
            elif m[3] is not None:
                if isinstance(node, list):
                    for item in node:
                        got = jsonpath_values(item, "." + m[3])
                        if got and str(got[0]) == m[4]:
                            nxt.append(item)
            elif isinstance(node, list):
                nxt.extend(node)
        nodes = nxt
    return nodes


def set_path(obj: dict, path: str, value: Any) -> None:
    """Set ``.a.b.c`` in ``obj``, creating objects on the way."""
    parts = [p for p in path.strip().lstrip(".").split(".") if p]
    node = obj
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


# ----------------------------------------------------------------------------- patches

MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"
APPLY = "application/apply-patch+yaml"


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = copy.deepcopy(dict(target)) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


class PatchError(ValueError):
    """A patch that cannot be applied (bad body or a failed JSON-patch ``test``)."""


def apply_patch(obj: dict, content_type: str, body: Any, shape: fm.Shape | None = None) -> dict:
    """Apply a PATCH body of ``content_type`` to a copy of ``obj``.

    A strategic merge patch follows ``shape`` (a built-in kind's schema:
    ``kube_field_manager.strategic_merge``); without one (custom resources, which the API
    server refuses it for) it is applied as a JSON merge patch.
    """
    ctype = content_type.split(";")[0].strip().lower()
    if ctype in (MERGE, STRATEGIC):
        if not isinstance(body, Mapping):
            raise PatchError("a merge patch must be a JSON object")
        if ctype == STRATEGIC and shape is not None:
            try:
                return fm.strategic_merge(obj, body, shape)
            except fm.InvalidConfig as exc:
                raise PatchError(str(exc)) from None
        return merge_patch(obj, body)
    if ctype == JSON_PATCH:
        try:
            return jsonpatch.apply_patch(obj, body)
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
            raise PatchError(str(exc)) from exc
    raise LookupError(ctype)


# ----------------------------------------------------------------------------- tables

def human_age(created: str | None, now: datetime.datetime | None = None) -> str:
    """``kubectl``'s short age: 45s, 5m30s, 12m, 3h20m, 5h, 3d4h, 12d."""
    if not created:
        return "<unknown>"
    now = now or datetime.datetime.now(datetime.UTC)
    then = datetime.datetime.fromisoformat(created.replace("Z", "+00:00"))
    s = max(0, int((now - then).total_seconds()))
    m, h, d = s // 60, s // 3600, s // 86400
    if s < 120:
        return f"{s}s"
    if m < 10:
        return f"{m}m{s % 60}s" if s % 60 else f"{m}m"
    if h < 3:
        return f"{m}m"
    if h < 8:
        return f"{h}h{m % 60}m" if m % 60 else f"{h}h"
    if d < 2:
        return f"{h}h"
    if d < 8:
        return f"{d}d{h % 24}h" if h % 24 else f"{d}d"
    return f"{d}d"


def _cell(column: Mapping[str, Any], obj: Mapping[str, Any]) -> Any:
    values = jsonpath_values(obj, column["jsonPath"])
    if not values:
        return None
    value = values[0]
    if column.get("type") == "date":
        return human_age(value)
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return value


def table(rtype: ResourceType, objects: list[dict], resource_version: str) -> dict:
    """A meta.k8s.io/v1 Table: Name, the printer columns (CRDs) or Age (built-ins)."""
    columns = [{"name": "Name", "type": "string", "format": "name", "priority": 0,
                "description": "Name of the object"}]
    printer = rtype.printer_columns or [{"name": "Age", "type": "date",
                                         "jsonPath": ".metadata.creationTimestamp"}]
    columns += [{"name": col["name"], "type": col.get("type", "string"), "format": col.get("format", ""),
                 "priority": col.get("priority", 0), "description": col.get("description", "")}
                for col in printer]
    rows = [{"cells": [obj["metadata"]["name"], *(_cell(col, obj) for col in printer)],
             "object": {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                        "metadata": obj["metadata"]}}
            for obj in objects]
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1",
            "metadata": {"resourceVersion": resource_version},
            "columnDefinitions": columns, "rows": rows}
