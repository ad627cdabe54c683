"""Two operator replicas with kopf peering: exactly one reconciles, and when it stops the
other takes over within a bounded, measured time.

Two real ``kvpilot operator`` processes share one ClusterKopfPeering (the CRDs are the
ones the Helm chart ships) on the API emulator. Which replica reconciled is read from each
process's own log and from its ``/metrics`` (a standby's counters stay at zero).
"""

from __future__ import annotations

import re
import time
import urllib.request

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.operator import constants as c

from support import crd_schema
from support.harness import (
    EmulatorThread,
    Kubectl,
    OperatorProcess,
    free_port,
    wait_for,
    write_kubeconfig,
)

pytestmark = pytest.mark.slow
NS = "team-a"
PEERING = "kvpilot"
LIFETIME = 3  # seconds a keep-alive stays valid: the bound on a takeover after a crash
SMALL = {"model": {"uri": "hf://Qwen/Qwen3-0.6B"}, "gpu": {"type": "l4"},
         "slo": {"maxContext": 8192, "p95PromptTokens": 2048, "p95OutputTokens": 512, "concurrency": 8}}
RECONCILED = re.compile(rf"\[{NS}/([\w-]+)\] reconcile pass \d+ done")


class Replica:
    def __init__(self, kubeconfig, log_path) -> None:
        self.metrics_port = free_port()
        self.process = OperatorProcess(kubeconfig, log_path, args=("--all-namespaces", "--peering", PEERING),
                                       env={"KVPILOT_PEERING_LIFETIME": str(LIFETIME),
                                            "KVPILOT_METRICS_PORT": str(self.metrics_port)})

    def reconciled(self) -> set[str]:
        """The services this replica ran reconcile passes for."""
        return set(RECONCILED.findall(self.process.log()))

    def passes(self) -> float:
        """``kvpilot:operator_reconcile_passes_total{result="ok"}`` from its /metrics."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "kvpilot:operator_reconcile_passes_total" and \
                        sample.labels.get("result") == "ok":
                    return sample.value
        raise AssertionError("no kvpilot:operator_reconcile_passes_total in /metrics")


def _planned(emu: EmulatorThread, name: str) -> bool:
    def find(e):
        obj = e.objects.get((c.GROUP, c.PLURAL, NS, name)) or {}
        return any(cd.get("type") == c.PLANNED and cd.get("status") == "True"
                   for cd in (obj.get("status") or {}).get("conditions") or ())
    return emu.run(find)


def _peers(emu: EmulatorThread) -> dict:
    return emu.run(lambda e: dict((e.objects.get(("kopf.dev", "clusterkopfpeerings", None, PEERING)) or {})
                                  .get("status") or {}))


def test_one_replica_reconciles_and_the_other_takes_over(tmp_path):
    peering_crds = list(yaml.safe_load_all((crd_schema.ROOT / "crds" / "kopf.dev_peerings.yaml").read_text()))
    with EmulatorThread([crd_schema.load_crd(), *peering_crds]) as emu:
        kubeconfig = write_kubeconfig(emu.kubeconfig(NS), tmp_path)
        kubectl = Kubectl(kubeconfig, tmp_path, NS)

        def apply(obj: dict) -> None:
            kubectl("apply", "--validate=false", "-f", "-", stdin=yaml.safe_dump(obj))

        def service(name: str) -> float:
            apply({"apiVersion": c.API_VERSION, "kind": c.KIND,
                   "metadata": {"name": name, "namespace": NS}, "spec": SMALL})
            return time.monotonic()

        apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
        apply({"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": PEERING}})
        first, second = Replica(kubeconfig, tmp_path / "a.log"), Replica(kubeconfig, tmp_path / "b.log")
        third = Replica(kubeconfig, tmp_path / "c.log")
        try:
            first.process.start()
            wait_for(lambda: len(_peers(emu)) == 1, 10, 0.05, "the first keep-alive")
            second.process.start()  # started later: a lower priority, so it stands by
            wait_for(lambda: len(_peers(emu)) == 2, 10, 0.05, "both keep-alives")
            service("one")
            wait_for(lambda: _planned(emu, "one"), 20, 0.05, "one planned")
            time.sleep(2.5)  # a few resync periods (1 s): the workers run on the leader only
            assert first.reconciled() == {"one"} and first.passes() >= 3
            assert (second.reconciled(), second.passes()) == (set(), 0)  # it started paused and stayed so

            # a clean stop (rollout, drain): the leader withdraws its keep-alive
            first.process.stop()
            stopped = time.monotonic()
            service("two")
            wait_for(lambda: _planned(emu, "two"), 20, 0.05, "two planned by the standby")
            clean_takeover = time.monotonic() - stopped
            assert second.passes() >= 1 and "Resuming operations after the pause" in second.process.log()

            # a crash: the keep-alive of the leader (now `second`) expires after LIFETIME
            third.process.start()
            wait_for(lambda: len(_peers(emu)) == 2, 10, 0.05, "the new replica's keep-alive")
            second.process.proc.kill()
            second.process.proc.wait(5)
            killed = time.monotonic()
            service("three")
            wait_for(lambda: _planned(emu, "three"), 20, 0.05, "three planned after the crash")
            crash_takeover = time.monotonic() - killed
        finally:
            for replica in (first, second, third):
                replica.process.stop()
        assert emu.emulator.failures == []
    for replica in (first, second, third):
        assert "Traceback" not in replica.process.log(), replica.process.log()[-3000:]
    print(f"\nfailover: takeover after a clean stop {clean_takeover:.2f} s, after a crash "
          f"{crash_takeover:.2f} s (keep-alive lifetime {LIFETIME} s)")
    assert "three" in third.reconciled() and first.reconciled() == {"one"}  # it never saw the others
    assert clean_takeover < 5.0
    assert crash_takeover < LIFETIME + 5.0
