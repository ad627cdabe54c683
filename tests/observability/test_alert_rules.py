"""The chart's alert rules (charts/kvpilot/files/rules/) against promtool: every file passes
``promtool check rules``, and ``promtool test rules`` fires each alert on synthetic series
of the trouble it names and keeps it silent on healthy ones. The chart renders them into
its PrometheusRule."""

from __future__ import annotations

import pytest

from support.chart import CHART, MONITORING_API, of_kind, render
from support.promtool import AlertCase, check_rules, rules_by_alert, run_alert_cases

RULE_FILES = sorted((CHART / "files" / "rules").glob("*.yaml"))
ENGINE_RULES = CHART / "files" / "rules" / "kvpilot-engines.yaml"
M = 'namespace="team",model_name="chat"'
WHO = {"namespace": "team", "model_name": "chat"}
POD_A, POD_B = f'{M},pod="chat-a"', f'{M},pod="chat-b"'

CASES = [
    # KV cache nearly full: sustained vs. a short spike
    AlertCase("KVPilotKVCacheNearlyFull", {f"vllm:kv_cache_usage_perc{{{POD_A}}}": "0.95x40",
                                           f"vllm:kv_cache_usage_perc{{{POD_B}}}": "0.97x40"}, 30, [WHO]),
    AlertCase("KVPilotKVCacheNearlyFull", {f"vllm:kv_cache_usage_perc{{{POD_A}}}": "0.5x10 0.97x5 0.5x25"}, 30),
    AlertCase("KVPilotKVCacheNearlyFull", {f"vllm:kv_cache_usage_perc{{{POD_A}}}": "0.7x40"}, 30),
    # exhaustion forecast: a rising trend vs. a high but flat one
    AlertCase("KVPilotKVCacheExhaustionForecast", {f"vllm:kv_cache_usage_perc{{{POD_A}}}": "0.5+0.01x40"},
              30, [WHO]),
    AlertCase("KVPilotKVCacheExhaustionForecast", {f"vllm:kv_cache_usage_perc{{{POD_A}}}": "0.85x40"}, 30),
    # preemptions: 1 per 10 finished requests vs. none
    AlertCase("KVPilotPreemptionRateHigh", {f"vllm:num_preemptions_total{{{POD_A}}}": "0+1x40",
                                            f"vllm:request_success_total{{{POD_A},finished_reason=\"stop\"}}": "0+10x40"},
              30, [WHO]),
    AlertCase("KVPilotPreemptionRateHigh", {f"vllm:num_preemptions_total{{{POD_A}}}": "3x40",
                                            f"vllm:request_success_total{{{POD_A},finished_reason=\"stop\"}}": "0+10x40"}, 30),
    # queue: growing vs. long but steady
    AlertCase("KVPilotQueueGrowing", {f"vllm:num_requests_waiting{{{POD_A}}}": "0+1x40"}, 30, [WHO]),
    AlertCase("KVPilotQueueGrowing", {f"vllm:num_requests_waiting{{{POD_A}}}": "12x40"}, 30),
    # at max replicas with KV pressure vs. room to scale
    AlertCase("KVPilotReplicasAtMaxWithKVPressure",
              {f'kvpilot:inferenceservice_replicas{{{M},name="chat"}}': "4x40",
               f'kvpilot:inferenceservice_max_replicas{{{M},name="chat"}}': "4x40",
               f"vllm:kv_cache_usage_perc{{{POD_A}}}": "0.9x40"}, 30, [WHO]),
    AlertCase("KVPilotReplicasAtMaxWithKVPressure",
              {f'kvpilot:inferenceservice_replicas{{{M},name="chat"}}': "2x40",
               f'kvpilot:inferenceservice_max_replicas{{{M},name="chat"}}': "4x40",
               f"vllm:kv_cache_usage_perc{{{POD_A}}}": "0.9x40"}, 30),
    # an engine's scrape fails vs. all up (and a non-engine target down is not an engine)
    AlertCase("KVPilotEngineDown",
              {'up{job="engines",instance="10.0.0.1:8000",namespace="team",pod="chat-a"}': "1x10 0x30",
               f"vllm:cache_config_info{{{POD_A}}}": "1x10"},
              30, [{"job": "engines", "instance": "10.0.0.1:8000", "namespace": "team", "pod": "chat-a"}]),
    AlertCase("KVPilotEngineDown",
              {'up{job="engines",instance="10.0.0.1:8000",namespace="team",pod="chat-a"}': "1x40",
               'up{job="other",instance="10.0.0.9:80",namespace="team",pod="web"}': "0x40",
               f"vllm:cache_config_info{{{POD_A}}}": "1x40"}, 30),
    # every engine of a model vanished vs. still scraped
    AlertCase("KVPilotEngineMetricsAbsent", {f"vllm:cache_config_info{{{POD_A}}}": "1x10"}, 30, [WHO]),
    AlertCase("KVPilotEngineMetricsAbsent", {f"vllm:cache_config_info{{{POD_A}}}": "1x40"}, 30),
]


@pytest.mark.parametrize("path", RULE_FILES, ids=lambda p: p.name)
def test_promtool_checks_every_rule_file(path):
    run = check_rules(path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS" in run.stdout


def test_each_alert_fires_on_trouble_and_stays_silent_when_healthy(tmp_path):
    alerts = set(rules_by_alert(ENGINE_RULES))
    assert {c.alert for c in CASES if c.expect} == alerts      # every alert has a firing case
    assert {c.alert for c in CASES if not c.expect} == alerts  # ... and a healthy one
    run = run_alert_cases(ENGINE_RULES, CASES, tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS" in run.stdout


def test_the_unit_tests_catch_a_rule_that_never_fires(tmp_path):
    broken = tmp_path / "rules" / ENGINE_RULES.name
    broken.parent.mkdir()
    broken.write_text(ENGINE_RULES.read_text().replace("> 0.9\n", "> 1.9\n", 1))
    run = run_alert_cases(broken, [c for c in CASES if c.alert == "KVPilotKVCacheNearlyFull"], tmp_path)
    assert run.returncode != 0 and "KVPilotKVCacheNearlyFull" in run.stdout + run.stderr


def test_the_chart_ships_the_rules_in_its_prometheusrule():
    (rule,) = of_kind(render(api_versions=[MONITORING_API]), "PrometheusRule")
    names = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]}
    assert names == set(rules_by_alert(ENGINE_RULES))
    off = render(sets=["monitoring.prometheusRule.enabled=false"], api_versions=[MONITORING_API])
    assert not of_kind(off, "PrometheusRule")
