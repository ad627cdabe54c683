"""The operator's in-memory caches: its write log over the watch, and cached discovery."""

from __future__ import annotations

import asyncio
import random

import pytest

from kvpilot.operator.discovery import Discovery
from kvpilot.operator.kube_api import KubeError
from kvpilot.operator.resource_version import newest
from kvpilot.operator.resources import DEPLOYMENT
from kvpilot.operator.worker import Backoff
from kvpilot.operator.write_log import WriteLog

KEY = (DEPLOYMENT, "ns", "svc")


def obj(rv: int, **spec) -> dict:
    return {"metadata": {"name": "svc", "resourceVersion": str(rv)}, "spec": spec}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_newest_compares_resource_versions_as_integers():
    assert newest(obj(9), obj(10))["metadata"]["resourceVersion"] == "10"  # not "9" > "10"
    assert newest(obj(10), None)["metadata"]["resourceVersion"] == "10"
    assert newest({"metadata": {"resourceVersion": "abc"}}, obj(10))["metadata"]["resourceVersion"] == "abc"


def test_a_write_shows_until_the_watch_delivers_it():
    log = WriteLog()
    log.record(KEY, obj(5, replicas=2))
    assert log.overlay(KEY, None)["spec"] == {"replicas": 2}          # the watch has not seen it yet
    assert log.overlay(KEY, obj(4, replicas=1))["spec"] == {"replicas": 2}  # an older event
    assert log.observe(KEY, "MODIFIED", obj(5, replicas=2))           # its echo: nothing new
    assert len(log) == 0
    assert log.overlay(KEY, None) is None  # deleted since, as the index now says


def test_a_newer_change_by_someone_else_wins_over_the_write():
    log = WriteLog()
    log.record(KEY, obj(5, replicas=2))
    assert not log.observe(KEY, "MODIFIED", obj(7, replicas=3))
    assert log.overlay(KEY, obj(7, replicas=3))["spec"] == {"replicas": 3}


def test_a_deletion_holds_until_the_watch_sees_it_or_a_re_creation():
    log = WriteLog()
    log.record(KEY, None, rv=5)
    assert log.overlay(KEY, obj(5)) is None                  # the stale copy in the index
    assert not log.observe(KEY, "DELETED", obj(6))
    assert log.overlay(KEY, None) is None and len(log) == 0
    log.record(KEY, None, rv=5)
    assert log.overlay(KEY, obj(8))["metadata"]["resourceVersion"] == "8"  # re-created since


def test_writes_expire():
    clock = Clock()
    log = WriteLog(ttl=10, clock=clock)
    log.record(KEY, obj(5))
    clock.now = 11
    assert log.overlay(KEY, None) is None


def test_discovery_asks_once_shares_the_answer_and_forgets_on_request():
    asked = []

    async def probe(group: str, version: str) -> bool:
        asked.append((group, version))
        await asyncio.sleep(0.01)
        return True

    async def scenario() -> None:
        discovery = Discovery(probe)
        assert await asyncio.gather(*(discovery.has_api("g", "v1") for _ in range(5))) == [True] * 5
        assert await discovery.has_api("g", "v1") and asked == [("g", "v1")]
        assert discovery.forget("g") and not discovery.forget("other")
        await discovery.has_api("g", "v1")
        assert asked == [("g", "v1")] * 2

    asyncio.run(scenario())


def test_a_failed_discovery_is_not_remembered():
    calls = []

    async def probe(group: str, version: str) -> bool:
        calls.append(1)
        if len(calls) == 1:
            raise KubeError(503, "unavailable")
        return False

    async def scenario() -> None:
        discovery = Discovery(probe)
        with pytest.raises(KubeError):
            await discovery.has_api("g", "v1")
        assert await discovery.has_api("g", "v1") is False

    asyncio.run(scenario())


def test_backoff_doubles_with_jitter_up_to_the_cap():
    rng, backoff = random.Random(0), Backoff(initial=0.5, cap=30)
    delays = [backoff.delay(n, rng) for n in range(1, 10)]
    for n, d in enumerate(delays, start=1):
        base = min(30, 0.5 * 2 ** (n - 1))
        assert 0.8 * base <= d <= 1.2 * base
    assert max(delays) <= 36
