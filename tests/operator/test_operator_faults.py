"""The operator under API faults: it converges, duplicates nothing, backs off, says Degraded.

Faults are injected at the emulator (``kube_faults``) for the operator's own client only
and only under the test's namespace, so each scenario is isolated. After the fault is
gone the children must equal those of a control service built without faults, every
child must have been created once, ``Planned`` posted once, and the operator's API calls
in the scenario (printed with ``-s``) must stay few: a retry loop shows up as hundreds.
The operator runs with a one-hour resync and a 1 s request timeout.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest

from support import traffic
from support.harness import wait_for
from support.kube_faults import WRITES, Fault
from support.operator_env import JSON_PATCH, MERGE, OperatorEnv, running

pytestmark = pytest.mark.slow
OPERATOR = "kvpilot-operator"   # the operator's own client (kopf's watches are not faulted)
CONTROL = "control"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with running(tmp_path_factory.mktemp("faults"), {"KVPILOT_RESYNC_SECONDS": "3600",
                                                     "KVPILOT_API_TIMEOUT_SECONDS": "1"}) as env:
        env.create(env.namespace(CONTROL), "svc")
        wait_for(lambda: env.reconciled(CONTROL, "svc"), what="the control service")
        yield env


@pytest.fixture(autouse=True)
def no_faults_left(env):
    yield
    env.emu.run(lambda e: e.faults.clear())


def _children_path(ns: str) -> str:
    return rf"/namespaces/{ns}/(deployments|services|persistentvolumeclaims|horizontalpodautoscalers|" \
           r"poddisruptionbudgets)(/|$)"


def _add(env: OperatorEnv, fault: Fault) -> Fault:
    return env.emu.run(lambda e: e.faults.add(fault))


def _specs(env: OperatorEnv, ns: str) -> dict:
    return {kind: obj["spec"] for kind, obj in env.children(ns, "svc").items()}


def _converged(env: OperatorEnv, ns: str) -> bool:
    cond = {c["type"]: c["status"] for c in ((env.cr(ns, "svc") or {}).get("status") or {}).get("conditions", ())}
    return cond.get("Planned") == "True" and cond.get("Degraded") == "False" and \
        _specs(env, ns) == _specs(env, CONTROL)


def _degraded_reports(env: OperatorEnv, ns: str) -> list[str]:
    """Messages of the stored status writes that said Degraded=True."""
    path = f"/namespaces/{ns}/inferenceservices/svc/status"
    return [c["message"] for w in env.emulator.writes if w.path.endswith(path) and w.status < 300
            for c in (w.body or {}).get("status", {}).get("conditions") or ()
            if c["type"] == "Degraded" and c["status"] == "True"]


def _created(env: OperatorEnv, ns: str, since: int = 0) -> Counter:
    """Children created in ``ns`` (by server-side apply: 201) since write ``since``, by kind."""
    return Counter(w.path.split("/")[-2] for w in env.emulator.writes[since:]
                   if w.method == "PATCH" and w.status == 201 and f"/namespaces/{ns}/" in w.path)


def _check_and_report(env: OperatorEnv, ns: str, mark: int, scenario: str, max_calls: int,
                      deleted: str = "") -> Counter:
    """Converged like the control, nothing created twice (but the ``deleted`` plural, once
    more), one Planned Event, few calls."""
    wait_for(lambda: _converged(env, ns), 20, 0.1, f"{ns} converged like the control")
    env.quiet(ns)
    creates = _created(env, ns)
    assert creates and all(n == 1 + (plural == deleted) for plural, n in creates.items()), creates
    assert len(env.events(ns, "svc", reason="Planned")) == 1
    calls = env.calls(mark, ns)
    print(f"\nfault scenario {scenario}: {sum(calls.values())} operator API calls in {ns}\n"
          f"{traffic.table(calls)}")
    assert sum(calls.values()) <= max_calls, calls
    return calls


def _tamper(env: OperatorEnv, ns: str) -> None:
    env.request("PATCH", env.child_path("deployments", ns, "svc"), [
        {"op": "replace", "path": "/spec/template/spec/containers/0/args/1", "value": "/tampered"}], JSON_PATCH)


def _ready(env: OperatorEnv, ns: str) -> None:
    env.create(env.namespace(ns), "svc")
    wait_for(lambda: _converged(env, ns), what=f"{ns}/svc converged")
    env.quiet(ns)


def test_conflicts_on_patch_are_retried(env):
    ns = "f-conflict"
    _ready(env, ns)
    mark = env.mark()
    fault = _add(env, Fault(409, methods=frozenset({"PATCH"}), path=_children_path(ns), user_agent=OPERATOR,
                            times=2))
    _tamper(env, ns)
    _check_and_report(env, ns, mark, "409 Conflict on PATCH (twice)", max_calls=10)
    assert fault.spent and any("HTTP 409" in m for m in _degraded_reports(env, ns))


def test_server_errors_are_retried_with_backoff(env):
    ns = env.namespace("f-errors")
    mark = env.mark()
    faults = [_add(env, Fault(500, methods=frozenset({"PATCH"}), path=rf"/namespaces/{ns}/deployments",
                              user_agent=OPERATOR, times=2)),
              _add(env, Fault(503, path=rf"/namespaces/{ns}/services", user_agent=OPERATOR, times=2,
                              retry_after=1)),
              _add(env, Fault(500, path=rf"/namespaces/{ns}/inferenceservices/svc/status", user_agent=OPERATOR,
                              times=1))]
    env.create(ns, "svc")
    # (each attempt at a child the cache does not show reads it first: a GET, then the apply;
    # the engine pods' ServiceAccount and NetworkPolicy are two children more than the
    # Deployment, Service and claim)
    _check_and_report(env, ns, mark, "500 / 503 on create and status (5 answers)", max_calls=28)
    assert all(f.spent for f in faults)
    assert any("HTTP 500" in m or "HTTP 503" in m for m in _degraded_reports(env, ns))


def test_throttling_honours_retry_after_without_a_hot_loop(env):
    ns = env.namespace("f-throttle")
    mark = env.mark()
    fault = _add(env, Fault(429, path=_children_path(ns), user_agent=OPERATOR, retry_after=1))
    env.create(ns, "svc")
    wait_for(lambda: any("HTTP 429" in m for m in _degraded_reports(env, ns)), what="Degraded while throttled")
    time.sleep(3)
    env.emu.run(lambda e: e.faults.clear())
    gaps = [b - a for a, b in zip(fault.hit_times, fault.hit_times[1:], strict=False)]
    print(f"\n429 answers: {fault.hits}, seconds between attempts: {[round(g, 2) for g in gaps]}")
    assert 3 <= fault.hits <= 5 and min(gaps) >= 0.95  # one write per Retry-After, then it stops
    _check_and_report(env, ns, mark, "429 Retry-After: 1 on every child write for ~3 s", max_calls=24)


def test_dropped_watch_streams_lose_no_change(env):
    ns = "f-drops"
    _ready(env, ns)
    mark, watches = env.mark(), lambda: sum(1 for r in env.operator_requests(mark)
                                             if r.params.get("watch") == "true")
    for i in range(6):  # every watch stream cut six times in ~2 s, a child deleted in between
        env.emu.run(lambda e: e.drop_watches())
        if i == 2:
            env.request("DELETE", env.child_path("deployments", ns, "svc"))
        time.sleep(0.3)
    calls = _check_and_report(env, ns, mark, "watch streams dropped 6 times, a Deployment deleted",
                              max_calls=4, deleted="deployments")
    assert calls[("patch", "apps/deployments")] == 1   # the one re-creation (an apply)
    print(f"watch requests (kopf reconnecting every stream): {watches()}")
    assert watches() >= 6


def test_slow_answers_time_out_and_are_retried(env):
    ns = env.namespace("f-slow")
    mark = env.mark()
    _add(env, Fault(None, methods=frozenset({"GET", *WRITES}), path=_children_path(ns), user_agent=OPERATOR,
                    delay=1.2))
    env.create(ns, "svc")
    wait_for(lambda: any("TimeoutError" in m for m in _degraded_reports(env, ns)), what="Degraded: timeouts")
    env.emu.run(lambda e: e.faults.clear())
    _check_and_report(env, ns, mark, "every child request answered after 1.2 s (1 s timeout) until Degraded",
                      max_calls=20)


def test_status_tells_the_truth_when_the_deployment_apply_fails(env):
    ns = "f-truth"
    _ready(env, ns)
    generation = env.children(ns, "svc")["Deployment"]["metadata"]["generation"]
    env.request("PATCH", env.child_path("deployments", ns, "svc") + "/status", {"status": {
        "replicas": 1, "readyReplicas": 1, "updatedReplicas": 1, "observedGeneration": generation}}, MERGE)
    env.wait_condition(ns, "svc", "Ready", "True")
    _add(env, Fault(500, methods=frozenset({"PATCH"}), path=rf"/namespaces/{ns}/deployments/svc$",
                    user_agent=OPERATOR))
    _tamper(env, ns)
    degraded = env.wait_condition(ns, "svc", "Degraded", "True")
    status = env.cr(ns, "svc")["status"]
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert degraded["reason"] == "ApplyFailed" and "Deployment svc: HTTP 500" in degraded["message"]
    assert (ready["status"], ready["reason"]) == ("True", "AllReplicasReady")  # not DeploymentMissing
    assert (status["replicas"], status["readyReplicas"]) == (1, 1)
    env.emu.run(lambda e: e.faults.clear())
    wait_for(lambda: _converged(env, ns), 20, 0.1, "repaired once the API answers again")


def test_deleting_while_the_operator_is_down_completes_at_once(env):
    """No finalizer: deleted while no operator runs, the service goes at once and its children
    with it (owner references); the operator back creates nothing (issue 43)."""
    ns = "f-down"
    _ready(env, ns)
    assert not env.cr(ns, "svc")["metadata"].get("finalizers")
    env.operator.stop()
    try:
        env.kubectl("-n", ns, "delete", "inferenceservice", "svc", "--wait=false")
        wait_for(lambda: env.cr(ns, "svc") is None, 5, 0.1, "the deletion completed without the operator")
        wait_for(lambda: env.children(ns, "svc") == {}, 5, what="children garbage-collected")
    finally:
        mark, writes = env.mark(), len(env.emulator.writes)
        env.operator.start()
    env.quiet(ns)
    assert [key for key in env.calls(mark, ns) if key[0] == "create"] == []  # nothing re-created
    assert _created(env, ns, writes) == Counter()
