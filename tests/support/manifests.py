"""Validating rendered manifests against the schema of their kind, strictly.

- built-in kinds (CustomResourceDefinitions included): ``kubernetes-validate`` in strict
  mode (unknown fields are errors), for the oldest and newest Kubernetes the chart targets;
- kinds whose CRD the chart ships (KopfPeering, ...): the CRD's openAPIV3Schema, as the API
  server admits them (``crd_schema.admit``: defaulting, pruning, schema, CEL); a field the
  server would prune counts as an error;
- ``monitoring.coreos.com/v1`` kinds: the Prometheus operator's own models (PyPI
  ``cloudcoil-models-prometheus-operator``, generated from its CRDs): a manifest must
  validate and round-trip unchanged (a field dropped on the way is unknown to the CRD).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any

import kubernetes_validate

from support import crd_schema

KUBERNETES_VERSIONS = ("1.25", "1.33")
# Kinds newer than the oldest version: validated where they exist (the chart renders them
# only on such clusters).
SINCE = {("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy"): "1.30",
         ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicyBinding"): "1.30"}


@functools.cache
def _prometheus_models() -> dict[str, Any]:
    from cloudcoil.models.prometheus_operator import v1

    return {"ServiceMonitor": v1.ServiceMonitor, "PrometheusRule": v1.PrometheusRule,
            "PodMonitor": v1.PodMonitor}


def crd_schemas(crds: Iterable[Mapping[str, Any]]) -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> openAPIV3Schema for every served version of ``crds``."""
    out = {}
    for crd in crds:
        spec = crd["spec"]
        for version in spec["versions"]:
            out[(f"{spec['group']}/{version['name']}", spec["names"]["kind"])] = \
                version["schema"]["openAPIV3Schema"]
    return out


def validate(doc: Mapping[str, Any], schemas: Mapping[tuple[str, str], dict]) -> str:
    """Validate ``doc``; returns the oracle used, raises AssertionError naming the problem."""
    what = f"{doc.get('kind')} {doc.get('metadata', {}).get('name')}"
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key in schemas:
        stored, errors = crd_schema.admit(schemas[key], doc)
        assert not errors, f"{what}: {errors}"
        assert stored == doc, f"{what}: the API server would prune or default fields: {stored} != {doc}"
        return "crd-schema"
    if doc.get("apiVersion") == "monitoring.coreos.com/v1":
        model = _prometheus_models().get(doc["kind"])
        assert model is not None, f"{what}: no schema for monitoring.coreos.com/v1 {doc['kind']}"
        parsed = model.model_validate(doc)  # raises pydantic's ValidationError
        back = parsed.model_dump(by_alias=True, exclude_unset=True, mode="json")
        assert back == doc, f"{what}: fields unknown to the CRD: {back} != {doc}"
        return "prometheus-operator-model"
    since = tuple(map(int, SINCE.get(key, "0.0").split(".")))
    for version in KUBERNETES_VERSIONS:
        if tuple(map(int, version.split("."))) < since:
            continue
        try:
            kubernetes_validate.validate(dict(doc), version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{what} (Kubernetes {version}): {exc.message} at "
                                 f"{'.'.join(map(str, exc.path))}") from None
        except kubernetes_validate.SchemaNotFoundError:
            raise AssertionError(f"{what}: no schema for {key} in Kubernetes {version}") from None
    return "kubernetes-validate"
