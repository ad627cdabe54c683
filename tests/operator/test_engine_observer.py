"""Reading what the engines allocated: the parser against the engine's own exporter, pod
selection, and the observer's reads (bounded, remembered, timed out, failures harmless),
straight from pods and through the API server's pod proxy.

Oracles: the engine's real ``ServerMetrics`` exposition (what ``kvpilot serve`` exports),
served over real HTTP on loopback; the API emulator's pod proxy; the chart's RBAC.
"""

from __future__ import annotations

import asyncio
import copy
import http.server
import json
import logging
import threading
import time

import aiohttp.web
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvpilot.engine.config import KVCacheInfo
from kvpilot.engine.server.metrics import ServerMetrics
from kvpilot.operator import constants as c
from kvpilot.operator.engine_observer import (
    MAX_METRICS_BYTES,
    ApiServerReader,
    DirectReader,
    EngineCache,
    EngineObserver,
    EnginePod,
    MetricsTooLarge,
    engine_pods,
    parse_engine_cache,
)
from kvpilot.operator.index_copies import pod_summary
from kvpilot.operator.kube_api import KubeApi
from kvpilot.operator.spec import parse_spec
from kvpilot.operator.spec_to_plan import plan_service

from support import crd_schema
from support.chart import CHART, render
from support.harness import EmulatorThread, Kubectl, OperatorProcess, wait_for, write_kubeconfig
from support.rbac import assert_chart_grants, call_key, grants, operator_calls, ungranted

SERVE_ARGS = ["--max-num-seqs", "4", "--kv-cache-memory-bytes", "4194304"]


def outcome_plan(spec: dict) -> dict:
    """``status.plan`` as the operator will write it for ``spec``."""
    return dict(plan_service(parse_spec(spec, "chat")).sizing.status)


def exposition(num_gpu_blocks: int = 64, profiled: int | None = None) -> str:
    """A /metrics page as kvpilot serve exports it, for a KV cache of ``num_gpu_blocks``."""
    registry = CollectorRegistry()
    info = KVCacheInfo(num_gpu_blocks=num_gpu_blocks, block_size=16, kv_cache_dtype="bfloat16",
                       bytes_per_block=65536, kv_cache_memory_bytes=num_gpu_blocks * 65536,
                       enable_prefix_caching=True, gpu_memory_utilization=0.9,
                       profiled_available_bytes=profiled)
    ServerMetrics(registry, "chat", info, 256, lambda: None)
    return generate_latest(registry).decode()


def test_the_parser_reads_the_engines_own_exposition():
    assert parse_engine_cache(exposition(48)) == EngineCache(48, 16, "bfloat16", 48 * 65536, None)
    cache = parse_engine_cache(exposition(64, profiled=20 << 30))
    assert (cache.profiled_kv_bytes, cache.token_capacity) == (20 << 30, 1024)
    with pytest.raises(ValueError, match="no vllm:cache_config_info"):
        parse_engine_cache("process_open_fds 12\n")
    with pytest.raises(ValueError):
        parse_engine_cache("this is { not the text format\n")


def pod(name: str, ip: str = "127.0.0.1", port: int = 8000, args=SERVE_ARGS, ready: bool = True,
        restarts: int = 0) -> dict:
    """An engine Pod object as the kubelet reports it."""
    return {"metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}"},
            "spec": {"containers": [{"name": c.ENGINE_CONTAINER, "args": ["--model", "/m", *args, "--x"],
                                     "ports": [{"name": "http", "containerPort": port}]}]},
            "status": {"phase": "Running", "podIP": ip,
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                       "containerStatuses": [{"name": c.ENGINE_CONTAINER, "restartCount": restarts}]}}


def test_only_ready_pods_running_the_plan_are_read():
    terminating = pod("d")
    terminating["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    no_ip = pod("e")
    del no_ip["status"]["podIP"]
    no_port = copy.deepcopy(pod("f"))
    no_port["spec"]["containers"][0]["ports"] = []
    pods = [pod("b", port=9000, restarts=2), pod("a"), pod("c", ready=False), terminating, no_ip, no_port,
            pod("g", args=["--max-num-seqs", "8", "--kv-cache-memory-bytes", "4194304"])]  # an older plan
    expected = [EnginePod("ns", "a", "uid-a", "127.0.0.1", 8000, 0), EnginePod("ns", "b", "uid-b", "127.0.0.1", 9000, 2)]
    assert engine_pods(pods, SERVE_ARGS) == expected
    # what the operator keeps of a pod in its watch cache is enough to find them
    assert engine_pods([pod_summary(p) for p in pods], SERVE_ARGS) == expected


class MetricsServers:
    """Engine-like /metrics servers on 127.0.0.1: each answers with a page, an error, or late."""

    def __init__(self) -> None:
        self.hits: dict[int, int] = {}
        self._runners: list[aiohttp.web.AppRunner] = []

    async def start(self, page: str | None, delay: float = 0.0) -> int:
        async def metrics(_: aiohttp.web.Request) -> aiohttp.web.Response:
            self.hits[port] = self.hits.get(port, 0) + 1
            await asyncio.sleep(delay)
            if page is None:
                return aiohttp.web.Response(status=500, text="engine broken")
            return aiohttp.web.Response(text=page, content_type="text/plain")
        app = aiohttp.web.Application()
        app.router.add_get("/metrics", metrics)
        runner = aiohttp.web.AppRunner(app)
        await runner.setup()
        site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self._runners.append(runner)
        return port

    async def close(self) -> None:
        for runner in self._runners:
            await runner.cleanup()


def test_each_pod_is_read_once_a_few_per_pass_and_failures_only_delay(caplog):
    caplog.set_level(logging.INFO, logger="kvpilot.operator.engine_observer")
    async def scenario():
        servers = MetricsServers()
        reader = DirectReader()
        observer = EngineObserver(reader, timeout=0.5, max_scrapes_per_pass=2)
        try:
            ports = [await servers.start(exposition(64)), await servers.start(exposition(48)),
                     await servers.start(None), await servers.start(exposition(64), delay=3)]
            pods = engine_pods([pod(f"p{i}", port=port) for i, port in enumerate(ports)], SERVE_ARGS)
            service = ("ns", "chat")
            first = await observer.observe(service, pods)           # p0, p1 read; p2, p3 wait
            assert [(s.pod, s.cache.num_gpu_blocks) for s in first] == [("p0", 64), ("p1", 48)]
            started = asyncio.get_running_loop().time()
            second = await observer.observe(service, pods)          # p2 fails, p3 times out
            assert asyncio.get_running_loop().time() - started < 2.5
            assert [s.pod for s in second] == ["p0", "p1"]
            assert servers.hits == {ports[0]: 1, ports[1]: 1, ports[2]: 1, ports[3]: 1}
            await observer.observe(service, pods)                   # retried; p0, p1 from memory
            assert servers.hits[ports[0]] == 1 and servers.hits[ports[2]] == 2
            restarted = engine_pods([pod("p0", port=ports[0], restarts=1)], SERVE_ARGS)
            assert [s.pod for s in await observer.observe(service, restarted)] == ["p0"]
            assert servers.hits[ports[0]] == 2                      # a new process is read again
            observer.forget(service)
            await observer.observe(service, restarted)
            assert servers.hits[ports[0]] == 3
        finally:
            await observer.close()
            await servers.close()
    asyncio.run(scenario())
    assert "engine broken" in caplog.text or "500" in caplog.text


def test_reading_through_the_api_servers_pod_proxy(tmp_path, monkeypatch):
    """``KVPILOT_ENGINE_METRICS=apiserver``: for an operator the pods' network is closed to;
    the chart grants ``get pods/proxy`` exactly in that mode."""
    with EmulatorThread() as emu:
        monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(emu.kubeconfig("ns"), tmp_path)))

        async def scenario() -> list:
            servers = MetricsServers()
            port = await servers.start(exposition(56))
            body = pod("p0", port=port)

            def create(e):
                pods = e.types[("", "v1", "pods")]
                e._store_create(pods, "ns", copy.deepcopy(body))
                e._write(pods, "ns", "p0", "status", "PATCH", "application/merge-patch+json",
                         {"status": body["status"]})
            emu.run(create)
            api = await KubeApi.connect()
            observer = EngineObserver(ApiServerReader(api))
            try:
                stored = (await api.request("GET", "/api/v1/namespaces/ns/pods"))["items"]
                return await observer.observe(("ns", "chat"), engine_pods([pod_summary(p) for p in stored],
                                                                          SERVE_ARGS))
            finally:
                await observer.close()
                await api.close()
                await servers.close()
        (sample,) = asyncio.run(scenario())
        assert (sample.pod, sample.cache.num_gpu_blocks) == ("p0", 56)
        calls = [call for call in emu.emulator.calls if call.subresource == "proxy"]
        assert [(call.verb, call.resource, call.name.split(":")[0]) for call in calls] == [("get", "pods", "p0")]
        values = tmp_path / "values.yaml"
        values.write_text("operator:\n  engineMetrics: apiserver\n")
        assert_chart_grants(emu.emulator.calls, [values])
        docs = render([CHART / "ci" / "cluster-rbac-values.yaml"])
        assert [call_key(call) for call in ungranted(operator_calls(calls), grants(docs, "kvpilot", "kvpilot"))] \
            == [("get", "", "pods/proxy")]  # not granted in the default mode (pod)


def test_an_endless_metrics_page_is_cut_off_not_buffered(caplog):
    """A pod that answers /metrics with an endless stream (or a huge declared length, or a
    gzip bomb) costs the operator at most MAX_METRICS_BYTES and one failed read."""
    import gzip

    caplog.set_level(logging.INFO, logger="kvpilot.operator.engine_observer")
    sent = {"endless": 0}

    async def endless(request):
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request)
        line = b"# HELP x y\n" * 4096
        while sent["endless"] < 64 * MAX_METRICS_BYTES:
            await response.write(line)
            sent["endless"] += len(line)
        return response

    async def declared(request):
        return aiohttp.web.Response(body=b"x" * (MAX_METRICS_BYTES + 1), content_type="text/plain")

    bomb = gzip.compress(b"#" * (8 * MAX_METRICS_BYTES))

    async def gzipped(request):
        return aiohttp.web.Response(body=bomb, headers={"Content-Encoding": "gzip", "Content-Type": "text/plain"})

    async def scenario():
        runners, ports = [], {}
        for kind, handler in (("endless", endless), ("declared", declared), ("gzip", gzipped)):
            app = aiohttp.web.Application()
            app.router.add_get("/metrics", handler)
            runner = aiohttp.web.AppRunner(app)
            await runner.setup()
            site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            runners.append(runner)
            ports[kind] = site._server.sockets[0].getsockname()[1]
        reader = DirectReader()
        try:
            for kind, port in ports.items():
                (target,) = engine_pods([pod(kind, port=port)], SERVE_ARGS)
                with pytest.raises(MetricsTooLarge):
                    await reader(target)
            observer = EngineObserver(reader, timeout=5)
            pods = engine_pods([pod("p0", port=ports["endless"])], SERVE_ARGS)
            assert await observer.observe(("ns", "chat"), pods) == []   # only a failed read
        finally:
            await reader.close()
            for runner in runners:
                await runner.cleanup()
    asyncio.run(scenario())
    assert sent["endless"] < 8 * MAX_METRICS_BYTES   # the stream was cut off, not drained
    assert "not read" in caplog.text


class FlakyEngine:
    """An engine's /metrics on loopback (the engine's own exposition) that fails its first read."""

    def __init__(self, page: str) -> None:
        self.hits = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                outer.hits += 1
                code, body = (500, b"warming up") if outer.hits == 1 else (200, page.encode())
                self.send_response(code)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_the_operator_reads_a_new_pod_soon_even_when_the_first_read_fails(tmp_path):
    """With the safety-net resync 10 minutes away, a ready pod is read when it appears and a
    failed read is tried again within seconds; the failure never disturbs the pass."""
    spec = {"model": {"uri": "hf://Qwen/Qwen3-0.6B"}, "gpu": {"type": "l4"},
            "slo": {"maxContext": 8192, "p95PromptTokens": 2048, "p95OutputTokens": 512, "concurrency": 8}}
    with EmulatorThread([crd_schema.load_crd()]) as emu:
        kubeconfig = write_kubeconfig(emu.kubeconfig("ns"), tmp_path)
        kubectl = Kubectl(kubeconfig, tmp_path, "ns")
        with OperatorProcess(kubeconfig, tmp_path / "operator.log", env={"KVPILOT_RESYNC_SECONDS": "600"}) as op:
            plan = outcome_plan(spec)
            engine = FlakyEngine(exposition(plan["numGpuBlocks"]))
            try:
                kubectl("apply", "--validate=false", "-f", "-", stdin=json.dumps(
                    {"apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": "chat", "namespace": "ns"},
                     "spec": {**spec, "port": engine.port}}))
                deployment = wait_for(lambda: emu.run(lambda e: copy.deepcopy(
                    e.objects.get(("apps", "deployments", "ns", "chat")))), what="the Deployment")
                template = deployment["spec"]["template"]
                ready = {"phase": "Running", "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}],
                         "containerStatuses": [{"name": c.ENGINE_CONTAINER, "restartCount": 0}]}

                def create(e):
                    pods = e.types[("", "v1", "pods")]
                    e._store_create(pods, "ns", {"metadata": {"name": "chat-1", "labels": template["metadata"]["labels"]},
                                                 "spec": template["spec"]})
                    e._write(pods, "ns", "chat-1", "status", "PATCH", "application/merge-patch+json", {"status": ready})
                started = time.monotonic()
                emu.run(create)

                def observed():  # the status is written after the children: absent at first
                    status = emu.run(lambda e: copy.deepcopy(e.objects[(c.GROUP, c.PLURAL, "ns", "chat")]))
                    status = status.get("status") or {}
                    return status.get("observed") and status
                status = wait_for(observed, 30, 0.2, "status.observed")
                assert time.monotonic() - started < 15 and engine.hits == 2   # failed once, then read
                assert status["observed"]["numGpuBlocks"] == plan["numGpuBlocks"]
                conditions = {cd["type"]: cd for cd in status["conditions"]}
                assert conditions["SizingDrift"]["status"] == "False"
                assert conditions["Planned"]["status"] == "True" and conditions["Degraded"]["status"] == "False"
                assert "reading the KV cache figures of engine pod ns/chat-1 failed" in op.log()
            finally:
                engine.close()
        assert "Traceback" not in op.log()
