"""Every dashboard panel's every target returns data from a real Prometheus.

The stack: the API emulator and the real operator (metrics on), an InferenceService of
the demo model (autoscaled, with latency SLOs, n-gram speculative decoding) plus an infeasible one; two engine pods of
the first one's Deployment run as real ``kvpilot serve`` processes (``tests/autoscaling/
kubelet.py``) with a KV cache smaller than the plan's (preemptions, SizingDrift), sampled
KV residency and MFU metrics on, and CPU + disk KV offload on the second; a real
Prometheus scrapes both pods as the operator's PodMonitor says, and the operator, every
second. A load of streaming requests sharing a prefix runs against both engines. Then
each target of both dashboards, with Grafana's variables substituted (``$__rate_interval``
= 15s at 1 s scrapes), is run through Prometheus' HTTP API over the last seconds of the
load (up to 30 s): it must return at least one finite value. docs/metrics.md's metric table is checked
against the names the live engines export.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time

import httpx
import pytest
import yaml

from kvpilot.engine.bench.server_process import free_port
from kvpilot.operator import constants as c

from support import crd_schema
from support.dashboards import substitute, targets
from support.docs_pages import documented_metrics
from support.harness import (
    EmulatorThread,
    Kubectl,
    OperatorProcess,
    schemaless_crd,
    wait_for,
    write_kubeconfig,
)
from support.kubelet import DEMO_MODEL_IN_IMAGE, Kubelet
from support.prometheus_sd import PROMETHEUS, LocalPrometheus, podmonitor_targets

pytestmark = pytest.mark.slow

NS, NAME = "serving", "chat"
GIB = 1 << 30
KV_BYTES, SMALL_KV_BYTES = 4 << 20, 1 << 20       # planned 64 blocks; the pods get 16 (= max_model_len)
PREFIX_TOKENS, SUFFIX_TOKENS, OUTPUT_TOKENS, CLIENTS = 96, 32, 24, 6
RATE_INTERVAL = "15s"
VARIABLES = {"namespace": NS, "model_name": ".*", "job": ".*"}
OBSERVABILITY = ("--kv-cache-metrics", "--kv-cache-metrics-sample", "1", "--enable-mfu-metrics",
                 "--kv-cache-memory-bytes", str(SMALL_KV_BYTES))


def _spec(port: int) -> dict:
    return {
        "model": {"uri": DEMO_MODEL_IN_IMAGE, "architecture": "kvpilot-demo"},
        "gpu": {"type": "l4"},
        "slo": {"maxContext": 256, "p95PromptTokens": 160, "p95OutputTokens": 32, "concurrency": 4,
                "ttftP95Ms": 2000, "itlP95Ms": 250},
        # n-gram speculation through the operator (vllm:spec_decode_* for the acceptance panel)
        "engine": {"kvCacheMemoryBytes": KV_BYTES, "extraArgs": ["--dtype", "bfloat16"],
                   "speculative": {"method": "ngram", "numSpeculativeTokens": 3, "promptLookupMin": 1,
                                   "promptLookupMax": 3}},
        "port": port,
        "autoscaling": {"mode": "hpa", "minReplicas": 1, "maxReplicas": 3},
    }


INFEASIBLE = {"model": {"uri": "hf://Qwen/Qwen3-32B"}, "gpu": {"type": "l4"},
              "slo": {"maxContext": 32768, "p95PromptTokens": 16000, "p95OutputTokens": 1000, "concurrency": 64}}


class SharedPrefixLoad:
    """``CLIENTS`` streaming clients per engine, each repeating prompts that share one prefix
    (prefix-cache hits, block reuse) with a fresh suffix, until stopped."""

    def __init__(self, urls: list[str], model: str) -> None:
        self.urls, self.model = urls, model
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.tasks: list = []

    async def _client(self, url: str, i: int) -> None:
        prefix = [500 + j for j in range(PREFIX_TOKENS)]
        async with httpx.AsyncClient(timeout=120) as client:
            for round_ in range(10_000):
                suffix = [5000 + 97 * i + 13 * round_ + j for j in range(SUFFIX_TOKENS)]
                body = {"model": self.model, "prompt": prefix + suffix, "max_tokens": OUTPUT_TOKENS,
                        "ignore_eos": True, "temperature": 0, "stream": True}
                async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                    async for _ in response.aiter_lines():
                        pass

    def start(self) -> SharedPrefixLoad:
        self.thread.start()
        self.tasks = [asyncio.run_coroutine_threadsafe(self._client(url, i), self.loop)
                      for url in self.urls for i in range(CLIENTS)]
        return self

    def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _range(prometheus: LocalPrometheus, promql: str, start: float, end: float) -> list[dict]:
    params = {"query": promql, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": "1"}
    body = prometheus.http.get("/api/v1/query_range", params=params).raise_for_status().json()
    assert body["status"] == "success", body
    return body["data"]["result"]


def _finite(result: list[dict]) -> bool:
    return any(math.isfinite(float(v)) for series in result for _, v in series["values"])


@pytest.fixture
def stack(tmp_path, demo_model_dir):
    if PROMETHEUS is None:
        pytest.fail("the prometheus binary is missing: run scripts/bootstrap.sh test")
    prometheus = LocalPrometheus(tmp_path).start()
    emu = EmulatorThread([crd_schema.load_crd(),
                          schemaless_crd("monitoring.coreos.com", "v1", "PodMonitor", "podmonitors"),
                          schemaless_crd("monitoring.coreos.com", "v1", "PrometheusRule", "prometheusrules")])
    emu.__enter__()
    kubelet = operator = None
    try:
        kubeconfig = write_kubeconfig(emu.kubeconfig(NS), tmp_path)
        kubectl = Kubectl(kubeconfig, tmp_path, NS)
        operator_port = free_port()
        operator = OperatorProcess(kubeconfig, tmp_path / "operator.log",
                                   env={"KVPILOT_METRICS_PORT": str(operator_port)}).start()
        kubectl("create", "namespace", NS, check=False)
        for name, spec in ((NAME, _spec(free_port())), ("too-big", INFEASIBLE)):
            kubectl("apply", "--validate=false", "-f", "-", stdin=yaml.safe_dump(
                {"apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": name, "namespace": NS},
                 "spec": spec}))

        def get(kind: str, name: str) -> dict | None:
            run = kubectl("get", kind, name, "-o", "json", check=False)
            return json.loads(run.stdout) if run.returncode == 0 else None

        deployment = wait_for(lambda: get("deployment", NAME), 30, 0.2, "the engine Deployment")
        monitor = wait_for(lambda: get("podmonitor", NAME), 30, 0.2, "the PodMonitor")
        plan = wait_for(lambda: ((get("inferenceservice", NAME) or {}).get("status") or {}).get("plan"),
                        30, 0.2, "the plan")
        total = plan["kvEstimateBytes"] / plan["gpuMemoryUtilization"] / GIB
        kubelet = Kubelet(emu, NS, demo_model_dir, tmp_path,
                          {"KVPILOT_FAKE_DEVICE_MEMORY": json.dumps({"total_gib": total, "free_gib": total}),
                           "VLLM_COMPUTE_NANS_IN_LOGITS": "1",   # vllm:corrupted_requests_total
                           "OMP_NUM_THREADS": "1"})   # two engines on a few cores: no thread oversubscription
        template = deployment["spec"]["template"]
        offload = ("--kv-offloading-size", "0.01", "--kv-offloading-backend", "native",
                   "--kv-offloading-disk-path", str(tmp_path / "kv-disk"), "--kv-offloading-disk-size", "0.02")
        pods = [f"{NAME}-5d8f7c6b9-{s}" for s in ("aaaaa", "bbbbb")]
        kubelet.start(pods[0], template["spec"], template["metadata"]["labels"], OBSERVABILITY)
        kubelet.start(pods[1], template["spec"], template["metadata"]["labels"], OBSERVABILITY + offload)
        for pod in pods:
            kubelet.admit(pod)
        stored = emu.run(lambda e: [json.loads(json.dumps(o)) for k, o in e.objects.items() if k[1] == "pods"])
        prometheus.set_targets([*podmonitor_targets(monitor, stored),
                                {"targets": [f"127.0.0.1:{operator_port}"], "labels": {"job": "kvpilot-operator"}}])
        yield prometheus, kubelet, pods, operator
    finally:
        if kubelet is not None:
            kubelet.close()
        if operator is not None:
            operator.stop()
        prometheus.stop()
        emu.__exit__(None, None, None)


def test_every_dashboard_target_returns_data(stack):
    prometheus, kubelet, pods, operator = stack
    model = httpx.get(f"{kubelet.engines[pods[0]].url}/v1/models").json()["data"][0]["id"]
    load = SharedPrefixLoad([kubelet.engines[p].url for p in pods], model).start()
    load_started = time.time()
    try:
        # the troubles the panels show, as Prometheus sees them: preemptions on both engines,
        # evictions of sampled blocks, offload transfers, the operator's observation of both pods
        for promql, what in (
                (f'rate(vllm:num_preemptions_total{{namespace="{NS}"}}[{RATE_INTERVAL}]) > 0', "preemptions"),
                (f'rate(vllm:kv_block_lifetime_seconds_count[{RATE_INTERVAL}]) > 0', "sampled evictions"),
                (f'rate(vllm:kv_block_reuse_gap_seconds_count[{RATE_INTERVAL}]) > 0', "sampled reuses"),
                (f'rate(vllm:kv_offload_total_bytes_total[{RATE_INTERVAL}]) > 0', "offload transfers"),
                (f'rate(vllm:request_success_total[{RATE_INTERVAL}]) > 0', "finished requests"),
                ('kvpilot:observed_kv_blocks', "the operator's observation")):
            prometheus.wait(promql, lambda r: len(r) >= 1, 60, what)
        prometheus.wait(f'rate(vllm:num_preemptions_total[{RATE_INTERVAL}]) > 0', lambda r: len(r) == 2, 60,
                        "preemptions on both engines")
        # the dashboards' view of the load: its last 10 to 30 s after the first rate window;
        # a target still empty is asked again over a later window while the load goes on (on
        # a loaded machine a 15 s rate window can miss a slow engine's rarer events, e.g. a
        # first token), up to a deadline
        time.sleep(max(0.0, load_started + 25 - time.time()))
        pending = [(name, target.panel, target.ref_id, substitute(target.expr, VARIABLES, RATE_INTERVAL))
                   for name in ("kvpilot-engines.json", "kvpilot-operator.json") for target in targets(name)]
        checked, deadline = [], time.monotonic() + 90
        while True:
            end = time.time()
            start = max(end - 30, load_started + 15)
            found = [t for t in pending if _finite(_range(prometheus, t[3], start, end))]
            checked += found
            pending = [t for t in pending if t not in found]
            if not pending or time.monotonic() > deadline:
                break
            time.sleep(5)
        empty = pending
        live = {n for n in prometheus.http.get("/api/v1/label/__name__/values").json()["data"]}
    finally:
        load.stop()
    panels = {(d, p) for d, p, _, _ in checked + empty}
    failing_panels = {(d, p) for d, p, _, _ in empty}
    print(f"\ndashboard panels checked: {len(panels)}, returning data (every target): "
          f"{len(panels - failing_panels)}; targets: {len(checked) + len(empty)}, returning data: {len(checked)}")
    assert empty == [], "targets without data:\n" + "\n".join(f"{d} {p} [{r}]: {e}" for d, p, r, e in empty)
    assert "Traceback" not in operator.log()
    # docs/metrics.md's table against the live engines (histograms appear as _bucket / _sum / _count)
    documented = documented_metrics()
    missing = {n for n, kind in documented.items()
               if (n + "_count" if kind == "histogram" else n) not in live}
    # (the profiled figure needs CUDA, the LoRA metrics --enable-lora: tests/lora checks them;
    # the KV-transfer and NIXL metrics --kv-transfer-config: tests/kv_transfer checks them)
    lora = {n for n in documented if "lora" in n}
    transfer = {n for n in documented if n.startswith(("kvpilot:kv_transfer_", "kvpilot:nixl_"))}
    assert missing <= {"kvpilot:kv_cache_profiled_available_bytes", *lora, *transfer}, sorted(missing)
