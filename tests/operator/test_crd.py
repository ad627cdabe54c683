"""The InferenceService CRD: valid as a CRD, examples admitted, bad objects rejected.

Oracles: kubernetes-validate (the CustomResourceDefinition kind, strict, Kubernetes 1.33),
jsonschema (the openAPIV3Schema) and cel-python (the x-kubernetes-validations rules).
The operator's own checks (``kvpilot.operator.spec``, from the contract tables the CRD is
generated from) must agree with them.
"""

from __future__ import annotations

import copy
from dataclasses import fields

import kubernetes_validate
import pytest
import yaml

from kvpilot.operator import constants as c
from kvpilot.operator.contract.inference_service import ENGINE, SLO
from kvpilot.operator.planner.catalog import model_presets
from kvpilot.operator.planner.gpu import gpu_names
from kvpilot.operator.planner.slo import Overrides, ServiceLevel
from kvpilot.operator.spec import SpecError, parse_spec, planner_name
from kvpilot.operator.spec_to_plan import STATUS_FIELDS, camel, plan_service

from support import crd_schema
from support.docs_pages import OPERATOR_PAGE

CRD = crd_schema.load_crd()
SCHEMA = crd_schema.version_schema(CRD)
SPEC = SCHEMA["properties"]["spec"]

GOOD = {
    "apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": "good", "namespace": "default"},
    "spec": {"model": {"uri": "hf://Qwen/Qwen3-0.6B"}, "gpu": {"type": "l4"},
             "slo": {"maxContext": 8192, "p95PromptTokens": 2048, "p95OutputTokens": 512,
                     "concurrency": 16}},
}


def _with(path: str, value):
    """GOOD with ``spec.<path>`` set (value DELETE removes it)."""
    obj = copy.deepcopy(GOOD)
    node = obj["spec"]
    *parents, leaf = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    if value == "DELETE":
        node.pop(leaf)
    else:
        node[leaf] = value
    return obj


# (case, object, a phrase the API server's message must contain)
BAD = [
    ("missing model", _with("model", "DELETE"), "'model' is a required property"),
    ("missing model uri", _with("model.uri", "DELETE"), "'uri' is a required property"),
    ("unsupported model uri", _with("model.uri", "ftp://host/model"), "does not match"),
    ("negative concurrency", _with("slo.concurrency", -4), "less than the minimum of 1"),
    ("unknown KV dtype", _with("engine.kvCacheDtype", "int4"), "is not one of"),
    ("unknown GPU", _with("gpu.type", "tpu-v5"), "is not one of"),
    ("min > max replicas", _with("autoscaling", {"mode": "hpa", "minReplicas": 4, "maxReplicas": 2}),
     "minReplicas must be <= autoscaling.maxReplicas"),
    ("autoscaling without max", _with("autoscaling", {"mode": "keda"}), "maxReplicas is required"),
    ("scale to zero with an HPA", _with("autoscaling", {"mode": "hpa", "minReplicas": 0, "maxReplicas": 2}),
     "needs autoscaling.mode keda"),
    ("no preemption target", _with("autoscaling", {"mode": "hpa", "maxReplicas": 2, "preemptionRateTarget": 0}),
     "less than or equal to the minimum of 0"),
    ("offload size without offload", _with("offload", {"cpuGiB": 16}), "need offload.enabled=true"),
    ("disk tier without offload", _with("offload", {"disk": {"sizeGiB": 50}}), "need offload.enabled=true"),
    ("lmcache settings on native", _with("offload", {"enabled": True, "lmcache": {"chunkSize": 256}}),
     "needs offload.backend=lmcache"),
    ("no concurrency nor rate", _with("slo.concurrency", "DELETE"), "target concurrency, a request rate"),
    ("p95 lengths beyond context", _with("slo.maxContext", 2000), "must fit in slo.maxContext"),
    ("p50 above p95", _with("slo.p50OutputTokens", 900), "p50OutputTokens must be <="),
    ("prefix longer than prompt", _with("slo.sharedPrefixTokens", 4096), "sharedPrefixTokens is part"),
    ("api key in extra args", _with("engine.extraArgs", ["--api-key=abc"]), "apiKeySecretRef"),
    ("seqs above batched tokens", _with("engine", {"maxNumSeqs": 64, "maxNumBatchedTokens": 32}),
     "maxNumBatchedTokens must be >="),
    ("credentials on a pvc model", _with("model", {"uri": "pvc://models/x", "credentialsSecretRef": {"name": "s"}}),
     "credentialsSecretRef is only used"),
]


def test_crd_is_a_valid_custom_resource_definition():
    assert kubernetes_validate.validate(CRD, "1.33", strict=True) == "1.33"
    spec = CRD["spec"]
    assert (spec["group"], spec["names"]["plural"], spec["names"]["kind"]) == (c.GROUP, c.PLURAL, c.KIND)
    assert spec["scope"] == "Namespaced"
    assert "isvc" not in spec["names"]["shortNames"]  # KServe's short name
    version = spec["versions"][0]
    assert version["name"] == c.VERSION and version["storage"] and version["served"]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    columns = [col["name"] for col in version["additionalPrinterColumns"]]
    assert columns == ["Model", "GPU", "KV-Dtype", "Max-Seqs", "Observed-KV-Tokens", "P:D", "Ready-Replicas", "Replicas",
                       "Ready", "Adapters", "Age"]


@pytest.mark.parametrize("path", crd_schema.EXAMPLES, ids=lambda p: p.stem)
def test_examples_are_admitted_and_parse(path):
    obj = yaml.safe_load(path.read_text())
    assert crd_schema.schema_errors(SCHEMA, obj) == []
    stored, errors = crd_schema.admit(SCHEMA, obj)
    assert errors == []
    parse_spec(stored["spec"], stored["metadata"]["name"])  # the operator agrees


def test_examples_cover_the_issue_cases():
    specs = {p.stem: yaml.safe_load(p.read_text())["spec"] for p in crd_schema.EXAMPLES}
    assert specs["qwen3-0.6b"]["model"]["uri"] == "hf://Qwen/Qwen3-0.6B"
    assert specs["long-context-fp8"]["slo"]["allowFp8KvCache"] is True
    offload = specs["offload-cpu-disk"]["offload"]
    assert offload["enabled"] and "disk" in offload
    assert specs["autoscaled-kv-usage"]["autoscaling"]["kvCacheUsageTarget"] == 0.7
    assert specs["llama-70b-tensor-parallel"]["gpu"]["count"] == 4
    # issue 31: 405B in FP8 on two nodes of eight H100s (the planner chooses the two nodes)
    grouped = specs["llama-405b-fp8-two-nodes"]
    assert grouped["gpu"] == {"type": "h100-80gb", "count": 8} and "nodes" not in grouped["gpu"]
    assert plan_service(parse_spec(grouped, "llama-405b")).sizing.nodes == 2


@pytest.mark.parametrize("case,obj,phrase", BAD, ids=[b[0] for b in BAD])
def test_bad_objects_are_rejected_by_schema_or_cel_and_by_the_operator(case, obj, phrase):
    stored, errors = crd_schema.admit(SCHEMA, obj)
    assert errors, f"{case}: the API server would accept it"
    assert any(phrase in e for e in errors), errors
    assert _operator_rejects(obj["spec"])


def _operator_rejects(spec: dict) -> str:
    """The operator's reason for refusing ``spec`` (its own checks, then the planner's)."""
    try:
        outcome = plan_service(parse_spec(spec, "bad"))
    except SpecError as exc:
        return str(exc)
    return outcome.message if outcome.reason == "InvalidSpec" else ""


def test_cel_rules_accept_the_good_object_and_edge_values():
    assert crd_schema.admit(SCHEMA, GOOD)[1] == []
    edge = _with("autoscaling", {"mode": "hpa", "minReplicas": 3, "maxReplicas": 3})
    assert crd_schema.admit(SCHEMA, edge)[1] == []
    to_zero = _with("autoscaling", {"mode": "keda", "minReplicas": 0, "maxReplicas": 3})
    assert crd_schema.admit(SCHEMA, to_zero)[1] == []
    offload = _with("offload", {"enabled": True, "cpuGiB": 8, "disk": {}})
    assert crd_schema.admit(SCHEMA, offload)[1] == []
    lmcache = _with("offload", {"enabled": True, "backend": "lmcache",
                                "lmcache": {"remoteUrl": "lm://lmcache:65432"}})
    assert crd_schema.admit(SCHEMA, lmcache)[1] == []


def test_cel_rules_are_evaluated_not_skipped():
    """The same broken object passes the OpenAPI part alone: only CEL catches it."""
    obj = _with("autoscaling", {"mode": "hpa", "minReplicas": 4, "maxReplicas": 2})
    assert crd_schema.schema_errors(SCHEMA, obj) == []
    assert crd_schema.cel_errors(SPEC, obj["spec"], "spec")


def test_operator_defaults_equal_the_crd_defaults():
    """A spec the server defaulted and the same spec undefaulted parse to the same values."""
    sparse = copy.deepcopy(GOOD)
    sparse["spec"].update(autoscaling={"mode": "hpa", "maxReplicas": 2}, offload={},
                          apiKeySecretRef={"name": "key"}, engine={})
    defaulted = crd_schema.apply_defaults(SCHEMA, sparse)
    assert defaulted != sparse  # the CRD did fill something in
    assert parse_spec(defaulted["spec"], "x") == parse_spec(sparse["spec"], "x")


@pytest.mark.parametrize("section,table,planner_type", [("slo", SLO, ServiceLevel), ("engine", ENGINE, Overrides)])
def test_slo_and_engine_fields_name_planner_fields(section, table, planner_type):
    """Each field of the section (but spec.engine.extraArgs, the command line) is handed to
    the planner field its name maps to, and the CRD declares exactly the table's fields."""
    declared = SPEC["properties"][section]["properties"]
    assert set(declared) == set(table.properties)
    planner_fields = {f.name for f in fields(planner_type)}
    for name in table.properties:
        if name != "extraArgs":
            assert planner_name(name) in planner_fields, name


def test_gpu_enum_is_the_planner_catalogue():
    assert SPEC["properties"]["gpu"]["properties"]["type"]["enum"] == gpu_names()


def test_examples_name_catalogue_models():
    for path in crd_schema.EXAMPLES:
        model = yaml.safe_load(path.read_text())["spec"]["model"]
        assert model.get("architecture") in (None, *model_presets())


def test_status_schema_keeps_every_field_the_operator_writes():
    plan = SCHEMA["properties"]["status"]["properties"]["plan"]["properties"]
    assert set(plan) == {camel(f) for f in STATUS_FIELDS} | {"generation", "plannedFor", "serveArgs", "kvEstimateBytes",
                                                             "disaggregation"}
    status = SCHEMA["properties"]["status"]["properties"]
    from kvpilot.operator.reconcile import STATUS_KEYS

    assert set(STATUS_KEYS) <= set(status)
    assert status["conditions"]["items"]["properties"]["type"]["enum"] == list(c.CONDITION_TYPES)


def test_printer_columns_point_at_schema_fields():
    for column in CRD["spec"]["versions"][0]["additionalPrinterColumns"]:
        path = column["jsonPath"].split("[")[0].strip(".").split(".")
        if path[0] == "metadata":
            continue
        node = SCHEMA
        for part in path:
            node = node["properties"][part]
        assert node  # every column reads a declared field


def test_the_docs_list_the_printer_columns_kubectl_shows():
    """``kubectl get kvis`` on the operator's docs page names every column, ADAPTERS
    included (issue 43), in the CRD's order."""
    text = OPERATOR_PAGE.read_text()
    line = next(x for x in text.splitlines() if x.startswith("kubectl get kvis") and "# NAME" in x)
    columns = ["NAME", *(col["name"].upper() for col in
                         crd_schema.load_crd()["spec"]["versions"][0]["additionalPrinterColumns"])]
    assert line.split("# ", 1)[1].split() == columns
