"""The emulator's server-side apply and managed fields behave as the Kubernetes docs say.

Oracles: the behaviour the "Server-Side Apply" documentation describes (conflicts, force,
co-ownership, removal of fields a manager stops applying, associative lists merged by
key, ``/scale`` owning ``spec.replicas``), the real API server's schema (which lists are
associative, with which keys) and the real kubectl, whose ``apply --server-side`` the
emulator must serve.
"""

from __future__ import annotations

import copy
import json
import urllib.error
import urllib.parse
import urllib.request

import pytest
import yaml

from support.harness import EmulatorThread, Kubectl, write_kubeconfig
from support.kube_field_manager import owners

DEPLOY = "/apis/apps/v1/namespaces/default/deployments"
APPLY = "application/apply-patch+yaml"
STRATEGIC = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"


@pytest.fixture(scope="module")
def emu():
    with EmulatorThread() as emu:
        yield emu
        assert emu.emulator.failures == []


def call(emu, method, path, body=None, ctype="application/json", **query):
    url = emu.url + path + (("?" + urllib.parse.urlencode(query)) if query else "")
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None,
                                 method=method, headers={"Content-Type": ctype, "User-Agent": "tests/1.0"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def apply(emu, name, config, manager, force=False):
    return call(emu, "PATCH", f"{DEPLOY}/{name}", config, APPLY, fieldManager=manager,
                force=str(force).lower())


def deployment(name, image="engine:1", env=(("A", "1"),), replicas=None):
    spec = {"selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": {"containers": [
                {"name": "engine", "image": image, "args": ["--port", "8000"],
                 "env": [{"name": k, "value": v} for k, v in env],
                 "ports": [{"containerPort": 8000, "protocol": "TCP", "name": "http"}]}]}}}
    if replicas is not None:
        spec["replicas"] = replicas
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": "default"},
            "spec": spec}


def pod(obj):
    return obj["spec"]["template"]["spec"]


ENGINE = 'k:{"name":"engine"}'


def test_apply_creates_and_records_its_manager(emu):
    code, obj = apply(emu, "created", deployment("created", replicas=2), "kvpilot")
    assert code == 201 and obj["metadata"]["uid"] and obj["spec"]["replicas"] == 2
    (entry,) = obj["metadata"]["managedFields"]
    assert (entry["manager"], entry["operation"], entry["fieldsType"]) == ("kvpilot", "Apply", "FieldsV1")
    engine = entry["fieldsV1"]["f:spec"]["f:template"]["f:spec"]["f:containers"][ENGINE]
    assert set(engine) >= {".", "f:image", "f:args", "f:env", "f:ports"}
    assert 'k:{"containerPort":8000,"protocol":"TCP"}' in engine["f:ports"]   # keyed as the API server keys it
    calls = {(c.verb, c.resource) for c in emu.emulator.calls if c.name == "created"}
    assert calls == {("patch", "deployments"), ("create", "deployments")}  # authorized as both
    code, _ = apply(emu, "created", deployment("other-name"), "kvpilot")
    assert code == 400  # the name in the body must be the one in the path


def test_lists_merge_by_key_and_each_manager_owns_its_items(emu):
    apply(emu, "merged", deployment("merged"), "kvpilot")
    sidecar = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "merged"},
               "spec": {"template": {"spec": {
                   "containers": [{"name": "proxy", "image": "envoy:1"},
                                  {"name": "engine", "env": [{"name": "INJECTED", "value": "yes"}]}],
                   "volumes": [{"name": "certs", "emptyDir": {}}]}}}}
    code, obj = apply(emu, "merged", sidecar, "mesh")
    assert code == 200
    assert [c["name"] for c in pod(obj)["containers"]] == ["engine", "proxy"]
    assert [e["name"] for e in pod(obj)["containers"][0]["env"]] == ["A", "INJECTED"]
    assert pod(obj)["containers"][0]["image"] == "engine:1"   # untouched: only named fields merge
    containers = ("f:spec", "f:template", "f:spec", "f:containers")
    assert owners(obj, *containers, 'k:{"name":"proxy"}') == {"mesh"}
    assert owners(obj, *containers, ENGINE, "f:image") == {"kvpilot"}
    assert owners(obj, *containers, ENGINE, "f:env", 'k:{"name":"INJECTED"}') == {"mesh"}
    # the first manager re-applying its own configuration changes nothing
    _, again = apply(emu, "merged", deployment("merged"), "kvpilot")
    assert again == obj


def test_a_changed_field_another_manager_owns_conflicts_unless_forced(emu):
    apply(emu, "contested", deployment("contested"), "kvpilot")
    code, status = apply(emu, "contested", deployment("contested", image="engine:2"), "someone")
    assert code == 409 and status["reason"] == "Conflict"
    assert 'conflict with "kvpilot"' in status["message"] and 'containers[name="engine"].image' in status["message"]
    code, same = apply(emu, "contested", deployment("contested"), "someone")   # equal values: co-owned
    assert code == 200 and owners(same, "f:spec", "f:template", "f:spec", "f:containers", ENGINE,
                                  "f:image") == {"kvpilot", "someone"}
    code, forced = apply(emu, "contested", deployment("contested", image="engine:2"), "someone", force=True)
    assert code == 200 and pod(forced)["containers"][0]["image"] == "engine:2"
    assert owners(forced, "f:spec", "f:template", "f:spec", "f:containers", ENGINE, "f:image") == {"someone"}


def test_fields_a_manager_stops_applying_are_removed_unless_another_owns_them(emu):
    apply(emu, "removal", deployment("removal", env=(("A", "1"), ("B", "2")), replicas=3), "kvpilot")
    call(emu, "PATCH", f"{DEPLOY}/removal", {"metadata": {"annotations": {"team": "x"}}}, MERGE,
         fieldManager="kubectl-annotate")
    apply(emu, "removal", deployment("removal", env=(("A", "1"), ("B", "2")), replicas=3), "other")
    code, obj = apply(emu, "removal", deployment("removal", env=(("A", "1"),)), "kvpilot")
    assert code == 200
    assert [e["name"] for e in pod(obj)["containers"][0]["env"]] == ["A", "B"]   # "other" owns B too
    assert obj["spec"]["replicas"] == 3 and obj["metadata"]["annotations"] == {"team": "x"}
    code, obj = apply(emu, "removal", {"apiVersion": "apps/v1", "kind": "Deployment",
                                       "metadata": {"name": "removal"}}, "other")
    # now only kvpilot's own configuration is left: B and the replica count go (a default
    # comes back), the annotation another manager owns stays
    assert [e["name"] for e in pod(obj)["containers"][0]["env"]] == ["A"]
    assert obj["spec"]["replicas"] == 1 and obj["metadata"]["annotations"] == {"team": "x"}


def test_other_writes_take_ownership_of_what_they_change(emu):
    apply(emu, "updated", deployment("updated", replicas=2), "kvpilot")
    code, obj = call(emu, "PATCH", f"{DEPLOY}/updated", {"spec": {"template": {"spec": {"containers": [
        {"name": "engine", "args": ["--port", "9000"]}]}}}}, STRATEGIC, fieldManager="kubectl-patch")
    assert code == 200 and pod(obj)["containers"][0]["args"] == ["--port", "9000"]
    assert pod(obj)["containers"][0]["image"] == "engine:1"   # strategic merge: by name, not replaced
    args = ("f:spec", "f:template", "f:spec", "f:containers", ENGINE, "f:args")
    assert owners(obj, *args) == {"kubectl-patch"}
    code, _ = apply(emu, "updated", deployment("updated", replicas=2), "kvpilot")
    assert code == 409   # the args are kubectl-patch's now
    _, scaled = call(emu, "PATCH", f"{DEPLOY}/updated/scale", {"spec": {"replicas": 5}}, MERGE,
                     fieldManager="hpa")
    obj = call(emu, "GET", f"{DEPLOY}/updated")[1]
    assert obj["spec"]["replicas"] == 5 and owners(obj, "f:spec", "f:replicas") == {"hpa"}
    (entry,) = [e for e in obj["metadata"]["managedFields"] if e["manager"] == "hpa"]
    assert (entry["operation"], entry["subresource"]) == ("Update", "scale")
    # without a fieldManager parameter the manager is the User-Agent's product
    _, obj = call(emu, "PATCH", f"{DEPLOY}/updated", {"metadata": {"labels": {"x": "1"}}}, MERGE)
    assert owners(obj, "f:metadata", "f:labels", "f:x") == {"tests"}


def test_strategic_merge_deletes_an_item_by_key(emu):
    apply(emu, "smp", deployment("smp", env=(("A", "1"), ("B", "2"))), "kvpilot")
    code, obj = call(emu, "PATCH", f"{DEPLOY}/smp", {"spec": {"template": {"spec": {"containers": [
        {"name": "engine", "env": [{"name": "A", "$patch": "delete"}]}]}}}}, STRATEGIC)
    assert code == 200 and pod(obj)["containers"][0]["env"] == [{"name": "B", "value": "2"}]
    code, status = apply(emu, "smp", {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "smp"},
                                      "spec": {"template": {"spec": {"containers": [{"image": "x"}]}}}}, "bad")
    assert code == 422 and "omits key field 'name'" in status["message"]


def test_real_kubectl_applies_server_side(emu, tmp_path):
    kubectl = Kubectl(write_kubeconfig(emu.kubeconfig(), tmp_path), tmp_path, "default")
    manifest = yaml.safe_dump(deployment("kubectl-ssa"))
    assert "serverside-applied" in kubectl("apply", "--server-side", "--validate=false", "-f", "-",
                                           stdin=manifest).stdout
    changed = copy.deepcopy(deployment("kubectl-ssa", image="engine:9"))
    result = kubectl("apply", "--server-side", "--validate=false", "--field-manager=other", "-f", "-",
                     stdin=yaml.safe_dump(changed), check=False)
    assert result.returncode != 0 and 'conflict with "kubectl"' in result.stderr
    kubectl("apply", "--server-side", "--force-conflicts", "--validate=false", "--field-manager=other",
            "-f", "-", stdin=yaml.safe_dump(changed))
    obj = json.loads(kubectl("get", "deployment", "kubectl-ssa", "-o", "json", "--show-managed-fields").stdout)
    assert pod(obj)["containers"][0]["image"] == "engine:9"
    assert {(e["manager"], e["operation"]) for e in obj["metadata"]["managedFields"]} == \
        {("kubectl", "Apply"), ("other", "Apply")}
