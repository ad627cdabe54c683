"""spec.adapters[] and spec.lora: the contract's checks, the pod that fetches the adapters,
the engine flags (oracle: the real ``kvpilot serve`` parser) and the planner's LoRA term."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest

from kvpilot.engine.server.args import engine_args_from_namespace, make_serve_parser
from kvpilot.operator.adapter_loader import FAILED, LOADING, PENDING, READY, AdapterStatus
from kvpilot.operator.planner.lora import lora_slots
from kvpilot.operator.planner.plan import make_plan
from kvpilot.operator.reconcile import adapter_entries, verified_adapters
from kvpilot.operator.resources import desired_children
from kvpilot.operator.resources.common import Owner
from kvpilot.operator.settings import OperatorSettings
from kvpilot.operator.spec import SpecError, parse_spec
from kvpilot.operator.spec_to_plan import plan_request, plan_service

from support import crd_schema
from support.engine_workload import leader_template

SETTINGS = OperatorSettings(engine_image="registry.example/kvpilot:1.2.3")
ADAPTERS = [{"name": "sql", "source": "hf://acme/qwen3-sql-lora@v2", "rank": 8},
            {"name": "chat", "source": "s3://adapters/chat", "rank": 16},
            {"name": "legal", "source": "pvc://lora-claim/legal"}]
SPEC = {"model": {"uri": "hf://Qwen/Qwen3-0.6B"}, "gpu": {"type": "l4"},
        "slo": {"maxContext": 8192, "p95PromptTokens": 2048, "p95OutputTokens": 512, "concurrency": 8},
        "adapters": ADAPTERS}


def _spec(**changes):
    spec = copy.deepcopy(SPEC)
    spec.update(changes)
    return spec


def _deployment(spec: dict, verified=frozenset()):
    parsed = parse_spec(spec, "qwen")
    outcome = plan_service(parsed)
    assert outcome.feasible, outcome.message
    children = desired_children(Owner("qwen", "serving", "uid-1"), parsed, outcome.sizing, SETTINGS,
                                podmonitor_api=False, verified_adapters=frozenset(verified))
    deployment = next(ch.body for ch in children if ch.kind.kind == "Deployment")
    return deployment, leader_template({"Deployment": deployment})


def test_adapters_are_fetched_mounted_and_only_verified_ones_load_at_start():
    deployment, template = _deployment(SPEC, verified={"sql", "legal"})
    assert kubernetes_validate.validate(deployment, "1.33", strict=True) == "1.33"
    pod = template["spec"]
    inits = {i["name"]: i for i in pod["initContainers"]}
    # hf:// through the weights' own fetch (integrity-checked, a marker per revision), into the cache
    assert inits["adapter-sql"]["command"] == ["python", "-m", "kvpilot.operator.model_fetch", "--uri",
                                               "hf://acme/qwen3-sql-lora@v2", "--dest", "/models/adapters/sql"]
    assert inits["adapter-chat"]["command"][:4] == ["aws", "s3", "sync", "s3://adapters/chat"]
    assert {m["name"] for m in inits["adapter-sql"]["volumeMounts"]} >= {"model"}
    claims = {v["name"]: v for v in pod["volumes"] if "persistentVolumeClaim" in v}
    assert claims["adapter-legal"]["persistentVolumeClaim"] == {"claimName": "lora-claim", "readOnly": True}

    args = pod["containers"][0]["args"]
    ns = make_serve_parser().parse_args(args)
    engine = engine_args_from_namespace(ns)
    lora = engine.create_lora_config()
    assert (lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras) == (3, 16, 3)
    assert lora.allow_runtime_updates
    assert {m.name: m.path for m in lora.modules} == {"sql": "/models/adapters/sql",
                                                      "legal": "/adapter-claims/legal/legal"}
    mounts = {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    for m in lora.modules:   # every path is on a volume of the engine container
        assert any(m.path.startswith(root + "/") for root in mounts), (m.path, mounts)


def test_no_adapters_no_lora_flags():
    _, template = _deployment(_spec(adapters=[]))
    assert "--enable-lora" not in template["spec"]["containers"][0]["args"]


def test_adapters_on_pvc_weights_get_their_own_volume():
    spec = _spec(model={"uri": "pvc://weights/qwen3", "architecture": "qwen3-0.6b"})
    _, template = _deployment(spec, verified={"sql"})
    pod = template["spec"]
    assert {"name": "adapters", "emptyDir": {}} in pod["volumes"]
    assert next(i for i in pod["initContainers"] if i["name"] == "adapter-sql")["command"][-1] == "/adapters/sql"
    assert "sql=/adapters/sql" in pod["containers"][0]["args"]


def test_the_plans_kv_cache_shrinks_by_the_lora_slots():
    with_lora = plan_request(parse_spec(SPEC, "qwen"))
    without = plan_request(parse_spec(_spec(adapters=[]), "qwen"))
    assert (with_lora.overrides.max_loras, with_lora.overrides.max_lora_rank) == (3, 16)
    a, b = make_plan(with_lora), make_plan(without)
    slots = lora_slots(with_lora.model, 3, 16)
    assert a.memory["lora_bytes"] == slots.num_bytes > 0
    assert b.memory["kv_estimate_bytes"] - a.memory["kv_estimate_bytes"] == slots.num_bytes


def test_lora_defaults_follow_the_adapters():
    lora = parse_spec(_spec(adapters=[{"name": f"a{i}", "source": f"s3://bk/a{i}", "rank": 32} for i in range(6)]),
                      "qwen").lora
    assert (lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras) == (4, 32, 6)
    pinned = parse_spec(_spec(lora={"maxLoras": 2, "maxLoraRank": 64, "maxCpuLoras": 3}), "qwen").lora
    assert (pinned.max_loras, pinned.max_lora_rank, pinned.max_cpu_loras) == (2, 64, 3)


@pytest.mark.parametrize("change, message", [
    ({"adapters": [*ADAPTERS, {"name": "sql", "source": "s3://xy/z"}]}, "duplicate name"),
    ({"adapters": [{"name": "Bad_Name", "source": "s3://xy/z"}]}, r"adapters\[0\]\.name .* is not a DNS-1123 label"),
    ({"adapters": [{"name": "a", "source": "https://x/y"}]}, r"adapters\[0\]\.source .* is not hf://"),
    ({"adapters": [{"name": "a", "source": "hf://org/repo/file.gguf"}]}, "a repository, not a file"),
    ({"adapters": [{"name": "qwen", "source": "s3://xy/z"}]}, "the base model's served name"),
    ({"adapters": [{"name": "a", "source": "pvc://claim/../../etc"}]}, "no '..' in a claim path"),
    ({"lora": {"maxLoraRank": 8}}, "rank 16 is above lora.maxLoraRank 8"),
    ({"lora": {"maxLoras": 4, "maxCpuLoras": 2}}, "lora.maxCpuLoras must be >= lora.maxLoras"),
    ({"gpu": {"type": "l4", "count": 2}}, "gpu.count must be 1"),
])
def test_bad_adapter_specs_are_refused(change, message):
    with pytest.raises(SpecError, match=message):
        parse_spec(_spec(**change), "qwen")


def test_the_crd_admits_adapters_and_its_cel_refuses_what_the_operator_does():
    schema = crd_schema.version_schema(crd_schema.load_crd())
    obj = {"apiVersion": "serving.kvpilot.dev/v1alpha1", "kind": "InferenceService",
           "metadata": {"name": "qwen"}, "spec": SPEC}
    _, errors = crd_schema.admit(schema, obj)
    assert errors == []
    bad = copy.deepcopy(obj)
    bad["spec"]["gpu"]["count"] = 2
    _, errors = crd_schema.admit(schema, bad)
    assert any("gpu.count must be 1" in e for e in errors)
    items = schema["properties"]["spec"]["properties"]["adapters"]
    assert items["x-kubernetes-list-type"] == "map" and items["x-kubernetes-list-map-keys"] == ["name"]


def test_a_verified_adapter_stays_on_the_command_line_until_it_fails_or_its_source_changes():
    """The engine pods load the verified adapters at start-up: a pod killed (no ready pod:
    Pending) or a new one starting (Loading) must not take them off the template, or the
    replacement would be ready before it serves them."""
    spec = parse_spec(SPEC, "qwen")
    sources = {a.name: a.source for a in spec.adapters}
    verified = frozenset()

    def step(*phases: str) -> frozenset[str]:
        nonlocal verified
        entries = adapter_entries([AdapterStatus(n, p) for n, p in zip(sources, phases, strict=True)],
                                  sources, verified)
        verified = verified_adapters(spec, entries)
        return verified

    assert step(PENDING, PENDING, PENDING) == frozenset()        # never seen to load
    assert step(READY, LOADING, READY) == {"sql", "legal"}
    assert step(PENDING, PENDING, PENDING) == {"sql", "legal"}    # the pod was killed
    assert step(LOADING, READY, LOADING) == {"sql", "chat", "legal"}   # its replacement starting
    assert step(FAILED, READY, READY) == {"chat", "legal"}
    assert step(PENDING, PENDING, PENDING) == {"chat", "legal"}

    moved = parse_spec(_spec(adapters=[{**ADAPTERS[0], "source": "hf://acme/qwen3-sql-lora@v3"},
                                       *ADAPTERS[1:]]), "qwen")
    entries = adapter_entries([AdapterStatus(a.name, READY) for a in spec.adapters], sources, verified)
    assert verified_adapters(moved, entries) == {"chat", "legal"}   # sql@v3 has not been seen to load
    # a status written before ``verified`` existed: Ready counts
    assert verified_adapters(spec, [{"name": "sql", "source": sources["sql"], "phase": READY}]) == {"sql"}
