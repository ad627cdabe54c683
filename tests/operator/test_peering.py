"""Peering priorities and the peering / metrics settings (units; the two-process
failover is in test_failover.py)."""

from __future__ import annotations

import time

import pytest

from kvpilot.engine.cli.main import build_parser
from kvpilot.operator.peering import peering_priority
from kvpilot.operator.settings import OperatorSettings


def test_the_replica_started_first_has_the_highest_priority():
    now = time.time()
    older, newer = peering_priority(now, tiebreak=0), peering_priority(now + 0.001, tiebreak=1023)
    assert older > newer  # a millisecond earlier beats any tie-break
    same_ms = {peering_priority(now, tiebreak=t) for t in range(1024)}
    assert len(same_ms) == 1024  # replicas started together still differ
    assert max(same_ms) < 2 ** 53  # exact as a JSON number
    assert peering_priority(4102444800.0) > 0  # the year 2100 is in range
    with pytest.raises(ValueError, match="tiebreak"):
        peering_priority(now, tiebreak=1024)


def test_peering_and_metrics_settings_from_the_environment():
    s = OperatorSettings.from_env({"KVPILOT_PEERING": "kvpilot", "KVPILOT_PEERING_LIFETIME": "30",
                                   "KVPILOT_METRICS_PORT": "8081"})
    assert (s.peering, s.peering_lifetime, s.metrics_port) == ("kvpilot", 30, 8081)
    defaults = OperatorSettings.from_env({})
    assert (defaults.peering, defaults.peering_lifetime, defaults.metrics_port) == (None, 60, 0)
    with pytest.raises(ValueError, match="KVPILOT_PEERING_LIFETIME"):
        OperatorSettings.from_env({"KVPILOT_PEERING_LIFETIME": "0"})
    with pytest.raises(ValueError, match="KVPILOT_METRICS_PORT"):
        OperatorSettings.from_env({"KVPILOT_METRICS_PORT": "70000"})


def test_peering_flags():
    parser = build_parser("operator")
    args = parser.parse_args(["operator", "--peering", "kvpilot"])
    assert (args.peering, args.standalone) == ("kvpilot", False)
    assert parser.parse_args(["operator", "--standalone"]).standalone
    with pytest.raises(SystemExit):
        parser.parse_args(["operator", "--standalone", "--peering", "x"])
