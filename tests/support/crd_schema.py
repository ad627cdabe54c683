"""What the API server does with a custom resource before storing it, done in Python.

Structural defaulting, pruning of unknown fields, OpenAPI v3 schema validation (with
``jsonschema``; the CRD dialect is draft-4-like: boolean ``exclusiveMinimum``) and the
CEL rules of ``x-kubernetes-validations`` (with ``cel-python``). Used by the CRD tests
and by the emulator, so that a bad CR is rejected at ``kubectl apply`` as a real API
server would reject it.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "serving.kvpilot.dev_inferenceservices.yaml"
EXAMPLES = sorted((ROOT / "crds" / "examples").glob("*.yaml"))
# The examples served by one pool of engine pods (a Deployment or a LeaderWorkerSet); the
# disaggregated ones (spec.disaggregation: a prefill and a decode Deployment behind the
# router) have tests of their own (tests/operator/test_disaggregation.py).
DISAGGREGATED = [p for p in EXAMPLES if "disaggregation" in yaml.safe_load(p.read_text())["spec"]]
ONE_POOL_EXAMPLES = [p for p in EXAMPLES if p not in DISAGGREGATED]


def load_crd(path: Path = CRD_PATH) -> dict:
    return yaml.safe_load(path.read_text())


def version_schema(crd: Mapping[str, Any], version: str | None = None) -> dict:
    """The openAPIV3Schema of ``version`` (default: the storage version)."""
    for v in crd["spec"]["versions"]:
        if (version is None and v.get("storage")) or v["name"] == version:
            return v["schema"]["openAPIV3Schema"]
    raise KeyError(f"no version {version!r} in {crd['metadata']['name']}")


def apply_defaults(schema: Mapping[str, Any], obj: Any) -> Any:
    """A copy of ``obj`` with the schema's ``default``s filled in where fields are absent."""
    obj = copy.deepcopy(obj)
    _default(schema, obj)
    return obj


def _default(schema: Mapping[str, Any], obj: Any) -> None:
    if isinstance(obj, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key not in obj and "default" in sub:
                obj[key] = copy.deepcopy(sub["default"])
            if key in obj:
                _default(sub, obj[key])
        extra = schema.get("additionalProperties")
        if isinstance(extra, Mapping):
            for key, value in obj.items():
                if key not in (schema.get("properties") or {}):
                    _default(extra, value)
    elif isinstance(obj, list) and isinstance(schema.get("items"), Mapping):
        for item in obj:
            _default(schema["items"], item)


def prune(schema: Mapping[str, Any], obj: Any, root: bool = True) -> Any:
    """A copy of ``obj`` without fields the schema does not declare (as the server prunes)."""
    if isinstance(obj, dict):
        if schema.get("x-kubernetes-preserve-unknown-fields"):
            return copy.deepcopy(obj)
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        out = {}
        for key, value in obj.items():
            if root and key in ("apiVersion", "kind", "metadata"):
                out[key] = copy.deepcopy(value)
            elif key in props:
                out[key] = prune(props[key], value, root=False)
            elif isinstance(extra, Mapping):
                out[key] = prune(extra, value, root=False)
        return out
    if isinstance(obj, list) and isinstance(schema.get("items"), Mapping):
        return [prune(schema["items"], item, root=False) for item in obj]
    return copy.deepcopy(obj)


def schema_errors(schema: Mapping[str, Any], obj: Any) -> list[str]:
    """OpenAPI schema violations as ``path: message`` strings (empty when valid)."""
    validator = jsonschema.Draft4Validator(schema)
    errors = []
    for err in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path))):
        where = ".".join(str(p) for p in err.absolute_path) or "<root>"
        errors.append(f"{where}: {err.message}")
    return errors


@functools.lru_cache(maxsize=256)
def _program(rule: str) -> celpy.Runner:
    env = celpy.Environment()
    return env.program(env.compile(rule))


def cel_errors(schema: Mapping[str, Any], obj: Any, path: str = "") -> list[str]:
    """Messages of the ``x-kubernetes-validations`` rules that ``obj`` breaks."""
    errors = []
    for rule in schema.get("x-kubernetes-validations") or ():
        try:
            ok = _program(rule["rule"]).evaluate({"self": celpy.json_to_cel(obj)})
        except celpy.CELEvalError as exc:  # pragma: no cover - a broken rule is a test failure
            errors.append(f"{path or '<root>'}: rule {rule['rule']!r} failed to evaluate: {exc}")
            continue
        if not bool(ok):
            errors.append(f"{path or '<root>'}: {rule.get('message') or rule['rule']}")
    if isinstance(obj, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key in obj:
                errors += cel_errors(sub, obj[key], f"{path}.{key}" if path else key)
    elif isinstance(obj, list) and isinstance(schema.get("items"), Mapping):
        for i, item in enumerate(obj):
            errors += cel_errors(schema["items"], item, f"{path}[{i}]")
    return errors


def admit(schema: Mapping[str, Any], obj: Mapping[str, Any]) -> tuple[dict, list[str]]:
    """Default, prune, validate and run CEL as the API server does on create/update.

    Returns the object as it would be stored and the list of errors (empty = accepted).
    """
    stored = prune(schema, apply_defaults(schema, obj))
    errors = schema_errors(schema, stored)
    if not errors:  # the server evaluates CEL only on schema-valid objects
        errors = cel_errors(schema, stored)
    return stored, errors
