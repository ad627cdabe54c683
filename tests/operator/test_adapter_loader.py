"""The operator's adapter loader against real ``kvpilot serve`` engines: three adapters reach
Ready on every ready pod, an over-rank one ends Failed with the engine's reason after its
retries while the others stay Ready, a restarted pod started with the verified adapters
(``resources.adapters.lora_args``) serves all three before it is ready, and an adapter
removed from the spec is unloaded everywhere."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvpilot.engine.bench.server_process import launch_server
from kvpilot.operator.adapter_loader import (
    FAILED,
    READY,
    AdapterLoader,
    AdapterTarget,
    HttpAdapterClient,
    LoaderPolicy,
    ready_total,
)
from kvpilot.operator.engine_observer import EnginePod
from kvpilot.operator.resources.adapters import lora_args
from kvpilot.operator.spec import parse_spec

from support.lora_adapters import build_adapter
from support.tiny_checkpoints import build_checkpoint

pytestmark = pytest.mark.slow
SERVICE = ("serving", "qwen")
GOOD = {"sql": 8, "chat": 16, "legal": 8}
SPEC = {"model": {"uri": "hf://Qwen/Qwen3-0.6B"}, "gpu": {"type": "l4"},
        "slo": {"maxContext": 8192, "p95PromptTokens": 2048, "p95OutputTokens": 512, "concurrency": 8},
        "adapters": [{"name": n, "source": f"pvc://lora/{n}", "rank": r} for n, r in GOOD.items()]
        + [{"name": "wide", "source": "pvc://lora/wide"}]}


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Counting(HttpAdapterClient):
    def __init__(self) -> None:
        super().__init__()
        self.loads: list[tuple[str, str]] = []

    async def load(self, pod, name, path):
        self.loads.append((pod.name, name))
        await super().load(pod, name, path)


def _pod(name: str, server) -> EnginePod:
    host, port = server.base_url.removeprefix("http://").rsplit(":", 1)
    return EnginePod("serving", name, f"uid-{name}", host, int(port), 0)


def _served(server) -> set[str]:
    data = httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"]
    return {m["id"] for m in data if m.get("parent")}


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("adapter-loader")
    base = build_checkpoint(tmp / "base", "qwen3")
    paths = {n: str(build_adapter(base, tmp / n, r, seed=300 + i)) for i, (n, r) in enumerate(GOOD.items())}
    paths["wide"] = str(build_adapter(base, tmp / "wide", 32, seed=399))   # above --max-lora-rank 16
    return base, paths, tmp


def _serve(base, tmp, name, extra=()):
    spec = parse_spec(SPEC, "qwen")
    flags = ["--model", str(base), "--dtype", "float32", "--served-model-name", "qwen", "--max-model-len", "256",
             "--num-gpu-blocks-override", "256", "--uvicorn-log-level", "warning", "--log-stats-interval", "0",
             *lora_args(spec, {}, frozenset()), *extra]
    return launch_server(flags, log_path=tmp / f"{name}.log", timeout=300)


def test_adapters_ready_failed_reloaded_and_unloaded(case):
    base, paths, tmp = case
    spec = parse_spec(SPEC, "qwen")
    assert (spec.lora.max_loras, spec.lora.max_lora_rank) == (4, 16)
    targets = [AdapterTarget(a.name, paths[a.name]) for a in spec.adapters]
    clock, client = _Clock(), _Counting()
    loader = AdapterLoader(client, LoaderPolicy(max_attempts=3, base_backoff_s=1.0, max_backoff_s=4.0), clock)
    first = _serve(base, tmp, "pod-a")
    try:
        asyncio.run(_scenario(loader, client, clock, spec, paths, targets, first,
                              lambda modules: _serve(base, tmp, "pod-b", modules)))
    finally:
        first.stop()
        for server in _started:
            server.stop()


_started: list = []


async def _scenario(loader, client, clock, spec, paths, targets, first, serve_second):
    """One event loop, as in the operator (the client's HTTP session belongs to it)."""
    pod_a = _pod("pod-a", first)

    async def passes(pods, targets, n):
        out = None
        for _ in range(n):
            out = await loader.sync(SERVICE, targets, pods)
            clock.now += 5.0   # past every backoff
        return out

    try:
        status = await passes([pod_a], targets, 4)
        by_name = {s.name: s for s in status}
        assert {n: by_name[n].phase for n in GOOD} == {n: READY for n in GOOD}
        wide = by_name["wide"]
        assert wide.phase == FAILED and wide.attempts == 3
        assert "rank" in wide.reason and "refused 3 times" in wide.reason, wide.reason
        assert ready_total(status) == "3/4"
        assert _served(first) == set(GOOD)
        assert client.loads.count(("pod-a", "wide")) == 3   # bounded: no fourth try

        # A pod (re)started with the verified adapters on its command line serves them
        # before it is ready: launch_server returns once /health answers.
        verified = frozenset(s.name for s in status if s.phase == READY)
        modules = lora_args(spec, paths, verified)
        assert modules[modules.index("--lora-modules") + 1:] == [f"{n}={paths[n]}" for n in GOOD]
        second = serve_second(modules[modules.index("--lora-modules"):])
        _started.append(second)
        assert _served(second) == set(GOOD)
        pod_b = _pod("pod-b", second)
        client.loads.clear()
        status = await passes([pod_a, pod_b], targets, 1)
        assert [s.ready_pods for s in status if s.name in GOOD] == [2, 2, 2]
        assert client.loads == []   # nothing to load on the restarted pod, and Failed stays Failed

        # "chat" leaves the spec: unloaded from every pod, the others stay
        kept = [t for t in targets if t.name != "chat"]
        status = await passes([pod_a, pod_b], kept, 1)
        assert _served(first) == _served(second) == {"sql", "legal"}
        assert [s.phase for s in status] == [READY, READY, FAILED]
    finally:
        await loader.close()
