"""The prometheus-adapter rules the chart ships serve exactly the metrics the operator's
HPAs ask for, in valid PromQL; the KEDA queries are valid PromQL too.

Oracles: ``promtool`` (parses every query as Prometheus does), the real ``helm`` (the
rules' ConfigMap), ``kubernetes-validate``. That the rules find the engine's real series
and return its values is shown end to end against a real Prometheus (test_closed_loop).
"""

from __future__ import annotations

import re
import subprocess

import kubernetes_validate
import pytest
import yaml

from kvpilot.operator.resources.autoscaling import (
    KV_USAGE_SERIES,
    PREEMPTIONS_SERIES,
    RATE_WINDOW,
    TTFT_SERIES,
    WAITING_SERIES,
    build_hpa,
    keda_queries,
)
from kvpilot.operator.resources.common import Owner
from kvpilot.operator.resources.pools import build_pool_hpa, pool_queries
from kvpilot.operator.settings import OperatorSettings
from kvpilot.operator.spec import parse_spec

from support import adapter_rules
from support.chart import of_kind, render, tool

ENGINE_SERIES = (KV_USAGE_SERIES, WAITING_SERIES, PREEMPTIONS_SERIES, f"{TTFT_SERIES}_bucket")
SPEC = {"model": {"uri": "hf://Qwen/Qwen3-0.6B"}, "gpu": {"type": "l4"},
        "slo": {"maxContext": 8192, "p95PromptTokens": 2048, "p95OutputTokens": 512, "concurrency": 8},
        "autoscaling": {"mode": "hpa", "maxReplicas": 4}}
# a disaggregated service's prefill pool scales on its queue and its p95 TTFT too (issue 44)
PD_SPEC = {**{k: v for k, v in SPEC.items() if k != "autoscaling"},
           "slo": {**SPEC["slo"], "ttftP95Ms": 800}, "routing": {"router": "vllm-router"},
           "disaggregation": {"prefill": {"autoscaling": {"mode": "hpa", "maxReplicas": 4}},
                              "decode": {"autoscaling": {"mode": "hpa", "maxReplicas": 4}}}}


def _series_selected(rule: dict) -> list[str]:
    """The engine series a rule's ``seriesQuery`` selects by name (PromQL matchers are anchored)."""
    op, value = re.search(r'__name__(=~|=)"([^"]+)"', rule["seriesQuery"]).groups()
    return [s for s in ENGINE_SERIES if (re.fullmatch(value, s) if op == "=~" else s == value)]


def test_the_values_block_and_the_config_file_hold_the_same_rules():
    values = yaml.safe_load(adapter_rules.CHART_VALUES.read_text())
    assert values["rules"]["custom"] == adapter_rules.load_rules()
    assert set(values) == {"rules"} and set(values["rules"]) == {"custom"}  # the adapter's defaults stay


def test_the_rules_serve_exactly_the_hpa_metrics():
    served = {}
    for rule in adapter_rules.load_rules():
        for series in _series_selected(rule):
            name = adapter_rules.metric_name(rule, series)
            assert name not in served, f"{name} served by two rules"
            served[name] = series
    settings = OperatorSettings()
    assert served == {settings.hpa_kv_usage_metric: KV_USAGE_SERIES,
                      settings.hpa_waiting_metric: WAITING_SERIES,
                      settings.hpa_preemption_metric: PREEMPTIONS_SERIES,
                      settings.hpa_ttft_metric: f"{TTFT_SERIES}_bucket"}
    owner, pools = Owner("chat", "team"), parse_spec(PD_SPEC, "chat")
    hpas = [build_hpa(owner, parse_spec(SPEC, "chat"), settings),
            *(build_pool_hpa(owner, pools, role, settings) for role in ("prefill", "decode"))]
    assert {m["pods"]["metric"]["name"] for h in hpas for m in h["spec"]["metrics"]} == set(served)


def test_the_counter_rate_window_is_the_kedas():
    (rate_rule,) = [r for r in adapter_rules.load_rules() if PREEMPTIONS_SERIES in _series_selected(r)]
    assert f"[{RATE_WINDOW}]" in rate_rule["metricsQuery"]


def test_every_query_is_valid_promql(tmp_path):
    queries = []
    for rule in adapter_rules.load_rules():
        for series in _series_selected(rule):
            queries += [adapter_rules.pods_query(rule, series, "team", ["chat-a"]),
                        adapter_rules.pods_query(rule, series, "team", ["chat-a", "chat-b"])]
    spec = parse_spec({**SPEC, "autoscaling": {"mode": "keda", "maxReplicas": 4}}, "chat")
    queries += [q for q, _ in keda_queries(Owner("chat", "team"), spec)]
    queries += [q for role in ("prefill", "decode")
                for q, _, _ in pool_queries(Owner("chat", "team"), parse_spec(PD_SPEC, "chat"), role)]
    assert 'pod=~"chat-a|chat-b"' in queries[1] and "<<" not in "".join(queries)
    rules = {"groups": [{"name": "queries", "rules": [{"record": f"kvpilot:query_{i}", "expr": q}
                                                      for i, q in enumerate(queries)]}]}
    path = tmp_path / "queries.yaml"
    path.write_text(yaml.safe_dump(rules))
    run = subprocess.run([tool("promtool"), "check", "rules", str(path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"{len(queries)} rules found" in run.stdout
    broken = tmp_path / "broken.yaml"  # promtool does reject a bad query
    broken.write_text(yaml.safe_dump({"groups": [{"name": "b", "rules": [
        {"record": "kvpilot:broken", "expr": queries[0].replace("(", "", 1)}]}]}))
    assert subprocess.run([tool("promtool"), "check", "rules", str(broken)], capture_output=True).returncode


@pytest.mark.parametrize("namespace", ["", "monitoring"])
def test_the_chart_renders_the_rules_as_the_adapters_config_map(namespace):
    docs = render(sets=["monitoring.prometheusAdapter.configMap.enabled=true",
                        f"monitoring.prometheusAdapter.configMap.namespace={namespace}"])
    (config_map,) = [d for d in of_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-prometheus-adapter")]
    assert config_map["metadata"]["namespace"] == (namespace or "kvpilot")
    assert yaml.safe_load(config_map["data"]["config.yaml"]) == yaml.safe_load(adapter_rules.CONFIG.read_text())
    assert kubernetes_validate.validate(config_map, "1.33", strict=True) == "1.33"
    assert not [d for d in of_kind(render(), "ConfigMap") if d["metadata"]["name"].endswith("-prometheus-adapter")]
