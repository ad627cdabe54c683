"""Deleting the release namespace, with InferenceServices in it, as the chart installs them.

Issue 43: with the chart's default layout (the operator watches its own namespace), a real
control plane deleted the operator's pods, then its ServiceAccount and Role; the operator
could no longer authenticate, and the 9 InferenceServices (kopf's finalizer on each) and
the namespace stayed Terminating for good. Here the emulator deletes the namespace in that
order (``support.kube_namespaces``: pods, then ServiceAccounts / Roles / RoleBindings, then
the rest; the operator's token refused with 401 once its account is gone), and the
namespace must be gone within 60 s with the operator running, with it stopped, and for
InferenceServices an older operator left its finalizer on (the new one removes it).
"""

from __future__ import annotations

import time

import pytest

from kvpilot.operator import constants as c

from support import crd_schema
from support.harness import EmulatorThread, wait_for
from support.operator_cluster import SMALL
from support.release import install

pytestmark = pytest.mark.slow
NS = "kvpilot"
SERVICES = [f"svc-{i}" for i in range(9)]
LIMIT = 60.0


def _objects(emu, plural: str) -> dict[str, dict]:
    return emu.run(lambda e: {k[3]: o for k, o in e.objects.items() if k[1] == plural and k[2] == NS})


def _namespace_gone(emu) -> bool:
    return emu.run(lambda e: ("", "namespaces", None, NS) not in e.objects)


def _create_services(release, finalizers: list[str] | None = None) -> None:
    for name in SERVICES:
        meta = {"name": name, "namespace": NS, **({"finalizers": finalizers} if finalizers else {})}
        release.emu.run(lambda e, meta=meta: e._store_create(e.types[(c.GROUP, c.VERSION, c.PLURAL)], NS,
                                                           {"apiVersion": c.API_VERSION, "kind": c.KIND,
                                                            "metadata": meta, "spec": SMALL}))


def _reconciled(release) -> bool:
    services = _objects(release.emu, c.PLURAL)
    deployments = _objects(release.emu, "deployments")
    return len(services) == 9 and all(
        any(cd["type"] == "Planned" and cd["status"] == "True" for cd in (o.get("status") or {}).get("conditions", ()))
        and name in deployments for name, o in services.items())


def _delete_namespace(release) -> float:
    """``kubectl delete namespace``; the seconds until the namespace is gone (or LIMIT + 1)."""
    started = time.monotonic()
    release.kubectl("delete", "namespace", NS, "--wait=false")
    try:
        wait_for(lambda: _namespace_gone(release.emu), LIMIT, 0.1, "the namespace gone")
    except TimeoutError:
        held = {n: o["metadata"].get("finalizers") for n, o in _objects(release.emu, c.PLURAL).items()}
        pytest.fail(f"namespace {NS} still Terminating after {LIMIT:g} s; InferenceServices left: {held}")
    return time.monotonic() - started


def _deletion_order(emu) -> list[str]:
    """The kinds deleted from the namespace, in order, each once."""
    seen: list[str] = []
    for entry in emu.run(lambda e: list(e._log)):
        plural = entry[1].split("/")[1]
        if entry[2] == "DELETED" and entry[3]["metadata"].get("namespace") == NS and plural not in seen:
            seen.append(plural)
    return seen


def test_the_release_namespace_goes_with_the_operator_running(tmp_path):
    with EmulatorThread([crd_schema.load_crd()]) as emu:
        release = install(emu, tmp_path, namespace=NS)
        assert release.watched == [NS]      # the chart's default: the operator's own namespace
        with release.operator:
            _create_services(release)
            wait_for(lambda: _reconciled(release), 60, 0.2, "9 InferenceServices reconciled")
            seconds = _delete_namespace(release)
            print(f"\nrelease namespace with 9 InferenceServices deleted, operator running: {seconds:.1f} s")
        order = _deletion_order(emu)
        assert order.index("pods") < order.index("serviceaccounts") < order.index(c.PLURAL)
        assert seconds < LIMIT
        assert emu.emulator.failures == []


def test_the_release_namespace_goes_with_the_operator_stopped(tmp_path):
    with EmulatorThread([crd_schema.load_crd()]) as emu:
        release = install(emu, tmp_path, namespace=NS)
        with release.operator:
            _create_services(release)
            wait_for(lambda: _reconciled(release), 60, 0.2, "9 InferenceServices reconciled")
        seconds = _delete_namespace(release)
        print(f"\nrelease namespace with 9 InferenceServices deleted, operator stopped: {seconds:.1f} s")
        assert seconds < LIMIT
        assert emu.emulator.failures == []


def test_the_operator_removes_the_finalizer_older_operators_left(tmp_path):
    """InferenceServices an older operator put ``serving.kvpilot.dev/finalizer`` on: this one
    removes it, after which the namespace goes without any operator."""
    with EmulatorThread([crd_schema.load_crd()]) as emu:
        release = install(emu, tmp_path, namespace=NS)
        _create_services(release, finalizers=[c.FINALIZER])
        with release.operator:
            wait_for(lambda: _reconciled(release) and all(
                not o["metadata"].get("finalizers") for o in _objects(emu, c.PLURAL).values()),
                60, 0.2, "9 InferenceServices reconciled, the legacy finalizer removed")
        seconds = _delete_namespace(release)
        print(f"\nrelease namespace deleted after the legacy finalizers were removed: {seconds:.1f} s")
        assert seconds < LIMIT
