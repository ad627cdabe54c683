"""Which of other projects' APIs a service needs, and the one condition that says so."""

from __future__ import annotations

import dataclasses

from kvpilot.operator.optional_apis import (
    INFERENCE,
    KEDA,
    LWS,
    OPTIONAL_APIS,
    PROMETHEUS,
    missing_apis,
    missing_message,
)
from kvpilot.operator.spec import parse_spec
from kvpilot.operator.spec_to_plan import plan_service
from kvpilot.operator.status import DeploymentState, workload_conditions

from support.built import SMALL

NONE = dict.fromkeys(OPTIONAL_APIS, False)


def _missing(spec: dict, served: dict, nodes: int = 1) -> list:
    parsed = parse_spec(spec, "svc")
    sizing = dataclasses.replace(plan_service(parsed).sizing, nodes=nodes)
    return missing_apis(parsed, sizing, served)


def test_only_what_the_spec_needs_is_missing():
    assert _missing(SMALL, NONE) == []     # monitors and the pool are used where served
    keda = {**SMALL, "autoscaling": {"mode": "keda", "maxReplicas": 3}, "routing": {"router": "gateway"}}
    missing = _missing(keda, NONE)
    assert [m.api for m in missing] == [KEDA, INFERENCE] and not any(m.blocking for m in missing)
    assert _missing(keda, {**NONE, KEDA: True, INFERENCE: True}) == []
    (lws,) = _missing(SMALL, {**NONE, PROMETHEUS: True}, nodes=2)
    assert lws.api is LWS and lws.blocking
    message = missing_message(missing)
    assert message.startswith("autoscaling.mode: keda needs keda.sh/v1alpha1, which the cluster does not "
                              "serve: install KEDA (kedacore/keda) or use autoscaling.mode: hpa")
    degraded = workload_conditions(DeploymentState(exists=True, desired=1), "HPA: 500", None, message)[2]
    assert (degraded.status, degraded.reason, degraded.message) == ("True", "MissingAPI", message)
