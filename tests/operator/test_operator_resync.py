"""The safety-net resync: passes that race never duplicate an Event, and cost no API request.

The operator here resyncs every 0.5 s (jittered), so resync passes run constantly while
services are created: under the old design (a timer next to the create handler, the
per-object lock released before kopf stored the status) this produced duplicate
``Planned`` Events for a fifth of new services.
"""

from __future__ import annotations

import re
import time

import pytest

from support.harness import wait_for
from support.operator_env import running

pytestmark = pytest.mark.slow
COUNT = 40


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with running(tmp_path_factory.mktemp("resync"), {"KVPILOT_RESYNC_SECONDS": "0.5"}) as env:
        yield env


def _services(env, prefix: str, count: int) -> list[tuple[str, str]]:
    services = [(env.namespace(f"{prefix}-{i % 2}"), f"svc-{i:02d}") for i in range(count)]
    for ns, name in services:
        env.create(ns, name)
    wait_for(lambda: all(env.reconciled(ns, name) for ns, name in services), 60, 0.2,
             f"{count} services reconciled")
    return services


def test_racing_passes_post_one_planned_event_per_service(env):
    services = _services(env, "race", COUNT)
    time.sleep(1.5)  # three more resync periods for late duplicates to show
    planned = {key: len(env.events(*key, reason="Planned")) for key in services}
    assert set(planned.values()) == {1}, {k: n for k, n in planned.items() if n != 1}


def test_resync_passes_read_only_the_caches(env):
    services = _services(env, "steady", 10)
    for ns in {ns for ns, _ in services}:
        env.quiet(ns)

    def passes() -> int:
        return len(re.findall(r"\[steady-\d/svc-\d+\] reconcile pass \d+ starting \(resync\)", env.operator.log()))

    before, mark = passes(), env.mark()
    time.sleep(3)
    ran = passes() - before
    calls = env.calls(mark)
    print(f"\n{ran} resync passes of 10 services in 3 s: {sum(calls.values())} API requests")
    assert ran >= 30  # ~6 per service
    assert calls == {}, calls  # not one GET: children from the watch cache, discovery cached
