"""spec.adapters through the real operator process on the emulator: the Deployment's LoRA
flags and adapter fetches, status.adapters / adaptersReady / AdaptersReady while no engine
pod is ready, the printer column, and an adapter removed from the spec leaving the status.
(Loading into real engines, retries, Failed and the reload at a pod's start:
tests/operator/test_adapter_loader.py.)"""

from __future__ import annotations

import copy

from support.harness import wait_for
from support.operator_cluster import SMALL

ADAPTERS = [{"name": "sql", "source": "hf://acme/sql-lora", "rank": 8},
            {"name": "chat", "source": "s3://adapters/chat", "rank": 16},
            {"name": "legal", "source": "pvc://lora-claim/legal"}]


def _spec(adapters):
    spec = copy.deepcopy(SMALL)
    spec["adapters"] = adapters
    return spec


def test_adapters_reach_the_deployment_and_the_status(cluster):
    deployment = cluster.create("lora", _spec(ADAPTERS))["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--max-loras") + 1] == "3" and args[args.index("--max-lora-rank") + 1] == "16"
    assert "--enable-lora" in args and "--allow-runtime-lora-updating" in args
    assert "--lora-modules" not in args            # none verified yet: a bad one would stop start-up
    assert {"adapter-sql", "adapter-chat"} <= {i["name"] for i in pod["initContainers"]}

    cond = cluster.wait_condition("lora", "AdaptersReady", "False")
    assert cond["reason"] == "AdaptersLoading"
    status = cluster.cr("lora")["status"]
    assert status["adaptersReady"] == "0/3"
    assert [(a["name"], a["phase"], a["reason"]) for a in status["adapters"]] == [
        (a["name"], "Pending", "no ready engine pod") for a in ADAPTERS]
    table = cluster.kubectl("get", "inferenceservices", "lora").stdout.splitlines()
    assert "ADAPTERS" in table[0].split() and "0/3" in table[1].split()

    cluster.apply("lora", _spec(ADAPTERS[:2]))
    wait_for(lambda: [a["name"] for a in cluster.cr("lora")["status"].get("adapters") or ()] == ["sql", "chat"],
             20, what="legal gone from status.adapters")
    assert cluster.cr("lora")["status"]["adaptersReady"] == "0/2"
