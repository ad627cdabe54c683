"""How a spec becomes a planner request, and the planner's verdict in operator terms."""

from __future__ import annotations

import copy

import pytest

from kvpilot.operator.planner.catalog import preset_model
from kvpilot.operator.planner.plan import make_plan
from kvpilot.operator.resources import desired_children
from kvpilot.operator.resources.common import Owner
from kvpilot.operator.settings import OperatorSettings
from kvpilot.operator.spec import parse_spec
from kvpilot.operator.spec_to_plan import model_preset, plan_overrides, plan_request, plan_service

BASE = {"model": {"uri": "hf://Qwen/Qwen3-8B"}, "gpu": {"type": "h100-80gb"},
        "slo": {"maxContext": 16384, "p95PromptTokens": 8192, "p95OutputTokens": 1024, "concurrency": 32,
                "sharedPrefixTokens": 4096, "distinctPrefixes": 500}}


def _spec(**changes):
    spec = copy.deepcopy(BASE)
    spec.update(changes)
    return parse_spec(spec, "svc")


def test_the_model_is_a_catalogue_preset_never_a_path():
    assert model_preset(_spec()) == "Qwen/Qwen3-8B"
    assert model_preset(_spec(model={"uri": "pvc://models/Qwen/Qwen3-8B"})) == "Qwen/Qwen3-8B"
    assert model_preset(_spec(model={"uri": "s3://bucket/weights/qwen3-8b"})) == "qwen3-8b"
    assert model_preset(_spec(model={"uri": "/etc", "architecture": "llama-3.1-8b"})) == "llama-3.1-8b"
    with pytest.raises(ValueError, match="spec.model.architecture"):
        model_preset(_spec(model={"uri": "pvc://models/finetune-v3"}))
    assert plan_request(_spec()).model == preset_model("Qwen/Qwen3-8B")


def test_offload_is_opt_in_and_explicit_values_are_pinned():
    off = plan_overrides(_spec())
    assert (off.cpu_offload_gib, off.disk_offload_gib) == (0, 0)
    auto = plan_overrides(_spec(offload={"enabled": True}))
    assert auto.cpu_offload_gib is None and auto.disk_offload_gib == 0  # no disk tier asked for
    sized = plan_overrides(_spec(offload={"enabled": True, "backend": "lmcache", "cpuGiB": 24, "disk": {}}))
    assert sized.cpu_offload_gib == 24 and sized.disk_offload_gib is None
    assert sized.offload_backend == "lmcache"
    planned = make_plan(plan_request(_spec(offload={"enabled": True, "disk": {}})))
    unplanned = make_plan(plan_request(_spec()))
    assert planned.cpu_offload_gib > 0 and unplanned.cpu_offload_gib == 0


def test_pins_follow_the_spec():
    over = plan_overrides(_spec(gpu={"type": "l4", "count": 2}, replicas=3,
                                engine={"kvCacheDtype": "fp8", "blockSize": 32, "maxNumSeqs": 8}))
    assert over.tensor_parallel_size == 2 and over.replicas == 3
    assert (over.kv_cache_dtype, over.block_size, over.max_num_seqs) == ("fp8", 32, 8)
    autoscaled = plan_overrides(_spec(replicas=3, autoscaling={"mode": "hpa", "maxReplicas": 4}))
    assert autoscaled.replicas is None  # the autoscaler decides
    spec = _spec()
    assert plan_request(spec).slo is spec.slo   # the parsed spec's own ServiceLevel, not a copy


def test_scaled_to_zero_plans_one_replica_and_runs_none():
    spec = _spec(replicas=0)
    assert plan_overrides(spec).replicas is None
    outcome = plan_service(spec)
    assert outcome.feasible
    children = desired_children(Owner("svc", "ns"), spec, outcome.sizing, OperatorSettings(), podmonitor_api=False)
    by_kind = {ch.kind.kind: ch for ch in children}
    assert by_kind["Deployment"].body["spec"]["replicas"] == 0
    # the model cache claim stays: scaling up again starts from the cached weights
    assert [ch.kind.kind for ch in children] == ["ServiceAccount", "Deployment", "Service", "NetworkPolicy",
                                                 "PersistentVolumeClaim"]


def test_outcomes():
    ok = plan_service(_spec())
    assert ok.feasible and ok.reason == "Planned" and ok.sizing is not None
    assert ok.sizing.status["maxNumSeqs"] > 0 and ok.sizing.status["derivation"]
    bad = plan_service(_spec(gpu={"type": "l4"}, model={"uri": "hf://Qwen/Qwen3-32B"}))
    assert not bad.feasible and bad.reason == "Infeasible" and bad.sizing is None
    assert bad.binding_constraint == "gpu_memory" and bad.suggestions
    assert all(s in bad.message for s in bad.suggestions)
    invalid = plan_service(_spec(model={"uri": "pvc://models/unknown"}))
    assert invalid.reason == "InvalidSpec" and "architecture" in invalid.message


def test_gpu_count_is_the_tensor_parallel_size_when_it_splits_the_model():
    outcome = plan_service(_spec(gpu={"type": "l4", "count": 2}))
    assert outcome.feasible and outcome.reason == "Planned"
    args = list(outcome.sizing.serve_args)
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert outcome.sizing.status["tensorParallelSize"] == 2
    assert outcome.sizing.status["numGpuBlocks"] == make_plan(
        plan_request(_spec(gpu={"type": "l4", "count": 2}))).num_gpu_blocks
    assert "--tensor-parallel-size" not in plan_service(_spec()).sizing.serve_args


def test_gpu_counts_the_engine_cannot_use_are_unsupported_with_the_reason():
    # Qwen3-8B: 32 query heads, 8 KV heads
    odd = plan_service(_spec(gpu={"type": "l4", "count": 6}))
    assert not odd.feasible and odd.reason == "Unsupported" and odd.sizing is None
    assert odd.message == ("gpu.count 6 cannot split Qwen3-8B for tensor parallelism: its 32 attention "
                           "heads do not split evenly over 6 GPUs; counts that work: 1, 2, 4, 8")
    offload = plan_service(_spec(gpu={"type": "l4", "count": 2}, offload={"enabled": True, "cpuGiB": 8}))
    assert offload.reason == "Unsupported" and "KV offloading" in offload.message


def test_a_model_beyond_one_node_gets_nodes_and_a_pinned_one_node_says_so():
    gpu = {"type": "l4", "count": 8}
    slo = {"maxContext": 131072, "p95PromptTokens": 8192, "p95OutputTokens": 1024, "concurrency": 4}
    outcome = plan_service(_spec(model={"uri": "hf://meta-llama/Llama-3.1-70B-Instruct"}, gpu=gpu, slo=slo))
    assert outcome.reason == "Planned", outcome.message
    assert outcome.sizing.nodes == outcome.sizing.status["pipelineParallelSize"] >= 2
    assert "nodes x 8x l4" in outcome.message
    args = outcome.sizing.serve_args
    assert args[args.index("--pipeline-parallel-size") + 1] == str(outcome.sizing.nodes)
    pinned = plan_service(_spec(model={"uri": "hf://meta-llama/Llama-3.1-70B-Instruct"},
                                gpu={**gpu, "nodes": 1}, slo=slo))
    assert pinned.reason == "Infeasible"
    assert "do not fit 1 node(s) of 8 x l4" in pinned.message
    fewer = plan_service(_spec(model={"uri": "hf://meta-llama/Llama-3.1-70B-Instruct"},
                               gpu={**gpu, "perNode": 4}, slo=slo))
    assert fewer.reason == "Unsupported" and "more than gpu.perNode 4" in fewer.message


def test_the_kv_safety_margin_is_a_planner_setting_in_the_spec():
    default = make_plan(plan_request(_spec()))
    wider = make_plan(plan_request(_spec(engine={"kvSafetyMargin": 0.1})))
    estimate = default.memory["kv_estimate_bytes"]
    assert wider.memory["kv_estimate_bytes"] == estimate
    assert (default.memory["kv_available_bytes"], wider.memory["kv_available_bytes"]) == (
        int(estimate * 0.97), int(estimate * 0.9))
    assert any("less the 10.0% safety margin" in line for line in wider.derivation)
    with pytest.raises(ValueError, match="kvSafetyMargin"):
        _spec(engine={"kvSafetyMargin": 0.6})
