"""``promtool check rules`` / ``promtool test rules`` on rule files, and unit-test files built
from (alert, input series, expected alerts) cases."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from support.chart import tool


@dataclass(frozen=True)
class AlertCase:
    """One ``promtool test rules`` test: ``series`` (selector -> promtool values notation)
    evaluated at ``eval_minutes``; ``expect`` the label sets of the alerts firing then
    (besides alertname and the rule's own labels), empty for a healthy case."""

    alert: str
    series: dict[str, str]
    eval_minutes: int
    expect: list[dict[str, str]] = field(default_factory=list)


def check_rules(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([tool("promtool"), "check", "rules", str(path)], capture_output=True,
                          text=True, timeout=60)


def rules_by_alert(rule_file: Path) -> dict[str, dict]:
    groups = yaml.safe_load(rule_file.read_text())["groups"]
    return {rule["alert"]: rule for group in groups for rule in group["rules"] if "alert" in rule}


def run_alert_cases(rule_file: Path, cases: list[AlertCase], tmp_path: Path) -> subprocess.CompletedProcess:
    """Write the cases as a promtool unit-test file next to ``rule_file``'s copy and run them."""
    rules = rules_by_alert(rule_file)
    copy = tmp_path / rule_file.name
    copy.write_text(rule_file.read_text())
    tests = []
    for case in cases:
        rule = rules[case.alert]
        tests.append({
            "interval": "1m",
            "input_series": [{"series": s, "values": v} for s, v in case.series.items()],
            "alert_rule_test": [{
                "eval_time": f"{case.eval_minutes}m",
                "alertname": case.alert,
                "exp_alerts": [{"exp_labels": {**rule.get("labels", {}), **labels},
                                "exp_annotations": rule.get("annotations", {})}
                               for labels in case.expect],
            }],
        })
    test_file = tmp_path / "alerts_test.yaml"
    test_file.write_text(yaml.safe_dump({"rule_files": [copy.name], "evaluation_interval": "1m",
                                         "tests": tests}, sort_keys=False))
    return subprocess.run([tool("promtool"), "test", "rules", test_file.name], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
