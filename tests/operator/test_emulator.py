"""The API emulator behaves like an API server where the operator and kubectl rely on it."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from support import crd_schema
from support.harness import EmulatorThread, wait_for
from support.operator_cluster import SMALL

CM = "/api/v1/namespaces/default/configmaps"
DEPLOY = "/apis/apps/v1/namespaces/default/deployments"
KVIS = "/apis/serving.kvpilot.dev/v1alpha1/namespaces/default/inferenceservices"


@pytest.fixture(scope="module")
def emu():
    with EmulatorThread([crd_schema.load_crd()]) as emu:
        yield emu
        assert emu.emulator.failures == []


def call(emu, method, path, body=None, ctype="application/json", stream=False):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(emu.url + path, data=data, method=method, headers={"Content-Type": ctype})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            raw = resp.read().decode()
            return resp.status, ([json.loads(x) for x in raw.splitlines() if x] if stream else json.loads(raw))
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _deployment(name, replicas=1, labels=None, owner_uid=None):
    meta = {"name": name, "labels": labels or {}}
    if owner_uid:
        meta["ownerReferences"] = [{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner_uid}]
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
            "spec": {"replicas": replicas, "selector": {"matchLabels": {"a": "b"}}, "template": {}}}


def test_server_sets_metadata_and_generation_follows_the_spec(emu):
    code, obj = call(emu, "POST", DEPLOY, _deployment("gen"))
    meta = obj["metadata"]
    assert code == 201 and meta["generation"] == 1 and meta["uid"] and meta["creationTimestamp"]
    rv = int(meta["resourceVersion"])
    _, obj = call(emu, "PATCH", f"{DEPLOY}/gen", {"metadata": {"labels": {"x": "1"}}},
                  "application/merge-patch+json")
    assert obj["metadata"]["generation"] == 1 and int(obj["metadata"]["resourceVersion"]) > rv
    _, obj = call(emu, "PATCH", f"{DEPLOY}/gen", {"spec": {"replicas": 4}}, "application/merge-patch+json")
    assert obj["metadata"]["generation"] == 2 and obj["metadata"]["uid"] == meta["uid"]
    same_rv = obj["metadata"]["resourceVersion"]
    _, obj = call(emu, "PATCH", f"{DEPLOY}/gen", {"spec": {"replicas": 4}}, "application/merge-patch+json")
    assert obj["metadata"]["resourceVersion"] == same_rv  # a no-op patch changes nothing


def test_status_subresource_isolation(emu):
    call(emu, "POST", DEPLOY, {**_deployment("iso"), "status": {"readyReplicas": 9}})
    _, obj = call(emu, "GET", f"{DEPLOY}/iso")
    assert "status" not in obj  # dropped on create
    _, obj = call(emu, "PATCH", f"{DEPLOY}/iso", {"spec": {"replicas": 2}, "status": {"readyReplicas": 2}},
                  "application/merge-patch+json")
    assert obj["spec"]["replicas"] == 2 and "status" not in obj
    _, obj = call(emu, "PATCH", f"{DEPLOY}/iso/status", {"spec": {"replicas": 7}, "status": {"readyReplicas": 2}},
                  "application/merge-patch+json")
    assert obj["spec"]["replicas"] == 2 and obj["status"] == {"readyReplicas": 2}
    assert obj["metadata"]["generation"] == 2


def test_json_patch_tests_and_put_preconditions(emu):
    _, obj = call(emu, "POST", CM, {"metadata": {"name": "cm"}, "data": {"k": "v"}})
    stale = obj["metadata"]["resourceVersion"]
    code, _ = call(emu, "PATCH", f"{CM}/cm", [{"op": "test", "path": "/metadata/resourceVersion", "value": "0"},
                                              {"op": "add", "path": "/data/x", "value": "1"}],
                   "application/json-patch+json")
    assert code == 422
    call(emu, "PATCH", f"{CM}/cm", [{"op": "add", "path": "/data/x", "value": "1"}], "application/json-patch+json")
    code, status = call(emu, "PUT", f"{CM}/cm", {"metadata": {"name": "cm", "resourceVersion": stale},
                                                 "data": {}})
    assert code == 409 and status["reason"] == "Conflict"
    code, _ = call(emu, "PATCH", f"{CM}/cm", {}, "application/x-unknown-patch")
    assert code == 415
    code, status = call(emu, "PATCH", f"{CM}/cm", {"apiVersion": "v1", "kind": "ConfigMap"},
                        "application/apply-patch+yaml")
    assert code == 400 and "fieldManager" in status["message"]  # apply names its manager


def test_lists_carry_kind_and_honour_selectors(emu):
    for name, tier in (("sel-a", "gpu"), ("sel-b", "cpu")):
        call(emu, "POST", DEPLOY, _deployment(name, labels={"tier": tier, "sel": "yes"}))
    _, lst = call(emu, "GET", f"{DEPLOY}?labelSelector=sel%3Dyes,tier!%3Dcpu")
    assert (lst["kind"], lst["apiVersion"]) == ("DeploymentList", "apps/v1")
    assert [o["metadata"]["name"] for o in lst["items"]] == ["sel-a"]
    _, lst = call(emu, "GET", f"{DEPLOY}?labelSelector=tier+in+(cpu,tpu)")
    assert [o["metadata"]["name"] for o in lst["items"]] == ["sel-b"]
    _, lst = call(emu, "GET", "/api/v1/namespaces")  # the path kmock mis-parses
    assert {"default", "kube-system"} <= {o["metadata"]["name"] for o in lst["items"]}


def test_watch_resumes_from_a_resource_version_and_times_out(emu):
    _, obj = call(emu, "POST", CM, {"metadata": {"name": "w1"}})
    since = obj["metadata"]["resourceVersion"]
    call(emu, "POST", CM, {"metadata": {"name": "w2"}})
    call(emu, "DELETE", f"{CM}/w1")
    _, events = call(emu, "GET", f"{CM}?watch=true&resourceVersion={since}&timeoutSeconds=1", stream=True)
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "w2"), ("DELETED", "w1")]


def test_garbage_collection_follows_owner_references(emu):
    _, owner = call(emu, "POST", CM, {"metadata": {"name": "owner"}})
    call(emu, "POST", DEPLOY, _deployment("owned", owner_uid=owner["metadata"]["uid"]))
    call(emu, "DELETE", f"{CM}/owner")
    assert call(emu, "GET", f"{DEPLOY}/owned")[0] == 404


def test_scale_subresource_maps_onto_spec_replicas(emu):
    call(emu, "POST", DEPLOY, _deployment("scaled", replicas=2))
    _, scale = call(emu, "GET", f"{DEPLOY}/scaled/scale")
    assert (scale["kind"], scale["spec"]["replicas"]) == ("Scale", 2)
    call(emu, "PATCH", f"{DEPLOY}/scaled/scale", {"spec": {"replicas": 5}}, "application/merge-patch+json")
    assert call(emu, "GET", f"{DEPLOY}/scaled")[1]["spec"]["replicas"] == 5


def test_custom_resources_are_defaulted_pruned_and_validated(emu):
    body = {"apiVersion": "serving.kvpilot.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "adm"},
            "spec": {"model": {"uri": "hf://a/b"}, "gpu": {"type": "l4"}, "bogus": 1,
                     "slo": {"maxContext": 4096, "p95PromptTokens": 1000, "p95OutputTokens": 100,
                             "concurrency": 2}}}
    code, obj = call(emu, "POST", KVIS, body)
    assert code == 201 and "bogus" not in obj["spec"] and obj["spec"]["gpu"]["count"] == 1
    code, status = call(emu, "PATCH", f"{KVIS}/adm", {"spec": {"slo": {"concurrency": 0}}},
                        "application/merge-patch+json")
    assert code == 422 and "concurrency" in status["message"]
    _, obj = call(emu, "PATCH", f"{KVIS}/adm/status", {"status": {"replicas": 1, "junk": True}},
                  "application/merge-patch+json")
    assert obj["status"] == {"replicas": 1}


def _history_kinds(emu, ns: str) -> list[tuple[str, str]]:
    """(plural, event) of the store's log for namespace ``ns``, in order."""
    return emu.run(lambda e: [(entry[1].split("/")[1], entry[2]) for entry in e._log
                              if entry[3]["metadata"].get("namespace") == ns])


def test_namespace_deletion_goes_in_the_real_order(emu):
    """Issue 43: Terminating at once, creates refused, the pods first, then the accounts and
    their roles (the account's token refused from then on), then the rest; an object with a
    finalizer stays Terminating and holds the namespace until the finalizer goes."""
    ns = "doomed"
    call(emu, "POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    base = f"/api/v1/namespaces/{ns}"
    call(emu, "POST", f"{base}/serviceaccounts", {"metadata": {"name": "op"}})
    call(emu, "POST", f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles", {"metadata": {"name": "op"}})
    call(emu, "POST", f"{base}/pods", {"metadata": {"name": "op-0"}, "spec": {"containers": []}})
    kvis = f"/apis/serving.kvpilot.dev/v1alpha1/namespaces/{ns}/inferenceservices"
    code, _ = call(emu, "POST", kvis, {"apiVersion": "serving.kvpilot.dev/v1alpha1", "kind": "InferenceService",
                                       "metadata": {"name": "held", "finalizers": ["example.com/hold"]},
                                       "spec": SMALL})
    assert code == 201
    token = emu.run(lambda e: e.service_account_token(ns, "op"))

    def as_account(path):
        req = urllib.request.Request(emu.url + path, headers={"Authorization": f"Bearer {token}"})
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code

    assert as_account(f"{base}/pods") == 200
    code, obj = call(emu, "DELETE", f"/api/v1/namespaces/{ns}")
    assert code == 200 and obj["status"]["phase"] == "Terminating" and obj["metadata"]["deletionTimestamp"]
    code, refused = call(emu, "POST", f"{base}/configmaps", {"metadata": {"name": "late"}})
    assert (code, refused["reason"]) == (403, "Forbidden")
    assert refused["message"] == ('configmaps "late" is forbidden: unable to create new content in namespace '
                                  'doomed because it is being terminated')
    held = wait_for(lambda: (o := call(emu, "GET", f"{kvis}/held")[1])["metadata"].get("deletionTimestamp") and o,
                    10, what="the InferenceService Terminating")
    assert held["metadata"]["finalizers"] == ["example.com/hold"]
    assert as_account(f"{base}/pods") == 401                  # the account went before the rest
    deleted = [plural for plural, event in _history_kinds(emu, ns) if event == "DELETED"]
    assert deleted[:3] == ["pods", "serviceaccounts", "roles"]
    time.sleep(1)
    assert call(emu, "GET", f"/api/v1/namespaces/{ns}")[0] == 200   # held by the finalizer
    call(emu, "PATCH", f"{kvis}/held", {"metadata": {"finalizers": None}}, "application/merge-patch+json")
    wait_for(lambda: call(emu, "GET", f"/api/v1/namespaces/{ns}")[0] == 404, 10, what="the namespace gone")
