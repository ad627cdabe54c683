"""Where hf:// weights are kept: the model cache claim the builders lay out.

Oracles: kubernetes-validate (strict) for the claim and the Deployment, the planner's own
checkpoint size (``Plan.memory["weight_bytes_total"]``) for the claim's size, the CRD
schema + CEL for the spec, and the init container's and the engine's real argument parsers.
"""

from __future__ import annotations

import copy
import math

import kubernetes_validate
import pytest
import yaml

from kvpilot.engine.server.args import make_serve_parser
from kvpilot.operator import constants as c
from kvpilot.operator.planner.plan import make_plan
from kvpilot.operator.planner.plan_request import PlanRequest
from kvpilot.operator.settings import OperatorSettings
from kvpilot.operator.spec import SpecError, parse_spec
from kvpilot.operator.spec_to_plan import plan_request

from support import crd_schema
from support.built import SETTINGS, build

K8S_VERSION = "1.33"
RWX_SETTINGS = OperatorSettings(engine_image="registry.example/kvpilot:1.2.3",
                                rwx_storage_classes=("efs", "filestore"))
BASE = {"model": {"uri": "hf://Qwen/Qwen3-0.6B"}, "gpu": {"type": "l4"},
        "slo": {"maxContext": 8192, "p95PromptTokens": 2048, "p95OutputTokens": 512, "concurrency": 8}}


def _children(spec: dict, settings: OperatorSettings = SETTINGS, name: str = "svc"):
    children = build(spec, settings, name)
    for child in children:
        if child.kind.kind in ("Deployment", "PersistentVolumeClaim"):
            assert kubernetes_validate.validate(child.body, K8S_VERSION, strict=True) == K8S_VERSION
    claims = {ch.name: ch for ch in children if ch.kind.kind == "PersistentVolumeClaim"}
    deployment = next(ch.body for ch in children if ch.kind.kind == "Deployment")
    return claims, deployment, make_plan(PlanRequest.from_dict(plan_request(parse_spec(spec, name))))


def _pod(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]


def _model_volume(deployment: dict) -> dict:
    return next(v for v in _pod(deployment)["volumes"] if v["name"] == "model")


def test_one_replica_keeps_its_weights_on_a_claim_sized_from_the_plan():
    claims, deployment, plan = _children(copy.deepcopy(BASE))
    claim = claims["svc-model-cache"]
    weights_gib = plan.memory["weight_bytes_total"] / (1 << 30)
    assert 1.0 < weights_gib < 1.6  # Qwen3-0.6B in bf16
    assert claim.body["spec"] == {"accessModes": ["ReadWriteOnce"],
                                  "resources": {"requests": {"storage": f"{math.ceil(weights_gib * 1.1 + 2)}Gi"}}}
    assert claim.create_only == ("spec",)  # a bound claim's size and mode are not patched
    assert _model_volume(deployment) == {"name": "model", "persistentVolumeClaim": {"claimName": "svc-model-cache"}}
    (init,) = _pod(deployment)["initContainers"]
    engine = _pod(deployment)["containers"][0]
    dest = init["command"][init["command"].index("--dest") + 1]
    assert make_serve_parser().parse_args(engine["args"]).model == dest
    assert {"name": "model", "mountPath": c.MODEL_MOUNT} in init["volumeMounts"]  # writable for the fetcher
    assert {"name": "model", "mountPath": c.MODEL_MOUNT, "readOnly": True} in engine["volumeMounts"]
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}  # the new pod may need the old one's node


def test_a_readwritemany_class_gives_one_claim_shared_by_all_replicas():
    spec = copy.deepcopy(BASE)
    spec.update(replicas=3, model={"uri": "hf://Qwen/Qwen3-0.6B", "cache": {"storageClassName": "efs"}})
    claims, deployment, _ = _children(spec, RWX_SETTINGS)
    claim = claims["svc-model-cache"].body["spec"]
    assert claim["accessModes"] == ["ReadWriteMany"] and claim["storageClassName"] == "efs"
    assert _model_volume(deployment)["persistentVolumeClaim"] == {"claimName": "svc-model-cache"}
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    # the operator's default class, named as RWX-capable, does the same without a spec field
    by_default = OperatorSettings(model_cache_storage_class="filestore", rwx_storage_classes=("filestore",))
    claims, _, _ = _children({**BASE, "replicas": 3}, by_default)
    assert claims["svc-model-cache"].body["spec"]["accessModes"] == ["ReadWriteMany"]


def test_readwriteonce_with_several_replicas_gets_a_claim_per_pod():
    claims, deployment, _ = _children({**BASE, "autoscaling": {"mode": "hpa", "maxReplicas": 4}})
    assert claims == {}
    template = _model_volume(deployment)["ephemeral"]["volumeClaimTemplate"]
    assert template["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert template["metadata"]["labels"][c.LABEL_COMPONENT] == "model-cache"
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"


def test_spec_settings_win_and_the_cache_can_be_turned_off():
    spec = copy.deepcopy(BASE)
    spec["model"]["cache"] = {"accessMode": "ReadWriteMany", "sizeGiB": 50, "storageClassName": "nfs"}
    claims, _, _ = _children(spec)
    assert claims["svc-model-cache"].body["spec"] == {
        "accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "50Gi"}},
        "storageClassName": "nfs"}
    spec["model"]["cache"] = {"enabled": False}
    claims, deployment, _ = _children(spec)
    assert claims == {} and _model_volume(deployment) == {"name": "model", "emptyDir": {}}
    off = OperatorSettings.from_env({"KVPILOT_MODEL_CACHE": "off"})
    claims, deployment, _ = _children(copy.deepcopy(BASE), off)
    assert claims == {} and _model_volume(deployment) == {"name": "model", "emptyDir": {}}
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    with pytest.raises(ValueError, match="KVPILOT_MODEL_CACHE must be on or off"):
        OperatorSettings.from_env({"KVPILOT_MODEL_CACHE": "sometimes"})


def test_pvc_and_s3_models_are_unchanged():
    example = next(p for p in crd_schema.EXAMPLES if p.stem == "long-context-fp8")
    claims, deployment, _ = _children(yaml.safe_load(example.read_text())["spec"])
    assert claims == {}
    assert _model_volume(deployment) == {"name": "model",
                                         "persistentVolumeClaim": {"claimName": "models", "readOnly": True}}
    s3 = {**BASE, "model": {"uri": "s3://weights/qwen3", "architecture": "qwen3-0.6b"}}
    claims, deployment, _ = _children(s3)
    assert claims == {} and _model_volume(deployment) == {"name": "model", "emptyDir": {}}


def test_a_cache_on_a_model_that_is_not_downloaded_is_rejected():
    spec = {**BASE, "model": {"uri": "pvc://models/qwen3", "architecture": "qwen3-0.6b", "cache": {"sizeGiB": 10}}}
    with pytest.raises(SpecError, match="model.cache is only used with hf://"):
        parse_spec(spec, "x")
    schema = crd_schema.version_schema(crd_schema.load_crd())
    obj = {"apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": "x"}, "spec": spec}
    _, errors = crd_schema.admit(schema, obj)
    assert any("model.cache is only used with hf://" in e for e in errors)
    bad_mode = {**BASE, "model": {"uri": "hf://Qwen/Qwen3-0.6B", "cache": {"accessMode": "ReadOnlyMany"}}}
    _, errors = crd_schema.admit(schema, {**obj, "spec": bad_mode})
    assert errors
    with pytest.raises(SpecError, match="accessMode"):
        parse_spec(bad_mode, "x")
