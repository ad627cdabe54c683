"""A release of charts/kvpilot in the API emulator, as ``helm install`` leaves it.

``install(emu, release, namespace, sets)`` renders the chart with the real ``helm`` (what
``helm install`` would send), creates the release namespace, and stores every rendered
object of a kind the emulator serves: the CRDs, the operator's ServiceAccount, Role and
RoleBinding in each watched namespace, its Deployment, Service, PodDisruptionBudget,
peering objects, ConfigMaps. Kinds the emulator does not serve are left out and listed
(``Release.skipped``: ClusterRoles and their bindings, the ValidatingAdmissionPolicy: the
emulator models no authorization or admission). The operator's pod is stored as its
ReplicaSet would make it, and ``Release.operator`` is the real ``kvpilot operator``
process with the container's arguments and environment, authenticated with a token of the
chart's ServiceAccount (refused with 401 once that account is deleted, as a real API
server refuses it).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from support.chart import operator_container, operator_env, render
from support.harness import EmulatorThread, Kubectl, OperatorProcess, free_port, write_kubeconfig


@dataclass
class Release:
    """What ``install`` stored, and how to run the operator as the chart runs it."""

    emu: EmulatorThread
    name: str
    namespace: str
    docs: list[dict]
    kubectl: Kubectl                         # the cluster admin's (default namespace "default")
    operator: OperatorProcess
    skipped: list[str] = field(default_factory=list)

    @property
    def watched(self) -> list[str]:
        return [arg.split("=", 1)[1] for arg in operator_container(self.docs)["args"]
                if arg.startswith("--namespace=")]


def _serves(emu: EmulatorThread, doc: dict) -> bool:
    api_version, kind = doc["apiVersion"], doc["kind"]
    return emu.run(lambda e: any(t.api_version == api_version and t.kind == kind for t in e.types.values()))


def _store(emu: EmulatorThread, doc: dict) -> None:
    def create(e):
        rtype = next(t for t in e.types.values() if (t.api_version, t.kind) == (doc["apiVersion"], doc["kind"]))
        ns = doc["metadata"].get("namespace") if rtype.namespaced else None
        if e._key(rtype, ns, doc["metadata"]["name"]) not in e.objects:
            e._store_create(rtype, ns, copy.deepcopy(doc))
    emu.run(create)


def install(emu: EmulatorThread, tmp: Path, release: str = "kvpilot", namespace: str = "kvpilot",
            sets: tuple[str, ...] = (), resync_seconds: float = 1.0) -> Release:
    """``helm install RELEASE charts/kvpilot -n NAMESPACE --create-namespace --set SETS...``
    against the emulator (the operator is not started: ``Release.operator.start()``)."""
    docs = render(sets=sets, release=release, namespace=namespace)
    admin = write_kubeconfig(emu.kubeconfig(), tmp)
    _store(emu, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    crds = [d for d in docs if d["kind"] == "CustomResourceDefinition"]
    skipped = []
    for doc in crds + [d for d in docs if d["kind"] != "CustomResourceDefinition"]:
        if _serves(emu, doc):
            _store(emu, doc)
        else:
            skipped.append(f"{doc['kind']} {doc['metadata']['name']}")
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    template = deployment["spec"]["template"]
    account = template["spec"]["serviceAccountName"]
    _store(emu, {"apiVersion": "v1", "kind": "Pod",
                 "metadata": {"name": f"{deployment['metadata']['name']}-7c9f8-x1", "namespace": namespace,
                              "labels": template["metadata"]["labels"]},
                 "spec": template["spec"]})
    token = emu.run(lambda e: e.service_account_token(namespace, account))
    as_operator = tmp / "operator-kubeconfig"
    as_operator.mkdir(exist_ok=True)
    kubeconfig = write_kubeconfig(emu.kubeconfig(namespace, token=token), as_operator)
    env = {**operator_env(docs), "KVPILOT_RESYNC_SECONDS": str(resync_seconds), "KVPILOT_LOG_LEVEL": "DEBUG",
           "KVPILOT_METRICS_PORT": str(free_port())}
    env.pop("KVPILOT_LIVENESS_ENDPOINT")  # the harness picks a free port
    operator = OperatorProcess(kubeconfig, tmp / "operator.log", env=env,
                               args=tuple(operator_container(docs)["args"]))
    return Release(emu, release, namespace, docs, Kubectl(admin, tmp), operator, skipped)


def example(name: str) -> dict:
    """``crds/examples/NAME.yaml``."""
    return yaml.safe_load((Path(__file__).resolve().parents[2] / "crds" / "examples" / f"{name}.yaml").read_text())
