"""Planned vs observed KV capacity: status.observed, the SizingDrift condition and its
Events, and the operator's planned/observed block gauges (pure, no cluster)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.operator import constants as c
from kvpilot.operator.engine_observer import EngineCache, EngineSample
from kvpilot.operator.metrics import OperatorMetrics
from kvpilot.operator.reconcile import ServiceFigures, transition_events
from kvpilot.operator.sizing_drift import sizing_observation

GIB = 1 << 30
PLAN = {"numGpuBlocks": 64, "blockSize": 16, "kvEstimateBytes": 20 * GIB}


def sample(pod: str, blocks: int, profiled: int | None = None) -> EngineSample:
    return EngineSample(pod, EngineCache(blocks, 16, "bfloat16", blocks * 65536, profiled))


def test_nothing_to_compare_is_unknown():
    none = sizing_observation(None, [sample("a", 64)], 0.02)
    assert (none.condition.status, none.condition.reason, none.observed) == ("Unknown", "NotPlanned", None)
    unread = sizing_observation(PLAN, [], 0.02)
    assert (unread.condition.status, unread.condition.reason, unread.observed) == ("Unknown", "NotObserved", None)
    assert (unread.planned_blocks, unread.observed_blocks) == (64, None)


def test_engines_as_planned():
    found = sizing_observation(PLAN, [sample("a", 64), sample("b", 64)], 0.02)
    assert found.condition.status == "False" and found.condition.reason == "AsPlanned"
    assert found.observed == {"pods": 2, "pod": "a", "numGpuBlocks": 64, "blockSize": 16,
                              "cacheDtype": "bfloat16", "tokenCapacity": 1024, "comparedOn": "numGpuBlocks",
                              "relativeError": 0.0}
    assert (found.planned_blocks, found.observed_blocks) == (64, 64)
    assert sizing_observation(PLAN, [sample("a", 63)], 0.02).condition.status == "False"  # -1.6 %


def test_fewer_blocks_are_drift_naming_both_numbers():
    found = sizing_observation(PLAN, [sample("a", 64), sample("b", 48), sample("c", 66)], 0.02)
    cond = found.condition
    assert (cond.status, cond.reason) == ("True", "BlocksDiffer")
    assert "pod b reports 48 KV blocks (768 tokens), the plan 64 (1,024 tokens): -25.0%" in cond.message
    assert "different engine image" in cond.message
    assert found.observed["pod"] == "b" and found.observed["relativeError"] == -0.25
    assert found.observed_blocks == 48


def test_profiled_memory_is_compared_with_the_plans_estimate():
    low = sizing_observation(PLAN, [sample("a", 64, profiled=19 * GIB)], 0.02)
    assert (low.condition.status, low.condition.reason) == ("True", "ProfiledMemoryDiffers")
    assert "19.00 GiB" in low.condition.message and "20.00 GiB" in low.condition.message
    assert "-5.0%" in low.condition.message and "another process on the GPU" in low.condition.message
    assert low.observed["comparedOn"] == "profiledKvBytes" and low.observed["profiledKvBytes"] == 19 * GIB
    close = sizing_observation(PLAN, [sample("a", 64, profiled=int(20.2 * GIB))], 0.02)
    assert close.condition.status == "False" and close.observed["relativeError"] == pytest.approx(0.01, abs=1e-4)
    high = sizing_observation(PLAN, [sample("a", 64, profiled=22 * GIB)], 0.02)
    assert high.condition.status == "True" and "capacity unused" in high.condition.message


def test_an_event_when_it_flips():
    drift = sizing_observation(PLAN, [sample("a", 48)], 0.02).condition
    fine = sizing_observation(PLAN, [sample("a", 64)], 0.02).condition
    unknown = sizing_observation(PLAN, [], 0.02).condition

    def stored(cond):
        return [{"type": cond.type, "status": cond.status, "reason": cond.reason, "message": cond.message}]
    assert transition_events(stored(unknown), [fine]) == []
    (event,) = transition_events(stored(fine), [drift])
    assert (event.type, event.reason) == ("Warning", "SizingDrift") and "48" in event.message
    assert transition_events(stored(drift), [drift]) == []
    (event,) = transition_events(stored(drift), [fine])
    assert (event.type, event.reason) == ("Normal", "SizingAsPlanned")
    assert drift.type == c.SIZING_DRIFT


def test_the_operator_exports_planned_and_observed_blocks():
    metrics = OperatorMetrics(CollectorRegistry())

    def values() -> dict:
        text = generate_latest(metrics.registry).decode()
        return {(s.name, s.labels.get("name")): s.value for f in text_string_to_metric_families(text)
                for s in f.samples if s.name.endswith("_kv_blocks")}
    metrics.record_sizing("ns", "chat", 64, 48)
    metrics.record_sizing("ns", "other", 32, None)
    assert values() == {("kvpilot:planned_kv_blocks", "chat"): 64, ("kvpilot:observed_kv_blocks", "chat"): 48,
                        ("kvpilot:planned_kv_blocks", "other"): 32}
    metrics.forget("ns", "chat")
    metrics.forget("ns", "never-seen")
    assert values() == {("kvpilot:planned_kv_blocks", "other"): 32}


def test_the_operator_exports_service_replicas_drift_and_plan_outcomes():
    metrics = OperatorMetrics(CollectorRegistry())

    def values() -> dict:
        text = generate_latest(metrics.registry).decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(text) for s in f.samples
                if s.name.startswith(("kvpilot:inferenceservice_", "kvpilot:operator_plan_outcomes_total"))}
    chat = (("model_name", "chat-model"), ("name", "chat"), ("namespace", "ns"))
    metrics.record_service("ns", "chat", ServiceFigures("chat-model", 3, 4, 8, "feasible", "Planned", True))
    metrics.record_service("ns", "big", ServiceFigures("big", 0, 0, None, "infeasible", "KVCacheTooSmall"))
    assert values() == {
        ("kvpilot:inferenceservice_replicas", chat): 3, ("kvpilot:inferenceservice_desired_replicas", chat): 4,
        ("kvpilot:inferenceservice_max_replicas", chat): 8, ("kvpilot:inferenceservice_sizing_drift", chat): 1,
        ("kvpilot:inferenceservice_replicas", (("model_name", "big"), ("name", "big"), ("namespace", "ns"))): 0,
        ("kvpilot:inferenceservice_desired_replicas", (("model_name", "big"), ("name", "big"),
                                                        ("namespace", "ns"))): 0,
        ("kvpilot:operator_plan_outcomes_total", (("outcome", "feasible"), ("reason", "Planned"))): 1,
        ("kvpilot:operator_plan_outcomes_total", (("outcome", "infeasible"), ("reason", "KVCacheTooSmall"))): 1}
    metrics.forget("ns", "big")
    metrics.record_service("ns", "chat", ServiceFigures("renamed", 3, 3, 8, "feasible", "Planned", False))
    renamed = (("model_name", "renamed"), ("name", "chat"), ("namespace", "ns"))
    assert {k for k in values() if k[0].startswith("kvpilot:inferenceservice_")} == {
        (f"kvpilot:inferenceservice_{g}", renamed) for g in ("replicas", "desired_replicas", "max_replicas",
                                                             "sizing_drift")}


def test_observed_describes_the_pod_the_verdict_is_about():
    samples = [sample("a", 64, profiled=20 * GIB), sample("b", 48, profiled=20 * GIB)]
    found = sizing_observation(PLAN, samples, 0.02)
    assert found.condition.reason == "BlocksDiffer"
    assert {k: found.observed[k] for k in ("pod", "numGpuBlocks", "comparedOn", "relativeError")} == \
        {"pod": "b", "numGpuBlocks": 48, "comparedOn": "numGpuBlocks", "relativeError": -0.25}
    fine = sizing_observation(PLAN, [sample("a", 64, profiled=int(19.9 * GIB)), sample("b", 64, profiled=20 * GIB)],
                              0.02)
    assert (fine.condition.status, fine.observed["pod"], fine.observed["comparedOn"]) == \
        ("False", "a", "profiledKvBytes")
    assert "64 KV blocks, the plan 64 (+0.0%; profiled KV memory -0.5%" in fine.condition.message


def test_the_operator_serves_its_names_with_colons_to_a_prometheus_that_asks_for_openmetrics():
    from wsgiref.util import setup_testing_defaults

    from kvpilot.operator.metrics import plain_text_app

    metrics = OperatorMetrics(CollectorRegistry())
    metrics.record_sizing("ns", "chat", 64, 48)
    environ = {"HTTP_ACCEPT": "application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
                              "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"}  # Prometheus 2.x
    setup_testing_defaults(environ)
    headers = {}
    body = b"".join(plain_text_app(metrics.registry)(environ, lambda status, h: headers.update(h)))
    assert headers["Content-Type"].startswith("text/plain; version=0.0.4")
    assert 'kvpilot:planned_kv_blocks{name="chat",namespace="ns"} 64.0' in body.decode()
