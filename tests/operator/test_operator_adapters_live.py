"""LoRA adapters through the real operator process on the emulator, into real engines
(issue 29, acceptance 4).

An InferenceService on the demo model names three good adapters and one whose rank (32,
undeclared) is above ``lora.maxLoraRank`` (16), all on one claim (``pvc://lora/NAME``).
The test is the ReplicaSet controller and the kubelet (``support.kubelet``): it runs the
Deployment's engine pod as a real ``kvpilot serve`` process with the claim's volume
mounted where the pod says, and stores the Pod object Ready once ``/health`` answers.

1. The operator loads the adapters into the ready pod (``POST /v1/load_lora_adapter``):
   the three reach Ready (``adaptersReady`` 3/4, the engine's /v1/models lists them), the
   bad one ends Failed with the engine's own reason after the loader's attempts, and the
   three stay Ready; the Deployment's template gains them as ``--lora-modules``.
2. The pod is killed. Once the operator has seen it gone, the replacement is started from
   the Deployment's template as it is then: it carries the three verified adapters and
   lists them on /v1/models the moment it first answers ``/health`` (before its Pod object
   exists, so before it is Ready and before the operator could load anything into it).
   Admitted, it brings the status back to 3 Ready without a single load by the operator.

The figures are printed (``-s``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest

from kvpilot.operator.adapter_loader import FAILED, PENDING, READY, LoaderPolicy
from kvpilot.operator.resources.adapters import CLAIMS_MOUNT

from support import pod_root
from support.harness import free_port, wait_for
from support.kubelet import DEMO_MODEL_IN_IMAGE, Kubelet, engine_container
from support.lora_adapters import build_adapter
from support.operator_cluster import NS, Cluster, running_cluster

pytestmark = pytest.mark.slow
BACKOFF_S = 0.25    # the operator's first wait between loads (KVPILOT_ADAPTER_LOAD_BACKOFF_SECONDS)

NAME, CLAIM = "qwen", "lora"
GOOD = {"sql": 8, "chat": 16, "legal": 8}
BAD, BAD_RANK = "wide", 32          # above maxLoraRank 16 (the largest declared rank)


def _spec(port: int) -> dict:
    return {
        "model": {"uri": DEMO_MODEL_IN_IMAGE, "architecture": "kvpilot-demo"},
        "gpu": {"type": "l4"},
        "slo": {"maxContext": 256, "p95PromptTokens": 128, "p95OutputTokens": 32, "concurrency": 2},
        "engine": {"kvCacheMemoryBytes": 4 << 20, "extraArgs": ["--dtype", "bfloat16"]},
        "port": port,
        "adapters": [{"name": n, "source": f"pvc://{CLAIM}/{n}", "rank": r} for n, r in GOOD.items()]
        + [{"name": BAD, "source": f"pvc://{CLAIM}/{BAD}"}],
    }


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory) -> Iterator[Cluster]:
    """The operator with a short first backoff: the bad adapter's tries wait 0.25 + 0.5 + 1 + 2 s
    instead of the default 2 + 4 + 8 + 16 s."""
    env = {"KVPILOT_ADAPTER_LOAD_BACKOFF_SECONDS": str(BACKOFF_S)}
    with running_cluster(tmp_path_factory.mktemp("operator"), env=env) as cluster:
        yield cluster


@pytest.fixture
def kubelet(cluster, tmp_path, demo_model_dir):
    """The node: the claim's volume (the four adapters, built for the demo model) and the
    engine pods it runs; every pod it started is deleted afterwards."""
    if not pod_root.supported(tmp_path / "probe"):
        pytest.skip("needs mount namespaces (root or user namespaces) to mount the claim where the pod says")
    volume = tmp_path / "claim-lora"
    for i, (name, rank) in enumerate([*GOOD.items(), (BAD, BAD_RANK)]):
        build_adapter(demo_model_dir, volume / name, rank, seed=290 + i)
    node = Kubelet(cluster.emu, NS, demo_model_dir, tmp_path, claims={CLAIM: volume})
    try:
        yield node
    finally:
        for name in list(node.engines):
            node.remove(name)
        node.close()


def _status(cluster) -> dict:
    return (cluster.cr(NAME) or {}).get("status") or {}


def _by_name(cluster) -> dict[str, dict]:
    return {a["name"]: a for a in _status(cluster).get("adapters") or ()}


def _served(kubelet: Kubelet, pod: str) -> set[str]:
    data = httpx.get(f"{kubelet.engines[pod].url}/v1/models", timeout=10).json()["data"]
    return {m["id"] for m in data if m.get("parent")}


def _lora_modules(deployment: dict) -> list[str]:
    """The ``--lora-modules`` values of the Deployment's engine container (none: [])."""
    args = engine_container(deployment["spec"]["template"]["spec"])["args"]
    if "--lora-modules" not in args:
        return []
    rest = args[args.index("--lora-modules") + 1:]
    return rest[:next((i for i, a in enumerate(rest) if a.startswith("--")), len(rest))]


def _start(kubelet: Kubelet, deployment: dict, name: str) -> None:
    template = deployment["spec"]["template"]
    kubelet.start(name, template["spec"], template["metadata"]["labels"])


def test_three_adapters_ready_a_bad_one_failed_and_a_new_pod_serves_them_before_ready(cluster, kubelet):
    figures: dict = {}
    started = time.monotonic()
    deployment = cluster.create(NAME, _spec(free_port()))["Deployment"]
    assert _lora_modules(deployment) == []          # none verified yet: a bad one would stop start-up
    first = f"{NAME}-6d8f7c9b5-aaaaa"
    _start(kubelet, deployment, first)
    kubelet.admit(first)
    ready = time.monotonic()
    figures["first_pod_ready_s"] = round(ready - started, 1)

    # 1. the operator loads them into the ready pod: three Ready, the bad one Failed after its tries
    wait_for(lambda: all(_by_name(cluster).get(n, {}).get("phase") == READY for n in GOOD), 30, 0.2,
             "the three good adapters Ready")
    figures["three_ready_after_pod_ready_s"] = round(time.monotonic() - ready, 1)
    bad = wait_for(lambda: (a := _by_name(cluster).get(BAD)) and a["phase"] == FAILED and a, 90, 0.2,
                   f"{BAD} Failed")
    figures["failed_after_pod_ready_s"] = round(time.monotonic() - ready, 1)
    figures["failed_attempts"], figures["failed_reason"] = bad["attempts"], bad["reason"]
    assert bad["attempts"] == LoaderPolicy().max_attempts > 1
    policy = LoaderPolicy(base_backoff_s=BACKOFF_S)     # the tries waited as the setting says
    assert figures["failed_after_pod_ready_s"] >= sum(policy.backoff(n) for n in range(1, bad["attempts"]))
    assert bad["reason"].startswith(f"refused {bad['attempts']} times: HTTP 400: ")
    assert f"rank {BAD_RANK} exceeds --max-lora-rank 16" in bad["reason"], bad["reason"]   # the engine's words
    assert _served(kubelet, first) == set(GOOD)

    cluster.settle(3)   # and they stay so: Failed is not tried again, the others stay Ready
    status = _status(cluster)
    assert status["adaptersReady"] == "3/4"
    assert [(a["name"], a["phase"], a["readyPods"]) for a in status["adapters"]] == [
        *((n, READY, 1) for n in GOOD), (BAD, FAILED, 0)]
    assert _by_name(cluster)[BAD]["attempts"] == bad["attempts"]
    condition = cluster.condition(NAME, "AdaptersReady")
    assert (condition["status"], condition["reason"]) == ("False", "AdapterFailed")
    assert condition["message"].startswith(f"{BAD}: refused"), condition["message"]
    assert _served(kubelet, first) == set(GOOD)
    good_attempts = {n: _by_name(cluster)[n]["attempts"] for n in GOOD}
    verified = [f"{n}={CLAIMS_MOUNT}/{n}/{n}" for n in GOOD]
    wait_for(lambda: _lora_modules(cluster.children(NAME)["Deployment"]) == verified, 20, 0.2,
             "the verified adapters on the Deployment's command line")

    # 2. the pod is killed; the replacement comes from the template as it is once the
    # operator has seen no ready pod left
    kubelet.remove(first)
    killed = time.monotonic()
    wait_for(lambda: all(_by_name(cluster)[n]["phase"] == PENDING for n in GOOD), 20, 0.2,
             "the operator seeing no ready engine pod")
    cluster.settle(2)
    deployment = cluster.children(NAME)["Deployment"]
    assert _lora_modules(deployment) == verified    # a bad adapter never reaches start-up
    second = f"{NAME}-6d8f7c9b5-bbbbb"
    _start(kubelet, deployment, second)
    kubelet.wait_healthy(second)
    healthy = time.monotonic()
    at_health = _served(kubelet, second)            # its Pod object does not exist yet
    assert cluster.obj("pods", second) is None
    figures["replacement_healthy_after_kill_s"] = round(healthy - killed, 1)
    figures["replacement_serves_at_first_health"] = sorted(at_health)
    assert at_health == set(GOOD)

    kubelet.admit(second)
    admitted = time.monotonic()
    wait_for(lambda: [(a["name"], a["phase"], a["readyPods"]) for a in _status(cluster).get("adapters") or ()]
             == [*((n, READY, 1) for n in GOOD), (BAD, FAILED, 0)], 30, 0.2, "3 Ready on the replacement")
    figures["three_ready_after_replacement_ready_s"] = round(time.monotonic() - admitted, 1)
    cluster.settle(2)
    status = _status(cluster)
    assert status["adaptersReady"] == "3/4"
    # the operator loaded nothing into it, and did not try the Failed one again
    assert {n: _by_name(cluster)[n]["attempts"] for n in GOOD} == good_attempts
    assert _by_name(cluster)[BAD]["attempts"] == bad["attempts"]
    assert _served(kubelet, second) == set(GOOD)
    figures["total_s"] = round(time.monotonic() - started, 1)
    print(json.dumps(figures, indent=2))
