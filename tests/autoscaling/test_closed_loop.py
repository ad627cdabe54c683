"""Autoscaling on KV usage and closed-loop sizing, end to end, in one scenario.

An InferenceService (the demo checkpoint, a 4 MiB KV cache pinned so that a handful of
requests fill it) is applied; the real operator reconciles it; its engine pods run real
``kvpilot serve`` processes (``platforms``: the test is the kubelet on the emulator, or a
real cluster runs them); a real Prometheus scrapes them as the PodMonitor says. Then:

1. the operator reads what the engine allocated: ``status.observed`` equals the plan
   (``SizingDrift=False``), on the profiled KV memory and on the blocks;
2. under a load that fills the KV cache, the HPA's decision, computed with the HPA
   algorithm from what Prometheus returns for the exact queries of the chart's
   prometheus-adapter rules for the generated HPA's metrics, rises above the current
   count; the operator leaves the Deployment's count to the autoscaler;
3. the next pod's engine is started with fewer blocks than the plan: ``SizingDrift=True``
   naming both numbers, a Warning Event, the operator's gauges;
4. after the load drains, the decision falls back to ``minReplicas``;
5. the drifting pod goes: ``SizingDrift=False`` again (a Normal Event);
6. switched to KEDA, the generated ScaledObject's own queries, evaluated at the same two
   moments, decide the same way.

The figures are printed (``-s``) and written to ``closed_loop.json`` in the test's folder.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from decimal import Decimal
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine.bench.server_process import free_port
from kvpilot.engine.model.models.demo import DEMO_MODEL_NAME
from kvpilot.operator import constants as c
from kvpilot.operator.quantity import quantity

from support import adapter_rules
from support.harness import wait_for
from support.hpa_algorithm import desired_replicas, external_average_proposal, pods_proposal
from support.kubelet import DEMO_MODEL_IN_IMAGE
from support.platforms import ClusterPlatform, EmulatedPlatform, Platform
from support.prometheus_sd import PROMETHEUS

NS, NAME = "serving", "chat"
KV_BYTES, DRIFT_KV_BYTES = 4 << 20, 3 << 20      # 64 and 48 blocks of the demo model in bfloat16
PROMPT_TOKENS, OUTPUT_TOKENS, REQUESTS = 224, 32, 8


def spec(port: int) -> dict:
    return {
        "model": {"uri": DEMO_MODEL_IN_IMAGE, "architecture": "kvpilot-demo"},
        "gpu": {"type": "l4"},
        "slo": {"maxContext": PROMPT_TOKENS + OUTPUT_TOKENS, "p95PromptTokens": PROMPT_TOKENS,
                "p95OutputTokens": OUTPUT_TOKENS, "concurrency": 4},
        # bfloat16: the checkpoint's dtype, which the plan assumes (on CPU "auto" would be float32)
        "engine": {"kvCacheMemoryBytes": KV_BYTES, "extraArgs": ["--dtype", "bfloat16"]},
        "port": port,
        "autoscaling": {"mode": "hpa", "minReplicas": 1, "maxReplicas": 3, "waitingRequestsTarget": 2},
    }


class Load:
    """``REQUESTS`` clients, each streaming completions of its own prompt against one engine
    one after another until ``stop`` (disconnecting aborts them, as a client going away
    does): the KV cache stays full and requests keep waiting for as long as the check needs,
    however fast the machine drains one round (a single round can finish between two
    scrapes)."""

    def __init__(self, url: str) -> None:
        self.url, self.loop = url, asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.tasks: list[asyncio.Future] = []

    async def _one(self, i: int) -> None:
        prompt = [1000 + 400 * i + j for j in range(PROMPT_TOKENS)]
        body = {"model": NAME, "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "ignore_eos": True,
                "temperature": 0, "stream": True}
        async with httpx.AsyncClient(timeout=300) as client:
            while True:
                async with client.stream("POST", f"{self.url}/v1/completions", json=body) as response:
                    async for _ in response.aiter_lines():
                        pass

    def start(self) -> Load:
        self.thread.start()
        self.tasks = [asyncio.run_coroutine_threadsafe(self._one(i), self.loop) for i in range(REQUESTS)]
        return self

    def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def hpa_decision(platform: Platform, hpa: dict, served: dict, pods: list[str], at: float) -> dict:
    """The HPA's desired replicas at time ``at``: each Pods metric through the adapter rule
    that serves it, run on Prometheus for ``pods``; the HPA algorithm on the answers."""
    proposals, signals = [], {}
    for metric in hpa["spec"]["metrics"]:
        name = metric["pods"]["metric"]["name"]
        rule, series = served[name]
        values = platform.prometheus.by_pod(adapter_rules.pods_query(rule, series, NS, pods), at)
        assert set(values) <= set(pods), values
        target = float(quantity(metric["pods"]["target"]["averageValue"]))
        proposals.append(pods_proposal(len(pods), values, target))
        signals[name] = {"per_pod": values, "target": target, "proposal": proposals[-1]}
    desired = desired_replicas(proposals, hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"])
    return {"current": len(pods), "desired": desired, "signals": signals}


def keda_decision(platform: Platform, scaled: dict, current: int, at: float) -> dict:
    """KEDA's HPA's desired replicas at ``at`` from the ScaledObject's own triggers (an
    empty answer counts as 0, KEDA's ``ignoreNullValues``)."""
    proposals, signals = [], {}
    for trigger in scaled["spec"]["triggers"]:
        query, threshold = trigger["metadata"]["query"], float(Decimal(trigger["metadata"]["threshold"]))
        value = platform.prometheus.scalar(query, at) or 0.0
        proposals.append(external_average_proposal(current, value, threshold))
        signals[query] = {"value": value, "threshold": threshold, "proposal": proposals[-1]}
    spec_ = scaled["spec"]
    return {"current": current, "signals": signals,
            "desired": desired_replicas(proposals, spec_["minReplicaCount"], spec_["maxReplicaCount"])}


def operator_gauges(platform: Platform) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{platform.metrics_port}/metrics", timeout=5).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.endswith("_kv_blocks") and s.labels == {"namespace": platform.namespace, "name": NAME}}


def condition(platform: Platform, status: str) -> dict:
    def found():
        cr = platform.get("inferenceservice", NAME) or {}
        cond = next((x for x in (cr.get("status") or {}).get("conditions") or () if x["type"] == c.SIZING_DRIFT),
                    None)
        return cond if cond and cond["status"] == status else None
    return wait_for(found, platform.timeout, 0.2, f"SizingDrift={status}")


def run_scenario(platform: Platform, tmp: Path) -> dict:
    report: dict = {}
    k = platform.kubectl
    k("apply", "--validate=false", "-f", "-", stdin=json.dumps({"apiVersion": c.API_VERSION, "kind": c.KIND,
                                            "metadata": {"name": NAME, "namespace": platform.namespace},
                                            "spec": spec(free_port())}))
    plan = wait_for(lambda: ((platform.get("inferenceservice", NAME) or {}).get("status") or {}).get("plan"),
                    platform.timeout, 0.2, "the plan")
    deployment = wait_for(lambda: platform.get("deployment", NAME), platform.timeout, 0.2, "the Deployment")
    hpa = wait_for(lambda: platform.get("hpa", NAME), platform.timeout, 0.2, "the HPA")
    assert plan["numGpuBlocks"] == 64 and plan["maxNumSeqs"] == 4 and deployment["spec"]["replicas"] == 1

    first = platform.first_pod(deployment, plan)
    platform.prepare_drift(deployment, DRIFT_KV_BYTES)  # loads while the rest runs

    # 1. as planned, on the profiled memory (the engine's GPU) and on the blocks
    fine = condition(platform, "False")
    observed = platform.get("inferenceservice", NAME)["status"]["observed"]
    assert fine["reason"] == "AsPlanned" and observed["numGpuBlocks"] == plan["numGpuBlocks"]
    assert observed["tokenCapacity"] == plan["kvTokenCapacity"] == 1024
    report["as_planned"] = {"planned_blocks": plan["numGpuBlocks"], "observed": observed, "message": fine["message"]}
    if isinstance(platform, EmulatedPlatform):
        assert observed["comparedOn"] == "profiledKvBytes" and abs(observed["relativeError"]) <= 0.02
    assert operator_gauges(platform) == {"kvpilot:planned_kv_blocks": 64, "kvpilot:observed_kv_blocks": 64}

    # the adapter rules find the engine's series, and serve every metric the HPA names
    usage = f'vllm:kv_cache_usage_perc{{namespace="{platform.namespace}",pod="{first}"}}'
    platform.prometheus.wait(usage, bool, platform.timeout, "the engine's series")
    served = {adapter_rules.metric_name(rule, series): (rule, series)
              for rule in adapter_rules.load_rules()
              for series in platform.prometheus.series_names(rule["seriesQuery"])}
    assert {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]} <= set(served), served

    # 2. a load that fills the KV cache: the HPA wants more replicas
    load = Load(platform.engine_url(first)).start()
    try:
        loaded, _ = platform.prometheus.wait(
            f"{usage} >= 0.8 and on() sum(vllm:num_requests_waiting{{pod=\"{first}\"}}) > 0", bool,
            platform.timeout, "KV usage >= 0.8 with requests waiting")
        up = hpa_decision(platform, hpa, served, [first], loaded)
    finally:
        load.stop()
    report["under_load"] = up
    assert up["desired"] > up["current"] == 1, up
    platform.scale(NAME, up["desired"])  # the HPA controller; the operator must leave it
    second = platform.add_pod(deployment, DRIFT_KV_BYTES)

    # 3. the new pod's engine has fewer blocks than planned
    drift = condition(platform, "True")
    assert drift["reason"] == "BlocksDiffer"
    assert "reports 48 KV blocks" in drift["message"] and "the plan 64" in drift["message"], drift["message"]
    events = [(e["type"], e["reason"]) for e in platform.events(NAME)]
    assert ("Warning", "SizingDrift") in events, events
    assert wait_for(lambda: operator_gauges(platform).get("kvpilot:observed_kv_blocks") == 48, 30, 0.2,
                    "the observed gauge")
    observed = platform.get("inferenceservice", NAME)["status"]["observed"]
    assert (observed["pod"], observed["numGpuBlocks"], observed["pods"]) == (second, 48, 2), observed
    report["forced_drift"] = {"message": drift["message"], "observed": observed}
    assert platform.get("deployment", NAME)["spec"]["replicas"] == up["desired"]

    # 4. drained: back to the minimum
    pods = [first, second]
    selector = "|".join(pods)
    drained, _ = platform.prometheus.wait(
        f'max(vllm:kv_cache_usage_perc{{pod=~"{selector}"}}) == 0 and on() '
        f'max(vllm:num_requests_waiting{{pod=~"{selector}"}}) == 0 and on() '
        f'count(vllm:kv_cache_usage_perc{{pod=~"{selector}"}}) == 2', bool, platform.timeout, "both pods idle")
    down = hpa_decision(platform, hpa, served, pods, drained)
    report["after_drain"] = down
    assert down["desired"] == hpa["spec"]["minReplicas"] < down["current"], down

    # 5. the drifting pod goes
    platform.remove_pod(second)
    back = condition(platform, "False")
    assert ("Normal", "SizingAsPlanned") in [(e["type"], e["reason"]) for e in platform.events(NAME)]
    report["after_removal"] = back["message"]

    # 6. KEDA: the ScaledObject's own queries decide the same at the same moments
    k("patch", "inferenceservice", NAME, "--type", "merge", "-p", '{"spec":{"autoscaling":{"mode":"keda"}}}')
    scaled = wait_for(lambda: platform.get("scaledobject", NAME), platform.timeout, 0.2, "the ScaledObject")
    keda_up, keda_down = keda_decision(platform, scaled, 1, loaded), keda_decision(platform, scaled, 2, drained)
    report["keda"] = {"under_load": keda_up, "after_drain": keda_down}
    assert keda_up["desired"] > 1 and keda_down["desired"] == scaled["spec"]["minReplicaCount"] == 1
    assert "Traceback" not in platform.operator.log(), platform.operator.log()[-4000:]
    (tmp / "closed_loop.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return report


@pytest.mark.slow
@pytest.mark.skipif(PROMETHEUS is None, reason="the prometheus binary is not installed "
                                               "(scripts/bootstrap.sh test installs it)")
def test_closed_loop_on_the_emulator(tmp_path, demo_model_dir):
    with EmulatedPlatform(tmp_path, NS, demo_model_dir) as platform:
        run_scenario(platform, tmp_path)
        assert platform.emu.emulator.failures == []


@pytest.mark.k8s
@pytest.mark.skipif(not os.environ.get("KUBECONFIG") or not os.environ.get("KVPILOT_E2E_PROMETHEUS_URL"),
                    reason="no real cluster: set KUBECONFIG (GPU nodes running the engine image, "
                           "KVPILOT_E2E_ENGINE_IMAGE) and KVPILOT_E2E_PROMETHEUS_URL (a Prometheus that "
                           "selects the operator's PodMonitors)")
def test_closed_loop_on_a_real_cluster(tmp_path):
    with ClusterPlatform(tmp_path) as platform:
        run_scenario(platform, tmp_path)


def test_the_engine_image_holds_the_demo_checkpoint_where_the_scenario_names_it():
    dockerfile = (Path(__file__).resolve().parents[2] / "Dockerfile.engine").read_text()
    assert "ensure_demo_model('/opt/kvpilot')" in dockerfile
    assert f"/opt/kvpilot/{DEMO_MODEL_NAME}" == DEMO_MODEL_IN_IMAGE
