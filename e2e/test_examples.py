"""Every example InferenceService, applied with kubectl, is reconciled and listed.

The same test runs against two API servers:

- ``emulator``: the kmock-based emulator on loopback (always; the CRD is applied after
  the operator started, so kopf must discover it at run time);
- ``cluster``: the cluster ``KUBECONFIG`` points at (marked ``k8s``; skipped without
  one). It needs rights to apply the CRD and to create/delete a scratch namespace; the
  operator runs here, restricted to that namespace. Pods will not become ready without
  GPUs and the examples' Secrets/PVCs; the test checks reconciliation, not serving.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from pathlib import Path

import pytest
import yaml

from kvpilot.operator import constants as c
from kvpilot.operator.planner.plan import make_plan
from kvpilot.operator.spec import parse_spec
from kvpilot.operator.spec_to_plan import plan_request

from support import crd_schema
from support.harness import EmulatorThread, Kubectl, OperatorProcess, wait_for, write_kubeconfig

CRD_NAME = f"{c.PLURAL}.{c.GROUP}"
COLUMNS = ["NAME", "MODEL", "GPU", "KV-DTYPE", "MAX-SEQS", "OBSERVED-KV-TOKENS", "P:D", "READY-REPLICAS", "REPLICAS",
           "READY", "ADAPTERS", "AGE"]


@contextlib.contextmanager
def emulator_target(tmp: Path):
    with EmulatorThread() as emu:
        kubeconfig = write_kubeconfig(emu.kubeconfig(), tmp)
        yield kubeconfig, "e2e", 20.0
        assert emu.emulator.failures == []


@contextlib.contextmanager
def cluster_target(tmp: Path):
    kubeconfig = Path(os.environ["KUBECONFIG"].split(os.pathsep)[0])
    namespace = f"kvpilot-e2e-{uuid.uuid4().hex[:6]}"
    try:
        yield kubeconfig, namespace, 120.0
    finally:
        Kubectl(kubeconfig, tmp)("delete", "namespace", namespace, "--wait=false", check=False)


TARGETS = [
    pytest.param(emulator_target, id="emulator", marks=pytest.mark.slow),
    pytest.param(cluster_target, id="cluster", marks=[
        pytest.mark.k8s,
        pytest.mark.skipif(not os.environ.get("KUBECONFIG"),
                           reason="no real cluster: set KUBECONFIG to run the e2e test against one"),
    ]),
]


def _stages(path: Path) -> int:
    """Pipeline stages (nodes) the planner gives one replica of the example at ``path``."""
    obj = yaml.safe_load(path.read_text())
    return make_plan(plan_request(parse_spec(obj["spec"], obj["metadata"]["name"]))).pipeline_parallel_size


def _deployments(path: Path, name: str) -> list[str]:
    """The Deployments the example at ``path`` becomes: one per pool when it is disaggregated."""
    spec = yaml.safe_load(path.read_text())["spec"]
    return [f"{name}-prefill", f"{name}-decode"] if spec.get("disaggregation") else [name]


def _jsonpath(kubectl: Kubectl, name: str, path: str) -> str:
    return kubectl("get", "inferenceservice", name, "-o", f"jsonpath={path}", check=False).stdout


@pytest.mark.parametrize("target", TARGETS)
def test_examples_are_reconciled_and_listed(target, tmp_path):
    examples = {yaml.safe_load(p.read_text())["metadata"]["name"]: p for p in crd_schema.EXAMPLES}
    with target(tmp_path) as (kubeconfig, namespace, timeout):
        admin = Kubectl(kubeconfig, tmp_path)
        kubectl = Kubectl(kubeconfig, tmp_path, namespace)
        admin("apply", "--validate=false", "-f", "-", stdin=yaml.safe_dump({"apiVersion": "v1", "kind": "Namespace",
                                                        "metadata": {"name": namespace}}))
        with OperatorProcess(kubeconfig, tmp_path / "operator.log", args=("--namespace", namespace),
                             env={"KVPILOT_RESYNC_SECONDS": "2"}) as operator:
            admin("apply", "--validate=false", "-f", str(crd_schema.CRD_PATH))
            admin("wait", "--for=condition=established", f"crd/{CRD_NAME}", "--timeout=60s")
            for path in examples.values():
                kubectl("apply", "--validate=false", "-f", str(path))
            for name in examples:
                wait_for(lambda n=name: _jsonpath(kubectl, n, '{.status.conditions[?(@.type=="Planned")]'
                                                              '.status}') == "True",
                         timeout, 0.2, f"{name} Planned=True")
                if _stages(examples[name]) > 1:   # a LeaderWorkerSet, whose API is not installed here
                    wait_for(lambda n=name: _jsonpath(kubectl, n, '{.status.conditions[?(@.type=="Degraded")]'
                                                                  '.reason}') == "MissingAPI",
                             timeout, 0.2, f"{name} Degraded=MissingAPI (no LeaderWorkerSet API)")
                    continue
                wait_for(lambda n=name: kubectl("get", "service", n, check=False).returncode == 0
                         and kubectl("get", "deployment", *_deployments(examples[n], n), check=False).returncode == 0,
                         timeout, 0.2, f"{name}'s Deployments and Service")
            rows = [line.split() for line in kubectl("get", "inferenceservices").stdout.splitlines()]
            assert rows[0] == COLUMNS
            listed = {row[0]: dict(zip(COLUMNS, row, strict=False)) for row in rows[1:]}
            assert set(listed) == set(examples)
            for name, path in examples.items():
                spec = yaml.safe_load(path.read_text())["spec"]
                row = listed[name]
                assert (row["MODEL"], row["GPU"]) == (spec["model"]["uri"], spec["gpu"]["type"])
                if _stages(path) > 1:   # not built without the LeaderWorkerSet API: no plan in status
                    continue
                plan = json.loads(_jsonpath(kubectl, name, "{.status.plan}"))
                assert (row["KV-DTYPE"], row["MAX-SEQS"]) == (plan["kvCacheDtype"], str(plan["maxNumSeqs"]))
            assert listed["llama-long-context"]["KV-DTYPE"].startswith("fp8")
            assert kubectl("get", "hpa", "qwen3-4b-autoscaled", check=False).returncode == 0
            assert kubectl("get", "pvc", "qwen3-8b-offload-kv-disk", check=False).returncode == 0
            for name in examples:
                kubectl("delete", "inferenceservice", name, "--wait=false")
            wait_for(lambda: kubectl("get", "inferenceservices", "-o", "name").stdout.strip() == "",
                     timeout, 0.2, "the InferenceServices deleted")
        assert "Traceback" not in operator.log(), operator.log()[-4000:]
