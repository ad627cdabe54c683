"""Observability tests: the chart's alert rules (promtool), the dashboards (generated, then
run against a real Prometheus scraping real servers) and the operator's per-service rules.
They reuse helpers of the chart, operator, server and autoscaling tests (those folders go
on ``sys.path``)."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for folder in (HERE, HERE.parent / "operator", HERE.parent / "chart", HERE.parent / "server",
               HERE.parent / "autoscaling"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
