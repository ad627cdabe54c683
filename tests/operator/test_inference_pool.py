"""The InferencePool child: Gateway API inference routing to the engine pods.

Oracles: the InferencePool CRD schema and CEL rules of the Gateway API inference extension
(``inferencepool_crd.yaml``, admitted with jsonschema + cel-python as the API server would),
kubernetes-validate for the Deployment and Service it must agree with, and the CRD of the
InferenceService for the spec fields.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from kvpilot.operator import constants as c
from kvpilot.operator.resources.inference_pool import ENGINE_TYPE_LABEL
from kvpilot.operator.settings import OperatorSettings
from kvpilot.operator.spec import SpecError, parse_spec

from support import crd_schema
from support.built import SETTINGS, build
from support.engine_workload import leader_template, templates, workload

POOL_CRD = yaml.safe_load((Path(__file__).resolve().parent / "inferencepool_crd.yaml").read_text())
POOL_SCHEMA = crd_schema.version_schema(POOL_CRD)
SERVICE_SCHEMA = crd_schema.version_schema(crd_schema.load_crd())
BASE = {"model": {"uri": "hf://Qwen/Qwen3-0.6B"}, "gpu": {"type": "l4"},
        "slo": {"maxContext": 8192, "p95PromptTokens": 2048, "p95OutputTokens": 512, "concurrency": 8}}


def _children(spec: dict, *, api: bool = True, settings: OperatorSettings = SETTINGS, name: str = "svc"):
    children = build(spec, settings, name, inference_pool_api=api)
    return {ch.kind.kind: ch.body for ch in children if ch.kind.kind != "PersistentVolumeClaim"}


def _admitted(pool: dict) -> dict:
    stored, errors = crd_schema.admit(POOL_SCHEMA, pool)
    assert errors == [], errors
    return stored


@pytest.mark.parametrize("path", crd_schema.ONE_POOL_EXAMPLES, ids=lambda p: p.stem)
def test_every_example_gets_a_valid_pool_over_its_engine_pods(path):
    cr = yaml.safe_load(path.read_text())
    children = _children(cr["spec"], name=cr["metadata"]["name"])
    pool = _admitted(children["InferencePool"])
    template = leader_template(children)          # a group's leaders only, where replicas span nodes
    selector = pool["spec"]["selector"]["matchLabels"]
    assert selector == children["Service"]["spec"]["selector"]
    if "Deployment" in children:
        assert selector == children["Deployment"]["spec"]["selector"]["matchLabels"]
    else:
        worker = templates(workload(children))[1]
        assert not selector.items() <= worker["metadata"]["labels"].items()
    assert selector.items() <= template["metadata"]["labels"].items()
    assert template["metadata"]["labels"][ENGINE_TYPE_LABEL] == "vllm"  # the EPP's metric names
    port = template["spec"]["containers"][0]["ports"][0]
    assert pool["spec"]["targetPorts"] == [{"number": port["containerPort"]}]
    assert pool["spec"]["endpointPickerRef"] == {"group": "", "kind": "Service",
                                                 "name": f"{cr['metadata']['name']}-epp",
                                                 "port": {"number": 9002}, "failureMode": "FailClose"}
    assert pool["metadata"]["ownerReferences"][0]["kind"] == c.KIND


def test_no_pool_without_the_api_or_when_disabled():
    assert "InferencePool" not in _children(copy.deepcopy(BASE), api=False)
    disabled = {**BASE, "routing": {"inferencePool": {"enabled": False}}}
    assert "InferencePool" not in _children(disabled)
    # the pods keep their engine-type label either way: toggling routing restarts nothing
    labels = _children(disabled)["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert labels[ENGINE_TYPE_LABEL] == "vllm"


def test_the_port_and_the_endpoint_picker_come_from_the_spec_then_the_settings():
    spec = {**BASE, "port": 8080, "routing": {"inferencePool": {"endpointPickerRef": {
        "name": "shared-epp", "port": 9102, "failureMode": "FailOpen"}}}}
    pool = _admitted(_children(spec)["InferencePool"])
    assert pool["spec"]["targetPorts"] == [{"number": 8080}]
    assert pool["spec"]["endpointPickerRef"] == {"group": "", "kind": "Service", "name": "shared-epp",
                                                 "port": {"number": 9102}, "failureMode": "FailOpen"}
    settings = OperatorSettings.from_env({"KVPILOT_EPP_NAME": "epp-{name}", "KVPILOT_EPP_PORT": "9003",
                                          "KVPILOT_EPP_FAILURE_MODE": "FailOpen"})
    ref = _admitted(_children(copy.deepcopy(BASE), settings=settings)["InferencePool"])["spec"]["endpointPickerRef"]
    assert (ref["name"], ref["port"], ref["failureMode"]) == ("epp-svc", {"number": 9003}, "FailOpen")
    with pytest.raises(ValueError, match="KVPILOT_EPP_NAME may use only"):
        OperatorSettings.from_env({"KVPILOT_EPP_NAME": "{service}-epp"})
    with pytest.raises(ValueError, match="KVPILOT_EPP_FAILURE_MODE"):
        OperatorSettings.from_env({"KVPILOT_EPP_FAILURE_MODE": "Retry"})


def test_the_pool_schema_is_an_oracle_that_can_say_no():
    pool = _children(copy.deepcopy(BASE))["InferencePool"]
    broken = copy.deepcopy(pool)
    del broken["spec"]["endpointPickerRef"]["port"]
    assert any("port is required" in e for e in crd_schema.admit(POOL_SCHEMA, broken)[1])
    broken = copy.deepcopy(pool)
    broken["spec"]["targetPorts"] = [{"number": 8000}, {"number": 8001}]
    assert crd_schema.admit(POOL_SCHEMA, broken)[1]


@pytest.mark.parametrize("routing,phrase", [
    ({"inferencePool": {"endpointPickerRef": {"port": 9002}}}, "name"),
    ({"inferencePool": {"endpointPickerRef": {"name": "epp", "failureMode": "Retry"}}}, "failureMode"),
    ({"inferencePool": {"endpointPickerRef": {"name": "epp", "port": 70000}}}, "port"),
])
def test_bad_routing_is_rejected_by_the_crd_and_the_operator(routing, phrase):
    obj = {"apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": "x"}, "spec": {**BASE, "routing": routing}}
    _, errors = crd_schema.admit(SERVICE_SCHEMA, obj)
    assert errors and any(phrase in e for e in errors), errors
    with pytest.raises(SpecError, match=phrase):
        parse_spec(obj["spec"], "x")


def test_a_port_below_1024_is_rejected():
    obj = {"apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": "x"}, "spec": {**BASE, "port": 80}}
    assert crd_schema.admit(SERVICE_SCHEMA, obj)[1]
    with pytest.raises(SpecError, match="spec.port must be >= 1024"):
        parse_spec(obj["spec"], "x")
