"""The dashboards as code: the committed JSON is exactly what scripts/gen_dashboards.py
generates with Grafana's SDK, follows the import conventions (``${DS_PROMETHEUS}``,
``namespace`` / ``model_name`` variables, ``$__rate_interval``), every query parses in
promtool, and the chart ships each as a ConfigMap labelled for Grafana's sidecar.
Whether every target returns data: test_dashboards_live.py."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from support.chart import of_kind, render
from support.dashboards import DASHBOARD_DIR, generator, load, panels, substitute, targets
from support.promtool import check_rules

GEN = generator()


def test_committed_dashboards_are_the_generated_ones(tmp_path):
    for name, build in GEN.DASHBOARDS.items():
        assert (DASHBOARD_DIR / name).read_text() == GEN.render(build), \
            f"{name} is stale: run scripts/gen_dashboards.py"
    assert GEN.main(["--check"]) == 0
    (tmp_path / "kvpilot-engines.json").write_text("{}\n")
    (tmp_path / "kvpilot-operator.json").write_text(GEN.render(GEN.DASHBOARDS["kvpilot-operator.json"]))
    assert GEN.main(["--check", "--out", str(tmp_path)]) == 1   # a hand edit is caught


@pytest.mark.parametrize("name", sorted(GEN.DASHBOARDS))
def test_dashboards_follow_the_import_conventions(name):
    dashboard = load(name)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert "namespace" in variables
    if name == "kvpilot-engines.json":
        assert "model_name" in variables
    for panel in panels(dashboard):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}"
            expr = target["expr"]
            for window in re.findall(r"\[([^\]]+)\]", expr):
                assert window == "$__rate_interval", (panel["title"], expr)


def test_the_engine_dashboard_has_the_panels_operators_ask_for():
    titles = {p["title"] for p in panels(load("kvpilot-engines.json"))}
    assert {"KV cache usage per pod", "KV cache usage, fleet", "Prefix cache hit rate",
            "Preemptions per second", "Preemptions per finished request", "Running and waiting requests",
            "Waiting by reason", "Time to first token", "Inter-token latency", "End-to-end latency",
            "Queue time", "Prefill time", "Decode time", "Prompt and generation tokens per second",
            "Batch size (tokens per step)", "Offload tier hit rate", "KV bytes moved", "Offload tier usage",
            "Planned vs observed KV blocks", "SizingDrift", "Replicas vs desired"} <= titles
    hit_rate = next(t for t in targets("kvpilot-engines.json") if t.panel == "Prefix cache hit rate")
    assert "rate(vllm:prefix_cache_hits_total" in hit_rate.expr and "/" in hit_rate.expr
    heat = next(p for p in panels(load("kvpilot-engines.json")) if p["title"].startswith("Batch size"))
    assert heat["type"] == "heatmap" and heat["targets"][0]["format"] == "heatmap"


def test_every_query_parses(tmp_path):
    rules = []
    for name in GEN.DASHBOARDS:
        for t in targets(name):
            expr = substitute(t.expr, {"namespace": ".*", "model_name": ".*", "job": ".*"}, "1m")
            rules.append({"record": f"kvpilot:dashboard_query_{len(rules)}", "expr": expr})
    path = tmp_path / "queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    run = check_rules(path)
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_chart_ships_each_dashboard_as_a_labelled_configmap():
    maps = of_kind(render(), "ConfigMap")
    shipped = {}
    for cm in maps:
        if cm["metadata"]["labels"].get("grafana_dashboard") == "1":
            shipped.update({k: json.loads(v) for k, v in cm["data"].items()})
    assert shipped == {name: load(name) for name in GEN.DASHBOARDS}
    off = render(sets=["monitoring.dashboards.enabled=false"])
    assert not [cm for cm in of_kind(off, "ConfigMap") if "grafana_dashboard" in cm["metadata"]["labels"]]
