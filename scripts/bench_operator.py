"""Operator at scale: the real ``kvpilot operator`` against the API emulator with many services.

For each service count (default 30 and 300, side by side; ``--services 30,300,1000``):

1. a fresh emulator (tests/support/kube_emulator.py) with the CRD and ``--namespaces``
   namespaces, and the operator process (``KVPILOT_RESYNC_SECONDS=--resync``, INFO logs);
2. all services are created at once; prints the time until every one is planned, has
   its Deployment and Service, and reports its status, and how many services got more
   than one ``Planned`` Event (must be 0);
3. after ``--warmup`` seconds, a ``--window`` of steady state with nothing changing:
   the operator's API requests per minute by verb and resource, its CPU use (share of
   one core) and RSS;
4. drift repair: one service's Deployment is deleted and another's tampered with, and
   the time until the operator has put them back is printed (events, no resync).

Run: ``.venv/bin/python scripts/bench_operator.py [--services 30,300] [--window 60]``
(about 2-3 minutes per count). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))   # the operator tests' helpers: tests/support

from support import crd_schema, traffic  # noqa: E402
from support.harness import EmulatorThread, OperatorProcess, wait_for, write_kubeconfig  # noqa: E402

GROUP, VERSION, PLURAL = "serving.kvpilot.dev", "v1alpha1", "inferenceservices"
SPEC = {"model": {"uri": "hf://Qwen/Qwen3-0.6B"}, "gpu": {"type": "l4"},
        "slo": {"maxContext": 8192, "p95PromptTokens": 2048, "p95OutputTokens": 512, "concurrency": 8}}


@dataclass
class Result:
    services: int
    reconcile_all_s: float
    duplicate_planned: int
    requests_per_min: float
    calls: Counter
    window_s: float
    cpu_share: float
    rss_mib: float
    repair_delete_s: float
    repair_tamper_s: float


def request(url: str, method: str, path: str, body: object | None = None,
            ctype: str = "application/json") -> None:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url + path, data=data, method=method,
                                 headers={"Content-Type": ctype, "User-Agent": "bench"})
    with urllib.request.urlopen(req, timeout=30):
        pass


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def names(count: int, namespaces: int) -> list[tuple[str, str]]:
    return [(f"bench-{i % namespaces}", f"svc-{i:04d}") for i in range(count)]


def reconciled(emu: EmulatorThread, services: list[tuple[str, str]]) -> int:
    """How many services are planned, have their Deployment and Service, and show it in status."""
    def count(e) -> int:
        have = {(k[1], k[2], k[3]) for k in e.objects}
        done = 0
        for ns, name in services:
            cr = e.objects.get((GROUP, PLURAL, ns, name))
            status = (cr or {}).get("status") or {}
            planned = any(c.get("type") == "Planned" and c.get("status") == "True"
                          for c in status.get("conditions") or ())
            done += bool(planned and status.get("observedGeneration") == cr["metadata"]["generation"]
                         and ("deployments", ns, name) in have and ("services", ns, name) in have)
        return done
    return emu.run(count)


def planned_events(emu: EmulatorThread) -> Counter:
    def count(e) -> Counter:
        return Counter((o["involvedObject"].get("namespace"), o["involvedObject"].get("name"))
                       for (g, p, _, _), o in e.objects.items()
                       if p == "events" and g == "" and o.get("reason") == "Planned")
    return emu.run(count)


def repair_seconds(emu: EmulatorThread, ns: str, name: str, tamper: bool) -> float:
    """Delete (or tamper with) a service's Deployment; seconds until the operator restored it."""
    path = f"/apis/apps/v1/namespaces/{ns}/deployments/{name}"
    before = emu.run(lambda e: copy.deepcopy(e.objects[("apps", "deployments", ns, name)]))
    args = before["spec"]["template"]["spec"]["containers"][0]["args"]
    started = time.monotonic()
    if tamper:
        request(emu.url, "PATCH", path, [{"op": "replace", "path": "/spec/template/spec/containers/0/args",
                                          "value": ["tampered"]}], "application/json-patch+json")
    else:
        request(emu.url, "DELETE", path)

    def restored() -> bool:
        obj = emu.run(lambda e: copy.deepcopy(e.objects.get(("apps", "deployments", ns, name))))
        return obj is not None and obj["spec"]["template"]["spec"]["containers"][0]["args"] == args
    wait_for(restored, 60, 0.02, f"{ns}/{name} repaired")
    return time.monotonic() - started


def run_one(count: int, args: argparse.Namespace, workdir: Path) -> Result:
    services = names(count, args.namespaces)
    with EmulatorThread([crd_schema.load_crd()]) as emu:
        for ns in sorted({ns for ns, _ in services}):
            request(emu.url, "POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                "metadata": {"name": ns}})
        kubeconfig = write_kubeconfig(emu.kubeconfig(), workdir)
        env = {"KVPILOT_RESYNC_SECONDS": str(args.resync), "KVPILOT_LOG_LEVEL": "INFO"}
        with OperatorProcess(kubeconfig, workdir / f"operator-{count}.log", env=env) as operator:
            pid = operator.proc.pid
            started = time.monotonic()
            for ns, name in services:
                request(emu.url, "POST", f"/apis/{GROUP}/{VERSION}/namespaces/{ns}/{PLURAL}",
                     {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceService",
                      "metadata": {"name": name, "namespace": ns}, "spec": SPEC})
            wait_for(lambda: reconciled(emu, services) == count, args.timeout, 0.5,
                     f"{count} services reconciled")
            reconcile_all = time.monotonic() - started
            time.sleep(args.warmup)
            mark = len(traffic.requests(emu.emulator))
            cpu0, t0 = cpu_seconds(pid), time.monotonic()
            time.sleep(args.window)
            cpu1, t1 = cpu_seconds(pid), time.monotonic()
            # every request but the benchmark's own (an older operator has other user agents)
            calls = traffic.counts(r for r in traffic.requests(emu.emulator, mark)
                                   if r.headers.get("User-Agent") != "bench")
            rss = rss_mib(pid)
            events = planned_events(emu)
            duplicates = sum(1 for key in services if events.get(key, 0) > 1)
            repair_delete = repair_seconds(emu, *services[0], tamper=False)
            repair_tamper = repair_seconds(emu, *services[-1], tamper=True)
    window = t1 - t0
    return Result(count, reconcile_all, duplicates, sum(calls.values()) * 60 / window, calls, window,
                  (cpu1 - cpu0) / window, rss, repair_delete, repair_tamper)


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--services", default="30,300", help="comma-separated service counts")
    parser.add_argument("--namespaces", type=int, default=4)
    parser.add_argument("--resync", type=float, default=10.0, help="KVPILOT_RESYNC_SECONDS")
    parser.add_argument("--warmup", type=float, default=15.0, help="seconds before the window")
    parser.add_argument("--window", type=float, default=60.0, help="steady-state seconds measured")
    parser.add_argument("--timeout", type=float, default=600.0, help="limit for reconciling all")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-operator-") as tmp:
        for count in (int(n) for n in args.services.split(",")):
            result = run_one(count, args, Path(tmp))
            results.append(result)
            print(f"\n== {count} services in {args.namespaces} namespaces, resync {args.resync:g}s ==")
            print(f"reconcile all: {result.reconcile_all_s:.1f}s; services with a duplicate Planned "
                  f"Event: {result.duplicate_planned}")
            print(f"steady state over {result.window_s:.0f}s: {result.requests_per_min:.1f} requests/min, "
                  f"CPU {100 * result.cpu_share:.1f}% of a core, RSS {result.rss_mib:.0f} MiB")
            print(traffic.table(result.calls, 60 / result.window_s, "/min"))
            print(f"drift repair: deleted Deployment back in {result.repair_delete_s:.2f}s, "
                  f"tampered args restored in {result.repair_tamper_s:.2f}s", flush=True)
    print("\nservices  reconcile-all  requests/min  CPU%   RSS-MiB  dup-Planned  repair(del/tamper)")
    for r in results:
        print(f"{r.services:>8}  {r.reconcile_all_s:>12.1f}s  {r.requests_per_min:>12.1f}  "
              f"{100 * r.cpu_share:>4.1f}  {r.rss_mib:>8.0f}  {r.duplicate_planned:>11}  "
              f"{r.repair_delete_s:.2f}s/{r.repair_tamper_s:.2f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
