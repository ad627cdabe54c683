"""The docs pages, read back by the tests that check them against the code."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"
METRICS_PAGE = DOCS / "metrics.md"
OPERATOR_PAGE = DOCS / "operator.md"


def documented_metrics() -> dict[str, str]:
    """Exposed name -> type of every row of docs/metrics.md's metric table."""
    text = METRICS_PAGE.read_text()
    assert "# Metrics" in text, "docs/metrics.md lacks its Metrics section"
    section = text.split("# Metrics", 1)[1].split("\n## ", 1)[0]
    documented = {}
    for row in re.finditer(r"^\|\s*(`(?:vllm|kvpilot):[^|]+)\|\s*(\w+)\s*\|", section, re.MULTILINE):
        for name in re.findall(r"`((?:vllm|kvpilot):[a-z0-9_:]+)`", row.group(1)):
            documented[name] = row.group(2)
    return documented
