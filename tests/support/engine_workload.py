"""The engine pods' owner among built children: a Deployment, or (replicas spanning nodes)
a LeaderWorkerSet, validated strictly.

No offline validator knows the LeaderWorkerSet kind, so ``lws_errors`` checks it the way a
cluster with LWS installed would: the object against the openAPI schema of kubernetes-sigs/lws
v0.10.0's CRD (``tests/operator/leaderworkerset_crd.yaml``, admitted as the API server does:
defaults, pruning, schema), and each pod template as a core ``PodTemplate`` with
kubernetes-validate (strict: unknown fields are errors).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

from support import crd_schema

LWS_CRD_PATH = Path(__file__).resolve().parents[1] / "operator" / "leaderworkerset_crd.yaml"
K8S_VERSION = "1.33"


@functools.cache
def lws_crd() -> dict:
    return yaml.safe_load(LWS_CRD_PATH.read_text())


def _body(child: Any) -> dict:
    return child.body if hasattr(child, "body") else child


def workload(children: Mapping[str, Any]) -> dict:
    """The Deployment's or LeaderWorkerSet's body (children by kind; bodies or Child)."""
    for kind in ("Deployment", "LeaderWorkerSet"):
        if kind in children:
            return _body(children[kind])
    raise KeyError("neither a Deployment nor a LeaderWorkerSet among the children")


def templates(obj: Mapping[str, Any]) -> list[dict]:
    """The pod templates of a workload: the Deployment's, or the leader's then the workers'."""
    if obj["kind"] == "Deployment":
        return [obj["spec"]["template"]]
    lwt = obj["spec"]["leaderWorkerTemplate"]
    return [lwt["leaderTemplate"], lwt["workerTemplate"]]


def leader_template(children: Mapping[str, Any]) -> dict:
    """The template of the pods clients reach (the Deployment's, or the group leaders')."""
    return templates(workload(children))[0]


def engine_container(template: Mapping[str, Any]) -> dict:
    (container,) = [c for c in template["spec"]["containers"] if c["name"] == "engine"]
    return container


def lws_errors(obj: Mapping[str, Any]) -> list[str]:
    """Why a cluster with LeaderWorkerSet installed would refuse ``obj`` (empty: it admits it)."""
    schema = crd_schema.version_schema(lws_crd())
    _, errors = crd_schema.admit(schema, obj)
    if crd_schema.prune(schema, obj) != obj:   # a field the API server would drop silently
        errors.append("the LeaderWorkerSet schema prunes fields the operator set")
    for template in templates(obj):
        pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                        "template": template}
        try:
            kubernetes_validate.validate(pod_template, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"pod template: {exc.message}")
    return errors


def assert_valid_workload(obj: Mapping[str, Any]) -> None:
    """Deployment: kubernetes-validate strict; LeaderWorkerSet: ``lws_errors`` empty."""
    if obj["kind"] == "Deployment":
        assert kubernetes_validate.validate(dict(obj), K8S_VERSION, strict=True) == K8S_VERSION
    else:
        assert lws_errors(obj) == []
