"""prometheus-adapter's rules as the adapter applies them, for the rules the chart ships.

For a ``Pods`` metric of an HPA the adapter (kubernetes-sigs/prometheus-adapter,
pkg/naming) finds series with each rule's ``seriesQuery``, names them by ``name.matches``
/ ``name.as`` (a Go regexp replacement, ``${1}``), and answers a request for some pods by
filling the ``metricsQuery`` template: ``<<.Series>>`` is the series name,
``<<.LabelMatchers>>`` is ``namespace="NS",pod="P"`` (``pod=~"P1|P2"`` for several pods)
and ``<<.GroupBy>>`` is ``pod``. This module does the same, so that tests can run the
exact queries an HPA's metrics come from against a real Prometheus.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

ADAPTER_FILES = Path(__file__).resolve().parents[2] / "charts" / "kvpilot" / "files" / "prometheus-adapter"
CONFIG = ADAPTER_FILES / "config.yaml"
CHART_VALUES = ADAPTER_FILES / "values.yaml"


def load_rules(path: Path = CONFIG) -> list[dict[str, Any]]:
    """The ``rules`` of the adapter's configuration file."""
    return yaml.safe_load(path.read_text())["rules"]


def metric_name(rule: Mapping[str, Any], series: str) -> str | None:
    """The custom-metrics name ``rule`` gives ``series`` (None when its pattern does not match)."""
    pattern = re.compile(rule["name"]["matches"])
    match = pattern.search(series)
    if match is None:
        return None
    # Go's Regexp.ExpandString: the template alone, $N / ${N} replaced (default "$1", or
    # "$0" when the pattern has no group)
    template = rule["name"].get("as") or ("${1}" if pattern.groups else "${0}")
    return match.expand(re.sub(r"\$\{?(\d+)\}?", r"\\g<\1>", template))


def _label(rule: Mapping[str, Any], resource: str) -> str:
    overrides = rule["resources"]["overrides"]
    return next(label for label, target in overrides.items() if target["resource"] == resource)


def pods_query(rule: Mapping[str, Any], series: str, namespace: str, pods: Iterable[str]) -> str:
    """The PromQL the adapter runs for ``series`` of ``pods`` in ``namespace``."""
    names = sorted(pods)
    pod_label = _label(rule, "pod")
    pod_matcher = (f'{pod_label}="{names[0]}"' if len(names) == 1
                   else f'{pod_label}=~"{"|".join(names)}"')
    matchers = f'{_label(rule, "namespace")}="{namespace}",{pod_matcher}'
    return (rule["metricsQuery"].replace("<<.Series>>", series)
            .replace("<<.LabelMatchers>>", matchers).replace("<<.GroupBy>>", pod_label))
