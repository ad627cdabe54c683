"""The operator's per-service SLO PrometheusRule (built by the pure builder the operator
applies; its life in a cluster: tests/operator/test_operator.py) checked by promtool: the
rule parses, fires when the p95 of the service's own series exceeds the declared SLO and
stays silent below it or for another service's series."""

from __future__ import annotations

from decimal import Decimal

import yaml

from kvpilot.operator.resources.common import Owner
from kvpilot.operator.resources.monitoring import build_slo_prometheusrule, seconds_from_ms

from support.promtool import AlertCase, check_rules, run_alert_cases

SELF = 'namespace="team",model_name="chat-model"'
OTHER = 'namespace="team",model_name="other"'


def _histogram(name: str, labels: str, bucket_rates: dict[str, int]) -> dict[str, str]:
    """Cumulative bucket series of a histogram whose observations per minute fall as
    ``bucket_rates`` says (upper bound -> observations at or below it, cumulative)."""
    return {f'{name}_bucket{{{labels},le="{le}"}}': f"0+{per_min}x40" for le, per_min in bucket_rates.items()}


# 100 observations a minute: slow = all between 1 s and 2.5 s; fast = all under 0.25 s
SLOW_TTFT = {"0.25": 0, "1.0": 0, "2.5": 100, "+Inf": 100}
FAST_TTFT = {"0.25": 100, "1.0": 100, "2.5": 100, "+Inf": 100}
SLOW_ITL = {"0.05": 0, "0.1": 100, "+Inf": 100}
FAST_ITL = {"0.05": 100, "0.1": 100, "+Inf": 100}


def test_thresholds_are_the_declared_milliseconds_exactly():
    for ms, seconds in ((750, "0.75"), (333.3, "0.3333"), (45.5, "0.0455"), (0.1, "0.0001"),
                        (2000, "2"), (1e-3, "0.000001")):
        assert seconds_from_ms(ms) == seconds
        assert Decimal(seconds) * 1000 == Decimal(repr(float(ms)))
    assert build_slo_prometheusrule(Owner("chat", "team"), "chat-model",
                                    {"ttftP95Ms": None, "itlP95Ms": None}) is None


def test_slo_alerts_fire_above_the_slo_and_stay_silent_below(tmp_path):
    rule = build_slo_prometheusrule(Owner("chat", "team"), "chat-model",
                                    {"ttftP95Ms": 1000, "itlP95Ms": 80})
    path = tmp_path / "rules" / "slo.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    check = check_rules(path)
    assert check.returncode == 0, check.stdout + check.stderr
    ttft, itl = "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds"
    cases = [
        AlertCase("KVPilotTTFTAboveSLO", _histogram(ttft, SELF, SLOW_TTFT), 20, [{}]),
        AlertCase("KVPilotTTFTAboveSLO", _histogram(ttft, SELF, FAST_TTFT), 20),
        AlertCase("KVPilotTTFTAboveSLO", {**_histogram(ttft, SELF, FAST_TTFT),
                                          **_histogram(ttft, OTHER, SLOW_TTFT)}, 20),
        AlertCase("KVPilotITLAboveSLO", _histogram(itl, SELF, SLOW_ITL), 20, [{}]),
        AlertCase("KVPilotITLAboveSLO", _histogram(itl, SELF, FAST_ITL), 20),
    ]
    run = run_alert_cases(path, cases, tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    # and the same series against a looser SLO (3 s TTFT) stay silent
    loose = build_slo_prometheusrule(Owner("chat", "team"), "chat-model", {"ttftP95Ms": 3000})
    path.write_text(yaml.safe_dump({"groups": loose["spec"]["groups"]}))
    run = run_alert_cases(path, [AlertCase("KVPilotTTFTAboveSLO", _histogram(ttft, SELF, SLOW_TTFT), 20)],
                          tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
