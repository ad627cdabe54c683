"""The operator shares its children with other controllers instead of fighting them.

A second writer adds to an engine Deployment what a service mesh, a secrets agent and a
person add in real clusters: a sidecar container and a volume (a mesh injector, with its
own server-side apply), an env var in the engine container (a secrets agent, a strategic
merge patch) and an annotation (``kubectl annotate``). Over ten resync passes the real
operator process writes nothing to the Deployment and every addition stays; a change to a
field the operator owns (image, args, resources) is repaired by the pass it triggers, and
the additions still stay. The emulator keeps managed fields as the API server does
(test_emulator_apply.py).
"""

from __future__ import annotations

import json
import re
import time

import pytest

from kvpilot.operator import constants as c

from support.harness import wait_for
from support.kube_field_manager import owners
from support.operator_env import JSON_PATCH, SMALL, running

pytestmark = pytest.mark.slow
NS, NAME = "shared", "chat"
APPLY = "application/apply-patch+yaml"
STRATEGIC = "application/strategic-merge-patch+json"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The operator, and a service whose Deployment other writers have added to."""
    with running(tmp_path_factory.mktemp("coexist"), {"KVPILOT_RESYNC_SECONDS": "0.5"}) as env:
        env.namespace(NS)
        env.create(NS, NAME, SMALL)
        wait_for(lambda: env.reconciled(NS, NAME), 30, what="the service reconciled")
        env.quiet(NS)
        path = env.child_path("deployments", NS, NAME)
        env.request("PATCH", path + "?fieldManager=mesh-injector&force=false", {
            "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": NAME, "namespace": NS},
            "spec": {"template": {"spec": {"containers": [{"name": "mesh-proxy", "image": "envoyproxy/envoy:v1.31"}],
                                           "volumes": [{"name": "mesh-certs", "emptyDir": {}}]}}}}, APPLY)
        env.request("PATCH", path + "?fieldManager=secrets-agent", {"spec": {"template": {"spec": {"containers": [
            {"name": c.ENGINE_CONTAINER, "env": [{"name": "DB_PASSWORD", "value": "from-the-vault"}]}]}}}},
            STRATEGIC)
        env.kubectl("-n", NS, "annotate", "deployment", NAME, "team.example/owner=search")
        _additions_survive(env)
        yield env


def _deployment(env) -> dict:
    return env.children(NS, NAME)["Deployment"]


def _pod(env) -> dict:
    return _deployment(env)["spec"]["template"]["spec"]


def _engine(env) -> dict:
    return next(ct for ct in _pod(env)["containers"] if ct["name"] == c.ENGINE_CONTAINER)


def _operator_writes(env, since: int) -> list:
    path = env.child_path("deployments", NS, NAME)
    return [w for w in env.emulator.writes[since:] if w.path == path and w.user_agent.startswith("kvpilot")]


def _passes(env) -> list[str]:
    """The service's pass log lines, in order."""
    return re.findall(rf"\[{NS}/{NAME}\] (reconcile pass \d+ starting \(\w+\)|patched Deployment \S+)",
                      env.operator.log())


def _additions_survive(env) -> None:
    pod = _pod(env)
    assert [ct["name"] for ct in pod["containers"]] == [c.ENGINE_CONTAINER, "mesh-proxy"]
    assert {"name": "mesh-certs", "emptyDir": {}} in pod["volumes"]
    assert {"name": "DB_PASSWORD", "value": "from-the-vault"} in _engine(env)["env"]
    assert _deployment(env)["metadata"]["annotations"]["team.example/owner"] == "search"


def test_other_writers_additions_survive_and_cost_no_patch(env):
    writes, lines = len(env.emulator.writes), len(_passes(env))
    wait_for(lambda: sum("(resync)" in line for line in _passes(env)[lines:]) >= 10, 30, 0.1,
             "ten resync passes")
    patches = _operator_writes(env, writes)
    print(f"\n{sum('(resync)' in x for x in _passes(env)[lines:])} resync passes with a sidecar, a volume, an "
          f"env var and an annotation from other writers: {len(patches)} operator writes to the Deployment")
    assert patches == []
    _additions_survive(env)


@pytest.mark.parametrize("field", ["image", "args", "resources"])
def test_a_field_the_operator_owns_is_repaired_by_the_pass_the_change_triggers(env, field):
    path = env.child_path("deployments", NS, NAME)
    before = _engine(env)
    index = [ct["name"] for ct in _pod(env)["containers"]].index(c.ENGINE_CONTAINER)
    value = {"image": "attacker/engine:latest", "args": ["--tampered"],
             "resources": {"limits": {"nvidia.com/gpu": "4"}}}[field]
    writes, lines = len(env.emulator.writes), len(_passes(env))
    env.request("PATCH", path + "?fieldManager=kubectl-edit", [
        {"op": "replace", "path": f"/spec/template/spec/containers/{index}/{field}", "value": value}], JSON_PATCH)
    wait_for(lambda: _engine(env)[field] == before[field], 10, 0.05, f"the engine's {field} repaired")
    time.sleep(2)   # four more resync passes: the repair is not fought over
    log = _passes(env)[lines:]
    repair = next(i for i, line in enumerate(log) if line.startswith("patched"))
    print(f"\n{field} changed by another manager: repaired by pass "
          f"{sum('starting' in x for x in log[:repair])} after the change; {log[:repair + 1]}")
    assert sum("(poked)" in x for x in log[:repair]) <= 1   # the pass the watch event started
    assert len(_operator_writes(env, writes)) == 1
    assert _engine(env)[field] == before[field]
    _additions_survive(env)
    assert _owners(_deployment(env), field) == {c.FIELD_MANAGER}   # taken back from kubectl-edit


def _owners(deployment: dict, field: str) -> set[str]:
    """The managers that own the engine container's ``field``."""
    engine = "k:" + json.dumps({"name": c.ENGINE_CONTAINER}, separators=(",", ":"))
    return owners(deployment, "f:spec", "f:template", "f:spec", "f:containers", engine, f"f:{field}")
