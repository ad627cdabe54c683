"""What the operator applies and when it needs to: the live object as the API server keeps it.

Oracles: the real API server's schema (which of the lists and maps the operator writes are
associative or atomic, and by which keys: the 1.33 OpenAPI that kubernetes-validate
ships) and the emulator's server-side apply (``kube_field_manager``, itself checked
against the Kubernetes documentation and kubectl in test_emulator_apply.py), which makes
the live objects, managed fields included.
"""

from __future__ import annotations

import copy

import pytest

from kvpilot.operator import constants as c
from kvpilot.operator.resources import Child
from kvpilot.operator.server_side_apply import (
    BUILTIN_KINDS,
    LIST_KEYS,
    applied_config,
    atomic_map,
    holds,
    owns,
)

from support import kube_field_manager as fm
from support.built import SMALL, build

RICH = {**SMALL, "replicas": 2,
        "env": [{"name": "FROM_FIELD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "FROM_SECRET", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
        "nodeSelector": {"pool": "gpu"}, "tolerations": [{"key": "spot", "operator": "Exists"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}},
            "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 1, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                                  "labelSelector": {"matchLabels": {"a": "b"}}}}]}},
        "apiKeySecretRef": {"name": "key"},
        "offload": {"enabled": True, "cpuGiB": 4, "disk": {"sizeGiB": 20}}}
AUTOSCALED = {**SMALL, "autoscaling": {"mode": "hpa", "minReplicas": 2, "maxReplicas": 4}}


def _shape(child: Child) -> fm.Shape:
    group, _, version = child.kind.api_version.rpartition("/")
    return fm.Shape.builtin(group, version, child.kind.kind)


def _walk(value, shape: fm.Shape, at=()):
    """(path, value, the server's shape) of every map and list in ``value``, not looking
    inside atomic lists (set and compared whole)."""
    if isinstance(value, dict):
        yield at, value, shape
        for k, v in value.items():
            yield from _walk(v, shape.field(k), (*at, k))
    elif isinstance(value, list):
        yield at, value, shape
        if shape.list_type == "map":
            for item in value:
                yield from _walk(item, shape.item(), (*at, "*"))


@pytest.mark.parametrize("spec", [RICH, AUTOSCALED], ids=["rich", "autoscaled"])
def test_the_operators_list_and_map_types_are_the_api_servers(spec):
    """Every list and map in every built-in child the builders make is merged by the
    operator's tables as the API server's schema says it is."""
    checked = 0
    for child in build(spec, podmonitor_api=True):
        if child.kind.kind not in BUILTIN_KINDS:
            continue
        for at, value, shape in _walk(child.body, _shape(child)):
            if isinstance(value, list):
                server = shape.keys if shape.list_type == "map" else None
                ours = LIST_KEYS.get(child.kind.kind, {}).get(at) or (
                    ("uid",) if at == ("metadata", "ownerReferences") else None)
                assert ours == server, (child.kind.kind, at)
            elif at and shape.atomic_map != atomic_map(child.kind.kind, at):
                pytest.fail(f"{child.kind.kind} {'.'.join(at)}: the server's map is "
                            f"{'atomic' if shape.atomic_map else 'granular'}")
            checked += 1
    assert checked > 40


def test_every_associative_list_in_the_table_is_one_on_the_server():
    deployment = fm.Shape.builtin("apps", "v1", "Deployment")
    service = fm.Shape.builtin("", "v1", "Service")
    for kind, shape in (("Deployment", deployment), ("Service", service)):
        for path, keys in LIST_KEYS[kind].items():
            node = shape
            for part in path:
                node = node.item() if part == "*" else node.field(part)
            assert (node.list_type, node.keys) == ("map", keys), (kind, path)


def _server(child: Child, config: dict, live: dict | None = None, manager: str = c.FIELD_MANAGER,
            force: bool = True) -> dict:
    """The object after ``manager`` applies ``config`` (identity fields set as the server does)."""
    obj = fm.apply(live, config, _shape(child), manager, force, child.kind.api_version, True)
    obj.update(apiVersion=config["apiVersion"], kind=config["kind"])
    obj["metadata"].update(name=config["metadata"]["name"], namespace=config["metadata"]["namespace"])
    return obj


def _update(child: Child, live: dict, change, manager: str) -> dict:
    new = copy.deepcopy(live)
    change(new)
    fm.record_update(live, new, _shape(child), manager, child.kind.api_version, True)
    return new


def _engine(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]["containers"][0]


def test_other_writers_additions_are_not_drift_but_changes_to_the_operators_fields_are():
    (child,) = [ch for ch in build(RICH) if ch.kind.kind == "Deployment"]
    live = _server(child, applied_config(child, None))
    assert holds(live, applied_config(child, live), "Deployment")
    injected = fm.strategic_merge(live, {"metadata": {"annotations": {"mesh/injected": "true"}}, "spec": {
        "template": {"spec": {"containers": [{"name": "proxy", "image": "envoy"},
                                             {"name": c.ENGINE_CONTAINER, "env": [{"name": "TOKEN", "value": "t"}],
                                              "volumeMounts": [{"name": "certs", "mountPath": "/certs"}]}],
                              "volumes": [{"name": "certs", "emptyDir": {}}]}}}}, _shape(child))
    fm.record_update(live, injected, _shape(child), "injector", "apps/v1", True)
    assert holds(injected, applied_config(child, injected), "Deployment")
    for what, change in [("image", lambda o: _engine(o).update(image="other:1")),
                         ("args", lambda o: _engine(o)["args"].append("--enforce-eager")),
                         ("resources", lambda o: _engine(o)["resources"]["limits"].update({"nvidia.com/gpu": 2})),
                         ("nodeSelector", lambda o: o["spec"]["template"]["spec"]["nodeSelector"].update(x="y")),
                         ("label", lambda o: o["metadata"]["labels"].pop(c.LABEL_MANAGED_BY))]:
        changed = _update(child, injected, change, "kubectl-edit")
        assert not holds(changed, applied_config(child, changed), "Deployment"), what
        repaired = _server(child, applied_config(child, changed), changed)
        assert holds(repaired, applied_config(child, repaired), "Deployment"), what
        assert [x["name"] for x in repaired["spec"]["template"]["spec"]["containers"]] == [c.ENGINE_CONTAINER, "proxy"]
        assert {e["name"] for e in _engine(repaired)["env"]} >= {"TOKEN", "FROM_SECRET"}


def test_a_field_the_operator_no_longer_sets_needs_an_apply():
    (child,) = [ch for ch in build(RICH) if ch.kind.kind == "Deployment"]
    live = _server(child, applied_config(child, None))
    fewer = copy.deepcopy(child.body)
    _engine(fewer)["env"] = [e for e in _engine(fewer)["env"] if e["name"] != "FROM_FIELD"]
    smaller = Child(child.kind, fewer)
    assert not holds(live, applied_config(smaller, live), "Deployment")   # still owned: remove it
    after = _server(smaller, applied_config(smaller, live), live)
    assert "FROM_FIELD" not in {e["name"] for e in _engine(after)["env"]}
    assert holds(after, applied_config(smaller, after), "Deployment")


def test_a_create_only_count_is_kept_while_owned_and_left_once_the_autoscaler_has_it():
    (child,) = [ch for ch in build(AUTOSCALED) if ch.kind.kind == "Deployment"]
    assert child.create_only == ("spec.replicas",)
    planned = child.body["spec"]["replicas"]
    live = _server(child, applied_config(child, None))
    assert live["spec"]["replicas"] == planned and owns(live, "spec.replicas")
    # the planner would now ask for another count: while the operator owns the field, it
    # re-applies the live value (omitting it would remove it: the server defaults 1)
    replanned = copy.deepcopy(child.body)
    replanned["spec"]["replicas"] = planned + 5
    again = Child(child.kind, replanned, child.create_only)
    assert applied_config(again, live)["spec"]["replicas"] == planned
    assert holds(live, applied_config(again, live), "Deployment")
    scaled = _update(child, live, lambda o: o["spec"].update(replicas=7), "horizontal-pod-autoscaler")
    assert not owns(scaled, "spec.replicas")
    config = applied_config(again, scaled)
    assert "replicas" not in config["spec"] and holds(scaled, config, "Deployment")
    assert _server(again, config, scaled)["spec"]["replicas"] == 7


def test_an_object_the_operator_never_applied_is_taken_over():
    (child,) = [ch for ch in build(SMALL) if ch.kind.kind == "Service"]
    created = copy.deepcopy(child.body)
    fm.record_update(None, created, _shape(child), "someone", "v1", True)
    assert not holds(created, applied_config(child, created), "Service")
